"""write_cache_indices' cheaper checks: the batched prefix checks and the few-call length checks
refuse exactly what the full checks refuse."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from memcache import CacheIndexError, ReqToTokenPool, prefix_check, write_cache, write_cache_indices
from memcache.prefix_check import tagged_addresses
from pinpool import PinnedRingBuffer, PoolSettings

MAX_LEN = 64
NAMES = ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")


def call(rtt: ReqToTokenPool, **case: Any) -> None:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="torch", **case)


def one_request(t: Any, prefix_len: int) -> dict[str, Any]:
    return {
        "out_cache_loc": torch.arange(1, 2),
        "req_pool_indices": [0],
        "prefix_lens": [prefix_len],
        "seq_lens": [prefix_len + 1],
        "extend_lens": [1],
        "prefix_tensors": [t],
    }


def test_data_swapped_for_another_dtype_at_the_same_address_is_checked_again() -> None:
    """Catches a check result carried from one call to the next: ``.data =`` changed the dtype but
    not the address, and the next call must read the new dtype (refuse it, then read int32 width)."""
    rtt = ReqToTokenPool(4, MAX_LEN, "cpu")
    t = torch.arange(8, dtype=torch.int64)
    call(rtt, **one_request(t, 8))
    address = t.data_ptr()
    t.data = t.view(torch.float64)
    assert t.data_ptr() == address
    with pytest.raises(CacheIndexError, match="int32 or int64"):
        call(rtt, **one_request(t, 8))
    t.data = t.view(torch.int32)  # 16 int32 values: read at the new width
    call(rtt, **one_request(t, 16))
    assert rtt.req_to_token[0, :16].tolist() == t.tolist()


def test_a_tensor_accepted_for_one_device_is_refused_for_another() -> None:
    """Catches the batched device rule answering for another device than the one asked (a CPU
    tensor passing for "meta", whose tensors' get_device() is -1 as a CPU tensor's)."""
    t = torch.arange(4, dtype=torch.int32)
    assert tagged_addresses([t], [0], [4], torch.device("cpu")).tolist() == [t.data_ptr()]
    with pytest.raises(CacheIndexError, match="on meta"):
        tagged_addresses([t], [0], [4], torch.device("meta"))
    meta = torch.empty(4, dtype=torch.int32, device="meta")
    with pytest.raises(CacheIndexError, match=r"on cpu \(got torch.int32 on meta\)"):
        tagged_addresses([t, meta], [0, 1], [4, 4], torch.device("cpu"))


def test_something_else_than_a_tensor_with_tensor_attributes_is_refused() -> None:
    """Catches the batched passes trusting duck-typed attributes: an object with a dtype, a device,
    a data_ptr and a numel, but no tensor, must be refused (its address is not a tensor's)."""

    class Forged:
        dtype = torch.int32
        is_cpu = True

        def data_ptr(self) -> int:
            return 4096

        def numel(self) -> int:
            return 64

    with pytest.raises(CacheIndexError, match=r"prefix_tensors\[0\]' must be an int32 or int64 tensor.*Forged"):
        call(ReqToTokenPool(4, MAX_LEN, "cpu"), **one_request(Forged(), 4))


@pytest.mark.parametrize("bs", [6, 300])
def test_a_batch_of_seen_new_and_changed_prefixes(bs: int) -> None:
    """Catches a tensor's state carried between calls: one changed (set_ to another address) or
    shortened between two calls must be read anew, at the right request index (small and
    vectorised ways)."""
    rng = random.Random(bs)
    prefix = [rng.choice([0, rng.randint(1, 20)]) for _ in range(bs)]
    extend = [rng.randint(1, 4) for _ in range(bs)]
    tensors = [torch.randint(0, 1000, (p + 2,), dtype=rng.choice([torch.int32, torch.int64])) for p in prefix]
    case: dict[str, Any] = {
        "out_cache_loc": torch.arange(sum(extend)),
        "req_pool_indices": rng.sample(range(bs), bs),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "prefix_tensors": tensors[: bs // 2] + [t.clone() for t in tensors[bs // 2 :]],
    }
    rtt = ReqToTokenPool(bs, MAX_LEN, "cpu")
    call(rtt, **{**case, "prefix_tensors": tensors})  # the first half is seen, the second new next call
    with_prefix = [i for i, p in enumerate(prefix) if p]
    changed = with_prefix[len(with_prefix) // 3]
    target = case["prefix_tensors"][changed]
    target.set_(torch.randint(0, 1000, (prefix[changed] + 5,), dtype=target.dtype))  # another address
    rtt.req_to_token.fill_(-1)
    call(rtt, **case)
    for i, row in enumerate(case["req_pool_indices"]):
        p = prefix[i]
        assert rtt.req_to_token[row, :p].tolist() == case["prefix_tensors"][i][:p].tolist()
    short = with_prefix[-1]
    target = case["prefix_tensors"][short]
    target.set_(torch.arange(prefix[short] - 1, dtype=target.dtype))
    with pytest.raises(CacheIndexError, match=rf"'prefix_tensors\[{short}\]' must hold prefix_len {prefix[short]}"):
        call(rtt, **case)


def rules_hold(rows: list[int], prefix: list[int], seq: list[int], extend: list[int], size: int, total: int) -> bool:
    ok = all(
        0 <= r < size and p >= 0 and s >= 0 and e >= 0 and s - p == e and s <= MAX_LEN
        for r, p, s, e in zip(rows, prefix, seq, extend, strict=True)
    )
    return ok and sum(extend) == total and len(set(rows)) == len(rows)


def test_the_few_call_checks_accept_exactly_what_the_rules_accept() -> None:
    """Catches the unsigned-maximum bounds, the row count or the small pass's C-level rules
    accepting a batch one rule refuses (or refusing a valid one), near every bound."""
    rng = random.Random(7)
    edges = [-(2**63), -1, 0, 1, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, 2**62]
    t = torch.arange(MAX_LEN + 2, dtype=torch.int32)
    for trial in range(400):
        bs = rng.choice([1, 2, 5, 40, 90])
        size = rng.choice([bs, bs + 3, 40 * bs])  # dense rows (counted) and sparse ones (sorted)
        prefix = [rng.randint(0, 8) for _ in range(bs)]
        extend = [rng.randint(0, 8) for _ in range(bs)]
        seq = [p + e for p, e in zip(prefix, extend, strict=True)]
        rows = rng.sample(range(size), bs)
        lengths = [rows, prefix, seq, extend]
        for _ in range(rng.choice([0, 0, 1, 2])):  # break a value, maybe one rule, maybe none
            values = rng.choice(lengths)
            i = rng.randrange(bs)
            values[i] = rng.choice([*edges, size, size - 1, values[(i + 1) % bs], values[(i + 1) % bs]])
        total = sum(extend) if rng.random() < 0.9 else sum(extend) + 1
        loc = torch.arange(total if 0 <= total <= MAX_LEN * bs else 3)  # a total out of range breaks a rule anyway
        rtt = ReqToTokenPool(size, MAX_LEN, "cpu")
        valid = rules_hold(rows, prefix, seq, extend, size, loc.shape[0])
        args = (tuple(np.asarray(v, dtype=np.int64) for v in lengths), bs, loc, [t] * bs, rtt)
        if valid:
            table, _ = write_cache._batch_meta(*args)
            small = write_cache._small_batch_meta((rows, prefix, seq, extend), bs, loc, [t] * bs, rtt)
            assert small is not None and small[0] == table.tolist(), trial
        else:
            with pytest.raises(CacheIndexError):
                write_cache._batch_meta(*args)
            assert write_cache._small_batch_meta((rows, prefix, seq, extend), bs, loc, [t] * bs, rtt) is None, trial


@pytest.mark.parametrize("size", [8, 1000])  # rows dense (counted) and sparse (sorted)
def test_a_repeated_row_is_refused_however_it_is_found(size: int) -> None:
    """Catches either way of finding a repeated row missing one (two programs writing one row)."""
    t = torch.arange(4, dtype=torch.int32)
    rtt = ReqToTokenPool(size, MAX_LEN, "cpu")
    lengths = [np.asarray(v, dtype=np.int64) for v in ([3, size - 1, 3], [1, 0, 2], [2, 1, 3], [1, 1, 1])]
    with pytest.raises(CacheIndexError, match="must not repeat a row"):
        write_cache._batch_meta(tuple(lengths), 3, torch.arange(3), [t] * 3, rtt)
    lengths[0][2] = 5
    table, _ = write_cache._batch_meta(tuple(lengths), 3, torch.arange(3), [t] * 3, rtt)
    assert table[:3].tolist() == [3, size - 1, 5]


def test_a_req_to_token_swapped_for_another_device_is_refused_before_staging() -> None:
    """Catches the launch trusting out_cache_loc's device check against a pool whose
    req_to_token was replaced by one on another device (the launcher used to refuse it)."""
    rtt = ReqToTokenPool(4, MAX_LEN, "cpu")
    rtt.req_to_token = torch.zeros((4, MAX_LEN), dtype=torch.int32, device="meta")

    class MetaPool:  # no pool stages for the meta device; this one cannot stage at all
        device = torch.device("meta")

    with pytest.raises(CacheIndexError, match="'out_cache_loc' must be on meta"):
        write_cache_indices(
            req_to_token_pool=rtt,
            pool=MetaPool(),  # type: ignore[arg-type]
            backend="triton",
            **one_request(torch.arange(4), 2),
        )


def test_the_batched_prefix_check_refuses_exactly_what_the_per_tensor_check_refuses() -> None:
    """Catches a batched rule accepting a tensor the per-tensor rules refuse (or refusing a valid
    one), or naming another request or rule than the first broken one, for every kind of defect
    anywhere in a batch: dtype, device, rank, strides, length, odd address, not a tensor."""
    rng = random.Random(3)
    cpu = torch.device("cpu")
    buf = bytearray(64)

    def good(n: int) -> Any:
        return rng.choice([torch.arange(n + rng.randint(0, 2), dtype=d) for d in (torch.int32, torch.int64)])

    defects = [
        lambda n: torch.arange(n, dtype=torch.float32),
        lambda n: torch.arange(n, dtype=torch.int16),
        lambda n: torch.empty(n, dtype=torch.int32, device="meta"),
        lambda n: torch.arange(2 * n, dtype=torch.int32).view(2, n),
        lambda n: torch.arange(2 * n, dtype=torch.int64)[::2],
        lambda n: torch.arange(n - 1, dtype=torch.int32),
        lambda n: torch.frombuffer(buf, dtype=torch.int32, offset=1, count=n),
        lambda n: list(range(n)),
        lambda n: torch.arange(8, dtype=torch.int64)[::3][:1],  # one value, strided: contiguous, valid
    ]
    for trial in range(300):
        n = rng.randint(1, 40)
        needs = [rng.randint(1, 12) for _ in range(n)]
        tensors = [good(k) for k in needs]
        for _ in range(rng.choice([0, 1, 1, 2])):
            j = rng.randrange(n)
            kind = rng.randrange(len(defects))
            needs[j] = 1 if kind == len(defects) - 1 else max(needs[j], 2)
            tensors[j] = defects[kind](needs[j])
        rows = [3 * j for j in range(n)]  # the request index named is rows[j], not j
        want = None
        for t, i, need in zip(tensors, rows, needs, strict=True):
            try:
                prefix_check._check_one(i, t, need, -1, cpu)
            except CacheIndexError as error:
                want = str(error)
                break
        if want is None:
            got = prefix_check.tagged_addresses(tensors, rows, needs, cpu)
            assert got.tolist() == [t.data_ptr() | (t.dtype == torch.int64) for t in tensors], trial
        else:
            with pytest.raises(CacheIndexError) as info:
                prefix_check.tagged_addresses(tensors, rows, needs, cpu)
            assert str(info.value) == want, trial
