"""Host µs of each CUDA call a decode step's staging makes, through torch and through cudart directly.

python3 tests/gpu/primitive_costs.py

A diagnostic, not a test. Each op is timed between bursts of small kernel launches (the
way it runs inside a decode loop), and in a tight loop. The torch column is what the pool
does today; the cudart column calls the CUDA runtime that torch already loaded, through
ctypes, on the same memory and stream.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from pinpool import PinnedRingBuffer, PoolSettings


def _cudart() -> ctypes.CDLL:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcudart is not loaded in this process")


def timed(op: Callable[[], object], burst: Callable[[], None] | None, reps: int = 400) -> float:
    samples = []
    for _ in range(reps):
        if burst is not None:
            burst()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples[reps // 10 :]) * 1e6


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    rt = _cudart()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    rt.cudaEventRecord.argtypes = [vp, vp]
    rt.cudaEventQuery.argtypes = [vp]
    rt.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=8, slot_bytes=1 << 20))
    host = pool.host_slab[:1024]
    host_back = pool.host_slab[4096 : 4096 + 512]
    dst = torch.empty(1024, dtype=torch.uint8, device=dev)
    src_d = torch.zeros(64, dtype=torch.int64, device=dev)
    torch_event = torch.cuda.Event()
    torch_event.record()
    handle = vp()
    assert rt.cudaEventCreateWithFlags(ctypes.byref(handle), 2) == 0
    raw_event = handle.value
    stream = torch._C._cuda_getCurrentRawStream(0)
    h_ptr, hb_ptr, d_ptr, s_ptr = host.data_ptr(), host_back.data_ptr(), dst.data_ptr(), src_d.data_ptr()
    work = torch.zeros(64, device=dev)

    def burst() -> None:
        for _ in range(40):
            work.add_(1.0)

    def check(rc: int) -> None:
        if rc not in (0, 600):
            raise RuntimeError(f"cudart returned {rc}")

    ops: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        (
            "H2D copy 1 KiB",
            lambda: dst.copy_(host, non_blocking=True),
            lambda: check(rt.cudaMemcpyAsync(d_ptr, h_ptr, 1024, 1, stream)),
        ),
        (
            "D2H copy 512 B",
            lambda: host_back.view(torch.int64).copy_(src_d, non_blocking=True),
            lambda: check(rt.cudaMemcpyAsync(hb_ptr, s_ptr, 512, 2, stream)),
        ),
        ("event record", lambda: torch_event.record(), lambda: check(rt.cudaEventRecord(raw_event, stream))),
        ("event query", lambda: torch_event.query(), lambda: check(rt.cudaEventQuery(raw_event))),
        ("current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0), lambda: None),
    ]
    print(f"{'op':24s} {'torch loop':>11s} {'cudart loop':>12s} {'torch tight':>12s} {'cudart tight':>13s}")
    for name, via_torch, via_rt in ops:
        cells = [timed(via_torch, burst), timed(via_rt, burst), timed(via_torch, None), timed(via_rt, None)]
        print(f"{name:24s} " + " ".join(f"{c:11.2f}" for c in cells))

    rows, pos = list(range(64)), list(range(100, 164))
    tokens = torch.zeros(64, dtype=torch.int64, device=dev)

    prev: list[Callable[[], object]] = []

    def read_prev() -> None:
        # Each step reads the previous step's tokens, as the decode loop does.
        if prev:
            prev.pop()()

    torch_pool = PinnedRingBuffer(PoolSettings(device=dev, num_slots=8, slot_bytes=1 << 20, cudart_direct=False))
    use = [pool]

    def pool_step() -> None:
        st = use[0].stage()
        st.put(rows, torch.int64)
        st.put(pos, torch.int64)
        st.flush()
        handle = st.readback(tokens)
        st.close()
        read_prev()
        prev.append(handle.tolist)

    def pinned_step() -> None:
        for values in (rows, pos):
            torch.tensor(values, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True)
        back = torch.empty(64, dtype=torch.int64, pin_memory=True)
        back.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        read_prev()

        def read() -> object:
            if not event.query():
                event.synchronize()
            return back.tolist()

        prev.append(read)

    np_view = pool.host_slab.numpy()[:1024].view("int64")
    back_view = pool.host_slab.numpy()[4096 : 4096 + 512].view("int64")

    handle2 = vp()
    assert rt.cudaEventCreateWithFlags(ctypes.byref(handle2), 2) == 0
    raw_events = [raw_event, handle2.value]

    def raw_step() -> None:
        raw_events.reverse()  # two slots: this step's fence, and the previous step's
        event = raw_events[0]
        check(rt.cudaEventQuery(event))
        np_view[:64] = rows
        np_view[64:128] = pos
        check(rt.cudaMemcpyAsync(d_ptr, h_ptr, 1024, 1, stream))
        check(rt.cudaMemcpyAsync(hb_ptr, s_ptr, 512, 2, stream))
        check(rt.cudaEventRecord(event, stream))
        read_prev()

        def read() -> object:
            if rt.cudaEventQuery(event) != 0:
                torch.cuda.synchronize()
            return back_view.tolist()

        prev.append(read)

    print(f"\n{'whole step (64 rows)':24s} {'loop':>11s} {'tight':>12s}")

    def pool_torch_step() -> None:
        use[0] = torch_pool
        pool_step()
        use[0] = pool

    steps = [
        ("pinned (per call)", pinned_step),
        (f"pool ({pool._transport.path})", pool_step),
        ("pool (torch)", pool_torch_step),
        ("raw cudart by hand", raw_step),
    ]
    for name, op in steps:
        cells = (timed(op, burst), timed(op, None))
        prev.clear()
        print(f"{name:24s} {cells[0]:11.2f} {cells[1]:12.2f}")
    pool.close()
    torch_pool.close()


if __name__ == "__main__":
    main()
