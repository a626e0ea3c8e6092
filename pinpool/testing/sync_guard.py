"""``no_sync()``: fail loudly on any host synchronisation inside a block.

``torch.cuda.set_sync_debug_mode("error")`` catches the syncs torch itself knows about
(reading a scalar with ``item``, ``nonzero``, blocking copies). It misses two that silently serialise the
host: a ``non_blocking`` host-to-device copy from pageable memory (torch stages it
through a bounce buffer and waits), and one from a non-contiguous pinned view (torch
makes a contiguous pageable temporary first). Those, device-to-pageable-host copies, and
explicit ``synchronize()`` calls are caught here by wrapping the copy entry points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pinpool.exceptions import HostSyncError
from pinpool.transport import host_waits


def check_copy(src: torch.Tensor, dst_device: torch.device, non_blocking: bool, dst_pinned: bool = False) -> None:
    """Raise ``HostSyncError`` if copying ``src`` to ``dst_device`` would block the host."""
    src_type, dst_type = src.device.type, dst_device.type
    if src_type == "cpu" and dst_type == "cuda":
        if not non_blocking:
            raise HostSyncError("host-to-device copy without non_blocking=True blocks the host")
        if not src.is_pinned():
            raise HostSyncError(
                "non_blocking host-to-device copy from pageable memory is synchronous; stage it through pinned memory"
            )
        if not src.is_contiguous():
            raise HostSyncError(
                "non_blocking host-to-device copy from a non-contiguous pinned view goes through a pageable "
                "temporary and is synchronous; copy a contiguous range"
            )
    elif src_type == "cuda" and dst_type == "cpu" and not (non_blocking and dst_pinned):
        raise HostSyncError("device-to-host copy into pageable memory or without non_blocking=True blocks the host")


def _explicit_sync(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise HostSyncError(f"{what} inside no_sync()")

    return refuse


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Raise ``HostSyncError`` on any host sync in the body (not thread-safe: a test tool).

    The pool's own fences wait through a raw binding: they ask ``host_waits``, which
    this block's depth is kept in.
    """
    if host_waits.depth:
        host_waits.depth += 1
        try:
            yield
        finally:
            host_waits.depth -= 1
        return
    originals: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, attr: str, new: Any) -> None:
        originals[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, new)

    orig_to, orig_copy, orig_cuda = torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # ``copy=`` is a keyword of Tensor.to that the argument parser below does not take.
        parse = {k: v for k, v in kwargs.items() if k != "copy"}
        device, _dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **parse)
        if device is not None:
            check_copy(self, torch.device(device), bool(non_blocking))
        return orig_to(self, *args, **kwargs)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        check_copy(src, self.device, non_blocking, dst_pinned=self.is_pinned() if self.device.type == "cpu" else False)
        return orig_copy(self, src, non_blocking)

    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kw: Any) -> torch.Tensor:
        check_copy(self, torch.device("cuda"), non_blocking)
        return orig_cuda(self, device, non_blocking, **kw)

    patch(torch.Tensor, "to", to)
    patch(torch.Tensor, "copy_", copy_)
    patch(torch.Tensor, "cuda", cuda)
    patch(torch.cuda, "synchronize", _explicit_sync("torch.cuda.synchronize()"))  # sync-ok: the guard refuses it
    patch(torch.cuda.Event, "synchronize", _explicit_sync("Event.synchronize()"))
    patch(torch.cuda.Stream, "synchronize", _explicit_sync("Stream.synchronize()"))
    debug_mode = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if debug_mode else 0
    if debug_mode:
        torch.cuda.set_sync_debug_mode("error")
    host_waits.depth = 1
    try:
        yield
    finally:
        host_waits.depth = 0
        if debug_mode:
            torch.cuda.set_sync_debug_mode(previous)
        for (owner, attr), value in originals.items():
            setattr(owner, attr, value)
