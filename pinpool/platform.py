"""The zero-copy start-up platform check (why: docs/rules.md, "The platform check") and the slab's device alias."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import torch

from pinpool.exceptions import PlatformError, PoolStateError

_PROBE_SLEEP_CYCLES = (10_000_000, 100_000_000)  # GPU sleeps ahead of the read kernel, so the host write lands first
_PROBE_BYTES = 64


@attrs.frozen
class PlatformReport:
    """What the start-up check found; ``None`` in a field: not checked, or the OS does not say."""

    checked: bool
    zero_copy_ok: bool
    reason: str
    pinned: bool | None = None
    alias_is_host_address: bool | None = None  # the device view is the slab's own address, not a copy
    kernel_sees_host_writes: bool | None = None  # a kernel queued before a host write read the new bytes

    @classmethod
    def unchecked(cls) -> PlatformReport:
        return cls(checked=False, zero_copy_ok=False, reason="not checked: PoolSettings.zero_copy is False")

    def log_fields(self) -> dict[str, Any]:
        """The fields ``pool.created`` logs."""
        if not self.checked:
            return {"zero_copy": "off"}
        return {"zero_copy": "ok" if self.zero_copy_ok else "refused", "zero_copy_reason": self.reason}

    def refusal(self, device: torch.device) -> Exception:
        """The error a stage whose kernels read or write the slots in place (zero-copy, landings) raises."""
        if not self.checked:
            return PoolStateError(
                "kernels reading or writing the pinned slots in place (pool.stage(zero_copy=True), landings: "
                "Field.landing) need PoolSettings(zero_copy=True) (PINPOOL_ZERO_COPY=1), which checks "
                "the platform when the pool is created (got zero_copy=False)"
            )
        return PlatformError(
            f"in-place reads and landings are refused on {device}: {self.reason}; use copy stages "
            "(pool.stage()) and read-backs (st.readback) here"
        )


def in_place_report(where: str) -> PlatformReport:
    """The report of a path whose "device" memory is host memory (the host path, the simulator)."""
    return PlatformReport(checked=True, zero_copy_ok=True, reason=f"ok: {where} reads host memory in place")


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor at ``host``'s own address (UVA) on ``device``; the caller keeps ``host`` alive."""
    interface = {"shape": (host.numel(),), "typestr": "|u1", "data": (host.data_ptr(), False), "version": 3}
    # No copy; the namespace keeps ``host`` alive. torch puts it on the device whose context pinned the
    # memory, and pinned memory is readable from every device, so rewrap it for ``device``.
    alias = torch.as_tensor(SimpleNamespace(host=host, __cuda_array_interface__=interface))
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if alias.device == device or construct is None:
        return alias  # on another device: the caller's check refuses it
    storage = construct(host.data_ptr(), device, host.numel())
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (host.numel(),), (1,))


def check_cuda(host_slab: torch.Tensor, device: torch.device) -> tuple[PlatformReport, torch.Tensor | None]:
    """Run the check on a CUDA pool's slab; returns the report and, when it passed, the slab's alias."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found: dict[str, Any] = {}

    def done(reason: str, alias: torch.Tensor | None = None) -> tuple[PlatformReport, torch.Tensor | None]:
        return PlatformReport(checked=True, zero_copy_ok=alias is not None, reason=reason, **found), alias

    found["pinned"] = bool(host_slab.is_pinned())
    if not found["pinned"]:
        return done(
            "the slab is not page-locked (tensor.is_pinned() is False): pin_memory=True returned pageable "
            "memory, as on confidential-compute hosts"
        )
    try:
        alias = device_alias(host_slab, device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return done(f"the slab has no device address (no UVA): {exc}")
    found["alias_is_host_address"] = alias.data_ptr() == host_slab.data_ptr() and alias.device == device
    if not found["alias_is_host_address"]:
        return done(
            f"the device view is a copy at {alias.data_ptr():#x} on {alias.device}, not the slab at "
            f"{host_slab.data_ptr():#x}"
        )
    seen = found["kernel_sees_host_writes"] = kernel_sees_host_write(host_slab, alias, index)
    if seen is not True:
        why = "did not finish in time to tell" if seen is None else "read the old bytes"
        return done(f"a kernel queued before a host write {why}: device reads of this memory are not live")
    if not kernel_write_reaches_host(host_slab, alias, index):
        return done("a kernel's stores into the device view did not reach the host bytes")
    ok = "ok: pinned, aliased, a queued kernel read a later host write, and a kernel's stores reached the host"
    return done(ok, alias)


def kernel_sees_host_write(host: torch.Tensor, alias: torch.Tensor, index: int) -> bool | None:
    """Queue a read of ``alias`` behind a GPU sleep, then write ``host``: did the kernel read the new bytes?
    None: the sleep always ended before the host wrote, so the probe cannot tell."""
    n = min(_PROBE_BYTES, host.numel())
    host_np = host[:n].numpy()
    new = (torch.arange(n, dtype=torch.int16) * 37 + 11) % 251 + 1  # nonzero, not a simple ramp
    new_bytes = new.to(torch.uint8).numpy()
    with torch.cuda.device(index):
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        asleep = torch.cuda.Event()  # type: ignore[no-untyped-call]
        for cycles in _PROBE_SLEEP_CYCLES:
            host_np[:] = 0
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
                asleep.record(stream)
                read = alias[:n].to(torch.int16)  # an elementwise kernel: reads the host bytes when it runs
            host_np[:] = new_bytes
            still_asleep = not asleep.query()  # type: ignore[no-untyped-call]  # after the write: read not started
            stream.synchronize()  # sync-ok: start-up platform check, once per pool created with zero_copy
            if still_asleep:
                return bool(torch.equal(read.cpu(), new))  # sync-ok: after the stream sync above
    return None


def kernel_write_reaches_host(host: torch.Tensor, alias: torch.Tensor, index: int) -> bool:
    """Have an elementwise kernel store a pattern through ``alias`` (as landings do); True when ``host`` holds it."""
    n = min(_PROBE_BYTES, host.numel())
    host_np = host[:n].numpy()
    host_np[:] = 0
    with torch.cuda.device(index):
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            pattern = ((torch.arange(n, device=alias.device, dtype=torch.int16) * 53 + 7) % 251 + 1).to(torch.uint8)
            torch.add(pattern, 0, out=alias[:n])  # an elementwise kernel's own stores into the slab
        stream.synchronize()  # sync-ok: start-up platform check, once per pool created with zero_copy
        want = pattern.cpu().numpy()  # sync-ok: after the stream sync above
    ok = bool((host_np == want).all())
    host_np[:] = 0
    return ok
