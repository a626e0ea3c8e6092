"""The start-up platform check behind zero-copy stages, and the device alias of the pinned slab.

Kernels read a zero-copy slot through its device address (UVA), sound only when the memory is
page-locked and read live: confidential-compute hosts can return pageable memory from
``pin_memory=True`` (vLLM #50671, #57224) and WSL2 can lack UVA (vLLM #47579), and kernels would
read garbage with no error. A failed check refuses zero-copy stages; copy stages keep working.
"""

from __future__ import annotations

import ctypes
import os
import platform as _os_platform
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from pinpool.exceptions import PlatformError, PoolStateError

#: GPU sleeps (cycles) queued ahead of the probe's read kernel, so that the host write lands first.
_PROBE_SLEEP_CYCLES = (10_000_000, 100_000_000)
_PROBE_BYTES = 64
#: ``move_pages`` syscall numbers (asks the kernel which node holds a page, cheaply).
_MOVE_PAGES_NR = {"x86_64": 279, "aarch64": 239}


@attrs.frozen
class PlatformReport:
    """What the start-up check found; ``None`` in a field: not checked, or the OS does not say."""

    checked: bool
    zero_copy_ok: bool
    reason: str
    pinned: bool | None = None
    alias_is_host_address: bool | None = None  # the device view is the slab's own address, not a copy
    kernel_sees_host_writes: bool | None = None  # a kernel queued before a host write read the new bytes
    slab_numa_node: int | None = None
    gpu_numa_node: int | None = None

    @classmethod
    def unchecked(cls) -> PlatformReport:
        return cls(checked=False, zero_copy_ok=False, reason="not checked: PoolSettings.zero_copy is False")

    @property
    def numa_local(self) -> bool | None:
        """Slab and GPU on one NUMA node (PCIe reads stay local), where both are known."""
        if self.slab_numa_node is None or self.gpu_numa_node is None:
            return None
        return self.slab_numa_node == self.gpu_numa_node

    def log_fields(self) -> dict[str, Any]:
        """The fields ``pool.created`` logs."""
        if not self.checked:
            return {"zero_copy": "off"}
        return {
            "zero_copy": "ok" if self.zero_copy_ok else "refused",
            "zero_copy_reason": self.reason,
            "slab_numa_node": self.slab_numa_node,
            "gpu_numa_node": self.gpu_numa_node,
        }

    def refusal(self, device: torch.device) -> Exception:
        """The error a stage whose kernels read or write the slots in place (zero-copy, landings) raises."""
        if not self.checked:
            return PoolStateError(
                "kernels reading or writing the pinned slots in place (pool.stage(zero_copy=True), landings: "
                "Field.landing, st.land) need PoolSettings(zero_copy=True) (PINPOOL_ZERO_COPY=1), which checks "
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
    # torch wraps the pointer without a copy, keeping the namespace (so ``host``) alive, on the device
    # whose context pinned the memory; pinned memory is readable from every device, so wrap it for ``device``.
    alias = torch.as_tensor(SimpleNamespace(host=host, __cuda_array_interface__=interface))
    if alias.device == device:
        return alias
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:
        return alias  # on another device: the caller's check refuses it
    storage = construct(host.data_ptr(), device, host.numel())
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (host.numel(),), (1,))


def check_cuda(host_slab: torch.Tensor, device: torch.device) -> tuple[PlatformReport, torch.Tensor | None]:
    """Run the check on a CUDA pool's slab; returns the report and, when it passed, the slab's alias."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found: dict[str, Any] = {
        "slab_numa_node": host_numa_node(host_slab.data_ptr()),
        "gpu_numa_node": gpu_numa_node(index),
    }

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

    None: the sleep always ended before the host wrote, so the probe cannot tell.
    """
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
            # Still asleep *after* the write: the read kernel had not started.
            still_asleep = not asleep.query()  # type: ignore[no-untyped-call]
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


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node of GPU ``index`` from sysfs, via its PCI address; None where unknown."""
    try:
        props = torch.cuda.get_device_properties(index)
        bus, dev = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", None)
        if bus is None or dev is None:
            return None
        domain = int(getattr(props, "pci_domain_id", 0))
        return read_node_file(f"/sys/bus/pci/devices/{domain:04x}:{int(bus):02x}:{int(dev):02x}.0/numa_node")
    except (RuntimeError, AssertionError, ValueError):
        return None


def read_node_file(path: str) -> int | None:
    """A sysfs ``numa_node`` file as a node number; -1 (no affinity) or unreadable is None."""
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def host_numa_node(addr: int) -> int | None:
    """The NUMA node of the page holding ``addr``: ``move_pages`` first, then ``/proc/self/numa_maps``."""
    node = _node_by_move_pages(addr)
    if node is not None:
        return node
    try:
        with open("/proc/self/numa_maps") as f:
            return node_from_numa_maps(f, addr)
    except OSError:
        return None


def _node_by_move_pages(addr: int) -> int | None:
    nr = _MOVE_PAGES_NR.get(_os_platform.machine())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (ctypes.c_void_p * 1)(addr - addr % os.sysconf("SC_PAGE_SIZE"))
        status = (ctypes.c_int * 1)(-1)
        rc = libc.syscall(ctypes.c_long(nr), 0, ctypes.c_ulong(1), pages, None, status, 0)  # nodes=NULL: query
    except (OSError, AttributeError, ValueError):
        return None
    return int(status[0]) if rc == 0 and status[0] >= 0 else None


def node_from_numa_maps(lines: Iterable[str], addr: int) -> int | None:
    """The node holding most pages of ``addr``'s mapping; lines are sorted, so reading stops past it
    (and the kernel walks no further through the process)."""
    last: str | None = None
    for line in lines:
        if int(line.split(" ", 1)[0], 16) > addr:
            break
        last = line
    if last is None:
        return None
    counts = {}
    for field in last.split()[1:]:
        key, _, value = field.partition("=")
        if len(key) > 1 and key[0] == "N" and key[1:].isdigit() and value.isdigit():
            counts[int(key[1:])] = int(value)
    return max(counts, key=lambda n: counts[n]) if counts else None
