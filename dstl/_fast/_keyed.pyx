# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, binding=False
"""Cython single-key path of keyed state: key -> key group, change payload, writer append.

`StateAppender.change(op, key, *fields)` checks the key, computes its key group, encodes the payload
(operation byte + msgpack array `[state_id, key, fields...]`) straight into a reused buffer (ints,
str, bytes, floats, bools, None and lists, tuples and dicts of them by hand, anything else through
msgpack) and appends it. Twin: dstl/_fast/_keyed_py.py (byte-identical payloads, same errors).

When the writer is a `WriterCore` (the changelog writer), the append is its C entry `_append_raw`:
the encoded change goes from this kernel's buffer straight into the writer's arena, with no bytes
object and no Python call. Any other `writer_append` (a wrapper, a test's function) is called with
the payload as bytes.

`binding=False`: the methods are plain C methods, so a bound `value_get`/`value_update` is a
builtin method that CPython calls straight through its vectorcall slot (no Python method object).
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_CheckExact
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_CheckExact
from cpython.list cimport PyList_CheckExact
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_CheckExact
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

import msgpack

from dstl._fast._writer cimport WriterCore
from dstl._fast._hash cimport _java_hash, _long_hash, _murmur
from dstl._fast._keyed_py import closed_error, key_group_of, serialize_error

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL


cdef object _packb = msgpack.packb

cdef enum:
    # lists/tuples/dicts nested deeper than this are packed by msgpack (with its own recursion limit)
    MAX_DEPTH = 32
    # pack_obj's "let msgpack pack the whole payload" (too deep, too long)
    WHOLE = -2


cdef class KeyedAppender:
    """The appends of one keyed state backend: key -> key group, writer append, change counters,
    the deferred append error and the materialization interval (see the twin for the contract)."""
    cdef readonly object backend
    cdef object _writer_append
    cdef WriterCore core  # the writer when `writer_append` is a WriterCore's own append, else None
    cdef readonly object key_group_range
    cdef object maxp_obj
    cdef int32_t maxp, mask
    cdef readonly long kg_start, kg_end
    cdef public int64_t changes, nbytes
    cdef public int64_t every_changes, every_bytes  # the backend's materialize_every_*; 0: none
    cdef public object deferred_error
    cdef bint _closed
    cdef list states  # the StateAppenders handed out (their table caches are dropped on close)
    cdef unsigned char* buf
    cdef Py_ssize_t cap

    def __cinit__(self, backend, writer_append, max_parallelism, key_group_range):
        self.backend = backend
        self._set_writer(writer_append)
        self.maxp_obj = max_parallelism
        self.maxp = max_parallelism
        self.mask = self.maxp - 1 if self.maxp & (self.maxp - 1) == 0 else -1
        self.key_group_range = key_group_range
        self.kg_start = key_group_range.start
        self.kg_end = key_group_range.end
        self.buf = NULL
        self.cap = 0
        self.states = []

    def __dealloc__(self):
        free(self.buf)

    cdef int _set_writer(self, writer_append) except -1:
        w = getattr(writer_append, "__self__", None)
        self._writer_append = writer_append
        # the C entry only for WriterCore's own append bound to `w` (a subclass's override, another
        # method or a wrapper is called as given)
        if isinstance(w, WriterCore) and writer_append == WriterCore.append.__get__(w, type(w)):
            self.core = <WriterCore>w
        else:
            self.core = None
        return 0

    @property
    def writer_append(self):
        """The writer's `append(key_group, payload)` the changes go to."""
        return self._writer_append

    @writer_append.setter
    def writer_append(self, value):
        self._set_writer(value)

    @property
    def closed(self):
        return self._closed

    @closed.setter
    def closed(self, bint value):
        """Closing refuses further appends and drops the states' table caches (the backend clears
        its table then)."""
        self._closed = value
        if value:
            for s in self.states:
                (<StateAppender>s).slots = None

    cdef inline long _kg(self, key) except -1:
        if not (PyLong_CheckExact(key) or PyUnicode_CheckExact(key) or PyBytes_CheckExact(key)):
            return key_group_of(key, self.maxp_obj, self.kg_start, self.kg_end, self.key_group_range)
        return self._group(_java_hash(key), key)

    cdef inline long _group(self, uint32_t code, key) except -1:
        """The key group of `key`, whose Java hashCode is `code`, checked against the range."""
        cdef int32_t m = _murmur(code)
        cdef long g = (m & self.mask) if self.mask >= 0 else (m % self.maxp)  # murmur is never negative
        if g < self.kg_start or g > self.kg_end:
            raise ValueError(f"key {key!r} belongs to key group {g}, outside this backend's range "
                             f"{self.key_group_range}")
        return g

    def kg(self, key):
        """The key group of a state key (TypeError/ValueError as `key_group_of`)."""
        return self._kg(key)

    cdef int _append(self, long kg, const unsigned char* data, Py_ssize_t n, object payload) except -1:
        """Log one encoded change of key group `kg`: the `n` bytes at `data` (`payload`: them as a bytes
        object, or None when there is none yet)."""
        if self._closed:
            raise closed_error(self.backend)
        try:
            if self.core is not None:
                self.core._append_raw(kg, data, n)
            else:
                if payload is None:
                    payload = PyBytes_FromStringAndSize(<const char*>data, n)
                self._writer_append(kg, payload)
        except OSError as exc:
            self.deferred_error = exc
        self.changes += 1
        self.nbytes += n
        return 0

    def append(self, long kg, bytes payload not None):
        """Log one encoded change of key group `kg`."""
        self._append(kg, <const unsigned char*>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload), payload)

    cdef inline bint _due(self) noexcept:
        """What the backend's `_mutated` would act on: a deferred append error, a reached interval."""
        return self.deferred_error is not None \
            or (self.every_changes != 0 and self.changes >= self.every_changes) \
            or (self.every_bytes != 0 and self.nbytes >= self.every_bytes)

    def due(self):
        """True when the backend's `_mutated` has something to do."""
        return self._due()

    def for_state(self, state_id, name):
        cdef StateAppender s = StateAppender.__new__(StateAppender)
        s.k = self
        s.state_id = state_id
        s.sid = state_id
        s.sid_len = -1
        if PyLong_CheckExact(state_id) and -2**63 <= state_id < 2**63:
            s.sid_len = <int>pack_int(s.sid_packed, state_id)
        s.name = name
        s.tables = self.backend._table
        if not self._closed:
            s.slots = [None] * (self.kg_end - self.kg_start + 1)
        self.states.append(s)
        return s

    cdef inline int _reserve(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap
        cdef void* p
        if need <= self.cap:
            return 0
        cap = self.cap * 2 if self.cap else 256
        while cap < need:
            cap *= 2
        p = realloc(self.buf, cap)
        if p == NULL:
            raise MemoryError()
        self.buf = <unsigned char*>p
        self.cap = cap
        return 0


cdef inline void be16(unsigned char* p, uint16_t v) noexcept:
    p[0] = <unsigned char>(v >> 8)
    p[1] = <unsigned char>v


cdef inline void be32(unsigned char* p, uint32_t v) noexcept:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline void be64(unsigned char* p, uint64_t v) noexcept:
    be32(p, <uint32_t>(v >> 32))
    be32(p + 4, <uint32_t>v)


cdef inline Py_ssize_t pack_int(unsigned char* p, int64_t d) noexcept:
    """msgpack's smallest form of an int64 (as msgpack-python's packer picks it)."""
    if d < -(1 << 5):
        if d < -(1 << 15):
            if d < -(<int64_t>1 << 31):
                p[0] = 0xd3
                be64(p + 1, <uint64_t>d)
                return 9
            p[0] = 0xd2
            be32(p + 1, <uint32_t>d)
            return 5
        if d < -(1 << 7):
            p[0] = 0xd1
            be16(p + 1, <uint16_t>d)
            return 3
        p[0] = 0xd0
        p[1] = <unsigned char>d
        return 2
    if d < (1 << 7):
        p[0] = <unsigned char>d  # positive or negative fixint
        return 1
    if d < (1 << 8):
        p[0] = 0xcc
        p[1] = <unsigned char>d
        return 2
    if d < (1 << 16):
        p[0] = 0xcd
        be16(p + 1, <uint16_t>d)
        return 3
    if d < (<int64_t>1 << 32):
        p[0] = 0xce
        be32(p + 1, <uint32_t>d)
        return 5
    p[0] = 0xcf
    be64(p + 1, <uint64_t>d)
    return 9


cdef inline Py_ssize_t pack_head(unsigned char* p, Py_ssize_t n, int fix, int fixmax, int c8, int c16,
                                 int c32) noexcept:
    """A str/bin/array/map header: fix form (when fix >= 0 and n < fixmax), then 8/16/32-bit
    lengths (c8 < 0: no 8-bit form, as for arrays and maps)."""
    if fix >= 0 and n < fixmax:
        p[0] = <unsigned char>(fix | n)
        return 1
    if c8 >= 0 and n < 256:
        p[0] = <unsigned char>c8
        p[1] = <unsigned char>n
        return 2
    if n < 65536:
        p[0] = <unsigned char>c16
        be16(p + 1, <uint16_t>n)
        return 3
    p[0] = <unsigned char>c32
    be32(p + 1, <uint32_t>n)
    return 5


cdef Py_ssize_t pack_obj(KeyedAppender k, Py_ssize_t pos, object o, int depth) except -1:
    """Append msgpack of `o` at k.buf[pos:]; returns the new position, or WHOLE when msgpack must
    pack the whole payload (nesting beyond MAX_DEPTH or a container beyond 32-bit lengths: its limits
    and errors then apply as they do in the twin). Raises what msgpack raises."""
    cdef long long d
    cdef int overflow = 0
    cdef Py_ssize_t n, i
    cdef const char* s
    cdef double f
    cdef uint64_t bits
    if PyLong_CheckExact(o):
        d = PyLong_AsLongLongAndOverflow(o, &overflow)
        if not overflow:
            k._reserve(pos + 9)
            return pos + pack_int(k.buf + pos, d)
    elif PyUnicode_CheckExact(o):
        try:
            s = PyUnicode_AsUTF8AndSize(o, &n)
        except UnicodeError:
            s = NULL  # msgpack raises its own error below
        if s != NULL and n <= 0xFFFFFFFF:
            k._reserve(pos + 5 + n)
            pos += pack_head(k.buf + pos, n, 0xa0, 32, 0xd9, 0xda, 0xdb)
            memcpy(k.buf + pos, s, n)
            return pos + n
    elif PyFloat_CheckExact(o):
        f = PyFloat_AS_DOUBLE(o)
        memcpy(&bits, &f, 8)
        k._reserve(pos + 9)
        k.buf[pos] = 0xcb
        be64(k.buf + pos + 1, bits)
        return pos + 9
    elif o is None or o is True or o is False:
        k._reserve(pos + 1)
        k.buf[pos] = 0xc0 if o is None else (0xc3 if o is True else 0xc2)
        return pos + 1
    elif PyList_CheckExact(o) or PyTuple_CheckExact(o):
        n = len(o)
        if depth >= MAX_DEPTH or n > 0xFFFFFFFF:
            return WHOLE
        k._reserve(pos + 5)
        pos += pack_head(k.buf + pos, n, 0x90, 16, -1, 0xdc, 0xdd)
        if PyList_CheckExact(o):
            for i in range(n):
                if i >= len(<list>o):  # cannot shrink while packing (no Python code runs); guarded anyway
                    raise RuntimeError("list changed size during packing")
                pos = pack_obj(k, pos, (<list>o)[i], depth + 1)
                if pos == WHOLE:
                    return WHOLE
        else:
            for i in range(n):
                pos = pack_obj(k, pos, (<tuple>o)[i], depth + 1)
                if pos == WHOLE:
                    return WHOLE
        return pos
    elif PyDict_CheckExact(o):
        n = len(o)
        if depth >= MAX_DEPTH or n > 0xFFFFFFFF:
            return WHOLE
        k._reserve(pos + 5)
        pos += pack_head(k.buf + pos, n, 0x80, 16, -1, 0xde, 0xdf)
        for key, value in (<dict>o).items():  # dict order, as msgpack iterates it
            pos = pack_obj(k, pos, key, depth + 1)
            if pos == WHOLE:
                return WHOLE
            pos = pack_obj(k, pos, value, depth + 1)
            if pos == WHOLE:
                return WHOLE
        return pos
    elif PyBytes_CheckExact(o):
        n = PyBytes_GET_SIZE(o)
        if n <= 0xFFFFFFFF:
            k._reserve(pos + 5 + n)
            pos += pack_head(k.buf + pos, n, -1, 0, 0xc4, 0xc5, 0xc6)
            memcpy(k.buf + pos, PyBytes_AS_STRING(o), n)
            return pos + n
    # anything else (subclasses, ints beyond int64, sets, ...): msgpack's own bytes or error; packing
    # an element on its own gives the bytes it has inside a container
    packed = _packb(o, use_bin_type=True)
    n = PyBytes_GET_SIZE(packed)
    k._reserve(pos + n)
    memcpy(k.buf + pos, PyBytes_AS_STRING(packed), n)
    return pos + n


cdef class StateAppender:
    """The single-key changes of one state: `change(op, key, *fields)` logs `[state_id, key, *fields]`
    under operation `op` and returns the key's key group."""
    cdef KeyedAppender k
    cdef readonly object state_id
    cdef readonly object name
    cdef object sid
    cdef unsigned char sid_packed[9]  # the state id's msgpack int, encoded once (sid_len -1: packed per change)
    cdef int sid_len
    cdef dict tables
    # per key group of the backend's range, this state's {key: value} of that group once it exists:
    # a list index instead of two dict lookups. The table never replaces or drops such a dict while the
    # backend is open (entries are only added, changed and removed inside it); None once closed.
    cdef list slots
    cdef int set_op
    cdef object slow_get, slow_update  # the state's own methods, for what the fast path leaves to them

    @property
    def appender(self):
        return self.k

    def set(self, int op, key, logged, value):
        """`change(op, key, logged)`, then `value` becomes the key's entry in this state's table."""
        cdef long g = self._change(op, key, None, logged)
        self._put(g, key, value)
        return g

    cdef inline object _entries(self, long g, bint create):
        """This state's {key: value} of key group `g` (in the backend's range); None when it has none
        and not `create`."""
        cdef PyObject* t
        cdef PyObject* s
        cdef Py_ssize_t i = g - self.k.kg_start
        if self.slots is not None:
            d = (<list>self.slots)[i]
            if d is not None:
                return d
        t = PyDict_GetItemWithError(self.tables, g)
        if t == NULL:
            if not create:
                return None
            table = self.tables[g] = {}
        else:
            table = <object>t
        s = PyDict_GetItemWithError(table, self.name)
        if s != NULL:
            d = <object>s
        elif create:
            d = (<dict>table)[self.name] = {}
        else:
            return None
        if self.slots is not None:
            (<list>self.slots)[i] = d
        return d

    cdef inline int _put(self, long g, key, value) except -1:
        # `value` becomes the key's entry in this state's table of key group `g`
        (<dict>self._entries(g, True))[key] = value
        return 0

    def change(self, int op, key, *fields):
        return self._change(op, key, fields, None)

    def bind_value(self, int set_op, slow_get, slow_update):
        """`(get, update)` of a ValueState with a native serializer as two bound C methods: an int, str
        or bytes key (and, for update, a value that is not None) takes one C call; anything else goes
        to `slow_get(key, default)` / `slow_update(key, value)`, the state's own methods."""
        self.set_op = set_op
        self.slow_get = slow_get
        self.slow_update = slow_update
        return self.value_get, self.value_update

    def value_get(self, key, default=None):
        """ValueState.get (see bind_value)."""
        cdef long long v
        cdef int overflow = 0
        cdef long g
        if PyLong_CheckExact(key):  # the common key: its value read once, hashed inline
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            g = self.k._kg(key) if overflow else self.k._group(_long_hash(v), key)
        elif PyUnicode_CheckExact(key) or PyBytes_CheckExact(key):
            g = self.k._kg(key)
        else:
            return self.slow_get(key, default)
        d = self._entries(g, False)
        if d is None:
            return default
        return (<dict>d).get(key, default)

    def value_update(self, key, value):
        """ValueState.update (see bind_value): logs SET, sets the entry, then the backend's `_mutated`
        when it has something to do (a deferred append error, a reached materialization interval)."""
        cdef long g
        cdef long long v
        cdef int overflow = 0
        cdef KeyedAppender k = self.k
        if value is None:
            return self.slow_update(key, value)
        if PyLong_CheckExact(key):  # the common key: its value read once, for the hash and the payload
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            if overflow:
                g = self._change(self.set_op, key, None, value)  # raises the int64 range error
            else:
                g = self._log(k._group(_long_hash(v), key), self.set_op, key, None, value, True, v)
        elif PyUnicode_CheckExact(key) or PyBytes_CheckExact(key):
            g = self._change(self.set_op, key, None, value)
        else:
            return self.slow_update(key, value)
        self._put(g, key, value)
        if k._due():
            k.backend._mutated()

    cdef long _change(self, int op, key, tuple fields, object one) except -1:
        """Log `[state_id, key, *fields]` (fields None: the one field `one`) under `op`."""
        return self._log(self.k._kg(key), op, key, fields, one, False, 0)

    cdef long _log(self, long g, int op, key, tuple fields, object one, bint int_key, int64_t kv) except -1:
        """`_change` of a key whose key group `g` is known (`int_key`: an int key whose value is `kv`)."""
        cdef KeyedAppender k = self.k
        cdef Py_ssize_t pos = WHOLE, i, nf = 1 if fields is None else len(fields)
        try:
            if nf <= 13 and 0 <= op <= 255:  # a fixarray and an op byte, else as the twin does it
                k._reserve(2 + 9 + 9)
                k.buf[0] = <unsigned char>op
                k.buf[1] = <unsigned char>(0x90 | (nf + 2))
                if self.sid_len == 1:  # a positive fixint (a state id below 128): no memcpy call
                    k.buf[2] = self.sid_packed[0]
                    pos = 3
                elif self.sid_len > 0:
                    memcpy(k.buf + 2, self.sid_packed, self.sid_len)
                    pos = 2 + self.sid_len
                else:
                    pos = pack_obj(k, 2, self.sid, 0)
                if pos != WHOLE:
                    if int_key:
                        k._reserve(pos + 9)
                        pos += pack_int(k.buf + pos, kv)
                    else:
                        pos = pack_obj(k, pos, key, 0)
                if fields is None:
                    if pos != WHOLE:
                        pos = pack_obj(k, pos, one, 0)
                else:
                    for i in range(nf):
                        if pos == WHOLE:
                            break
                        pos = pack_obj(k, pos, fields[i], 0)
            if pos == WHOLE:
                payload = bytes((op,)) + _packb([self.sid, key, *((one,) if fields is None else fields)],
                                                use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise serialize_error(exc, self.name, key) from exc
        if pos == WHOLE:
            k._append(g, <const unsigned char*>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload), payload)
        else:
            k._append(g, k.buf, pos, None)
        return g


def plain_list(value, tuple types):
    """`list(value)` when `value` is a tuple or list (exactly) whose items have exactly the types in
    `types`, one for one; else None. The processor adapters' plain-value encode
    (dstl/spark/processor_adapters.py)."""
    cdef Py_ssize_t i, n = len(types)
    if PyTuple_CheckExact(value):
        if len(<tuple>value) != n:
            return None
        for i in range(n):
            if type((<tuple>value)[i]) is not (<tuple>types)[i]:
                return None
        return list(<tuple>value)
    if PyList_CheckExact(value):
        if len(<list>value) != n:
            return None
        for i in range(n):
            if type((<list>value)[i]) is not (<tuple>types)[i]:
                return None
        return list(<list>value)
    return None
