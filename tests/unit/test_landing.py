"""Landings: a kernel stores a step's outputs straight into the step's ring slot.

A landing is a field kind (``Field.landing``): the stage writes, per live row, the pinned
host address the row's value is stored at when it opens, and ``st.landing(name)`` reads
the values after close. There is no other form (``tests.fakes.landing_stage`` declares one landing).

Three parts:
- ``pinpool.landing.land`` (the kernel, under the Triton interpreter here, and its torch
  reference): each value at its address, padding rows (address 0) untouched, typed
  errors that write nothing;
- landing fields of a ``DeviceBlock`` on the plain CPU path: the addresses travel in the
  step's one copy, no read-back copy, the handle readable only after a successful close;
- the stream rules against the stream-aware simulator (``LaggingGpu``): a random plan of
  stage streams, registered replay streams, current stream and device changes, lag and
  frozen bursts must read every step's own landed values. The controls plant the two
  bugs the rules exist for (a writer on an unregistered stream; a close whose fence does
  not wait for the replay streams) and must be caught.
"""

from __future__ import annotations

import itertools
import random
from collections import deque

import numpy as np
import pytest
import torch

from pinpool import (
    CapacityError,
    DeviceBlock,
    Field,
    Layout,
    PinnedRingBuffer,
    PoolSettings,
    PoolStateError,
    SettingsError,
    StagingTypeError,
    StagingValueError,
)
from pinpool.landing import land, land_reference
from pinpool.layout import LANDING_TAG
from pinpool.readback import Landing
from pinpool.stage import State
from pinpool.testing import LaggingGpu, SimStream
from tests.fakes import NoFenceAfterReaders, landing_stage

MAX_ROWS = 16
LAYOUT = Layout([Field("x", torch.int64, pad=-1), Field.landing("dst")], MAX_ROWS)
SLOT_BYTES = 1024


def cpu_block(num_slots: int = 2, zero_copy: bool = True) -> tuple[PinnedRingBuffer, DeviceBlock]:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=zero_copy))
    return pool, DeviceBlock(pool, LAYOUT)


# -- the kernel and its reference ---------------------------------------------------------
@pytest.mark.parametrize("fn", [land, land_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_land_stores_each_value_at_its_address_and_nothing_where_the_address_is_zero(
    fn: object, dtype: torch.dtype
) -> None:
    """Catches a store to the wrong row, a store through a padding row's 0, or a dtype width mix-up."""
    target = torch.full((9,), -7, dtype=dtype)
    size, tag = target.element_size(), LANDING_TAG[dtype]
    keep = [i % 3 != 1 for i in range(9)]
    addresses = torch.tensor([target.data_ptr() + size * (8 - i) + tag if k else 0 for i, k in enumerate(keep)])
    values = (torch.arange(9) * 11 + 3).to(dtype)
    fn(values, addresses)  # type: ignore[operator]
    want = [float(values[8 - j]) if keep[8 - j] else -7.0 for j in range(9)]  # row i lands at index 8 - i
    assert target.tolist() == want


@pytest.mark.parametrize("fn", [land, land_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize(
    ("writer", "landing"), [(torch.int64, torch.int32), (torch.int64, torch.float32), (torch.int32, torch.int64)]
)
def test_a_writer_stores_its_landings_dtype_never_its_own_width(
    fn: object, writer: torch.dtype, landing: torch.dtype
) -> None:
    """Catches a store as wide as the writer's values: an int64 token into an int32 landing would
    overwrite the 4 bytes after it (the next value, or the next slot's staged bytes)."""
    raw = torch.full((8,), -1, dtype=torch.int64)  # 64 bytes; the landing is its first 3 values
    target = raw.view(landing)
    size = target.element_size()
    addresses = torch.tensor([raw.data_ptr() + size * i + LANDING_TAG[landing] for i in range(3)])
    fn(torch.tensor([5, -6, 7], dtype=writer), addresses)  # type: ignore[operator]
    assert target[:3].tolist() == [5, -6, 7]
    untouched = raw.view(torch.uint8)[3 * size :]
    assert untouched.tolist() == [255] * len(untouched), "bytes past the landing were written"


@pytest.mark.parametrize(
    ("values", "addresses", "error"),
    [
        (torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int64), StagingTypeError),
        (torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), StagingTypeError),
        (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), StagingValueError),
        (torch.zeros(4, 2, dtype=torch.int64)[:, 0], torch.zeros(4, dtype=torch.int64), StagingValueError),
        (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), StagingValueError),
    ],
    ids=["values-dtype", "addresses-dtype", "lengths", "strided", "2-D"],
)
def test_land_refuses_bad_input_by_name_and_stores_nothing(
    values: torch.Tensor, addresses: torch.Tensor, error: type[Exception]
) -> None:
    """Catches a launcher that stores through addresses it has not validated."""
    for fn in (land, land_reference):
        with pytest.raises(error, match=r"'values'|'addresses'"):
            fn(values, addresses)


# -- landing fields of a DeviceBlock on the CPU path ------------------------------------------
def test_a_landed_step_is_one_copy_no_read_back_and_reads_after_close() -> None:
    """Catches addresses left out of the copy, a read-back copy issued anyway, a landing inside the
    copied bytes, padding rows that would store, or a handle readable before its fence follows the kernel."""
    pool, block = cpu_block()
    rows, live = 8, 5
    st = block.stage(rows, live)
    st.put("x", np.arange(live, dtype=np.int64))
    handle = st.landing("dst")
    assert isinstance(handle, Landing) and not handle.ready()
    with pytest.raises(PoolStateError, match="before its stage closed"):
        handle.tolist()
    st.flush()
    views = block.views(rows)
    assert st.views["dst"] is views["dst"] or torch.equal(st.views["dst"], views["dst"])
    dst = views["dst"].tolist()
    assert all(a != 0 for a in dst[:live]) and dst[live:] == [0] * (rows - live)
    assert [b - a for a, b in itertools.pairwise(dst[:live])] == [8] * (live - 1)
    lo, hi = pool.host_slab.data_ptr(), pool.host_slab.data_ptr() + pool.host_slab.numel()
    slot_lo = lo + st.slot * SLOT_BYTES
    assert all(slot_lo + block.layout.nbytes(rows) <= a < slot_lo + SLOT_BYTES <= hi for a in dst[:live])
    land(torch.arange(rows, dtype=torch.int64) * 10 + 1, views["dst"])  # the "replay"
    with pytest.raises(PoolStateError, match="before its stage closed"):
        handle.tolist()
    st.close()
    assert handle.tolist() == [1, 11, 21, 31, 41]
    stats = pool.stats()
    assert stats.copies == 1 and stats.readbacks == 0 and stats.bytes_copied == block.layout.nbytes(rows)


@pytest.mark.parametrize(
    ("declare", "match"),
    [
        (lambda: Field("dst", torch.int64, 1, torch.int64), "a landing field holds int64 addresses with pad 0"),
        (lambda: Field("dst", torch.float32, 0, torch.float32), "a landing field holds int64 addresses with pad 0"),
        (lambda: Field.landing("dst", torch.int16), "'lands' must be one of"),
    ],
    ids=["pad", "dtype", "landing-dtype"],
)
def test_a_landing_field_that_cannot_hold_addresses_is_refused_when_declared(declare: object, match: str) -> None:
    """Catches a landing on a field that cannot hold addresses (a pad that would store through a
    padding row, a non-int64 column), or of a dtype no writer stores, found only at a step."""
    with pytest.raises(SettingsError, match=match):
        declare()  # type: ignore[operator]


def test_landing_errors_are_typed_and_leave_the_stage_usable_or_aborted() -> None:
    """Catches a handle asked of a field that is no landing, a landing on a pool whose kernels may not
    write its slots, or a handle read after its stage was aborted."""
    _, block = cpu_block()
    with block.stage(4, 2) as st:
        st.put("x", [1, 2])
        with pytest.raises(StagingValueError, match="'name' must be a landing field"):
            st.landing("x")
        with pytest.raises(StagingValueError, match="'name' must be a declared field"):
            st.landing("nope")
        st.flush()
        land(torch.tensor([3, 4, 5, 6]), st.views["dst"])
    assert st.landing("dst").tolist() == [3, 4]  # the refusals took nothing the landing needs
    with pytest.raises(RuntimeError, match="boom"), block.stage(4, 2) as st:
        st.put("x", [1, 2])
        aborted = st.landing("dst")
        st.flush()
        raise RuntimeError("boom")
    assert st.state is State.ABORTED
    with pytest.raises(PoolStateError, match="aborted"):
        aborted.tolist()
    plain_pool_, plain = cpu_block(zero_copy=False)
    with pytest.raises(PoolStateError, match="zero_copy"):
        plain.stage(4, 2)  # refused at open: no address is handed out
    assert plain_pool_.claims == 0
    with pytest.raises(PoolStateError, match="zero_copy"):
        landing_stage(plain_pool_, 2)
    assert plain_pool_.claims == 0


def test_a_read_back_in_a_landed_stage_stops_before_the_landing() -> None:
    """Catches a read-back copied over the bytes a kernel lands in."""
    pool, block = cpu_block()
    st = block.stage(16, 16)
    st.put("x", np.arange(16, dtype=np.int64))
    handle = st.landing("dst")
    st.flush()
    views = block.views(16)
    land(torch.arange(16, dtype=torch.int64) + 500, views["dst"])
    room = SLOT_BYTES - 16 * 8 - block.layout.nbytes(16)
    with pytest.raises(CapacityError, match="before its landings"):
        st.readback(torch.zeros(room // 8 + 2, dtype=torch.int64))
    other = st.readback(torch.arange(4, dtype=torch.int64) + 900)
    st.close()
    assert handle.tolist() == list(range(500, 516)) and other.tolist() == [900, 901, 902, 903]
    assert pool.stats().readbacks == 1


# -- the stream rules, in the simulator -----------------------------------------------------
def run_landing_plan(
    seed: int, block_type: type[DeviceBlock] = DeviceBlock, unregistered_writer: bool = False, steps: int = 30
) -> list[str]:
    """One random plan: each step stages (the addresses are written at open), "replays" (a queued
    kernel that reads the staged addresses when it runs and stores the step's values there) and
    closes; handles are read up to num_slots - 1 claims later. Returns every wrong read."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=rng.randint(0, 40), seed=seed, devices=2)
    streams: list[SimStream] = [gpu.current_stream(0)]
    streams += [gpu.new_stream(f"s{i}") for i in range(1, rng.randint(2, 3) + 1)]
    other_device = [gpu.current_stream(1), gpu.new_stream("dev1:side", device_index=1)]
    num_slots = rng.randint(2, 5)
    pool = PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=True), transport=gpu
    )
    gpu.set_current(rng.choice(streams))
    block = block_type(pool, LAYOUT)
    readers = rng.sample(streams, rng.randint(1, 2))
    for reader in readers:
        block.register_reader(reader)
    stray = gpu.new_stream("unregistered")
    wrong: list[str] = []
    waiting: deque[tuple[Landing, list[int], int]] = deque()

    def read_one() -> None:
        handle, want, step = waiting.popleft()
        got = handle.tolist()
        if got != want:
            wrong.append(f"seed {seed} step {step}: read {got[:4]}, expected {want[:4]}")

    slab_lo = pool.host_slab.data_ptr()
    slab_hi = slab_lo + pool.host_slab.numel()

    def replay(values: torch.Tensor, dst_view: torch.Tensor, step: int) -> None:
        addresses = dst_view.clone()
        outside = [a for a in addresses.tolist() if a and not slab_lo <= a < slab_hi]
        if outside:  # read before its step's copy landed: bytes of another layout, not addresses
            wrong.append(f"seed {seed} step {step}: the replay read non-addresses {outside[:2]}")
            return
        land_reference(values, addresses)

    for step in range(steps):
        gpu.current_device = rng.choice([0, 1])
        gpu.set_current(rng.choice(streams))
        gpu.set_current(rng.choice(other_device))
        if rng.random() < 0.15:
            gpu.frozen = not gpu.frozen
        rows = rng.randint(1, MAX_ROWS)
        live = rng.randint(1, rows)
        stage_stream = rng.choice([*streams, None])
        with block.stage(rows, live, stream=stage_stream) as st:
            st.put("x", np.full(live, step, dtype=np.int64))
            handle = st.landing("dst")
            st.flush()
            writer = stray if unregistered_writer else rng.choice([st.stream, *readers])
            dst_view = block.views(rows)["dst"]
            values = torch.arange(rows, dtype=torch.int64) + 1000 * (step + 1)
            # The replay's last kernel: it reads the staged addresses when it runs, as the graph does.
            gpu.submit(writer, lambda v=values, d=dst_view, s=step: replay(v, d, s), "kernel")
            gpu.set_current(rng.choice(streams))  # the current stream at close need not be the stage's
        waiting.append((handle, values[:live].tolist(), step))
        # Read the oldest handles, never more than num_slots - 1 claims old (the lifetime rule).
        while waiting and (len(waiting) >= num_slots or rng.random() < 0.4):
            read_one()
    while waiting:
        read_one()
    gpu.frozen = False
    gpu.drain()
    assert gpu.errors == [], gpu.errors[:3]  # nothing queued on the other device's streams
    return wrong


PLAN_SEEDS = range(60)


def test_any_mix_of_stage_streams_and_replay_streams_reads_every_steps_own_landed_values() -> None:
    """Catches a landing read before its kernel ran or after a later step reused the slot."""
    for seed in PLAN_SEEDS:
        wrong = run_landing_plan(seed)
        assert wrong == [], wrong[:3]


@pytest.mark.parametrize(
    ("planted", "unregistered", "least"),
    [
        pytest.param(DeviceBlock, True, 0.8, id="writer-on-an-unregistered-stream"),
        pytest.param(NoFenceAfterReaders, False, 0.7, id="close-fence-does-not-wait-for-replays"),
    ],
)
def test_control_the_same_plans_with_the_guard_planted_away_read_wrong_values(
    planted: type[DeviceBlock], unregistered: bool, least: float
) -> None:
    """Catches a property test too weak to see the landing's fence rule: planted away, it must fail."""
    caught = sum(bool(run_landing_plan(seed, planted, unregistered)) for seed in PLAN_SEEDS)
    print(f"{planted.__name__} unregistered={unregistered}: caught in {caught} of {len(PLAN_SEEDS)} seeds")
    assert caught >= least * len(PLAN_SEEDS), f"caught in only {caught} of {len(PLAN_SEEDS)} seeds"


# -- the review's cases: misuse is refused or fenced, never silently wrong ---------------------
def plain_pool(num_slots: int = 3) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=SLOT_BYTES, zero_copy=True))


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_a_put_after_a_landing_never_reaches_its_bytes(zero_copy: bool) -> None:
    """Catches a list put (the hot path) or a read-back placed over the landing at the slot's end."""
    pool = plain_pool()
    st, _, _ = landing_stage(pool, 4, zero_copy=zero_copy)
    with st:
        room = (SLOT_BYTES - 32 - 32) // 8  # the landing (32 bytes) and its addresses (32) are taken
        with pytest.raises(CapacityError):
            st.put(list(range(room + 1)), torch.int64)
        with pytest.raises(CapacityError):
            st.put(np.arange(room + 1, dtype=np.int64))
        st.put(list(range(room - 8)), torch.int64)  # what fits still goes in
        st.flush()


def test_a_stage_with_a_landing_closed_without_flush_is_refused_and_its_handle_never_reads() -> None:
    """Catches a landing whose addresses are copied only at close: no writer can have stored after
    that copy, and one launched after close would store past the slot's fence. The close aborts
    (nothing copied) and raises; the handle stays unreadable."""
    pool = plain_pool()
    st, _, handle = landing_stage(pool, 2)
    with pytest.raises(PoolStateError, match="needs flush"), st:
        pass
    assert pool.stats().copies == 0
    with pytest.raises(PoolStateError, match="before its stage closed"):
        handle.tolist()
    block_pool, block = cpu_block()
    with pytest.raises(PoolStateError, match="needs flush"), block.stage(2, 2) as sst:
        sst.put("x", [1, 2])
        static_handle = sst.landing("dst")
    with pytest.raises(PoolStateError, match="before its stage closed"):
        static_handle.tolist()
    with pytest.raises(PoolStateError, match="needs flush"), block_pool.stage(LAYOUT, rows=2) as rst:
        rst.put("x", [1, 2])
    with pytest.raises(PoolStateError, match="before its stage closed"):
        rst.landing("dst").tolist()
    assert block_pool.stats().copies == 0 and block_pool.stats().aborted_stages == 2


def test_writes_that_would_cancel_a_landing_are_refused_and_an_image_keeps_the_addresses() -> None:
    """Catches put or host on a landing field, or a put_image that copies the image's zeros over the
    addresses: each would leave an armed handle that reads stale bytes while the writer stores nowhere."""
    _, block = cpu_block()
    image = block.layout.host_image(4, 2)
    image.views["x"][:] = [7, 8]
    with block.stage(4, 2) as st:
        for write in (lambda: st.put("dst", [0, 0]), lambda: st.host("dst")):
            with pytest.raises(PoolStateError, match="'dst' is a landing"):
                write()
        st.put_image(image)
        st.flush()
        addresses = block.views(4)["dst"].tolist()
        assert all(addresses[:2]) and addresses[2:] == [0, 0]
        land(torch.tensor([5, 6, 7, 8]), block.views(4)["dst"])
    assert block.views(4)["x"].tolist() == [7, 8, -1, -1] and st.landing("dst").tolist() == [5, 6]


@pytest.mark.parametrize("kind", ["landing-only", "ring-layout", "block"])
def test_an_aborted_stage_with_landing_bytes_is_fenced_and_moves_the_ring_on(kind: str) -> None:
    """Catches a stage that claimed landing bytes but copied nothing (aborted) being closed with no
    fence, its slot handed straight to the next stage while a writer it launched may still store into it."""
    pool, block = cpu_block(num_slots=3)
    if kind == "landing-only":
        st = landing_stage(pool, 8)[0]
    else:
        st = pool.stage(LAYOUT, rows=2) if kind == "ring-layout" else block.stage(2, 2)
    assert st.landing_bytes
    st.close(ok=False)
    assert pool.stats().copies == 0 and pool.stats().aborted_stages == 1
    with pool.stage() as nxt:
        nxt.put([1], torch.int64)
        assert nxt.slot != st.slot


def test_a_read_back_of_something_not_a_tensor_is_a_typed_error() -> None:
    """Catches the landing's room check reading ``numel`` of a non-tensor (AttributeError)."""
    pool = plain_pool()
    st, _, _ = landing_stage(pool, 1)
    with st:
        st.put([1], torch.int64)
        st.flush()  # a refused read-back flushes nothing itself
        with pytest.raises(PoolStateError, match=r"'src' must be a torch\.Tensor"):
            st.readback([1, 2, 3])  # type: ignore[arg-type]


def test_the_sampler_refuses_a_bad_land_to_before_sampling() -> None:
    """Catches land_to checked only after the sampling kernels ran, or under another error type."""
    from sampling import BatchMismatchError, Sampler, SamplingBatchInfo, SamplingParams
    from tests.fakes import Batch, Req

    pool = plain_pool()
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(SamplingParams(temperature=0.0)) for _ in range(3)]), 11, pool, owned=True
    )
    logits = torch.randn(3, 11)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(BatchMismatchError, match=r"'land_to' must be contiguous torch\.int64"):
            Sampler()(logits, info, land_to=bad)


def test_an_image_of_another_size_is_refused_and_never_written_past_the_block() -> None:
    """Catches put_image copying a resized HostImage.data past the layout (into the next slot) or
    leaving part of the layout stale; also an image of another layout or size."""
    pool, block = cpu_block(num_slots=2)
    image = block.layout.host_image(4, 2)
    pool.host_slab.numpy()[:] = 0x5A  # what the refused images must leave as it is
    for data in (
        np.full(image.data.shape[0] + 64, 0xAB, np.uint8),
        np.zeros(8, np.uint8),
        np.zeros(image.data.shape[0] // 8, np.int64),
    ):
        image.data = data
        with pytest.raises(StagingValueError, match=r"'image\.data' must be uint8"), block.stage(4, 2) as st:
            st.put_image(image)
    assert pool.stats().aborted_stages == 3
    slab, end = pool.host_slab.numpy(), block.layout.nbytes(4)
    for slot in range(2):  # each stage wrote its addresses in its layout, and nothing past it
        assert (slab[slot * SLOT_BYTES + end : (slot + 1) * SLOT_BYTES] == 0x5A).all(), (
            f"written past slot {slot}'s layout"
        )
    for other in (block.layout.host_image(4, 3), Layout(LAYOUT.fields, MAX_ROWS).host_image(4, 2)):
        with pytest.raises(StagingValueError, match=r"'image' must be this stage's"), block.stage(4, 2) as st:
            st.put_image(other)
    assert pool.stats().copies == 0


@pytest.mark.parametrize("registered", [True, False], ids=["drained", "control-not-drained"])
def test_a_pool_dropped_mid_step_waits_for_a_replay_on_a_block_reader(
    registered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches teardown freeing the slab while a replay queued on a block's reader stream may still
    store into it (a landing): the stage is still open, so no fence of the slot follows that replay.
    The control drops the reader from the teardown list: teardown then never waits on it."""
    gpu = LaggingGpu(max_lag=0, seed=1)
    pool = PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=2, slot_bytes=SLOT_BYTES, zero_copy=True), transport=gpu
    )
    if not registered:
        monkeypatch.setattr(PinnedRingBuffer, "_drain_at_teardown", lambda self, stream: None)
    block = DeviceBlock(pool, LAYOUT)
    replay = gpu.new_stream("replay")
    block.register_reader(replay)
    st = block.stage(4, 2)
    st.put("x", [1, 2])
    st.flush()
    ran: list[bool] = []
    gpu.frozen = True  # the device runs only when the host waits
    gpu.submit(replay, lambda: ran.append(True), "kernel")
    before = len(gpu.calls)
    pool.__del__()  # what the garbage collector does when an engine is torn down mid-step
    # Teardown's wait covers the replay stream: a fence recorded at its end, then waited on.
    # (The device may run the replay anyway while teardown waits on other streams: only the
    # fence says it was waited for.)
    waited_on_replay = ("cudaEventRecord", "replay") in gpu.calls[before:]
    assert waited_on_replay == registered
    assert not registered or ran == [True]
    gpu.frozen = False
    gpu.drain()
