"""Host µs of one async copy, by what is queued ahead of it (a diagnostic, not a test).

python3 tests/bench/copy_latency.py

Answers: does a non-blocking host-to-device or device-to-host copy cost more host time
when kernels are queued ahead of it on the stream, and does writing a pinned host buffer
from a kernel (zero-copy) avoid that?
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(before: Callable[[], None], op: Callable[[], object], reps: int = 200) -> float:
    samples = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    dev = torch.device("cuda", 0)
    small = torch.zeros(64, dtype=torch.int64, device=dev)
    host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    big = torch.randn(256, 32000, device=dev)
    pending: list[torch.Tensor] = []

    def idle() -> None:
        torch.cuda.synchronize()

    def launches(n: int) -> Callable[[], None]:
        def run() -> None:
            torch.cuda.synchronize()
            x = small
            for _ in range(n):
                x = x + 1
            pending.append(x)

        return run

    def heavy() -> None:
        torch.cuda.synchronize()
        pending.append(big.sort(dim=-1)[0])

    def sleeping() -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)

    d2h = lambda: host.copy_(small, non_blocking=True)  # noqa: E731
    h2d = lambda: small.copy_(host, non_blocking=True)  # noqa: E731
    kernel = lambda: small.add_(1)  # noqa: E731
    event = torch.cuda.Event()
    record = lambda: event.record()  # noqa: E731
    print(f"{'ahead of it':28s} {'D2H copy':>10s} {'H2D copy':>10s} {'kernel':>10s} {'event':>10s}")
    for label, before in [
        ("idle GPU", idle),
        ("10 small kernels", launches(10)),
        ("100 small kernels", launches(100)),
        ("a 256x32000 sort", heavy),
        ("1 ms sleep kernel", sleeping),
    ]:
        cells = [timed(before, op) for op in (d2h, h2d, kernel, record)]
        pending.clear()
        print(f"{label:28s} " + " ".join(f"{c:10.1f}" for c in cells))


if __name__ == "__main__":
    main()
