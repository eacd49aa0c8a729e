"""Sampling parameters and the one target distribution (DESIGN.md §5).

`target_probs` turns logits into the distribution a request samples from, after its
temperature, top-k and top-p. Both the plain sampler (`sample`) and the speculative
verifier (tree_accept) call it, so a lossless verifier reproduces exactly what the sampler
would have drawn: speculation changes speed, never the output distribution.

Randomness: every sampled row consumes exactly one float64 uniform, drawn from the row's
own `torch.Generator` (seeded requests) or from torch's default CPU generator (None). A
seeded request therefore draws the same uniforms whatever else is in the batch, and with
the same logits it produces the same tokens.
"""

import math
from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor

from specserve.errors import InvalidRequestError

# Temperatures below this are greedy: dividing by them overflows, and argmax is the limit.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1].
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# Integers that become tensor entries stay far inside int64 (and int32 where kernels read them).
MAX_INT = 2**31 - 1
MAX_PENALTY = 2.0            # presence and frequency penalties, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_BIAS, MAX_BIASED_TOKENS = 100.0, 1024   # logit_bias: as OpenAI bounds a bias
# Alternatives returned per position with logprobs (OpenAI's top_logprobs allows 20).
MAX_LOGPROBS = 20
# A log-probability reported for a token the request's processors banned (-inf; JSON has no
# infinities), as vLLM reports it.
MIN_LOGPROB = -9999.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0                  # EOS, stop_token_ids and stop strings do not end the request before this
    # Each output token's log-probability and this many alternatives (None: none); see
    # token_logprobs for the convention.
    logprobs: int | None = None
    # The same for every prompt token after the first (None: none). A request that asks for
    # them is not served from the prefix cache, and may have max_tokens = 0 (OpenAI's echo).
    prompt_logprobs: int | None = None
    # Penalties (OpenAI's and vLLM's meanings): presence subtracts this from every token that
    # occurs in the output, frequency this times its count there; repetition divides a positive
    # logit (multiplies a negative one) of every token seen in the prompt or the output. Under
    # speculation a tree node's output is the output so far and its own path.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    skip_special_tokens: bool = True     # the output text leaves out special tokens (EOS, ...)
    include_stop_str_in_output: bool = False   # the stop string or stop token's text ends the text

    def __post_init__(self):
        if isinstance(self.stop, str):   # the OpenAI API allows a single string
            self.stop = [self.stop]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field, its value and what is allowed."""

        def bad(param: str, allowed: str):
            value = getattr(self, param)
            raise InvalidRequestError(f"{param} must be {allowed}, got {value!r}", param)

        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                bad(name, f"null or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                bad(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        r = self.repetition_penalty
        if not _is_number(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or len(bias) > MAX_BIASED_TOKENS or not all(
                _is_int(t) and 0 <= t <= MAX_INT and _is_number(b) and -MAX_BIAS <= b <= MAX_BIAS
                for t, b in bias.items())):
            bad("logit_bias", f"null or at most {MAX_BIASED_TOKENS} token ids mapped to numbers in "
                              f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        least = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or not least <= self.max_tokens <= MAX_INT:
            bad("max_tokens", f"an integer in [{least}, {MAX_INT}]" + ("" if least == 0 else
                                                                       " (0 only with prompt_logprobs)"))
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            bad("temperature", f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT:
            bad("top_k", f"an integer in [1, {MAX_INT}], or 0 or -1 for no top-k")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad("seed", f"null or an integer in [{MIN_SEED}, {MAX_SEED}]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(i) and 0 <= i <= MAX_INT
                                                                for i in self.stop_token_ids):
            bad("stop_token_ids", f"a list of token ids in [0, {MAX_INT}]")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "true or false")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one seeded request. Keep it on the CPU: `sample` draws there."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, built once and shared by sampler and verifier."""

    temperature: Tensor   # [N] float32, < GREEDY_TEMPERATURE = greedy
    top_k: Tensor         # [N] int64, 0 = off
    top_p: Tensor         # [N] float32, 1 = off
    all_greedy: bool      # lets the caller skip target_probs/sample for an all-greedy batch
    any_restricted: bool = True   # some sampled row has top-k or top-p (target_probs must sort)

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: str | torch.device = "cpu") -> "SamplingTensors":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(p.is_greedy for p in params),
            any_restricted=any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        )


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 any_restricted: bool | None = None) -> Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by top-k, top-p.

    logits [N, V]; temperature [N] float; top_k [N] int (<= 0 = off); top_p [N] float.
    any_restricted: whether some row has top-k or top-p (SamplingTensors knows it from the
    parameters; None: read off the tensors, a device sync on a GPU).
    Returns [N, V] probabilities (float32, float64 if logits are).

    - top-k keeps the logits at least the k-th highest (every token tied with the k-th, as
      transformers and vLLM keep them); top-p then keeps the smallest prefix of the
      remaining tokens (by descending probability) whose mass is >= p, so the top token is
      always kept. Ties rank by token id there (stable sort): the kept set is deterministic.
    - Greedy rows (T < 1e-5) get plain softmax(logits) with no top-k/top-p: callers take
      argmax for them, and the softmax keeps the rows finite.
    """
    if logits.dtype != torch.float64:
        logits = logits.float()
    vocab_size = logits.shape[1]
    greedy = temperature < GREEDY_TEMPERATURE                                   # [N]
    temperature = torch.where(greedy, 1.0, temperature.to(logits.dtype))       # [N]
    k = torch.where(greedy | (top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)   # [N]
    p = torch.where(greedy, 1.0, top_p.to(logits.dtype))                        # [N]
    scaled = logits / temperature[:, None]
    # Rows that keep every token need no sort, which costs far more than the softmax; a
    # speculative step runs this on every draft level and verified row.
    restricted = (k < vocab_size) | (p < 1.0)                                   # [N]
    if any_restricted is None:
        any_restricted = bool(restricted.any())
    probs = torch.softmax(scaled, dim=-1)
    if not any_restricted:
        return probs
    rows = restricted.nonzero().squeeze(1)
    if rows.numel():
        probs[rows] = _restricted_probs(scaled[rows], k[rows], p[rows])
    return probs


# Candidates the top-k/top-p rows are first cut from: the highest logits of each row, found by
# a partial selection (topk) rather than a sort of the whole vocabulary. A row whose kept set
# ends inside them (top-p mass reached, or top-k <= this) is done with them; the others, a flat
# distribution whose nucleus runs past them, sort the whole row.
TOP_CANDIDATES = 256


def _restricted_probs(scaled: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """target_probs of rows with top-k or top-p: scaled = logits / T [R, V]; k [R], p [R].

    A stable sort of every row over the vocabulary is what defines the kept set, and the
    fallback; most rows keep a few tokens, so they are first cut from the row's top
    candidates (see _candidate_probs), which gives the same set and probabilities."""
    vocab_size = scaled.shape[1]
    limited = k < vocab_size
    m = TOP_CANDIDATES
    if bool(limited.any()):
        m = max(m, int(k[limited].max()))
    if 4 * (m + 1) > vocab_size:   # a partial selection would not spare much: sort
        return _sorted_probs(scaled, k, p)
    probs, done = _candidate_probs(scaled, k, p, m)
    if not bool(done.all()):
        rest = (~done).nonzero().squeeze(1)
        probs[rest] = _sorted_probs(scaled[rest], k[rest], p[rest])
    return probs


def _candidate_probs(scaled: Tensor, k: Tensor, p: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """target_probs from each row's m highest logits, and which rows they are exact for.

    The candidates, ordered as the stable sort orders them (value descending, then token id),
    are a prefix of the sorted row wherever their values stay above the (m + 1)-th highest
    logit. A row is exact when its kept set cannot reach past them: with top-k, its k-th
    value (so every tie of it) above that logit; without, a nucleus ending before the last
    candidate, at a value above that logit (which of the tokens tied across the cut come
    first would otherwise be topk's arbitrary order)."""
    num_rows, vocab_size = scaled.shape
    values, ids = scaled.topk(m + 1, dim=-1, sorted=True)                   # [R, m + 1]
    outside = values[:, m]                                                  # the best not kept
    values, ids = values[:, :m], ids[:, :m]
    order = ids.argsort(dim=-1)                                             # ties: by token id
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    ranks = torch.arange(m, device=scaled.device)
    kth = values.gather(-1, (k.clamp(max=m) - 1)[:, None])                  # [R, 1]
    keep = values >= kth                          # top-k, with every token tied with the k-th
    # The softmax over the top-k set: its candidates (k <= m), or the whole row (no top-k;
    # k between m and the vocabulary never comes here: m is at least every such k).
    whole = k >= vocab_size
    log_norm = torch.where(whole, torch.logsumexp(scaled, dim=-1),
                           torch.logsumexp(values.masked_fill(~keep, -math.inf), dim=-1))
    cand_probs = torch.exp(values - log_norm[:, None]).masked_fill(~keep, 0.0)
    mass_before = cand_probs.cumsum(dim=-1) - cand_probs
    keep &= (mass_before < p[:, None]) | (p[:, None] >= 1.0) | (ranks[None, :] == 0)
    count = keep.sum(dim=-1)                                                # >= 1
    last = values.gather(-1, (count - 1)[:, None]).squeeze(1)
    # Exact when the kept set cannot reach past the candidates: a top-k set whose k-th value
    # (hence every tie of it) is above the best left out; without top-k, a nucleus ending
    # before the last candidate, above the best left out.
    done = torch.where(whole, (count < m) & (last > outside), kth.squeeze(1) > outside)
    cand_probs = cand_probs.masked_fill(~keep, 0.0)
    cand_probs = cand_probs / cand_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(scaled).scatter_(-1, ids, cand_probs)
    return probs, done


def _sorted_probs(scaled: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """_restricted_probs by a stable sort of each whole row."""
    vocab_size = scaled.shape[1]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=scaled.device)                       # [V]
    kth = sorted_logits.gather(-1, (k.clamp(min=1, max=vocab_size) - 1)[:, None])
    keep = sorted_logits >= kth                # [R, V] top-k, every token tied with the k-th kept
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                     # mass of higher ranks
    keep &= (mass_before < p[:, None]) | (p[:, None] >= 1.0) | (ranks[None, :] == 0)
    sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, sorted_ids, sorted_probs)


def _uniforms(generators: list[torch.Generator | None]) -> Tensor:
    """One U[0, 1) float64 per row, on the CPU: [N]. Rows with a generator draw only from it."""
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=g)[0]
    return u


def sample(
    logits: Tensor,          # [N, V]
    temperature: Tensor,     # [N] float
    top_k: Tensor,           # [N] int
    top_p: Tensor,           # [N] float
    generators: list[torch.Generator | None],   # N entries, CPU generators
    any_restricted: bool | None = None,          # see target_probs
    probs: Tensor | None = None,                 # target_probs of these rows, where the caller has them
) -> Tensor:
    """Next token per row: [N] int64. Greedy rows take argmax(logits); others draw from target_probs.

    Draws by inverse CDF: with u ~ U[0, 1) the token is the first whose cumulative
    probability exceeds u * total. Zero-probability tokens never are (their CDF step is
    empty), so top-k/top-p masks hold exactly.
    """
    assert len(generators) == logits.shape[0], f"{len(generators)} generators for {logits.shape[0]} rows"
    if probs is None:
        probs = target_probs(logits, temperature, top_k, top_p, any_restricted)  # [N, V]
    cdf = probs.double().cumsum(dim=-1)                                          # [N, V]
    u = _uniforms(generators).to(logits.device)                                  # [N]
    x = (u * cdf[:, -1]).unsqueeze(1)                                            # [N, 1]
    sampled = torch.searchsorted(cdf, x, right=True).squeeze(1)                  # [N]
    # u * total can round up to total itself: fall back to the last token with mass.
    sampled = torch.where(sampled >= logits.shape[1], cdf.argmax(dim=-1), sampled)
    greedy = temperature < GREEDY_TEMPERATURE
    return torch.where(greedy, logits.argmax(dim=-1), sampled).to(torch.int64)


Logprob = tuple[float, list[tuple[int, float]]]   # (the token's, [(alternative, its), ...] best first)


def token_logprobs(logits: Tensor, temperature: list[float], tokens: list[int], k: list[int]) -> list[Logprob]:
    """Row i's log-probability of tokens[i] and its k[i] most likely tokens, for logits [R, V].

    The convention (as OpenAI reports them): log_softmax(logits / T) with the request's
    temperature T (T = 0, greedy: the logits as they are), after penalties, logit_bias and
    min_tokens' masks, and before top-k and top-p, so the figures do not depend on how much of
    the distribution a request samples from. Computed in the logits' dtype (float32, float64 for a float64 model)."""
    if not tokens:
        return []
    dev = logits.device
    scale = torch.tensor([t if t >= GREEDY_TEMPERATURE else 1.0 for t in temperature], dtype=logits.dtype, device=dev)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=dev)[:, None]).squeeze(1).clamp(min=MIN_LOGPROB).tolist()
    top_k = max(k)
    if top_k:
        values, ids = logp.topk(top_k, dim=-1)
        values, ids = values.clamp(min=MIN_LOGPROB).tolist(), ids.tolist()
    return [(chosen[i], list(zip(ids[i][:k[i]], values[i][:k[i]])) if k[i] else []) for i in range(len(tokens))]


def penalize(logits: Tensor, rows: list[int], params: SamplingParams, output: list[int], prompt: list[int],
             paths: list[list[int]]) -> None:
    """In place: apply one request's logit_bias and penalties to its rows of logits [N, V];
    row rows[j] follows the output tokens `output` + paths[j] after `prompt`. Dense over the
    vocabulary for this request's rows only, as vLLM's penalties are dense over a batch."""
    dev, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    x = logits[rows]                                                                   # [n, V]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=dev)
        x[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=dtype, device=dev)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(device=dev, dtype=dtype).expand(len(rows), vocab).clone()    # [n, V]
    pairs = [(j, t) for j, path in enumerate(paths) for t in path]
    if pairs:
        r, t = torch.tensor(pairs, device=dev).unbind(1)
        counts.index_put_((r, t), torch.ones(len(pairs), dtype=dtype, device=dev), accumulate=True)
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor(prompt, device=dev)] = True
        r = params.repetition_penalty
        x = torch.where((counts > 0) | in_prompt, torch.where(x > 0, x / r, x * r), x)
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(dtype)
    logits[rows] = x


def mask_tokens(logits: Tensor, rows: list[int], banned: list[list[int]]) -> None:
    """In place: row rows[i] of logits [N, V] may not produce any id in banned[i] (-inf).
    Used for min_tokens: EOS and stop_token_ids cannot be generated before it is reached,
    as in vLLM and transformers' min_new_tokens; the sampler and the verifier both apply it."""
    pairs = [(row, tok) for row, ids in zip(rows, banned) for tok in ids if 0 <= tok < logits.shape[-1]]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")
