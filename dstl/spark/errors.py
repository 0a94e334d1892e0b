"""The errors a failed batch raises on the driver, each with its cause and what to do on the first line.

A task's failure reaches the driver as Spark's `PythonException` (or a Py4J error) whose text holds
the worker's whole traceback, the cause twenty lines down. The errors below are raised in the
worker with a one-line message; `raise_from_worker` finds the most telling of them in that text and
raises it again on the driver, Spark's exception attached as `__cause__`.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Sequence, Tuple, Type

from dstl.changelog.fs import StoreUnreachableError, unreachable_reason
from dstl.spark.memory_limit import SlotMemoryError

__all__ = ["ProcessorError", "OutputSchemaError", "SlotError", "raise_from_worker", "processor_name",
           "processor_failed", "call_fn", "output_lacks_columns", "store_failed", "one_line"]


class ProcessorError(RuntimeError):
    """The user's processor (or function) raised: the message names it, the key and its error."""


class OutputSchemaError(ValueError):
    """A processor's output lacks columns of the declared output schema."""


class SlotError(RuntimeError):
    """The slot process could not be started, or died while it ran the task."""


#: the errors that lead on the driver, most telling first: a slot's error may carry a processor's
_LEADING: Tuple[Type[BaseException], ...] = (ProcessorError, OutputSchemaError, SlotMemoryError,
                                              StoreUnreachableError, SlotError)


def one_line(text: str, limit: int = 500) -> str:
    """`text` on one line (the driver reads a worker's error message by its line), at most `limit` chars."""
    flat = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def processor_name(processor: Any) -> str:
    """A processor's class name, or a function's qualified name."""
    if isinstance(processor, type):
        return processor.__qualname__
    name = getattr(processor, "__qualname__", None) or getattr(processor, "__name__", None)
    if name is None:
        name = type(processor).__qualname__
    module = getattr(processor, "__module__", None) or type(processor).__module__
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


def processor_failed(processor: Any, key: Any, exc: BaseException, where: str = "") -> ProcessorError:
    """The error for `exc` raised by `processor` for `key` (None: not for one key)."""
    at = f" for key {key!r}" if key is not None else ""
    in_ = f" in {where}" if where else ""
    return _kind_of(exc)(one_line(f"processor {processor_name(processor)} failed{at}{in_}: "
                                   f"{type(exc).__name__}: {exc} (fix the processor or the input; the batch "
                                   f"was not committed and reruns from the last checkpoint)"))


_KINDS: Dict[type, type] = {}


def _kind_of(exc: BaseException) -> type:
    """ProcessorError, and in the worker also the built-in type of `exc` (a caller catching the
    processor's TypeError still does); the driver sees a plain ProcessorError."""
    base = type(exc)
    if base.__module__ != "builtins" or not issubclass(base, Exception) or base is KeyError:
        return ProcessorError
    kind = _KINDS.get(base)
    if kind is None:
        kind = _KINDS[base] = type("ProcessorError", (ProcessorError, base),
                                   {"__module__": __name__, "__qualname__": "ProcessorError",
                                    # pickled (a slot's reply) as the plain class, which has a name
                                    "__reduce__": lambda self: (ProcessorError, self.args)})
    return kind


def call_fn(fn: Any, rows: Any, state: Any) -> Any:
    """A vectorised `fn(rows, state)` on a subtask's rows (None without rows); what it raises comes
    back as a `ProcessorError` naming it."""
    if not len(rows):
        return None
    try:
        return fn(rows, state)
    except Exception as exc:
        raise processor_failed(fn, None, exc) from exc


def output_lacks_columns(processor: Any, missing: Sequence[str], present: Sequence[str]) -> OutputSchemaError:
    """The error for a processor's output without the output schema's columns `missing`."""
    who = "the processor" if processor is None else f"processor {processor_name(processor)}"
    return OutputSchemaError(one_line(
        f"{who} returned output without the output schema's columns {list(missing)} (it has "
        f"{list(present)}): return every column of output_schema, or change output_schema"))


def store_failed(base_path: str, subtask: int, attempts: int, seconds: float,
                 exc: BaseException) -> BaseException:
    """The error for a subtask whose state could not be written to the store at `base_path`: a
    `StoreUnreachableError` saying so (URL, attempts, time spent) when `exc` is such a failure,
    else `exc` itself."""
    chain, e = [], exc
    while e is not None and len(chain) < 6:  # the retries wrap the store's own error
        chain.append(e)
        e = e.__cause__ or e.__context__
    reason = next((r for r in (unreachable_reason(c, base_path) for c in chain) if r is not None), None)
    if reason is None:
        return exc
    tries = f"{attempts} attempt(s) per upload"
    return StoreUnreachableError(one_line(
        f"the store at {base_path} is unreachable: subtask {subtask}'s state upload failed after {tries} "
        f"in {seconds:.1f} s ({reason}); check the endpoint, network and credentials, then restart: the batch "
        f"was not committed and reruns from the last checkpoint"))


def _found(text: str, cls: Type[BaseException]) -> Optional[str]:
    """The message of the last `cls` in a traceback's text (by class name, with or without its module)."""
    marker = re.compile(rf"(?:^|[\s.:]){re.escape(cls.__name__)}: ")
    for line in reversed(text.splitlines()):
        m = None
        for m in marker.finditer(line):
            pass
        if m is not None:
            return line[m.end():].strip()
    return None


def raise_from_worker(exc: BaseException) -> None:
    """On the driver: re-raise a task failure whose worker traceback holds one of dstl's leading
    errors as that error, its message first and `exc` as its cause; otherwise return."""
    text = str(exc)
    for cls in _LEADING:
        message = _found(text, cls)
        if message is not None:
            raise cls(message or "no message") from exc

