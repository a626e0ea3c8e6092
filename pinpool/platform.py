"""The start-up platform check behind zero-copy stages, and the device alias of the pinned slab.

A zero-copy stage hands kernels the slot's pinned host memory through its device address
(unified virtual addressing). That is only sound when the memory really is page-locked
and a kernel really reads it at run time: confidential-compute hosts can hand back
pageable memory from ``pin_memory=True`` (vLLM #50671, #57224), and WSL2 can lack UVA
(vLLM #47579). Either way the kernel would read garbage with no error. So a pool created
with ``PoolSettings(zero_copy=True)`` checks, once:

- the slab is page-locked (``tensor.is_pinned()``, which asks ``cudaPointerGetAttributes``);
- its device view is an alias (the same address), not a copy torch made quietly;
- a kernel queued *before* a host write reads the written bytes (a live alias);
- the NUMA node of the slab and of the GPU, where the OS tells (``None`` otherwise).

The result is a frozen ``PlatformReport``: ``pool.platform``, ``stats().platform`` and the
``pool.created`` log event carry it. A failed check refuses zero-copy stages with
``PlatformError`` naming the reason; copy stages keep working.
"""

from __future__ import annotations

import ctypes
import os
import platform as _os_platform
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from pinpool.exceptions import PlatformError, PoolStateError

#: GPU sleep (cycles) queued ahead of the probe's read kernel: long enough (~5 ms, then
#: ~50 ms) that the host write lands first; the probe checks that it did.
_PROBE_SLEEP_CYCLES = (10_000_000, 100_000_000)
_PROBE_BYTES = 64
#: ``move_pages`` syscall numbers (asks the kernel which node holds a page, cheaply).
_MOVE_PAGES_NR = {"x86_64": 279, "aarch64": 239}


@attrs.frozen
class PlatformReport:
    """What the start-up check found. ``zero_copy_ok`` gates zero-copy stages; ``reason`` says why.

    ``None`` in a field means "not checked" or "the OS does not say" (NUMA nodes).
    """

    checked: bool
    zero_copy_ok: bool
    reason: str
    pinned: bool | None = None
    #: The device view's address equals the host pointer (UVA alias, not a copy).
    alias_is_host_address: bool | None = None
    #: A kernel queued before a host write read the written bytes.
    kernel_sees_host_writes: bool | None = None
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
        """The fields ``pool.created`` logs, prefixed so dashboards can match them."""
        if not self.checked:
            return {"zero_copy": "off"}
        return {
            "zero_copy": "ok" if self.zero_copy_ok else "refused",
            "zero_copy_reason": self.reason,
            "slab_numa_node": self.slab_numa_node,
            "gpu_numa_node": self.gpu_numa_node,
        }

    def refusal(self, device: torch.device) -> Exception:
        """The typed error a stage that kernels would read or write in place (zero-copy, landings) raises here."""
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


# -- the CUDA check ----------------------------------------------------------------------
class _HostAlias:
    """A ``__cuda_array_interface__`` over pinned host bytes; holds the host tensor alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (host.numel(),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor at ``host``'s own address (UVA) on ``device``, built once per pool.

    torch wraps the pointer without copying, on the device ``cudaPointerGetAttributes``
    names: the one whose context pinned the memory. Pinned memory is readable from every
    device under UVA, so when that is another device (torch's host cache can hand back a
    block first pinned under it), the same address is wrapped for ``device`` directly. The
    alias does not own the memory: the caller keeps ``host`` alive (the ring holds its slab).
    The caller checks ``data_ptr()`` all the same.
    """
    alias = torch.as_tensor(_HostAlias(host))
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
    nodes: dict[str, Any] = {
        "slab_numa_node": host_numa_node(host_slab.data_ptr()),
        "gpu_numa_node": gpu_numa_node(index),
    }

    def refused(reason: str, **found: Any) -> tuple[PlatformReport, None]:
        return PlatformReport(checked=True, zero_copy_ok=False, reason=reason, **found, **nodes), None

    pinned = bool(host_slab.is_pinned())
    if not pinned:
        return refused(
            "the slab is not page-locked (tensor.is_pinned() is False): pin_memory=True returned pageable "
            "memory, as on confidential-compute hosts",
            pinned=False,
        )
    try:
        alias = device_alias(host_slab, device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return refused(f"the slab has no device address (no UVA): {exc}", pinned=True)
    if alias.data_ptr() != host_slab.data_ptr() or alias.device != device:
        return refused(
            f"the device view is a copy at {alias.data_ptr():#x} on {alias.device}, not the slab at "
            f"{host_slab.data_ptr():#x}",
            pinned=True,
            alias_is_host_address=False,
        )
    seen = kernel_sees_host_write(host_slab, alias, index)
    if seen is not True:
        why = "did not finish in time to tell" if seen is None else "read the old bytes"
        return refused(
            f"a kernel queued before a host write {why}: device reads of this memory are not live",
            pinned=True,
            alias_is_host_address=True,
            kernel_sees_host_writes=seen,
        )
    if not kernel_write_reaches_host(host_slab, alias, index):
        # Landings (``Stage.land``) have kernels store into the slab: that direction must work too.
        return refused(
            "a kernel's stores into the device view did not reach the host bytes",
            pinned=True,
            alias_is_host_address=True,
            kernel_sees_host_writes=True,
        )
    report = PlatformReport(
        checked=True,
        zero_copy_ok=True,
        reason="ok: pinned, aliased, a queued kernel read a later host write, and a kernel's stores reached the host",
        pinned=True,
        alias_is_host_address=True,
        kernel_sees_host_writes=True,
        **nodes,
    )
    return report, alias


def kernel_sees_host_write(host: torch.Tensor, alias: torch.Tensor, index: int) -> bool | None:
    """Queue a read of ``alias`` behind a GPU sleep, write ``host`` from Python, and see which bytes it read.

    True: the kernel read the new bytes. False: it read the old ones (no live alias).
    None: the GPU finished its sleep before the host wrote, every time, so it cannot tell.
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
            # The sleep not yet over, *after* the write: the read kernel had not started.
            still_asleep = not asleep.query()  # type: ignore[no-untyped-call]
            stream.synchronize()  # sync-ok: start-up platform check, once per pool created with zero_copy
            if still_asleep:
                return bool(torch.equal(read.cpu(), new))  # sync-ok: after the stream sync above
    return None


def kernel_write_reaches_host(host: torch.Tensor, alias: torch.Tensor, index: int) -> bool:
    """Have an elementwise kernel store a pattern through ``alias``; True when ``host`` then holds it."""
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


# -- NUMA nodes, where the OS tells -----------------------------------------------------
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
        page = addr - addr % os.sysconf("SC_PAGE_SIZE")
        pages = (ctypes.c_void_p * 1)(page)
        status = (ctypes.c_int * 1)(-1)
        # nodes=NULL: query only, nothing moves.
        rc = libc.syscall(ctypes.c_long(nr), 0, ctypes.c_ulong(1), pages, None, status, 0)
    except (OSError, AttributeError, ValueError):
        return None
    return int(status[0]) if rc == 0 and status[0] >= 0 else None


def node_from_numa_maps(lines: Iterable[str], addr: int) -> int | None:
    """The node holding most pages of the mapping that contains ``addr``, from numa_maps lines.

    Lines are sorted by start address; the mapping of ``addr`` is the last one starting at
    or below it. Reading stops there, so the kernel does not walk the rest of the process.
    """
    last: str | None = None
    for line in lines:
        start = int(line.split(" ", 1)[0], 16)
        if start > addr:
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
