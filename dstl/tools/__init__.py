"""Command-line tools behind `dstl` subcommands."""
