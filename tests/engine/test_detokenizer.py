"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained here.

The vocabulary is small, so CJK characters and emoji are split across several byte tokens:
exactly the case where a naive streamer emits broken characters.
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specserve.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a small test of streaming text.",
    "你好世界，今天天气很好。我们一起去公园吧！",
    "Emoji time 😀🎉👍🏽 and flags 🇯🇵🇫🇷 with café naïve façade.",
    "The quick brown fox jumps over the lazy dog. Stop here please.",
    "数据科学和机器学习 😀 are fun; value: 42 ## done",
]

TEXT = "Hello 世界! Emoji 😀🎉 then 👍🏽 and 🇯🇵, café; 你好 the lazy dog. Stop here please 🎉 end"


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def encode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def stream(detok, ids, chunk_sizes):
    """Append ids in chunks; return the deltas and the (chunk index, stop_index) of a stop."""
    deltas, pos = [], 0
    for n, size in enumerate(chunk_sizes):
        delta, stop_index = detok.append(ids[pos : pos + size])
        deltas.append(delta)
        if stop_index is not None:
            return deltas, (n, pos + stop_index)
        pos += size
        if pos >= len(ids):
            break
    return deltas, None


def first_stop_token(tokenizer, ids, stops):
    """Brute force: the first token after which the decoded text contains a stop string."""
    for i in range(len(ids)):
        if any(s in tokenizer.decode(ids[: i + 1]) for s in stops):
            return i
    return None


def test_vocabulary_really_splits_characters(tokenizer):
    ids = encode(tokenizer, TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_token_by_token_equals_full_decode(tokenizer):
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, TEXT) + [eos]
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Prompt: 你好"))
    deltas, stop = stream(detok, ids, [1] * len(ids))
    assert stop is None
    for delta in deltas:
        assert "\ufffd" not in delta
    out = "".join(deltas) + detok.flush()
    assert out == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert detok.text == TEXT
    # Characters split over tokens appear only once complete: some token emitted nothing.
    assert "" in deltas


@pytest.mark.parametrize("seed", range(6))
def test_random_chunks_equal_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = encode(tokenizer, TEXT)
    chunks = [rng.randint(1, 6) for _ in range(len(ids))]
    detok = IncrementalDetokenizer(tokenizer, [], stop=["never appears"])
    deltas, stop = stream(detok, ids, chunks)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == TEXT


def test_split_emoji_is_held_until_complete(tokenizer):
    ids = encode(tokenizer, "ok 🇯🇵")
    # Find a split point inside the flag: the prefix decodes to a broken character.
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    first, _ = detok.append(ids[:cut])
    assert first == tokenizer.decode(ids[:cut]).rstrip("\ufffd")      # complete characters only
    second, _ = detok.append(ids[cut:])
    assert first + second == "ok 🇯🇵" and "\ufffd" not in second
    assert detok.flush() == ""


def test_flush_emits_trailing_incomplete_bytes(tokenizer):
    ids = encode(tokenizer, "a 你")
    cut = len(ids) - 1
    assert tokenizer.decode(ids[:cut]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [])
    delta, _ = detok.append(ids[:cut])
    assert "\ufffd" not in delta
    # The request ended mid-character: flush gives what tokenizer.decode would.
    assert delta + detok.flush() == tokenizer.decode(ids[:cut])


def test_stop_string_spanning_two_appends(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. Stop here please."
    stop = "lazy dog"
    ids = encode(tokenizer, text)
    # Cut so that "lazy" ends the first append and " dog" begins the second.
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith("lazy"))
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    first, stop_index = detok.append(ids[:cut])
    assert stop_index is None
    assert first == "The quick brown fox jumps over the "      # "lazy" is held back
    second, stop_index = detok.append(ids[cut:])
    assert second == ""
    assert stop_index == first_stop_token(tokenizer, ids, [stop]) - cut
    assert detok.text == "The quick brown fox jumps over the "
    assert detok.stopped and detok.stop_string == stop
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.append(ids[-1:])


def test_stop_string_never_partially_streamed(tokenizer):
    text = "value: 42 ## done and more"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["## done"])
    deltas, stop = stream(detok, ids, [1] * len(ids))
    assert stop is not None and stop[1] == first_stop_token(tokenizer, ids, ["## done"])
    assert "".join(deltas) == "value: 42 "
    assert all("#" not in d for d in deltas)


def test_held_prefix_released_when_stop_does_not_follow(tokenizer):
    text = "value: 42 # done"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["##"])
    out = "".join(detok.append([i])[0] for i in ids) + detok.flush()
    assert out == text and not detok.stopped
    # A held suffix at the very end comes back from flush.
    ids = encode(tokenizer, "value: 42 #")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["##"])
    delta, _ = detok.append(ids)
    assert delta == "value: 42 " and detok.flush() == "#"


def test_stop_in_middle_of_multi_token_append(tokenizer):
    text = "Hello world, this is a small test of streaming text."
    ids = encode(tokenizer, text)
    stop = "small"
    expected = first_stop_token(tokenizer, ids, [stop])
    assert 0 < expected < len(ids) - 1                    # really in the middle
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"), stop=[stop])
    head, stop_index = detok.append(ids[:3])
    assert stop_index is None
    delta, stop_index = detok.append(ids[3:])
    assert stop_index == expected - 3
    assert head + delta == "Hello world, this is a "


@pytest.mark.parametrize("stops", [["dog", "lazy", "zy d"], ["zy d", "lazy", "dog"]])
def test_multiple_stop_strings_earliest_wins(tokenizer, stops):
    text = "The quick brown fox jumps over the lazy dog. Stop here please."
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    delta, stop_index = detok.append(ids)
    assert delta == "The quick brown fox jumps over the "
    assert detok.stop_string == "lazy"
    assert stop_index == first_stop_token(tokenizer, ids, stops)


def test_earliest_start_wins_when_two_stops_complete_together(tokenizer):
    ids = encode(tokenizer, "Stop here please.")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["here please", "p here"])
    delta, stop_index = detok.append(ids)
    assert delta == "Sto" and detok.stop_string == "p here"
    assert stop_index == first_stop_token(tokenizer, ids, ["p here"])


def test_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hello") + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(detok.append([i])[0] for i in ids) + detok.flush() == "Hello<eos>"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.append(ids)[0] + detok.flush() == "Hello"


def test_decodes_a_bounded_window(tokenizer):
    ids = encode(tokenizer, TEXT * 8)
    seen = []

    class Recording:
        def decode(self, window, **kwargs):
            seen.append(len(window))
            return tokenizer.decode(window, **kwargs)

    detok = IncrementalDetokenizer(Recording(), encode(tokenizer, "Prompt: 你好 " * 5))
    out = "".join(detok.append([i])[0] for i in ids) + detok.flush()
    assert out == TEXT * 8
    assert len(ids) > 200 and max(seen) <= 8      # never the whole sequence
