"""Pure-Python twin of `dstl._fast._filewrite`: sealed bodies and bytes written to files.

Writes the same bytes, with the same checks and errors, as the compiled routines, which do all of it
in one release of the GIL (and write bodies with chunks by writev).
"""
from __future__ import annotations

import operator
import os

MAX_FDS = 4


def write_bodies(fds, bodies) -> int:
    """Write `bodies` (sealed bodies or bytes-like objects) back to back to each file descriptor in
    `fds`, at its position; returns the bytes written to each fd (twin of the Cython routine, which
    does it with the GIL released once)."""
    targets = []
    for fd in fds:
        if len(targets) == MAX_FDS:
            raise ValueError(f"write_bodies: at most {MAX_FDS} file descriptors")
        try:
            fd = operator.index(fd)
        except TypeError:
            raise TypeError(f"write_bodies: file descriptors must be ints, got {type(fd).__name__}") from None
        if fd < 0:
            raise ValueError(f"write_bodies: invalid file descriptor {fd}")
        targets.append(fd)
    views = []
    for i, b in enumerate(bodies):
        try:
            view = memoryview(b)
        except TypeError:
            raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous bytes-like "
                            f"object, got {type(b).__name__}") from None
        if not view.c_contiguous:
            raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous bytes-like "
                            f"object, got {type(b).__name__}")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    if not targets:
        return 0
    pos = 0
    for view in views:
        for fd in targets:
            rest = view
            while rest:
                try:
                    rest = rest[os.write(fd, rest):]
                except InterruptedError:
                    continue
                except OSError as exc:
                    raise OSError(exc.errno, f"write_bodies: write failed at byte {pos} of the bodies: "
                                             f"{os.strerror(exc.errno)}") from None
        pos += view.nbytes
    return pos


def write_bodies_at(paths, offset, bodies, create=False, size=-1) -> int:
    """Open each of `paths` (existing files: write-only, never created or truncated; or, with
    `create`, made exclusively and removed again if a write fails), write `bodies` from byte `offset`
    as `write_bodies` does and close it; OSError naming a path that cannot be opened or made (twin
    of the Cython routine, which does all of it in one GIL release and also reserves `size` bytes
    first: the files end the same)."""
    paths = list(paths)
    if len(paths) > MAX_FDS:
        raise ValueError(f"write_bodies_at: at most {MAX_FDS} paths")
    if operator.index(offset) < 0:
        raise ValueError(f"write_bodies_at: negative offset {offset}")
    operator.index(size)  # checked as the compiled routine checks it
    if not paths or (not bodies and not create):
        return 0
    fds = []
    ok = False
    try:
        for p in paths:
            try:
                if create:
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                else:
                    fd = os.open(p, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise OSError(exc.errno, f"write_bodies_at: cannot {'make' if create else 'open'} "
                                         f"{os.fsdecode(p)} at byte {offset}: {os.strerror(exc.errno)}",
                              os.fsdecode(p)) from None
            fds.append(fd)  # no reservation here: it only saves the compiled routine block work
            os.lseek(fd, offset, os.SEEK_SET)
        n = write_bodies(fds, bodies)
        ok = True
        return n
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            if create and not ok:
                os.unlink(p)
