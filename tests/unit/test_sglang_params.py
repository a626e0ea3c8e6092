"""Requests carrying sglang's sampling-param names: equal to the native path, to sglang's own build,
packed once, and refused with a typed error when bad."""

from __future__ import annotations

import gc
import itertools
import random
import weakref
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.sglang_sampling import SglangBatch, SglangParams, SglangReq, load, rebuild
from sampling import RECORD_DTYPE, TOP_K_ALL, SamplingBatchInfo, SamplingParamError, SamplingParams, sglang_params
from sampling.params import F32_MAX
from tests.fakes import Batch, Req

VOCAB = 60
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")


def make_pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=1 << 18))


class Raw:
    """A plain object with sglang's attribute names, values as a caller wrote them (not normalised)."""

    def __init__(self, **kw: Any) -> None:
        self.temperature = kw.get("temperature", 1.0)
        self.top_p = kw.get("top_p", 1.0)
        self.top_k = kw.get("top_k", -1)
        self.min_p = kw.get("min_p", 0.0)
        self.sampling_seed = kw.get("sampling_seed")
        self.logit_bias = kw.get("logit_bias")


def pair(rng: random.Random) -> tuple[Raw, SamplingParams]:
    """The same settings in sglang's names and in pinpool's."""
    bias = {rng.randrange(VOCAB): round(rng.uniform(-5, 5), 3) for _ in range(rng.randint(1, 4))}
    kw = {
        "temperature": rng.choice([0.0, 1e-7, rng.uniform(0.2, 1.5)]),
        "top_p": rng.choice([1.0, rng.uniform(0.1, 1.0)]),
        "top_k": rng.choice([-1, rng.randint(1, VOCAB)]),
        "min_p": rng.choice([0.0, rng.uniform(0.0, 0.5)]),
    }
    seed = rng.choice([None, rng.randint(-(2**63), 2**63 - 1)])
    use_bias = rng.random() < 0.3
    raw = Raw(**kw, sampling_seed=seed, logit_bias={str(k): v for k, v in bias.items()} if use_bias else None)
    return raw, SamplingParams(**kw, seed=seed, logit_bias=bias if use_bias else None)


def assert_same(a: Any, b: Any) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    for flag in ("is_all_greedy", "is_any_greedy", "need_top_p_sampling", "need_top_k_sampling"):
        assert getattr(a, flag) == getattr(b, flag), flag
    assert a.need_min_p_sampling == b.need_min_p_sampling
    assert a.max_top_k == b.max_top_k


@pytest.mark.parametrize("bs", [1, 7, 999])
def test_sglang_named_requests_stage_the_same_values_as_native_ones(bs: int) -> None:
    """Catches a field read under the wrong name, sglang's greedy or top_k=-1 rule not applied,
    string bias keys or negative seeds refused or mangled."""
    rng = random.Random(bs)
    pairs = [pair(rng) for _ in range(bs)]
    pool = make_pool()
    foreign = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(r) for r, _ in pairs]),
        VOCAB,
        pool,
        deterministic=True,  # type: ignore[arg-type]
    )
    native = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for _, p in pairs]), VOCAB, pool, deterministic=True)
    assert_same(foreign, native)


@pytest.mark.parametrize("bs", [1, 33])
def test_values_equal_sglangs_own_build(bs: int) -> None:
    """Catches a normalisation or bias rule that differs from sglang's from_schedule_batch
    (its own code when .sglang/ holds it, else the rebuild)."""
    rng = random.Random(100 + bs)
    reqs = []
    for _ in range(bs):
        raw, _ = pair(rng)
        p = SglangParams(raw.temperature, raw.top_p, raw.top_k, raw.min_p, raw.sampling_seed, raw.logit_bias)
        reqs.append(SglangReq(p))
    reqs.append(SglangReq(SglangParams(logit_bias={"5": 1.0, "05": -2.5, "7": 0.5})))  # "5" and "05" collide
    batch = SglangBatch(reqs, torch.device("cpu"))
    ours = SamplingBatchInfo.from_schedule_batch(batch, VOCAB, make_pool(), deterministic=True)
    for build in {load()[0], rebuild}:
        assert_same(ours, build(batch, VOCAB))


class Counted:
    """sglang-named params that count every attribute read."""

    reads: ClassVar[dict[str, int]] = {}

    def __init__(self, raw: Raw) -> None:
        object.__setattr__(self, "_raw", raw)

    def __getattr__(self, name: str) -> Any:
        Counted.reads[name] = Counted.reads.get(name, 0) + 1
        return getattr(object.__getattribute__(self, "_raw"), name)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bs", [3, sglang_params.SMALL_BATCH + 1, 1000])
def test_a_first_sight_build_reads_each_field_once_per_request(bs: int, deterministic: bool) -> None:
    """Catches a build that reads a request's fields more than once (a per-request Python pass per
    check, or a per-object cache probing the object) instead of one vectorised pass per field, or
    that reads the seeds of a batch that samples without them."""
    rng = random.Random(bs)
    raws = [pair(rng)[0] for _ in range(bs)]
    objs = [Counted(r) for r in raws]
    Counted.reads.clear()
    pool = make_pool()
    got = SamplingBatchInfo.from_schedule_batch(Batch([Req(o) for o in objs]), VOCAB, pool, deterministic=deterministic)  # type: ignore[misc]
    fields = ("temperature", "top_p", "top_k", "min_p", "logit_bias") + (("sampling_seed",) if deterministic else ())
    assert Counted.reads == dict.fromkeys(fields, bs)
    want = SamplingBatchInfo.from_schedule_batch(Batch([Req(r) for r in raws]), VOCAB, pool, deterministic=True)  # type: ignore[misc]
    for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_build_keeps_nothing_of_the_objects_it_read() -> None:
    """Catches a build that keeps request objects alive (a cache by object) after it returns: sglang's
    requests are new at every prefill, so anything kept is memory spent for no later hit."""
    rng = random.Random(11)
    raws = [pair(rng)[0] for _ in range(40)]
    refs = [weakref.ref(r) for r in raws]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(r) for r in raws]), VOCAB, make_pool())  # type: ignore[misc]
    del raws
    gc.collect()
    assert [r() for r in refs] == [None] * 40
    assert len(info) == 40


def test_mixed_native_and_sglang_requests_in_one_batch() -> None:
    """Catches a batch whose first request is native but later ones are sglang's (or the reverse)
    failing, or taking the wrong record for a row."""
    rng = random.Random(7)
    pairs = [pair(rng) for _ in range(6)]
    mixed = [Req(p if i % 2 else r) for i, (r, p) in enumerate(pairs)]  # type: ignore[arg-type]
    pool = make_pool()
    got = SamplingBatchInfo.from_schedule_batch(Batch(mixed), VOCAB, pool, deterministic=True)
    want = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for _, p in pairs]), VOCAB, pool, deterministic=True)
    assert_same(got, want)
    got = SamplingBatchInfo.from_schedule_batch(Batch(mixed[1:]), VOCAB, pool, deterministic=True)
    want = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for _, p in pairs[1:]]), VOCAB, pool, deterministic=True)
    assert_same(got, want)


def test_none_means_sglangs_default() -> None:
    """Catches a None field (sglang's "use the default") refused or staged as NaN."""
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(Raw(temperature=None, top_p=None, top_k=None, min_p=None))]),  # type: ignore[arg-type]
        VOCAB,
        make_pool(),
        deterministic=True,
    )
    assert_same(
        info,
        SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams())]), VOCAB, make_pool(), deterministic=True),
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"top_p": 1.5}, "'top_p' of request 1 must be in (0, 1] (got 1.5)"),
        ({"temperature": float("nan")}, "'temperature' of request 1 must be finite, >= 0 and fit float32 (got nan)"),
        ({"temperature": "hot"}, "'temperature' of request 1 must be a real number (got 'hot')"),
        ({"top_k": 0}, "'top_k' of request 1 must be >= 1, or -1 for all tokens (got 0)"),
        ({"top_k": 2.5}, "'top_k' of request 1 must be an int (got 2.5)"),
        ({"min_p": -0.5}, "'min_p' of request 1 must be in [0, 1] (got -0.5)"),
        ({"sampling_seed": 2**64}, "'sampling_seed' of request 1 must be in [-2**63, 2**63)"),
        ({"logit_bias": {"x": 1.0}}, "'logit_bias' keys of request 1 must be token ids (got 'x')"),
        ({"logit_bias": {"-2": 1.0}}, "'logit_bias' token ids of request 1 must be ints >= 0 (got '-2')"),
        (
            {"logit_bias": {"3": float("inf")}},
            "'logit_bias' values of request 1 must be finite and fit float32 (got inf for token 3)",
        ),
        ({"logit_bias": [1]}, "'logit_bias' of request 1 must be a mapping"),
        ({"temperature": 1e39}, "'temperature' of request 1 must be finite, >= 0 and fit float32 (got 1e+39)"),
        ({"logit_bias": {"3": -1e39}}, "'logit_bias' values of request 1 must be finite and fit float32 (got -1e+39"),
        ({"top_k": True}, "'top_k' of request 1 must be an int (got True)"),
        ({"temperature": True}, "'temperature' of request 1 must be a real number (got True)"),
        ({"min_p": np.True_}, "'min_p' of request 1 must be a real number (got "),
        ({"top_k": np.True_}, "'top_k' of request 1 must be an int (got "),
        ({"top_p": 10**400}, "'top_p' of request 1 must be finite and fit float32 (got 1000"),
        ({"logit_bias": {"3": 10**400}}, "'logit_bias' values of request 1 must be finite and fit float32 (got 1000"),
        ({"logit_bias": {float("inf"): 1.0}}, "'logit_bias' keys of request 1 must be token ids (got inf)"),
        ({"top_k": 2**70}, "'top_k' of request 1 must be in [-2**63, 2**63)"),
        ({"sampling_seed": -(2**63) - 1, "logit_bias": {"x": 1.0}}, "'sampling_seed' of request 1 must be in"),
        ({"top_k": -2}, "'top_k' of request 1 must be >= 1, or -1 for all tokens (got -2)"),
        ({"top_k": 2**53 + 1}, "'top_k' of request 1 must be >= 1, or -1 for all tokens (got 9007199254740993)"),
        ({"temperature": -1e-9}, "'temperature' of request 1 must be finite, >= 0 and fit float32 (got -1e-09)"),
        ({"min_p": float("nan")}, "'min_p' of request 1 must be in [0, 1] (got nan)"),
        ({"top_p": 0.0}, "'top_p' of request 1 must be in (0, 1] (got 0.0)"),
        ({"temperature": Fraction(1, 2)}, "'temperature' of request 1 must be a real number (got Fraction(1, 2))"),
    ],
)
@pytest.mark.parametrize("bs", [2, sglang_params.SMALL_BATCH + 5])
@pytest.mark.parametrize("base", [{}, {"temperature": 0.7, "top_k": TOP_K_ALL}])
def test_bad_sglang_values_raise_and_nothing_is_staged_or_cached(
    kw: dict[str, Any], message: str, bs: int, base: dict[str, Any]
) -> None:
    """Catches a bad value reaching the device, or the small-batch and numpy packers applying
    different rules. ``base``: the other requests as written (top_k -1: the vectorised packer's
    normalising branch) or as sglang's own params arrive (nothing to normalise: its in-range test)."""
    objs = [Raw(**base), Raw(**{**base, **kw})] + [Raw(**base) for _ in range(bs - 2)]
    with pytest.raises(SamplingParamError) as info:
        sglang_params.pack_foreign(objs)
    assert message in str(info.value)
    pool = make_pool()
    with pytest.raises(SamplingParamError):
        SamplingBatchInfo.from_schedule_batch(Batch([Req(o) for o in objs]), VOCAB, pool, deterministic=True)  # type: ignore[arg-type]
    assert pool.stats().copies == 0


def test_small_and_numpy_packers_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the one-by-one packer (small batches) and the numpy packer drifting apart: flags,
    float32 rounding, greedy and top_k = -1 rules, None defaults, bias counts."""
    rng = random.Random(3)
    objs: list[Any] = [pair(rng)[0] for _ in range(sglang_params.SMALL_BATCH)]
    objs += [Raw(temperature=None, top_p=None, top_k=None, min_p=None), Raw(top_k=40.0, top_p=0.99999999)]
    small = [sglang_params.pack_foreign(objs[i : i + 1]) for i in range(len(objs))]
    monkeypatch.setattr(sglang_params, "SMALL_BATCH", 0)
    rec, biases = sglang_params.pack_foreign(objs)
    assert rec.tobytes() == b"".join(r.tobytes() for r, _ in small)
    assert biases == {i: b[0] for i, (_, b) in enumerate(small) if b}


def test_plain_numbers_and_numpy_scalars_pack_the_same_bytes() -> None:
    """Catches the vectorised packer's C-level conversion (plain ints and floats only) and its
    checked conversion (anything else: here numpy scalars and integral float top_ks) drifting
    apart on valid values, ints given for the float fields included."""
    rng = random.Random(7)
    plain: list[Any] = [pair(rng)[0] for _ in range(sglang_params.SMALL_BATCH + 20)]
    plain[0].temperature, plain[1].top_p, plain[2].min_p = 1, 1, 0  # ints where floats are usual
    other = []
    for r in plain:
        o = Raw(
            temperature=np.float64(r.temperature),
            top_p=np.float64(r.top_p),
            top_k=float(r.top_k),  # 40.0 is read as 40, as sglang's int conversion does
            min_p=np.float64(r.min_p),
            sampling_seed=None if r.sampling_seed is None else np.int64(r.sampling_seed),
            logit_bias=r.logit_bias,
        )
        other.append(o)
    want, want_bias = sglang_params.pack_foreign(plain)
    got, got_bias = sglang_params.pack_foreign(other)
    assert got.tobytes() == want.tobytes() and got_bias == want_bias


def test_an_object_without_sglangs_fields_is_named() -> None:
    """Catches an AttributeError (or a silent default) for params that are neither pinpool's nor sglang's."""

    class Half:
        temperature = 1.0

    with pytest.raises(SamplingParamError, match="must carry sglang's field 'top_p'"):
        sglang_params.pack_foreign([Half()])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bs", [3, sglang_params.SMALL_BATCH + 4])
def test_a_mixed_batch_with_a_biased_native_request_builds_either_way(bs: int, deterministic: bool) -> None:
    """Catches a native SamplingParams in a large sglang-named batch read as if it were sglang's
    (its sorted bias tuples refused as "not a mapping") when the seeds are not read."""
    rng = random.Random(bs)
    pairs = [pair(rng) for _ in range(bs)]
    native = SamplingParams(top_p=0.5, logit_bias={5: 1.0})
    mixed = [Req(r) for r, _ in pairs] + [Req(native)]
    want = [Req(p) for _, p in pairs] + [Req(native)]
    pool = make_pool()
    got = SamplingBatchInfo.from_schedule_batch(Batch(mixed), VOCAB, pool, deterministic=deterministic)  # type: ignore[arg-type]
    assert_same(got, SamplingBatchInfo.from_schedule_batch(Batch(want), VOCAB, pool, deterministic=deterministic))


def test_a_missing_field_in_a_mixed_batch_names_the_request_that_lacks_it() -> None:
    """Catches the error naming a native request (which never has sglang's ``sampling_seed``)
    instead of the sglang-named one that lacks the field."""

    class NoSeed:
        temperature, top_p, top_k, min_p, logit_bias = 1.0, 1.0, -1, 0.0, None

    with pytest.raises(
        SamplingParamError, match="request 1 must carry sglang's field 'sampling_seed' \\(got NoSeed\\)"
    ):
        sglang_params.pack_foreign([SamplingParams(), NoSeed()])


@pytest.mark.parametrize("bs", [2, sglang_params.SMALL_BATCH + 3])
def test_the_top_p_flag_compares_the_double_as_sglang_does(bs: int) -> None:
    """Catches need_top_p_sampling computed from the stored float32: top_p = 0.99999999 rounds to
    1.0 in float32, but sglang's flag (and pinpool's native params) say top-p is on."""
    objs = [Raw(top_p=0.99999999)] + [Raw() for _ in range(bs - 1)]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(o) for o in objs]), VOCAB, make_pool())  # type: ignore[misc]
    native = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(SamplingParams(top_p=0.99999999))] + [Req(SamplingParams()) for _ in range(bs - 1)]),
        VOCAB,
        make_pool(),
    )
    assert info.need_top_p_sampling and native.need_top_p_sampling


_TEMPERATURES = [0.0, 1e-7, 1e-6, float(np.nextafter(1e-6, 0.0)), 0.5, 1, 2, F32_MAX, 1e-300]
_TOP_PS = [1.0, 1, 0.99999999, 5e-324, 0.5]
_TOP_KS = [-1, 1, 2, 40, TOP_K_ALL - 1, TOP_K_ALL]
_MIN_PS = [0.0, -0.0, 0, 1, 1.0, 5e-324, 0.3]
_SEEDS = [None, 0, -1, 2**63 - 1, -(2**63), 12345]
_BIASES: list[dict[Any, float] | None] = [None, {}, {"3": 1.5, "03": -2.0, "9": 0.25}, {"7": -0.5}]


def _edge(rng: random.Random) -> Raw:
    return Raw(
        temperature=rng.choice(_TEMPERATURES),
        top_p=rng.choice(_TOP_PS),
        top_k=rng.choice(_TOP_KS),
        min_p=rng.choice(_MIN_PS),
        sampling_seed=rng.choice(_SEEDS),
        logit_bias=rng.choice(_BIASES),
    )


def _as_numpy(r: Raw) -> Raw:
    """The same values as numpy scalars (and top_k as an integral float): the checked paths."""
    return Raw(
        temperature=np.float64(r.temperature),
        top_p=np.float64(r.top_p),
        top_k=float(r.top_k),
        min_p=np.float64(r.min_p),
        sampling_seed=None if r.sampling_seed is None else np.int64(r.sampling_seed),
        logit_bias=r.logit_bias,
    )


def _native(r: Raw) -> SamplingParams:
    bias = None if r.logit_bias is None else {int(k): v for k, v in r.logit_bias.items()}
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, seed=r.sampling_seed, logit_bias=bias
    )


@pytest.mark.parametrize("seed", range(4))
def test_every_path_packs_the_same_bytes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the packers' fast paths drifting from their checked ones or from pinpool's own
    records: the small packer's per-request fast test and its checked path, the vectorised
    packer's plain conversion and its checked one, its in-range branch (nothing to normalise,
    as sglang's own params arrive) and its normalising one, and the flag bits of every
    combination, on edge values (greedy bounds, ints in float fields, -0.0, the smallest top_p,
    int64 seed bounds, colliding bias keys)."""
    rng = random.Random(seed)
    raws = [_edge(rng) for _ in range(60)]
    want = b"".join(_native(r).record for r in raws)
    want_bias = {i: _native(r).logit_bias for i, r in enumerate(raws) if _native(r).logit_bias is not None}
    for objs in (raws, [_as_numpy(r) for r in raws]):
        one_by_one = [sglang_params.pack_foreign([o]) for o in objs]  # the small packer
        assert b"".join(rec.tobytes() for rec, _ in one_by_one) == want
        assert {i: b[0] for i, (_, b) in enumerate(one_by_one) if b} == want_bias
        small, small_bias = sglang_params._pack_small(objs, None)
        assert small.tobytes() == want and small_bias == want_bias
        vec, vec_bias = sglang_params._pack_vectorised(objs, None)  # normalising branch: greedy rows
        assert vec.tobytes() == want and vec_bias == want_bias
    # The in-range branch: no greedy temperature, no top_k -1.
    plain = [r for r in raws if r.temperature >= 1e-6 and r.top_k != -1]
    assert len(plain) > 10
    vec, _ = sglang_params._pack_vectorised(plain, None)
    assert vec.tobytes() == b"".join(_native(r).record for r in plain)
    # One row to normalise sends the whole batch to the normalising branch: a greedy temperature
    # (of each kind), or a top_k of -1 alone.
    for extra in (Raw(temperature=0.0, top_k=40), Raw(temperature=1e-7, top_k=TOP_K_ALL), Raw(top_k=-1)):
        vec, _ = sglang_params._pack_vectorised([*plain, extra], None)
        assert vec.tobytes() == b"".join(_native(r).record for r in [*plain, extra])
    # Every reachable flag combination, in-range branch and small packer.
    combos = [
        Raw(temperature=0.7, top_p=p, top_k=k, min_p=m)
        for p, k, m in itertools.product([1.0, 0.5], [1, 40, TOP_K_ALL], [0.0, 0.1])
    ]
    want = b"".join(_native(r).record for r in combos)
    assert sglang_params._pack_vectorised(combos, None)[0].tobytes() == want
    assert sglang_params._pack_small(combos, None)[0].tobytes() == want
    monkeypatch.setattr(sglang_params, "SMALL_BATCH", 0)
    assert sglang_params.pack_foreign(raws)[0].tobytes() == b"".join(_native(r).record for r in raws)


@pytest.mark.parametrize("bs", [3, sglang_params.SMALL_BATCH + 3])
@pytest.mark.parametrize("bad", [{"top_k": 0}, {"sampling_seed": 2**63}, {"logit_bias": {"x": 1.0}}, {"top_p": None}])
def test_a_refused_batch_leaves_out_untouched(bs: int, bad: dict[str, Any]) -> None:
    """Catches a packer writing the requests before a bad one into ``out`` (records half-written
    into a caller's table), and ``out`` filled unlike the returned records."""
    objs = [Raw(temperature=0.5, top_k=40) for _ in range(bs)]
    out = np.zeros(bs, RECORD_DTYPE)
    out.view(np.uint8)[:] = 0xAB
    got, _ = sglang_params.pack_foreign(objs, out)
    assert got is out and out.tobytes() == sglang_params.pack_foreign(objs)[0].tobytes()
    out.view(np.uint8)[:] = 0xAB
    objs[-1] = Raw(**{"temperature": 0.5, **bad})
    if bad == {"top_p": None}:  # None is the default: accepted
        sglang_params.pack_foreign(objs, out)
        return
    with pytest.raises(SamplingParamError, match=f"of request {bs - 1}"):
        sglang_params.pack_foreign(objs, out)
    assert out.tobytes() == b"\xab" * (32 * bs)
