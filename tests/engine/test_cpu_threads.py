"""CPU intra-op threads per forward (runner.CpuThreads).

Forwards of fewer than 5 rows run on one thread, the others on `[cpu] threads`;
the process's thread count is the same after every forward as before it (so code sharing
the process, such as a benchmark's transformers baseline, keeps its setting); and the
output does not depend on the threads (greedy speculation still equals plain decoding).
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig, with_overrides
from specserve.errors import ConfigError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 13, 21, 4, 6], [17, 3, 3, 9]]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield 2
    torch.set_num_threads(before)


def record_threads(runner, seen: list[tuple[int, int]]) -> None:
    """Record (rows, torch threads) inside every forward of `runner`'s model."""
    model_forward = runner.model.forward

    def forward(input_ids, *args, **kw):
        seen.append((input_ids.shape[0], torch.get_num_threads()))
        return model_forward(input_ids, *args, **kw)

    runner.model.forward = forward


def test_few_rows_run_on_one_thread(tiny_llama, two_threads):
    llm = LLM(target=str(tiny_llama), draft=str(tiny_llama), dtype="float64", device="cpu", progress=False,
              num_blocks=64, block_size=4, spec_mode="static", spec_depth=5, cpu_threads=two_threads)
    seen_target, seen_draft = [], []
    record_threads(llm.engine.target, seen_target)
    record_threads(llm.engine.draft, seen_draft)
    torch.set_num_threads(2)
    llm.generate(PROMPTS[:1], GREEDY)
    assert torch.get_num_threads() == 2  # restored after every forward
    seen = seen_target + seen_draft
    assert {t for rows, t in seen if rows < 5} == {1}
    assert {t for rows, t in seen if rows >= 5} == {2}
    # Both kinds occurred: the prompt (11 rows) and depth-5 verify passes (6 rows) on two
    # threads, draft levels (1-2 rows) on one.
    assert any(rows >= 5 for rows, _ in seen_target) and any(rows < 5 for rows, _ in seen_draft)


def test_threads_do_not_change_greedy_output(tiny_llama, two_threads):
    common = dict(target=str(tiny_llama), dtype="float64", device="cpu", progress=False, num_blocks=64, block_size=4)
    ref = [o.token_ids for o in LLM(draft="none", **common).generate(PROMPTS, GREEDY)]
    spec = LLM(draft=str(tiny_llama), spec_mode="static", spec_depth=4, cpu_threads=two_threads, **common)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == ref


def test_setting_is_validated():
    assert with_overrides(EngineConfig(), cpu_threads=3).cpu.threads == 3
    with pytest.raises(ConfigError, match="cpu.threads"):
        with_overrides(EngineConfig(), cpu_threads=0)
