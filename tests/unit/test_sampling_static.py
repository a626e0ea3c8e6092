"""StaticSamplingInfo on CPU: the graph's one path draws the eager tokens, from the block's own views.

On CPU the sampler's deterministic draw is ``draw_reference``; the Triton kernel runs here
only through the interpreter (the ``needs_interpreter`` test). tests/gpu checks capture.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings
from sampling import (
    DEFAULT_SEED,
    RECORD_DTYPE,
    SAMPLING_FIELDS,
    TOP_K_ALL,
    BatchMismatchError,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    StaticSamplingInfo,
    draw_reference,
    launch_draw_sorted,
    pack_foreign,
    sampling_columns,
)
from tests.fakes import Batch, Req, random_params

VOCAB = 64
FIELDS = (*SAMPLING_FIELDS, Field("positions", torch.int64, 0))
KINDS = ("greedy", "plain", "top_p", "top_k", "min_p", "mixed")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU on this machine; tests/gpu checks the kernel on the device",
)


def make_pool(slot_bytes: int = 1 << 16) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=slot_bytes))


def make_block(max_rows: int = 16) -> DeviceBlock:
    return DeviceBlock(make_pool(), Layout(FIELDS, max_rows))


def params_of(rng: random.Random, kind: str, n: int, vocab: int = VOCAB) -> list[SamplingParams]:
    def one() -> SamplingParams:
        seed = rng.randrange(-(2**40), 2**40) if rng.random() < 0.8 else None  # None: DEFAULT_SEED
        temperature = rng.uniform(0.3, 1.5)
        if kind == "greedy":
            return SamplingParams(temperature=0.0, seed=seed)
        if kind == "plain":
            return SamplingParams(temperature=temperature, seed=seed)
        if kind == "top_p":
            return SamplingParams(temperature=temperature, top_p=rng.uniform(0.2, 0.95), seed=seed)
        if kind == "top_k":
            return SamplingParams(temperature=temperature, top_k=rng.randint(1, vocab), seed=seed)
        if kind == "min_p":
            return SamplingParams(temperature=temperature, min_p=rng.uniform(0.01, 0.3), seed=seed)
        return random_params(rng, vocab, bias=False)

    return [one() for _ in range(n)]


def records(params: list[SamplingParams]) -> bytes:
    return b"".join(p.record for p in params)


def stage(block: DeviceBlock, rows: int, params: list[SamplingParams], positions: torch.Tensor) -> None:
    """One engine step: the live requests' columns and positions; padding is written with the copy."""
    cols = sampling_columns(records(params))
    with block.stage(rows, len(params)) as st:
        for name, values in cols.items():
            st.put(name, values)
        st.put("positions", positions.numpy())


def eager(params: list[SamplingParams], logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The sampler on a deterministic SamplingBatchInfo of exactly the live requests."""
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), logits.shape[1], make_pool(1 << 18), owned=True, deterministic=True
    )
    return Sampler()(logits, info, positions)


def random_logits(gen: torch.Generator, rows: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen) * 3.0


@pytest.mark.parametrize("live", [1, 5, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_static_info_draws_the_eager_tokens(kind: str, live: int) -> None:
    """Catches a static path whose forced filters, greedy handling or padded batch change a live row's token."""
    rng = random.Random(hash((kind, live)) % 10_000)
    gen = torch.Generator().manual_seed(live)
    rows = 8
    block = make_block()
    info = StaticSamplingInfo(block.views(rows), rows, VOCAB)
    for _ in range(4):
        params = params_of(rng, kind, live)
        logits = random_logits(gen, rows)
        positions = torch.tensor([rng.randrange(1 << 20) for _ in range(live)], dtype=torch.int64)
        stage(block, rows, params, positions)
        got = Sampler()(logits, info, block.views(rows)["positions"])
        want = eager(params, logits[:live], positions)
        assert got.shape == (rows,)
        assert got[:live].tolist() == want.tolist()


def test_one_info_follows_every_restaged_step() -> None:
    """Catches an info that copied the views' values at construction instead of reading the block
    (a graph replays with the info it captured, so every step must come through the views)."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    block = make_block(max_rows=16)
    infos = {rows: StaticSamplingInfo(block.views(rows), rows, VOCAB) for rows in (4, 16)}
    for step in range(16):
        rows = rng.choice(list(infos))
        live = rng.randint(0, rows)
        params = params_of(rng, rng.choice(KINDS), live)
        logits = random_logits(gen, rows)
        positions = torch.tensor([step * 100 + i for i in range(live)], dtype=torch.int64)
        stage(block, rows, params, positions)
        got = Sampler()(logits, infos[rows], block.views(rows)["positions"])
        if live:
            assert got[:live].tolist() == eager(params, logits[:live], positions).tolist()


def test_padding_rows_do_not_change_live_tokens() -> None:
    """Catches a live row whose token depends on what the padding rows hold (their logits or values)."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    rows, live = 12, 5
    block = make_block()
    info = StaticSamplingInfo(block.views(rows), rows, VOCAB)
    params = params_of(rng, "mixed", live)
    positions = torch.arange(live, dtype=torch.int64) + 17
    stage(block, rows, params, positions)
    live_logits = random_logits(gen, live)
    want = eager(params, live_logits, positions).tolist()
    views = block.views(rows)
    assert views["temperature"][live:].tolist() == [1.0] * (rows - live)
    assert views["top_k"][live:].tolist() == [TOP_K_ALL] * (rows - live)
    assert views["seed"][live:].tolist() == [DEFAULT_SEED] * (rows - live)
    for scale in (0.0, 1.0, 50.0, -50.0):
        padding = random_logits(gen, rows - live) * scale
        got = Sampler()(torch.cat([live_logits, padding]), info, views["positions"])
        assert got[:live].tolist() == want


def test_top_p_one_row_keeps_its_tail_on_the_static_path() -> None:
    """Catches the static path (top-p filter always on) cutting a top_p = 1 row whose float32 running
    sum passes 1.0 before its tail: the row must draw what it draws alone with the filter off."""
    vocab = 4097
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2.0
    probs = torch.softmax(logits, -1).sort(descending=True).values
    assert int(((probs.cumsum(-1) - probs) > 1.0).sum()) > 0  # the row really trips the rounding
    target = SamplingParams(temperature=1.0, seed=-77)
    block = make_block(max_rows=2)
    info = StaticSamplingInfo(block.views(2), 2, vocab)
    batch_logits = torch.stack([logits, torch.randn(vocab, generator=torch.Generator().manual_seed(9))])
    for pos in range(16):
        positions = torch.tensor([pos])
        stage(block, 2, [target], positions)
        got = Sampler()(batch_logits, info, block.views(2)["positions"])
        assert int(got[0]) == int(eager([target], logits[None], positions)[0])


def test_info_tensors_are_the_block_views() -> None:
    """Catches an info that copies (or re-views into new memory) instead of reading the block in place."""
    block = make_block()
    rows = 8
    views = block.views(rows)
    info = StaticSamplingInfo(views, rows, VOCAB)
    pairs = {
        "temperature": info.temperatures,
        "top_p": info.top_ps,
        "top_k": info.top_ks,
        "min_p": info.min_ps,
        "seed": info.sampling_seed,
    }
    for name, t in pairs.items():
        assert t is not None
        assert t.data_ptr() == views[name].data_ptr()
        assert t.untyped_storage().data_ptr() == block.device_block.untyped_storage().data_ptr()
        assert t.is_contiguous()
    assert info.temperatures.shape == (rows, 1)
    assert info.top_ps is views["top_p"] and info.sampling_seed is views["seed"]
    assert info.top_ks.dtype == torch.int32 and info.sampling_seed is not None
    assert info.sampling_seed.dtype == torch.int64
    assert len(info) == rows and info.vocab_size == VOCAB and info.device == torch.device("cpu")


def test_info_takes_one_path_whatever_the_batch_holds() -> None:
    """Catches flags that follow the staged values: an all-greedy step must not flip the graph to argmax."""
    block = make_block()
    info = StaticSamplingInfo(block.views(4), 4, VOCAB)
    stage(block, 4, [SamplingParams(temperature=0.0)] * 4, torch.arange(4))
    assert info.deterministic and not info.is_all_greedy
    assert info.need_top_p_sampling and info.need_top_k_sampling and info.need_min_p_sampling
    assert info.logit_bias is None
    assert info.check_live() is None
    assert "rows=4" in repr(info)
    logits = random_logits(torch.Generator().manual_seed(1), 4)
    assert Sampler()(logits, info, block.views(4)["positions"]).tolist() == logits.argmax(-1).tolist()


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_with_static_info_draws_the_eager_kernel_tokens(kind: str) -> None:
    """Catches the Triton draw (interpreted here) disagreeing between the static info's forced flags and
    the eager batch's own flags, or with its torch reference."""
    rng = random.Random(len(kind))
    vocab, rows, live = 300, 6, 4
    block = make_block(max_rows=rows)
    info = StaticSamplingInfo(block.views(rows), rows, vocab)
    params = params_of(rng, kind, live, vocab)
    positions = torch.tensor([rng.randrange(4096) for _ in range(live)], dtype=torch.int64)
    stage(block, rows, params, positions)
    logits = random_logits(torch.Generator().manual_seed(2), rows, vocab)
    probs_sort, probs_idx = torch.softmax(logits / info.temperatures, -1).sort(dim=-1, descending=True, stable=True)
    got = launch_draw_sorted(probs_sort, probs_idx, info, block.views(rows)["positions"])
    reference = draw_reference(probs_sort, probs_idx, info, block.views(rows)["positions"])
    assert got.tolist() == reference.tolist()
    eager_info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), vocab, make_pool(), owned=True, deterministic=True
    )
    want = launch_draw_sorted(probs_sort[:live], probs_idx[:live], eager_info, positions)
    assert got[:live].tolist() == want.tolist()


# -- validation ----------------------------------------------------------------------------


def plain_views(rows: int, **override: Any) -> dict[str, Any]:
    views: dict[str, Any] = {f.name: torch.full((rows,), f.pad, dtype=f.dtype) for f in SAMPLING_FIELDS}
    views.update(override)
    return views


def test_plain_tensors_work_and_extra_fields_are_ignored() -> None:
    """Catches an info that insists on a DeviceBlock, or trips on an engine's own fields."""
    views = plain_views(3, positions=torch.zeros(3, dtype=torch.int64), other="not a tensor")
    info = StaticSamplingInfo(views, 3, VOCAB)
    assert info.top_ks is views["top_k"]


@pytest.mark.parametrize(
    ("views", "rows", "vocab", "match"),
    [
        (plain_views(4), 0, VOCAB, "'rows' must be an int >= 1"),
        (plain_views(4), True, VOCAB, "'rows' must be an int >= 1"),
        (plain_views(4), 4.0, VOCAB, "'rows' must be an int >= 1"),
        (plain_views(4), 4, 0, "'vocab_size' must be an int >= 1"),
        (list(plain_views(4).values()), 4, VOCAB, "'views' must be a mapping"),
        ({k: v for k, v in plain_views(4).items() if k != "seed"}, 4, VOCAB, r"missing: \['seed'\]"),
        (plain_views(4, top_p=[1.0] * 4), 4, VOCAB, r"'views\['top_p'\]' must be a tensor"),
        (plain_views(4, top_k=torch.zeros(4, dtype=torch.int64)), 4, VOCAB, r"'views\['top_k'\]'.*torch.int32"),
        (plain_views(4, temperature=torch.ones(4, 1)), 4, VOCAB, r"'views\['temperature'\]'.*1-D"),
        (plain_views(4, min_p=torch.zeros(8)[::2]), 4, VOCAB, r"'views\['min_p'\]' must be a contiguous"),
        (plain_views(4), 8, VOCAB, r"'views\['temperature'\]' must hold rows=8 elements \(got 4\)"),
        (plain_views(4, seed=torch.zeros(3, dtype=torch.int64)), 4, VOCAB, r"'views\['seed'\]' must hold rows=4"),
        (plain_views(4, seed=torch.zeros(4, dtype=torch.int64, device="meta")), 4, VOCAB, "one device"),
    ],
)
def test_bad_views_raise_typed_errors(views: Any, rows: Any, vocab: Any, match: str) -> None:
    """Catches a malformed view reaching the sampler (or the graph) instead of a named error here."""
    with pytest.raises(BatchMismatchError, match=match):
        StaticSamplingInfo(views, rows, vocab)


def test_views_of_another_graph_size_are_refused() -> None:
    """Catches an info built over block.views(8) but used as a 16-row graph's input."""
    block = make_block()
    with pytest.raises(BatchMismatchError, match="rows=16"):
        StaticSamplingInfo(block.views(8), 16, VOCAB)


def test_sampler_refuses_unpadded_logits() -> None:
    """Catches a caller passing only the live rows' logits to a padded graph's sampler."""
    block = make_block()
    info = StaticSamplingInfo(block.views(8), 8, VOCAB)
    stage(block, 8, [SamplingParams(seed=1)] * 3, torch.arange(3))
    with pytest.raises(BatchMismatchError, match=r"'logits' must be shape \(8, 64\)"):
        Sampler()(torch.zeros(3, VOCAB), info, block.views(8)["positions"])
    with pytest.raises(BatchMismatchError, match="'positions' must be shape"):
        Sampler()(torch.zeros(8, VOCAB), info, None)


# -- sampling_columns ----------------------------------------------------------------------


def test_columns_hold_the_normalised_values_with_the_block_dtypes() -> None:
    """Catches a column read from the wrong record offset, a dtype that misses put()'s direct path,
    or greedy / top_k=-1 / seedless requests not stored as the sampler expects."""
    params = [
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=7, seed=-(2**63)),
    ]
    cols = sampling_columns(records(params))
    assert list(cols) == [f.name for f in SAMPLING_FIELDS]
    dtypes = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32, "seed": np.int64}
    for name, values in cols.items():
        assert values.dtype == np.dtype(dtypes[name]) and values.shape == (3,)
        assert values.flags.c_contiguous
    assert cols["temperature"].tolist() == [1.0, np.float32(0.7), np.float32(1.3)]
    assert cols["top_p"].tolist() == [1.0, np.float32(0.9), 1.0]
    assert cols["top_k"].tolist() == [1, TOP_K_ALL, 7]
    assert cols["min_p"].tolist() == [0.0, np.float32(0.05), 0.0]
    assert cols["seed"].tolist() == [5, DEFAULT_SEED, -(2**63)]


def test_columns_from_arrays_and_bytes_agree() -> None:
    """Catches a records form (array, strided array, bytearray, memoryview, sglang's packed array) read differently."""
    rng = random.Random(11)
    params = params_of(rng, "mixed", 9)
    joined = records(params)
    want = sampling_columns(joined)
    array = np.frombuffer(joined, RECORD_DTYPE)
    interleaved = np.zeros(18, RECORD_DTYPE)
    interleaved[::2] = array
    strided = interleaved[::2]  # the records, 64 bytes apart
    assert not strided.flags.c_contiguous
    forms = [array, array.copy(), strided, bytearray(joined), memoryview(joined), memoryview(array)]
    for form in forms:
        got = sampling_columns(form)
        for name in want:
            assert got[name].tolist() == want[name].tolist(), name
    foreign = [
        type(
            "P",
            (),
            {"temperature": 0.5, "top_p": 0.8, "top_k": -1, "min_p": 0.0, "sampling_seed": 3, "logit_bias": None},
        )()
    ]
    packed, _ = pack_foreign(foreign)
    assert sampling_columns(packed)["top_k"].tolist() == [TOP_K_ALL]


def test_columns_are_copies() -> None:
    """Catches columns that alias the records (an engine's cached columns would change under it)."""
    array = np.frombuffer(records([SamplingParams(seed=1)]), RECORD_DTYPE).copy()
    cols = sampling_columns(array)
    array["seed"] = 99
    array["top_p"] = 0.5
    assert cols["seed"].tolist() == [1] and cols["top_p"].tolist() == [1.0]


def test_empty_batch_gives_empty_columns() -> None:
    """Catches an empty step (every row padding) failing instead of staging live=0."""
    cols = sampling_columns(b"")
    assert all(v.shape == (0,) for v in cols.values())
    block = make_block()
    with block.stage(4, 0) as st:
        for name, values in cols.items():
            st.put(name, values)
        st.put("positions", np.zeros(0, np.int64))
    assert block.views(4)["top_k"].tolist() == [TOP_K_ALL] * 4


def test_logit_bias_is_refused() -> None:
    """Catches a biased request slipping into a graph that would silently ignore its bias."""
    params = [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(logit_bias={3: 1.5})]
    for form in (records(params), np.frombuffer(records(params), RECORD_DTYPE)):
        with pytest.raises(BatchMismatchError, match=r"logit bias \(got one in request 2\).*not captured in the graph"):
            sampling_columns(form)


@pytest.mark.parametrize(
    ("records_", "match"),
    [
        (b"\0" * 33, "whole 32-byte records"),
        (np.zeros(3, np.int32), "RECORD_DTYPE array"),
        (np.zeros((2, 2), RECORD_DTYPE), "1-D RECORD_DTYPE"),
        ([b"\0" * 32], "must be a RECORD_DTYPE array or joined record bytes"),
        (memoryview(b"\0" * 64)[::2], "contiguous"),
    ],
)
def test_bad_records_raise_typed_errors(records_: Any, match: str) -> None:
    """Catches malformed records read as garbage columns instead of a named error."""
    with pytest.raises(BatchMismatchError, match=match):
        sampling_columns(records_)
