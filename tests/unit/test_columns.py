"""The column block's row edits (``sampling.columns``): ``select_parts`` and ``concat_parts``."""

from __future__ import annotations

import pytest
import torch

from sampling import columns


def _inside(words: torch.Tensor, offset: int) -> torch.Tensor:
    """``words`` copied into a larger buffer at ``offset`` (int32 words): a block that starts
    inside its storage, as a ring slot's does."""
    buf = torch.full((offset + words.numel() + 6,), -7, dtype=torch.int32)
    buf[offset : offset + words.numel()] = words
    return buf[offset : offset + words.numel()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A column as 32-bit words: random bits read as float32 include NaNs, which never compare equal."""
    return t.contiguous().view(torch.int32)


def _random_block(bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (columns.COLUMN_WORDS * bs,), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("offset", [0, 2, 1026])
@pytest.mark.parametrize("bs", [1, 5, 999])
def test_select_takes_each_columns_rows_from_a_block_inside_its_storage(bs: int, offset: int) -> None:
    """Catches a gather that reads from the storage's start instead of the block's (a ring block
    starts inside its slot), or mixes the seed words of two rows."""
    block = _inside(_random_block(bs, bs), offset)
    keep = torch.tensor([bs - 1, 0, *range(0, bs, 3), bs - 1], dtype=torch.int64)
    out = columns.select_parts(block, columns.parts_and_views(block, bs)[0], bs, keep)[0]
    assert out.shape == (columns.COLUMN_WORDS * len(keep),)
    for got, src in zip(columns.views(out, len(keep)), columns.views(block, bs), strict=True):
        assert torch.equal(_bits(got), _bits(src[keep]))


@pytest.mark.parametrize(("a_bs", "b_bs"), [(1, 1), (7, 4), (999, 0), (0, 3)])
def test_concat_appends_each_column_from_blocks_inside_their_storage(a_bs: int, b_bs: int) -> None:
    """Catches a join that reads a block from its storage's start, or interleaves the seed words wrongly."""
    a = _inside(_random_block(a_bs, 1), 10)
    b = _inside(_random_block(b_bs, 2), 4)
    out = columns.concat_parts(columns.parts_and_views(a, a_bs)[0], columns.parts_and_views(b, b_bs)[0])
    for got, x, y in zip(columns.views(out, a_bs + b_bs), columns.views(a, a_bs), columns.views(b, b_bs), strict=True):
        assert torch.equal(_bits(got), _bits(torch.cat((x, y))))


@pytest.mark.parametrize("offset", [0, 2, 1026])
@pytest.mark.parametrize("bs", [1, 5, 999])
def test_select_parts_hands_back_its_new_blocks_pieces_and_views(bs: int, offset: int) -> None:
    """Catches the gather (filter_batch's) returning pieces and views that are not those of its new block."""
    block = _inside(_random_block(bs, bs), offset)
    parts = columns.parts_and_views(block, bs)[0]
    keep = torch.tensor([bs - 1, 0, *range(0, bs, 3), bs - 1], dtype=torch.int64)
    out, new_parts, new_views = columns.select_parts(block, parts, bs, keep)
    k = len(keep)
    want_parts, want_views = columns.parts_and_views(out, k)
    for got, want in zip((*new_parts, *new_views), (*want_parts, *want_views), strict=True):
        assert (got.data_ptr(), got.shape, got.dtype, got.stride()) == (
            want.data_ptr(),
            want.shape,
            want.dtype,
            want.stride(),
        )
