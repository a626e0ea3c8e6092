"""Host µs of a stage's copy + fence record: torch calls against one captured graph (a diagnostic).

python3 tests/bench/diag_copy_graph.py > $OUT/diag_copy_graph.txt

A stage's end costs two CUDA calls through torch: ``copy_`` (pinned slot -> device mirror)
and the fence's ``record``. A CUDA graph holding a memcpy node and an external event-record
node does both in one ``replay()``. Measured warm (back to back) and cold (after ~80
small kernel launches, as in the eager decode loop), device idle before each timing.
"""

from __future__ import annotations

import statistics
import time

import torch

dev = torch.device("cuda:0")
_record = torch._C._CudaEventBase.record


def timed(fn, launches: int, n: int = 300) -> float:
    x = torch.zeros(256, device=dev)
    times = []
    for _ in range(n):
        for _ in range(launches):
            x.add_(1.0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[30:]) * 1e6


def main() -> None:
    nbytes = 1024
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    mirror = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
    src, dst = host[:nbytes], mirror[:nbytes]
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        ev = torch.cuda.Event()
        ev_ext = torch.cuda.Event(external=True)

        def torch_path() -> None:
            dst.copy_(src, True)
            _record(ev, stream)

        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            dst.copy_(src, True)
            ev_ext.record(side)
            graph.capture_end()
        stream.wait_stream(side)

        def graph_path() -> None:
            graph.replay()

        # Values: the graph's copy lands, and its event is recorded on the replay's stream.
        for value in (3, 7):
            host[:nbytes].fill_(value)
            torch.cuda._sleep(10_000_000)  # ~5 ms: the replay's event must read pending behind it
            graph.replay()
            queued_passed = ev_ext.query()
            ev_ext.synchronize()
            print(
                f"value {value}: mirror ok={bool((mirror[:nbytes] == value).all())}  "
                f"event pending behind sleep={not queued_passed}"
            )
        rows = []
        for launches in (0, 80):
            rows.append((launches, timed(torch_path, launches), timed(graph_path, launches)))
    print("launches before  torch copy_+record µs  graph replay µs")
    for launches, t, g in rows:
        print(f"{launches:15d}  {t:22.1f}  {g:15.1f}")


if __name__ == "__main__":
    main()
