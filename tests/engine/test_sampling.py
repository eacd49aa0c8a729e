"""Sampling: the target distribution's masks, the sampler's fidelity to it, seeds, validation."""

import math

import msgspec
import pytest
import torch

from specserve.errors import InvalidRequestError
from specserve.sampling import SamplingParams, SamplingTensors, make_generator, sample, target_probs


def rows(n, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.int64),
        torch.full((n,), float(top_p)),
    )


# Probabilities 0.4, 0.3, 0.2, 0.1 at token ids 2, 0, 3, 1 (so sorting matters).
CRAFTED_P = torch.tensor([0.3, 0.1, 0.4, 0.2])
CRAFTED_LOGITS = CRAFTED_P.log().unsqueeze(0) + 5.0     # a shift must not matter


def test_greedy_is_argmax_and_ignores_filters():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    t, k, p = rows(6, temperature=0.0, top_k=3, top_p=0.2)
    gens = [None, make_generator(1), None, make_generator(2), None, None]
    assert torch.equal(sample(logits, t, k, p, gens), logits.argmax(-1))
    # Tiny temperatures count as greedy too.
    t = torch.full((6,), 1e-6)
    assert torch.equal(sample(logits, t, k, p, gens), logits.argmax(-1))
    # Greedy rows of target_probs are the plain softmax.
    torch.testing.assert_close(target_probs(logits, t, k, p), torch.softmax(logits, -1))


def test_plain_softmax_with_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = target_probs(logits, *rows(1, temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize(
    "top_k, top_p, expected",
    [
        (0, 1.0, [0.3, 0.1, 0.4, 0.2]),
        (-1, 1.0, [0.3, 0.1, 0.4, 0.2]),
        (1, 1.0, [0.0, 0.0, 1.0, 0.0]),
        (2, 1.0, [3 / 7, 0.0, 4 / 7, 0.0]),
        (3, 1.0, [3 / 9, 0.0, 4 / 9, 2 / 9]),
        (10, 1.0, [0.3, 0.1, 0.4, 0.2]),            # k > V is off
        (0, 0.1, [0.0, 0.0, 1.0, 0.0]),             # the top token is always kept
        (0, 0.65, [3 / 7, 0.0, 4 / 7, 0.0]),        # 0.4 < 0.65 <= 0.7
        (0, 0.75, [3 / 9, 0.0, 4 / 9, 2 / 9]),      # 0.7 < 0.75 <= 0.9
        (0, 0.95, [0.3, 0.1, 0.4, 0.2]),
        (3, 0.5, [3 / 7, 0.0, 4 / 7, 0.0]),         # top-p applies after top-k: 4/9 < 0.5
    ],
)
def test_top_k_top_p_mask_exactly(top_k, top_p, expected):
    probs = target_probs(CRAFTED_LOGITS, *rows(1, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(probs[0], torch.tensor(expected))


def test_rows_use_their_own_parameters():
    logits = CRAFTED_LOGITS.expand(3, 4)
    t = torch.tensor([1.0, 1.0, 0.0])
    k = torch.tensor([2, 0, 1])
    p = torch.tensor([1.0, 0.65, 0.1])
    probs = target_probs(logits, t, k, p)
    torch.testing.assert_close(probs[0], torch.tensor([3 / 7, 0.0, 4 / 7, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([3 / 7, 0.0, 4 / 7, 0.0]))
    torch.testing.assert_close(probs[2], CRAFTED_P)      # greedy row: plain softmax


def test_top_k_keeps_ties_with_the_kth_and_top_p_breaks_ties_by_lowest_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    probs = target_probs(logits, *rows(1, top_k=2))        # as transformers' TopKLogitsWarper
    assert probs[0].nonzero().flatten().tolist() == [1, 2, 4]
    torch.testing.assert_close(probs[0, [1, 2, 4]], torch.full((3,), 1 / 3))
    probs = target_probs(logits, *rows(1, top_p=0.3))     # each tied token has mass ~0.32
    assert probs[0].nonzero().flatten().tolist() == [1]


def test_float64_logits_stay_float64():
    probs = target_probs(CRAFTED_LOGITS.double(), *rows(1, top_k=2))
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs[0], torch.tensor([3 / 7, 0.0, 4 / 7, 0.0], dtype=torch.float64))


def test_sample_follows_target_probs():
    torch.manual_seed(1234)
    vocab_size, num_draws = 12, 40_000
    logits = torch.randn(1, vocab_size) * 1.5
    t, k, p = rows(1, temperature=0.8, top_k=8, top_p=0.9)
    probs = target_probs(logits, t, k, p)[0].double()
    support = probs > 0
    assert 2 <= int(support.sum()) <= 8
    drawn = sample(logits.expand(num_draws, vocab_size), *rows(num_draws, 0.8, 8, 0.9), [None] * num_draws)
    counts = torch.bincount(drawn, minlength=vocab_size).double()
    assert counts[~support].sum() == 0, "sampled a token that top-k/top-p removed"
    freq = counts / num_draws
    assert 0.5 * (freq - probs).abs().sum() < 0.015          # total variation distance
    expected = probs[support] * num_draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    # Critical value of chi-square with <= 7 degrees of freedom at p = 0.001 is <= 24.3.
    assert chi2 < 24.3, chi2


def test_seeded_row_independent_of_batch_mates():
    torch.manual_seed(0)
    vocab_size, steps = 64, 30
    row = torch.randn(vocab_size)

    def stream(seed, make_batch):
        g = make_generator(seed)
        tokens = []
        for step in range(steps):
            batch, index, gens = make_batch(step, g)
            tokens.append(int(sample(batch, *rows(len(gens), 1.0), gens)[index]))
        return tokens

    def alone(step, g):
        return row.unsqueeze(0), 0, [g]

    def crowded(step, g):
        # Batch mates change every step: unseeded rows, other seeds, greedy-looking rows.
        n = 2 + step % 3
        mates = torch.randn(n, vocab_size)
        batch = torch.cat([mates[:1], row.unsqueeze(0), mates[1:]])
        gens = [None, g] + [make_generator(step) if i % 2 else None for i in range(n - 1)]
        return batch, 1, gens

    base = stream(42, alone)
    assert stream(42, crowded) == base
    assert stream(43, alone) != base
    assert len(set(base)) > 5                  # the stream is really random, not constant


def test_sampling_tensors_from_params():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9),
        SamplingParams(top_k=5),
    ]
    st = SamplingTensors.from_params(params, "cpu")
    torch.testing.assert_close(st.temperature, torch.tensor([0.0, 0.7, 1.0]))
    assert st.top_k.tolist() == [0, 0, 5] and st.top_k.dtype == torch.int64
    torch.testing.assert_close(st.top_p, torch.tensor([1.0, 0.9, 1.0]))
    assert not st.all_greedy
    assert SamplingTensors.from_params(params[:1], "cpu").all_greedy
    # Whether target_probs must sort: a sampled row with top-k or top-p (a greedy row's are
    # ignored), read from the parameters so that a GPU need not be asked.
    assert st.any_restricted
    assert not SamplingTensors.from_params([params[0], SamplingParams(temperature=0.7)], "cpu").any_restricted
    assert not SamplingTensors.from_params([SamplingParams(temperature=0.0, top_k=3)], "cpu").any_restricted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_that_keep_every_token_skip_the_sort_and_match_it(dtype):
    """Unrestricted rows take softmax(logits / T) directly; restricted rows in the same batch
    still go through the sort; both equal what the sorted path gives every row."""
    from specserve.sampling import _sorted_probs
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 4096, generator=g) * 3).to(dtype)
    t = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.5, 1.0])
    k = torch.tensor([0, 0, 7, 50, 0, 4096])
    p = torch.tensor([1.0, 1.0, 0.2, 1.0, 0.9, 1.0])
    probs = target_probs(logits, t, k, p)
    assert probs.dtype == dtype
    scaled = logits / torch.where(t < 1e-5, 1.0, t).to(dtype)[:, None]
    everything = torch.full((6,), 4096)
    reference = _sorted_probs(scaled, torch.where((k <= 0) | (t < 1e-5), everything, k),
                              torch.where(t < 1e-5, 1.0, p).to(dtype))
    torch.testing.assert_close(probs, reference)
    assert (probs[3] > 0).sum() == 50 and (probs[0] > 0).all()
    # The hint gives the same, with or without restricted rows.
    torch.testing.assert_close(target_probs(logits, t, k, p, any_restricted=True), probs)
    free = [0, 1, 2, 5]
    torch.testing.assert_close(target_probs(logits[free], t[free], torch.zeros(4, dtype=torch.long),
                                            torch.ones(4), any_restricted=False), reference[free])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_candidates_give_what_the_sort_of_the_whole_row_gives(dtype):
    """Top-k/top-p rows are cut from their highest logits (a partial selection) where the kept
    set ends inside them, and sort the whole row where it does not: either way the set and
    the probabilities are the sorted path's, ties across the cut included."""
    from specserve.sampling import TOP_CANDIDATES, _candidate_probs, _restricted_probs, _sorted_probs
    g = torch.Generator().manual_seed(11)
    num_rows, vocab_size = 240, 4096
    spread = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(num_rows // 4)[:, None]   # flat .. peaked
    logits = (torch.randn(num_rows, vocab_size, generator=g) * spread).to(dtype)
    logits[::3] = torch.round(logits[::3] * 2) / 2          # many ties, some across the cut
    logits[1::5, : vocab_size // 2] = -math.inf              # banned tokens (min_tokens)
    ks = torch.tensor([vocab_size, 1, 5, TOP_CANDIDATES, 40, 200])
    ps = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 0.8])
    k = ks[torch.arange(num_rows) % len(ks)]
    p = ps[torch.arange(num_rows) % len(ps)].to(dtype)
    reference = _sorted_probs(logits, k, p)
    got = _restricted_probs(logits, k, p)
    assert torch.equal(got > 0, reference > 0)
    torch.testing.assert_close(got, reference)
    # Both paths ran: rows exact from the candidates, and rows the sort had to finish (a flat
    # row whose nucleus runs past them, or a tie across the cut).
    _, done = _candidate_probs(logits, k, p, max(TOP_CANDIDATES, int(k[k < vocab_size].max())))
    assert 0.3 < done.double().mean() < 0.95
    tied = torch.tensor([[5.0] * 70 + [0.0] * 4026], dtype=dtype)   # 4026 tied across the cut
    one = torch.tensor([TOP_CANDIDATES])
    _, done = _candidate_probs(tied, one, torch.ones(1, dtype=dtype), TOP_CANDIDATES)
    assert not done.any()
    kept = _restricted_probs(tied, one, torch.ones(1, dtype=dtype))[0].nonzero().flatten()
    assert kept.tolist() == list(range(4096))     # the k-th is 0.0: every token tied with it stays


def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and p.min_tokens == 0
    p.stop.append("x")
    assert SamplingParams().stop == []        # defaults are not shared between instances
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert msgspec.convert({"max_tokens": 3, "stop": ["a"]}, SamplingParams).max_tokens == 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", 1000.0),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("seed", 2**70),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("min_tokens", -1),
        ("min_tokens", 17),
    ],
)
def test_validation_names_field_and_value(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    message = str(info.value)
    assert message.startswith(field) and repr(value) in message


def test_validate_after_mutation():
    p = SamplingParams(max_tokens=4, min_tokens=2)
    p.max_tokens = 1
    with pytest.raises(InvalidRequestError, match=r"min_tokens .*max_tokens=1.*got 2"):
        p.validate()
