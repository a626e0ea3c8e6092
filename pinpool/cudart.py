"""The CUDA runtime that torch already loaded, called directly for the ring's copies and fences.

A decode step stages through the pool with a handful of CUDA calls: a fence query, an
upload, a read-back, a fence record. Through torch each of them pays for argument
parsing, a device guard and, on pinned memory, an extra event that torch's caching host
allocator records on every copy. The ring never frees its slab while a fence is pending,
so that event buys it nothing. ``tests/gpu/primitive_costs.py`` measured it on an H200
(torch 2.11, 2026-11-29), inside bursts of kernel launches: an event record 8.4 µs of
host time through torch and 1.4 µs here, an upload 5.8 µs and 3.8, a read-back 7.0 and
4.2.

Only the library torch itself loaded is used: a second CUDA runtime in the process would
not share torch's per-thread current device. When none is found, ``load()`` returns None
and the transport goes through torch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable

from pinpool.exceptions import TransportError
from pinpool.sync_guard import refuse_explicit_sync

SUCCESS = 0
NOT_READY = 600  # cudaErrorNotReady: an event query on work still queued (not an error)
HOST_TO_DEVICE = 1  # cudaMemcpyKind
DEVICE_TO_HOST = 2
_DISABLE_TIMING = 2  # cudaEventDisableTiming: such events are cheaper to record; we never read times


def cudart_path(maps: Iterable[str]) -> str | None:
    """The file of the first ``libcudart.so*`` mapped into the process, from ``/proc/self/maps`` lines."""
    for line in maps:
        fields = line.split()
        if len(fields) >= 6 and "/libcudart.so" in fields[-1]:
            return fields[-1]
    return None


@functools.cache
def load() -> Cudart | None:
    """The runtime torch loaded, or None (no such library in the process, or no ``/proc``)."""
    try:
        with open("/proc/self/maps") as maps:
            path = cudart_path(maps)
    except OSError:
        return None
    if path is None:
        return None
    try:
        return Cudart(ctypes.PyDLL(path), blocking=ctypes.CDLL(path))
    except (OSError, AttributeError):
        return None


class Cudart:
    """Typed wrappers over the few runtime entry points the ring needs; errors raise ``TransportError``.

    ``lib`` serves the calls that return at once (queue a copy, record or query an
    event): opened as ``ctypes.PyDLL`` it keeps the GIL, which is cheaper than handing it
    off and taking it back. ``blocking`` (a ``ctypes.CDLL``, default ``lib``) serves the
    one call that may wait, ``event_synchronize``, and releases the GIL meanwhile.
    """

    def __init__(self, lib: ctypes.CDLL, *, blocking: ctypes.CDLL | None = None) -> None:
        vp = ctypes.c_void_p
        # The hot path's entry points are raw (return code out, nothing checked): the
        # transport and its fences call them and check the code inline, since every
        # Python frame between the ring and the runtime costs host time
        # (tests/gpu/step_phases.py). ``fail`` turns a code into the error.
        self.memcpy_raw = _bind(lib.cudaMemcpyAsync, [vp, vp, ctypes.c_size_t, ctypes.c_int, vp])
        self._create = _bind(lib.cudaEventCreateWithFlags, [ctypes.POINTER(vp), ctypes.c_uint])
        self._destroy = _bind(lib.cudaEventDestroy, [vp])
        self.record_raw = _bind(lib.cudaEventRecord, [vp, vp])
        self.query_raw = _bind(lib.cudaEventQuery, [vp])
        self._synchronize = _bind((blocking if blocking is not None else lib).cudaEventSynchronize, [vp])
        self._wait = _bind(lib.cudaStreamWaitEvent, [vp, vp, ctypes.c_uint])
        self._error_name = lib.cudaGetErrorName
        self._error_name.argtypes, self._error_name.restype = [ctypes.c_int], ctypes.c_char_p
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes, self._error_string.restype = [ctypes.c_int], ctypes.c_char_p

    def event_create(self) -> int:
        handle = ctypes.c_void_p()
        rc = self._create(ctypes.byref(handle), _DISABLE_TIMING)
        if rc or handle.value is None:
            self.fail(rc, "cudaEventCreateWithFlags")
        assert handle.value is not None
        return handle.value

    def event_destroy(self, event: int) -> None:
        # The runtime releases an event still pending once its work completes.
        self._destroy(event)

    def event_synchronize(self, event: int) -> None:
        refuse_explicit_sync("a pool fence's synchronize()")
        rc = self._synchronize(event)  # sync-ok: callers wait only on a fence they queried as pending
        if rc:
            self.fail(rc, "cudaEventSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        rc = self._wait(stream, event, 0)
        if rc:
            self.fail(rc, "cudaStreamWaitEvent")

    def fail(self, rc: int, call: str) -> None:
        """Raise ``TransportError`` for return code ``rc`` of ``call``."""
        name = (self._error_name(rc) or b"?").decode()
        text = (self._error_string(rc) or b"?").decode()
        raise TransportError(f"{call} failed with {name} ({rc}): {text}")


def _bind(fn: ctypes._NamedFuncPointer, argtypes: list[type]) -> ctypes._NamedFuncPointer:
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
