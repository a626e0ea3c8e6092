"""Host cost of cudaGraphLaunch against what a graph holds (a diagnostic, not a test).

python3 tests/bench/diag_graph_launch.py

Per size n (rows of a 2048-wide float32 row block): the host µs of ``replay()`` with the
device idle for graphs of one device-to-device copy, one elementwise kernel, one sort,
and 30 small kernels, so whichever node kind makes the launch grow with the data shows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

dev = torch.device("cuda:0")


def launch_us(fn: Callable[[], None]) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(120):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    print(f"{'n':>5} {'memcpy':>8} {'kernel':>8} {'sort':>8} {'30 small':>9} {'memcpy+30':>10}")
    for n in (1, 4, 16, 64, 256):
        a = torch.randn(n, 2048, device=dev)
        b = torch.empty_like(a)
        small = torch.zeros(16, device=dev)

        def memcpy() -> None:
            b.copy_(a)

        def kernel() -> None:
            torch.mul(a, 2.0, out=b)

        def sort() -> None:
            torch.sort(a, dim=-1, descending=True)

        def many() -> None:
            for _ in range(30):
                small.add_(1.0)

        def both() -> None:
            b.copy_(a)
            many()

        row = [launch_us(f) for f in (memcpy, kernel, sort, many, both)]
        print(f"{n:5d} " + " ".join(f"{v:8.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
