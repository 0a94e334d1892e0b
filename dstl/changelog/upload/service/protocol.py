"""Every message between the upload service's processes: one small immutable class per kind, and
`dispatch` to route a received message through a table `{message class: handler}`.

Three channels, each a multiprocessing connection (pickled messages):

* client <-> service (Unix socket): Hello, Upload, Release, Call, Close, Written / Welcome, Refused,
  Done, Failed, Availability, Reply, Closed, Notice, WriteRegion;
* service <-> registry process (pipe): Operation, Query, Shutdown / RegistryHello, Ack, QueryReply;
* service <-> uploader process (pipe): Job, Stop / WorkerReady, Intent, AttemptDone, AttemptFailed.

Bump `runtime.PROTOCOL_VERSION` whenever a message changes: other versions get a service of their own.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Type


class ProtocolError(Exception):
    """A message that the receiver does not expect on that channel."""


# ---- client -> service ------------------------------------------------------------------------
class Hello(NamedTuple):
    """First message of a connection."""
    client_id: str
    pid: int


class Upload(NamedTuple):
    """One upload task: its sealed bodies are in shared-memory segment `segment`, or held by the
    client when `segment` is "" (it writes them itself when asked: WriteRegion); `items` lists
    (offset, length, log id bytes, sqn, size, number of changes) per change set. `queued_at` is
    the client's `time.monotonic()` when its writer handed the task over (the persist delay runs
    from there); `more`: the client has more tasks on their way (the batch waits for them)."""
    task_id: int
    job_id: str
    local_dir: Optional[str]
    segment: str
    items: List[tuple]
    size: int
    queued_at: Optional[float] = None
    more: bool = False


class Release(NamedTuple):
    """One change set of file `path` is no longer needed by this client (asynchronous)."""
    path: str


class Call(NamedTuple):
    """A request answered by a Reply: ping, status, count, gauges, flush, sync, reg, delete_failures."""
    call_id: int
    name: str
    args: Any


class Close(NamedTuple):
    """The client closes: cancel its queued tasks, answer Closed once its running ones finished."""


class Written(NamedTuple):
    """The answer to WriteRegion `attempt_id`: every region is written (`error` None) or not."""
    attempt_id: int
    error: Optional[BaseException]


# ---- service -> client ------------------------------------------------------------------------
class Welcome(NamedTuple):
    instance: str
    pid: int
    max_in_flight: int
    available: bool
    in_flight: int


class Refused(NamedTuple):
    reason: str


class Done(NamedTuple):
    """A task's change sets are in file `path`: `results` = [(sqn, offset, local offset, size)]."""
    task_id: int
    path: str
    local_path: Optional[str]
    logical_size: int
    results: List[tuple]
    metrics: Optional[dict]
    gauges: tuple


class Failed(NamedTuple):
    task_id: int
    error: BaseException
    metrics: Optional[dict]
    gauges: tuple


class Availability(NamedTuple):
    """Back-pressure changed (pushed to every client); gauges = (in-flight bytes, queued, available)."""
    available: bool
    gauges: tuple


class Reply(NamedTuple):
    call_id: int
    ok: bool
    value: Any


class Closed(NamedTuple):
    """Every task of the closing client has finished."""


class WriteRegion(NamedTuple):
    """Write held change sets into the attempt's new files `paths` (the file and its local copy, each
    created and sized by the service): `writes` = [(task id, index of the change set in the task's
    Upload items, file offset)]. Answered by Written."""
    attempt_id: int
    paths: List[str]
    writes: List[tuple]


class Notice(NamedTuple):
    """An error the service logged, pushed to every client so that it is visible in the clients' logs
    even when the service's own log file cannot be written (a full runtime file system)."""
    text: str


# ---- service <-> registry process -------------------------------------------------------------
class Operation(NamedTuple):
    """A journaled registry operation: `record` = [kind, op id, *arguments] (see journal.RegistryState)."""
    record: list


class Query(NamedTuple):
    """count (args: path), sync, delete_failures: answered by a QueryReply."""
    query_id: int
    kind: str
    args: tuple


class Shutdown(NamedTuple):
    """Finish scheduled deletions, compact the journal, exit."""


class RegistryHello(NamedTuple):
    last_id: int
    pid: int


class Ack(NamedTuple):
    """Operation `op_id` is journaled and applied (`error` None) or was refused unapplied."""
    op_id: int
    error: Optional[str]


class QueryReply(NamedTuple):
    query_id: int
    value: Any


# ---- service <-> uploader process -------------------------------------------------------------
class Job(NamedTuple):
    """One attempt (see worker.run_attempt for the keys of `spec`)."""
    spec: dict


class Stop(NamedTuple):
    """The uploader exits."""


class WorkerReady(NamedTuple):
    pid: int


class Intent(NamedTuple):
    """The attempt is about to create `url` (so a killed uploader leaves no unknown file)."""
    url: str


class AttemptDone(NamedTuple):
    result: dict


class AttemptFailed(NamedTuple):
    error: BaseException
    metrics: Optional[dict]


Handlers = Dict[Type[tuple], Callable[..., Any]]


def dispatch(table: Handlers, msg: Any, *args: Any) -> Any:
    """Call the handler of `type(msg)` with (msg, *args); ProtocolError for an unexpected message."""
    handler = table.get(type(msg))
    if handler is None:
        raise ProtocolError(f"unexpected message {type(msg).__name__}: {msg!r:.200}")
    return handler(msg, *args)


__all__ = ["ProtocolError", "dispatch", "Hello", "Upload", "Release", "Call", "Close", "Written", "Welcome",
           "Refused", "Done", "Failed", "WriteRegion", "Availability", "Reply", "Closed", "Notice", "Operation",
           "Query", "Shutdown",
           "RegistryHello", "Ack", "QueryReply", "Job", "Stop", "WorkerReady", "Intent", "AttemptDone",
           "AttemptFailed", "Handlers"]
