# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython file writes of change-set bodies: `write_bodies` (to open file descriptors) and
`write_bodies_at` (opens, or makes, the files itself), each in one release of the GIL.

A sealed body with its groups' chunks is written from them with writev (the payload is copied once,
into the page cache); another is produced in canonical order one L2-sized piece at a time
(dstl/_fast/_sealed.pyx `fill_body`) and each piece written while it is still in the cache.

Twin: dstl/_fast/_filewrite_py.py (the same bytes in the files, same checks and errors).
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

from dstl._fast._cutil cimport put_be32
from dstl._fast._sealed cimport BodyRef, Cursor, SealedBody, body_ref, cursor_start, fill_body
from dstl._fast._spares cimport give_chunk, take_chunk

import operator
import os


cdef extern from "unistd.h" nogil:
    ssize_t c_write "write" (int fd, const void* buf, size_t count)
    int64_t c_lseek "lseek" (int fd, int64_t offset, int whence)
    int c_close "close" (int fd)
    int c_unlink "unlink" (const char* path)
    int c_ftruncate "ftruncate" (int fd, int64_t length)

cdef extern from "fcntl.h" nogil:
    int c_open "open" (const char* path, int flags, int mode)
    int c_fallocate "fallocate" (int fd, int mode, int64_t offset, int64_t length)
    int O_WRONLY, O_CLOEXEC, O_CREAT, O_EXCL
    int SEEK_SET

cdef enum:
    PREALLOCATE_MIN = 1 << 20  # smaller files gain nothing from reserving their blocks first

cdef extern from "errno.h" nogil:
    int errno
    int EINTR


cdef int write_all(const int* fds, int nfds, const unsigned char* p, int64_t n) noexcept nogil:
    """write(2) p[:n] in full to every fd; 0, or the errno of the first failure."""
    cdef int k
    cdef int64_t done
    cdef ssize_t got
    for k in range(nfds):
        done = 0
        while done < n:
            got = c_write(fds[k], p + done, <size_t>(n - done))
            if got < 0:
                if errno == EINTR:
                    continue
                return errno
            done += got
    return 0


cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t c_writev "writev" (int fd, const iovec* iov, int iovcnt)


cdef enum:
    MAX_FDS = 4
    IOVS = 512  # iovecs per writev (Linux allows 1024)


cdef int writev_all(const int* fds, int nfds, const iovec* iov, int cnt, int64_t n) noexcept nogil:
    """writev(2) the `cnt` iovecs (`n` bytes) in full to every fd (a short write is finished with
    write(2)); 0, or the errno of the first failure."""
    cdef int k, j, err
    cdef ssize_t got
    cdef int64_t skip
    for k in range(nfds):
        got = c_writev(fds[k], iov, cnt)
        while got < 0 and errno == EINTR:
            got = c_writev(fds[k], iov, cnt)
        if got < 0:
            return errno
        if got == n:
            continue
        skip = got
        for j in range(cnt):
            if skip >= <int64_t>iov[j].iov_len:
                skip -= iov[j].iov_len
                continue
            err = write_all(&fds[k], 1, (<const unsigned char*>iov[j].iov_base) + skip, iov[j].iov_len - skip)
            if err:
                return err
            skip = 0
    return 0


cdef int write_chunked(const int* fds, int nfds, const BodyRef* b, unsigned char* hdr) noexcept nogil:
    """Write a body that has its groups' chunks (b.spans set) to every fd: its headers go into `hdr`
    (4 + 8 bytes a group) and the chunks are written where they are, IOVS iovecs a writev: the
    payload is copied once, into the page cache, as a plain write() copies it."""
    cdef iovec iov[IOVS]
    cdef int cnt = 1, err
    cdef int64_t n = 4, g, j, s = 0
    cdef unsigned char* h
    put_be32(hdr, <int32_t>b.num_groups)
    iov[0].iov_base, iov[0].iov_len = hdr, 4
    for g in range(b.num_groups):
        h = hdr + 4 + 8 * g
        put_be32(h, <int32_t>b.groups[2 * g + 1])
        put_be32(h + 4, <int32_t>b.groups[2 * g])
        if cnt == IOVS:
            err = writev_all(fds, nfds, iov, cnt, n)
            if err:
                return err
            cnt, n = 0, 0
        iov[cnt].iov_base, iov[cnt].iov_len = h, 8
        cnt += 1
        n += 8
        for j in range(b.gspans[g]):
            if cnt == IOVS:
                err = writev_all(fds, nfds, iov, cnt, n)
                if err:
                    return err
                cnt, n = 0, 0
            iov[cnt].iov_base, iov[cnt].iov_len = <void*>(b.arena + b.spans[2 * s]), b.spans[2 * s + 1]
            cnt += 1
            n += b.spans[2 * s + 1]
            s += 1
    return writev_all(fds, nfds, iov, cnt, n) if cnt else 0


cdef int64_t piece_size = 512 << 10  # write_bodies' piece: produced and written while in the L2 cache


def _set_piece_size(nbytes):
    """Benchmarks and tests: the piece size of write_bodies; returns the previous one."""
    global piece_size
    if nbytes <= 0:
        raise ValueError(f"piece size must be positive, got {nbytes}")
    old, piece_size = piece_size, nbytes
    return old


def write_bodies(fds, bodies):
    """Write `bodies` (sealed bodies or bytes-like objects) back to back to each file descriptor in
    `fds`, at its position, with the GIL released once for all of them: an upload thread needs the
    interpreter only before and after the file's bytes. A sealed body with its groups' chunks is
    written from them with writev; another is produced in canonical order one L2-sized piece at a
    time and each piece written while it is still in the cache, so that two upload threads scale on
    two cores (a whole-body layout first makes them contend for the shared cache and memory).
    Returns the bytes written to each fd; OSError (with the byte offset reached) if a write fails."""
    cdef int cfds[MAX_FDS]
    cdef int nfds = 0
    for fd in fds:
        if nfds == MAX_FDS:
            raise ValueError(f"write_bodies: at most {MAX_FDS} file descriptors")
        try:
            cfds[nfds] = operator.index(fd)
        except TypeError:
            raise TypeError(f"write_bodies: file descriptors must be ints, got {type(fd).__name__}") from None
        if cfds[nfds] < 0:
            raise ValueError(f"write_bodies: invalid file descriptor {cfds[nfds]}")
        nfds += 1
    return _bodies_out(cfds, nfds, bodies, None, 0)


def write_bodies_at(paths, offset, bodies, create=False, size=-1):
    """Open each of `paths`, write `bodies` into it from byte `offset` as `write_bodies` does, and
    close it, all in one GIL release. The files exist (write-only, never created or truncated), or
    with `create` are made exclusively (mode 0666 less the umask) with `size` bytes reserved first
    when that is 1 MiB or more (fallocate; best effort), and are removed again if a write fails.
    A thread that writes beside a busy appending thread waits up to the interpreter's switch interval
    (5 ms) for the GIL after every system call it makes without it; here there is one. Returns the
    bytes written to each file; OSError naming the path if one cannot be opened or made."""
    cdef int cfds[MAX_FDS]
    cdef list names = [os.fsencode(p) for p in paths]
    if len(names) > MAX_FDS:
        raise ValueError(f"write_bodies_at: at most {MAX_FDS} paths")
    if operator.index(offset) < 0:
        raise ValueError(f"write_bodies_at: negative offset {offset}")
    return _bodies_out(cfds, len(names), bodies, names, offset, operator.index(size) if create else -2)


cdef object _bodies_out(int* cfds, int nfds, bodies, list names, int64_t offset, int64_t reserve=-2):
    """write_bodies' work; with `names`, the nfds files are opened (and closed) inside the GIL release,
    and made when `reserve` > -2 (the bytes to reserve, or -1)."""
    cdef int err = 0, opened = 0, failed_at = -1
    cdef bint create = reserve > -2
    cdef const char* cnames[MAX_FDS]
    cdef Py_ssize_t nb = len(bodies), i, nviews = 0
    cdef int64_t pos = 0, got, size = piece_size
    cdef bint sealed = False
    cdef Py_buffer* views
    cdef BodyRef* refs
    cdef int* kinds          # 0 = raw buffer, 1 = sealed body, 2 = one with chunks, -1 = not looked at
    cdef int64_t max_groups = -1
    cdef unsigned char* hdr = NULL
    cdef unsigned char* chunk_ptr = NULL
    cdef Cursor c
    cdef bytearray chunk = None
    cdef list held = []      # keeps the bodies alive while the GIL is released
    cdef bint open_here = names is not None
    if open_here:
        for i in range(nfds):
            cnames[i] = <const char*>(<bytes>names[i])
    if nfds == 0 or (nb == 0 and not create):
        return 0
    views = <Py_buffer*>malloc((nb or 1) * sizeof(Py_buffer))
    refs = <BodyRef*>malloc((nb or 1) * sizeof(BodyRef))
    kinds = <int*>malloc((nb or 1) * sizeof(int))
    if views == NULL or refs == NULL or kinds == NULL:
        free(views)
        free(refs)
        free(kinds)
        raise MemoryError()
    try:
        for i in range(nb):
            kinds[i] = -1
            nviews = i + 1
            b = bodies[i]
            held.append(b)
            if type(b) is SealedBody and (<SealedBody>b)._bytes is None and (<SealedBody>b).spans != NULL:
                refs[i] = body_ref(<SealedBody>b)
                kinds[i] = 2
                if refs[i].num_groups > max_groups:
                    max_groups = refs[i].num_groups
                continue
            if type(b) is SealedBody and (<SealedBody>b)._bytes is None:
                (<SealedBody>b)._order()
                refs[i] = body_ref(<SealedBody>b)
                kinds[i] = 1
                sealed = True
                continue
            if type(b) is SealedBody:
                b = (<SealedBody>b)._bytes
            try:
                PyObject_GetBuffer(b, &views[i], PyBUF_SIMPLE)
            except (TypeError, BufferError, ValueError):
                raise TypeError(f"write_bodies: body {i} is not a sealed body or a contiguous "
                                f"bytes-like object, got {type(b).__name__}") from None
            kinds[i] = 0
        if max_groups >= 0:
            hdr = <unsigned char*>malloc(4 + 8 * max_groups)
            if hdr == NULL:
                raise MemoryError()
        if sealed:
            chunk = take_chunk(size)
            chunk_ptr = <unsigned char*>(<char*>chunk)
        with nogil:
            if open_here:
                for i in range(nfds):
                    if create:
                        cfds[i] = c_open(cnames[i], O_WRONLY | O_CLOEXEC | O_CREAT | O_EXCL, 0o666)
                        if cfds[i] >= 0 and reserve >= PREALLOCATE_MIN and c_fallocate(cfds[i], 0, 0, reserve) != 0:
                            c_ftruncate(cfds[i], 0)  # a partial reservation must not stay
                    else:
                        cfds[i] = c_open(cnames[i], O_WRONLY | O_CLOEXEC, 0)
                    if cfds[i] < 0 or c_lseek(cfds[i], offset, SEEK_SET) < 0:
                        err = errno
                        failed_at = <int>i
                        if cfds[i] >= 0:
                            opened += 1
                        break
                    opened += 1
            for i in range(nb):
                if err:
                    break
                if kinds[i] == 0:
                    err = write_all(cfds, nfds, <const unsigned char*>views[i].buf, views[i].len)
                    if err:
                        break
                    pos += views[i].len
                    continue
                if kinds[i] == 2:
                    err = write_chunked(cfds, nfds, &refs[i], hdr)
                    if err:
                        break
                    pos += refs[i].total
                    continue
                cursor_start(&c)
                while True:
                    got = fill_body(&refs[i], chunk_ptr, size, &c)
                    if got == 0:
                        break
                    err = write_all(cfds, nfds, chunk_ptr, got)
                    if err:
                        break
                    pos += got
                if err:
                    break
            for i in range(opened):
                c_close(cfds[i])
                if err and create:  # made here: a failed write leaves nothing behind
                    c_unlink(cnames[i])
    finally:
        for i in range(nviews):
            if kinds[i] == 0:
                PyBuffer_Release(&views[i])
        free(views)
        free(refs)
        free(kinds)
        free(hdr)
    if chunk is not None:
        give_chunk(size, chunk)
    if err and failed_at >= 0:
        raise OSError(err, f"write_bodies_at: cannot {'make' if create else 'open'} "
                           f"{names[failed_at].decode(errors='replace')} at byte {offset}: {os.strerror(err)}",
                      os.fsdecode(names[failed_at]))
    if err:
        raise OSError(err, f"write_bodies: write failed at byte {pos} of the bodies: {os.strerror(err)}")
    return pos
