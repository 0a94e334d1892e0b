import sys

from dstl.cli import main

sys.exit(main())
