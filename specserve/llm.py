"""LLM: the offline facade. LLM(config or paths).generate(prompts, params)."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from specserve import config as config_mod
from specserve.config import EngineConfig
from specserve.engine import LLMEngine, RequestOutput
from specserve.sampling import SamplingParams


def _prompt(prompt):
    """A prompt as vLLM's LLM.generate takes it: text, token ids, or {"prompt": text} /
    {"prompt_token_ids": ids} (TextPrompt / TokensPrompt)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids'; got the keys {sorted(prompt)}")
    return prompt


class LLM:
    """
    >>> llm = LLM(target="path/to/hf_dir", device="cpu", dtype="float32")
    >>> outs = llm.generate(["text", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0.0))

    `LLM(config="configs/x.toml")` loads everything from a config file; keyword arguments
    override it (`target`, `draft` (a path, "ngram" or "none"), `dtype`, `device`, or any
    field name such as `block_size`, `num_blocks`, `spec_depth`). With neither, the
    embedded pair is used. Passing `target` alone serves that model without a draft.
    """

    def __init__(self, config: str | EngineConfig | None = None, progress: bool = True, **overrides):
        if isinstance(config, EngineConfig):
            cfg = config
        elif config is not None:
            cfg = config_mod.load(config)
        else:
            cfg = config_mod.default()
            if "target" in overrides and "draft" not in overrides and "draft_kind" not in overrides:
                overrides["draft_kind"] = "none"  # the embedded draft does not fit a foreign target
        self.config = config_mod.with_overrides(cfg, **overrides)
        self.engine = LLMEngine(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p).request_id)
        except Exception:
            for request_id in ids:   # all or nothing: no part of a refused batch stays queued
                self.engine.abort_request(request_id)
            if ids:
                self.engine.step()   # reports the aborted requests, and with that lets go of them
            raise
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not progress)
        self.engine.idle()   # the time since the last call is not the first step's cost
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:   # not one aborted from a refused batch
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]
