"""The vllm+graph mode's gather kernel (engine.vllm_gather): it writes what its torch reference writes,
moves each gathered request's position on by one, leaves rows past the batch alone, and refuses
outputs it cannot write."""

from __future__ import annotations

import os

import pytest
import torch

from pinpool.bench.engine.vllm_gather import SAMPLING_NAMES, gather_inputs, gather_inputs_torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without CUDA)",
)
DTYPES = {"temperature": torch.float32, "top_p": torch.float32, "top_k": torch.int32, "min_p": torch.float32}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tables(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        name: (torch.rand(rows, generator=gen) * 100).to(DTYPES.get(name, torch.int64)).to(DEV)
        for name in SAMPLING_NAMES
    }


def _out(width: int) -> dict[str, torch.Tensor]:
    """Outputs prefilled with -7: rows past the batch must keep it."""
    names = {"rows": torch.int64, "positions": torch.int64, **{n: DTYPES.get(n, torch.int64) for n in SAMPLING_NAMES}}
    return {name: torch.full((width,), -7, dtype=dtype, device=DEV) for name, dtype in names.items()}


@pytest.mark.parametrize("bs", [1, 7, 300])
def test_kernel_matches_the_reference_and_moves_positions_on(bs: int) -> None:
    """Catches a gather that reads the wrong table row, writes past the batch, or skips the +1
    that makes the next step's positions (the next step would replay this one's)."""
    gen = torch.Generator().manual_seed(bs)
    rows = 512
    idx = torch.randperm(rows, generator=gen)[:bs].to(DEV)
    positions = torch.randint(0, 100, (rows,), generator=gen).to(DEV)
    tables = _tables(rows, gen)
    got, want = _out(bs + 5), _out(bs + 5)
    pos_got, pos_want = positions.clone(), positions.clone()
    gather_inputs(idx, pos_got, tables, got)
    gather_inputs_torch(idx, pos_want, tables, want)
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert (got[name][bs:] == -7).all(), name
    assert torch.equal(pos_got, pos_want)
    assert torch.equal(pos_got[idx], positions[idx] + 1)


def test_bad_outputs_are_refused_before_launch() -> None:
    """Catches a launch into a strided view or a dtype the kernel would reinterpret."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.arange(4, device=DEV)
    positions = torch.zeros(8, dtype=torch.int64, device=DEV)
    out = _out(4)
    out["rows"] = torch.zeros(8, dtype=torch.int64, device=DEV)[::2]
    with pytest.raises(ValueError, match=r"out\['rows'\] must be contiguous"):
        gather_inputs(idx, positions, _tables(8, gen), out)
    tables = _tables(8, gen)
    tables["top_k"] = tables["top_k"].long()
    with pytest.raises(TypeError, match=r"table 'top_k' is torch\.int64"):
        gather_inputs(idx, positions, tables, _out(4))
