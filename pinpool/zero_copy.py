"""``ZeroCopyStage``: a stage whose device views *are* the slot's pinned host memory (UVA).

No copy is issued. ``put`` writes the slot's pinned region and returns a CUDA tensor at
the same address, so a kernel reads the values over PCIe when it runs. The slot's fence
cannot follow a copy, so it follows the readers: it is recorded when the stage closes, on
the stage's stream, after the registered consumer streams' work queued so far (the ring's
``finish_zero_copy``). Reuse waits on that fence exactly as for a copy stage (rule 1).

The lifetime differs from a copy stage's, and this is the rule to remember:

    **launch every kernel that reads a zero-copy view before the stage closes**, on the
    stage's stream or on a registered consumer stream.

A kernel queued after close, or on an unregistered stream, is not covered by the fence:
the host may rewrite the slot while it still waits to run, and it reads the next stage's
values. ``is_live`` is False once the stage is closed; in debug mode, closing while an
unregistered stream is current raises ``UnguardedReaderError``. Data that must outlive
the stage belongs in a copy stage (``pool.stage()``) or an owned one.

When to choose it: few, small fields read once or twice per step (sampling parameters).
Each read crosses PCIe, so a field read by many kernels, or a large one, is cheaper
copied once (``pinpool bench`` → ``zero_copy`` measures both for your sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

from pinpool.exceptions import StaleLeaseError, UnguardedReaderError
from pinpool.stage import Stage
from pinpool.transport import Stream, Transport


class ZeroCopyStage(Stage):
    """An open zero-copy stage: same ``put`` / ``reserve`` / ``retain`` / ``readback`` as ``Stage``.

    Example::

        pool = PinnedRingBuffer(PoolSettings(device="cuda:0", zero_copy=True))
        with pool.stage(zero_copy=True) as st:
            temps = st.put(temperatures, torch.float32)   # a CUDA view of pinned memory
            sample(logits, temps)                          # launch the readers *inside* the stage
        # exit: no copy; the slot's fence is recorded after the readers

    ``flush()`` issues nothing (the views are readable at once); it only ends the puts,
    as it does for a copy stage. A ``readback`` in the stage works as in a copy stage.
    """

    __slots__ = ()

    def close(self, ok: bool = True) -> None:
        """Finish the stage: no copy; the slot's fence after the readers launched so far."""
        if self._open:
            self._open = False
            self._pool.finish_zero_copy(self, ok)
            if ok and self._landings:
                self.arm_landings()  # the addresses were readable in place from the put: no copy to wait for

    def flush(self) -> None:
        """End the puts. Nothing is copied: kernels may read the views from the moment ``put`` returns."""
        if not self._open or self.flushed:
            self._check_open()  # raises
        self.flushed = True

    @property
    def is_live(self) -> bool:
        """True while the stage is open: only kernels launched before close are covered by its fence."""
        return self._open and self._pool.slot_generation(self.slot) == self.generation

    def check_live(self, what: str = "zero-copy view") -> None:
        if not self.is_live:
            raise StaleLeaseError(
                f"{what} of zero-copy stage {self.generation} (slot {self.slot}) was used after the stage "
                "closed; its fence covers only kernels launched before close. Launch readers inside the "
                "stage, or stage data that must live longer with pool.stage() (a copy)"
            )


def refuse_unregistered_reader(transport: Transport, st: Stage, consumers: Sequence[Stream]) -> None:
    """(debug) Raise ``UnguardedReaderError`` when ``st`` closes under a stream its fence does not cover.

    Readers cannot be seen from here, but closing under another stream is the usual sign
    that they were launched there (``with torch.cuda.stream(side): ...; st.close()``). A
    reader on an unregistered stream that is not current at close goes unseen: the rule
    in the module docstring is what guards it.
    """
    current = transport.resolve_stream(None)
    if transport.same_stream(current, st.stream) or any(transport.same_stream(current, c) for c in consumers):
        return
    raise UnguardedReaderError(
        f"{'zero-copy stage' if isinstance(st, ZeroCopyStage) else 'stage with landings'} {st.generation} closed "
        f"while stream {current!r} is current, which is neither the "
        f"stage's stream ({st.stream!r}) nor a registered consumer: kernels there are not covered by the slot's "
        "fence. Register it with pool.register_consumer_stream(stream), or launch the readers on the stage's stream"
    )
