"""The sparse logit-bias kernel (interpreted on CPU) against its torch reference and a dense add."""

from __future__ import annotations

import os
import random

import pytest
import torch

from sampling import BatchMismatchError, apply_logit_bias_reference, launch_apply_logit_bias
from sampling.bias_kernel import BLOCK

BF16_STEP = 2.0**-7  # one bfloat16 step, relative (8 significant bits)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU on this machine; tests/gpu checks the kernel on the device",
)


def entries(rng: random.Random, bs: int, vocab: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = sorted(rng.sample(range(bs * vocab), n))  # unique (row, token) pairs, as a batch's are
    rows = torch.tensor([p // vocab for p in pairs], dtype=torch.int32)
    tokens = torch.tensor([p % vocab for p in pairs], dtype=torch.int32)
    values = torch.tensor([rng.uniform(-10, 10) for _ in pairs], dtype=torch.float32)
    return rows, tokens, values


@needs_interpreter
@pytest.mark.parametrize(("bs", "vocab", "n"), [(1, 7, 1), (3, 999, 5), (5, 300, BLOCK + 1), (2, 4097, 2 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_and_a_dense_add(bs: int, vocab: int, n: int, dtype: torch.dtype) -> None:
    """Catches an entry added to the wrong row or column, a block's tail entries skipped, or a
    bfloat16 row read at float32 width."""
    rng = random.Random(bs * vocab + n)
    rows, tokens, values = entries(rng, bs, vocab, n)
    logits = (torch.randn(bs, vocab, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    dense = torch.zeros(bs, vocab)
    dense[rows.long(), tokens.long()] = values
    want = (logits.float() + dense).to(dtype)
    got = launch_apply_logit_bias(logits.clone(), rows, tokens, values)
    ref = apply_logit_bias_reference(logits.clone(), rows, tokens, values)
    assert torch.equal(ref, want)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest, and
        # tests/gpu checks it bit for bit): allow one bfloat16 step here, and only on biased cells.
        assert torch.equal(got[dense == 0], want[dense == 0])
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=0)


@needs_interpreter
def test_kernel_honours_a_padded_row_stride() -> None:
    """Catches a kernel that assumes rows are vocab apart (sglang's logits may be a padded view)."""
    wide = torch.zeros(3, 16)
    logits = wide[:, :10]
    rows, tokens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([9, 0], dtype=torch.int32)
    launch_apply_logit_bias(logits, rows, tokens, torch.tensor([1.5, -2.0]))
    assert wide[0, 9].item() == 1.5 and wide[2, 0].item() == -2.0 and wide.abs().sum().item() == 3.5


def test_launcher_refuses_bad_inputs_naming_them() -> None:
    """Catches a launch with entries of the wrong dtype, length or device (the kernel cannot raise)."""
    logits = torch.zeros(2, 5)
    rows, tokens, values = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), torch.ones(1)
    cases = [
        ((logits.long(), rows, tokens, values), "'logits' must be float32/float16/bfloat16"),
        ((logits.t(), rows, tokens, values), "unit inner stride"),
        ((torch.zeros(1, 5).expand(2, 5), rows, tokens, values), "'logits' rows must not overlap"),
        ((logits, rows.long(), tokens, values), "'rows' must be contiguous torch.int32"),
        (
            (logits, rows, torch.tensor([1, 2], dtype=torch.int32), values),
            "'tokens' must be contiguous torch.int32 [n] with n = len(rows) = 1",
        ),
        ((logits, rows, tokens, values.double()), "'values' must be contiguous torch.float32"),
        ((logits, rows, tokens, torch.ones(1, device="meta")), "'values' must be on the logits' device cpu"),
    ]
    for args, message in cases:
        with pytest.raises(BatchMismatchError) as info:
            launch_apply_logit_bias(*args)
        assert message in str(info.value)
    assert logits.abs().sum().item() == 0
