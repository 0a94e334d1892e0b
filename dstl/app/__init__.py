"""The demo application: the `dstl pipeline` job (user activity over a synthetic or file source).

An application built on the `dstl.spark` library API, not part of it: the library never imports it.
"""
