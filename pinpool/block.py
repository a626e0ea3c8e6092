"""``DeviceBlock``: a layout's fixed device home for CUDA graphs, one copy a step (streams: docs/layouts.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pinpool.exceptions import SettingsError
from pinpool.layout import Layout
from pinpool.ring import PinnedRingBuffer
from pinpool.stage import BLOCK, Stage
from pinpool.transport import Fence, Stream, wait_for_streams


class DeviceBlock:
    """One device allocation holding ``layout`` for every row count up to its ``max_rows``."""

    def __init__(self, pool: PinnedRingBuffer, layout: Layout) -> None:
        if not isinstance(layout, Layout):
            raise SettingsError(f"'layout' must be a pinpool.Layout (got {type(layout).__name__})")
        need = layout.nbytes(layout.max_rows)
        if need > pool.settings.slot_bytes:
            raise SettingsError(
                f"'layout' of {layout.max_rows} rows needs {need} bytes per step but a slot holds "
                f"{pool.settings.slot_bytes}; raise PoolSettings.slot_bytes or lower max_rows"
            )
        self.pool, self.layout = pool, layout
        transport = self._transport = pool.transport
        # The caching allocator hands out memory the current stream may still use: a copy elsewhere waits for it.
        alloc_stream = transport.resolve_stream(None)
        #: The one uint8 device allocation every row count's layout lives in.
        self.device_block = transport.alloc_device(need, alloc_stream)
        self._writer: Stream = alloc_stream
        self._writer_fence, self._landed = transport.new_fence(), transport.new_fence()
        self._readers: list[tuple[Stream, Fence]] = []
        self._seen_streams: list[Stream] = [alloc_stream]
        #: Per row count, at most max_rows + 1: a graph loop asks for its size's views every step.
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def views(self, rows: int) -> Mapping[str, torch.Tensor]:
        """name -> device view of ``rows`` elements: fixed addresses, for a graph to capture."""
        views = self._views.get(rows) if type(rows) is int else None  # 4.0 and True hash as ints
        if views is None:
            views = self._views[rows] = self.layout.device_views(self.device_block, rows)
        return views

    def stage(self, rows: int, live: int, *, stream: Stream | None = None) -> Stage:
        """Open this step's stage: ``live`` real rows of a graph sized ``rows``; the stream is fixed now."""
        st = self.pool._open_stage(stream, BLOCK, None, self.layout, rows, live, self, self.device_block)
        self._note_stream(st.stream)
        return st

    def register_reader(self, stream: Stream) -> None:
        """Declare a stream (a graph replay's) reading the block: each copy waits for its work, and it for the copy."""
        transport = self._transport
        stream = transport.resolve_stream(stream)
        if any(transport.same_stream(r, stream) for r, _ in self._readers):
            return
        # What the block holds now may still be landing on the writer's stream.
        wait_for_streams(transport, stream, ((self._writer, self._writer_fence),))
        self._readers.append((stream, transport.new_fence()))
        self._note_stream(stream)
        self.pool._drain_at_teardown(stream)  # a replay there may store into a slot (a landing)

    @property
    def readers(self) -> tuple[Stream, ...]:
        return tuple(r for r, _ in self._readers)

    def record_stream(self, stream: Stream) -> None:
        """Declare a stream that touches the block outside stages and readers, so its memory outlives that use."""
        self._note_stream(self._transport.resolve_stream(stream))

    def wait_for_readers(self, stream: Stream) -> None:
        """Make ``stream`` wait, on the device, for the work queued so far on every other reader."""
        if self._readers:
            wait_for_streams(self._transport, stream, self._readers)

    def before_copy(self, stream: Stream) -> None:
        """The previous readers and the previous writer come before this copy (rule 2)."""
        self.wait_for_readers(stream)
        if self._writer is not stream:
            wait_for_streams(self._transport, stream, ((self._writer, self._writer_fence),))
        self._writer = stream

    def after_copy(self, stream: Stream) -> None:
        """Each reader on another stream waits for this copy before its next work."""
        transport = self._transport
        waiting = [r for r, _ in self._readers if not transport.same_stream(r, stream)]
        if waiting:
            self._landed.record(stream)
            for reader in waiting:
                transport.stream_wait(reader, self._landed)

    def _note_stream(self, stream: Stream) -> None:
        # The caching allocator reuses freed memory on its allocation stream only: record the block on every
        # other stream, so teardown cannot hand it out while work queued there may touch it.
        seen = self._seen_streams
        if stream is seen[-1] or any(self._transport.same_stream(s, stream) for s in seen):
            return
        seen.append(stream)
        if isinstance(stream, torch.cuda.Stream) and self.device_block.is_cuda:
            self.device_block.record_stream(stream)
