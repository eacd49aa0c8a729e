"""One request's state: its tokens, its blocks in the shared pool, how far each model has computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_target_passes: int = 0  # target forwards that produced tokens for this request
    num_drafts: int = 0  # speculative steps (a tree was proposed and verified)
    num_draft_tokens: int = 0  # tree nodes proposed
    num_accepted_tokens: int = 0  # tree nodes accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # [depth-1] -> times accepted
    num_preemptions: int = 0

    @property
    def mean_tokens_per_pass(self) -> float:
        """Tokens emitted per target pass (1 without speculation)."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


class Request:
    """Token layout: token_ids = prompt + output. The target's KV covers positions
    [0, num_computed_tokens); the draft's covers [0, num_draft_computed_tokens). In decode the
    last token (the 'pending' one) has no KV yet: num_computed_tokens == num_tokens - 1."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        detokenizer: Any = None,
        generator: Any = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.eos_token_ids = set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.detokenizer = detokenizer
        self.generator = generator  # torch.Generator for seeded requests, else None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None   # the stop token id or stop string that ended it
        self.error: str | None = None          # finish_reason "error": what went wrong
        # The shared pool.
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0
        self.num_draft_marked_blocks = 0   # leading blocks the pool knows hold the draft's KV
        # What the engine has already reported (for incremental outputs).
        self.num_reported_tokens = 0
        self.text = ""
        self.new_text = ""
        # sampling.Logprob per output token (params.logprobs), and per prompt token, None for
        # the first (params.prompt_logprobs); None where not asked for.
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.num_step_drafted = 0   # of the last step's tokens, the accepted draft tokens (they lead)
        self.stats = RequestStats(num_prompt_tokens=len(prompt_token_ids))
        if arrival_time is not None:
            self.stats.arrival_time = arrival_time

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_left(self) -> int:
        """Output tokens the request may still emit before max_tokens."""
        return self.params.max_tokens - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )
