"""Which NUMA node holds the pool's slab and which the GPU: a lab diagnostic for zero-copy reads.

A zero-copy read crosses PCIe from the slab's node; a slab on another node than the GPU makes
every such read slower. The pool does not need this to be correct, so it lives in the lab.
"""

from __future__ import annotations

import ctypes
import os
import platform as _os_platform
from collections.abc import Iterable

import torch

#: ``move_pages`` syscall numbers (asks the kernel which node holds a page, cheaply).
_MOVE_PAGES_NR = {"x86_64": 279, "aarch64": 239}


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
