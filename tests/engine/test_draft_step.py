"""The per-step shortcuts of a draft forward change no result.

- RoPE with widened tables ([cos, cos], [-sin, sin] and a roll) == the rotate_half formula,
  bit for bit, in every dtype.
- ModelRunner.forward packs its inputs into two buffers and slices (rather than gathers) a
  run of logit rows: the logits equal a forward of each sequence on its own, whatever the
  order of the logit rows and however long each block table is.
"""

from __future__ import annotations

import pytest
import torch

from specserve.model.llama import apply_rope, rope_full_tables
from specserve.model.loader import load_model
from specserve.runner import ForwardInput, ModelRunner, slots_for
from tests.engine.test_model import prompt_ids

BLOCK_SIZE = 4
NUM_BLOCKS = 40


def rotate_half_rope(x, cos, sin):  # x [T, H, D]; cos, sin [T, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 6, 32), (37, 12, 64)])
def test_rope_tables_are_bit_exact(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos = torch.randn(shape[0], shape[2] // 2, generator=g).to(table_dtype)
    sin = torch.randn(shape[0], shape[2] // 2, generator=g).to(table_dtype)
    expected = rotate_half_rope(x, cos, sin)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    assert torch.equal(apply_rope(x, *rope_full_tables(cos, sin, dtype)), expected)


def _add_seq(inp: ForwardInput, ids, start, table, logit_rows):
    n = len(ids) - start
    inp.add(ids[start:], list(range(start, len(ids))), slots_for(table, BLOCK_SIZE, start, n), table, len(ids),
            logit_rows=logit_rows)


def test_batched_forward_with_any_logit_rows_matches_one_at_a_time(tiny_llama):
    model, args = load_model(tiny_llama, dtype=torch.float64, progress=False)
    runner = ModelRunner(model, args, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    short, long = prompt_ids(5, args.vocab_size, seed=1), prompt_ids(23, args.vocab_size, seed=2)
    short_table, long_table = [7, 3], [0, 9, 4, 12, 1, 30]  # different lengths: padded in the int32 buffer
    # Each alone: the prompt minus its last 2 tokens, then those 2 with logits for both.
    expected = []
    for ids, table in ((short, short_table), (long, long_table)):
        inp = ForwardInput()
        _add_seq(inp, ids[:-2], 0, table, [])
        assert runner.forward(inp) is None
        inp = ForwardInput()
        _add_seq(inp, ids, len(ids) - 2, table, [0, 1])
        expected.append(runner.forward(inp))
    # Both in one forward (the same KV is rewritten with the same values), logit rows out of order.
    inp = ForwardInput()
    _add_seq(inp, long, len(long) - 2, long_table, [1])
    _add_seq(inp, short, len(short) - 2, short_table, [1, 0])
    logits = runner.forward(inp)
    torch.testing.assert_close(logits, torch.stack([expected[1][1], expected[0][1], expected[0][0]]))
    # A run of rows is sliced, not gathered: the same values.
    inp = ForwardInput()
    _add_seq(inp, long, len(long) - 2, long_table, [0, 1])
    _add_seq(inp, short, len(short) - 2, short_table, [0])
    torch.testing.assert_close(runner.forward(inp), torch.stack([expected[1][0], expected[1][1], expected[0][0]]))
