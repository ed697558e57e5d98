"""Long pieces of prompt text keep their ids between requests (``station.model.segment_cache``):
on real tokenizers (the tiny models' byte-level BPE with and without merges, the default
model's), every encode through the cache, first or reused, gives the tokenizer's own ids."""

from __future__ import annotations

import random

import pytest

from station.model import segment_cache
from station.model.segment_cache import MIN_CHARS, SegmentCache
from station.model.tokenizing import Codec
from tests.station.model.test_tokenizing import MERGES, metaspace_tokenizer, render
from tests.support.tiny_models import build_tokenizer

WORDS = ["the", " user", "\n\n", "héllo", " 😀", "  ", "<|im_", "|>", "system", "\t", "42", "'s"]


def long_text(seed: int, words: int = 400) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module", params=["bytes", "merges", "default"])
def tok(request):
    if request.param == "default":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(request.getfixturevalue("default_model_cache").cache)
    return build_tokenizer(MERGES if request.param == "merges" else ())


def test_every_encode_is_the_tokenizers_own_and_long_pieces_come_back(tok):
    codec = Codec(tok)
    cache = codec.segments
    assert cache is not None
    system = long_text(1)
    turns = [{"role": "system", "content": system}]
    texts = [system, system + "<|im_end|>" + long_text(2), "<|im_start|>" + system + "<|im_end|>",
             "<|im_end|><|im_start|>" + system + "\n\n<|im_end|>\n", "short <|im_end|> text"]
    for turn in range(3):  # a conversation: each turn's prompt holds the earlier turns' pieces
        turns += [{"role": "user", "content": long_text(10 + turn)},
                  {"role": "assistant", "content": long_text(20 + turn, 100)}]
        texts.append(render(tok)(turns))
    hits = 0
    for _ in range(2):  # the second pass reuses every long piece
        for text in texts:
            for add in (False, True):
                before = cache.hits
                assert codec.encode(text, add) == tok.encode(text, add_special_tokens=add), text[:80]
                hits += cache.hits - before
        for add in (False, True):
            assert codec.encode_many(texts, add) == [tok.encode(t, add_special_tokens=add) for t in texts]
    assert cache.enabled and hits > 0 and cache.checks_left == 0  # compared, and held
    # A chat prompt's later turn: the earlier turns' pieces come from the cache.
    before = cache.hits
    turns.append({"role": "user", "content": "and now?"})
    assert codec.encode_chat(turns, render(tok)) == tok.encode(render(tok)(turns), add_special_tokens=False)
    assert cache.hits - before == sum(len(m["content"]) >= MIN_CHARS for m in turns)


def test_the_cache_holds_at_most_its_tokens_and_drops_the_least_recently_used():
    tok = build_tokenizer()  # one token per byte: a piece of n ASCII characters is n ids
    codec = Codec(tok)
    cache = codec.segments
    assert cache is not None
    cache.max_tokens = 3 * MIN_CHARS
    a, b, c, d = ("abcd"[i] * MIN_CHARS for i in range(4))
    for text in (a, b, c, a, d):  # a is used again before d comes: b goes
        assert codec.encode(text, False) == tok.encode(text, add_special_tokens=False)
    assert cache.tokens == 3 * MIN_CHARS
    before = cache.hits
    codec.encode(a + "<|im_end|>" + c + "<|im_end|>" + d, False)
    assert cache.hits - before == 3
    codec.encode(b, False)  # a miss: it is kept again, and c, now the oldest, goes
    assert cache.hits - before == 3 and cache.tokens == 3 * MIN_CHARS


def test_a_tokenizer_that_marks_the_start_of_the_text_encodes_later_pieces_as_mid_text():
    tok = metaspace_tokenizer()  # Metaspace, prepend_scheme "first": sentencepiece's shape
    codec = Codec(tok)
    cache = codec.segments
    assert cache is not None and segment_cache.why_not(tok.backend_tokenizer, _spec(tok)) is None
    body = "the user is here. " * (MIN_CHARS // 18 + 1)
    texts = [body, body + "<|im_end|>" + body, "<|im_start|>" + body + "<|im_end|>\n" + body,
             "<|im_start|>user\n" + body + "<|im_end|><|im_start|>" + body]
    for _ in range(2):
        for text in texts:
            for add in (False, True):
                assert codec.encode(text, add) == tok.encode(text, add_special_tokens=add), text[:60]
    assert cache.enabled and cache.hits > 0
    # the same piece first and mid-text: two entries, two encodings (a prefix only at the start)
    assert cache._entries[False, body] != cache._entries[True, body]


def test_an_added_token_that_strips_whitespace_gets_no_cache():
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.backend_tokenizer.add_special_tokens([AddedToken("<|end|>", rstrip=True, special=True)])
    assert segment_cache.why_not(tok.backend_tokenizer, _spec(tok)) == (
        "added token '<|end|>' strips whitespace or matches whole words")
    assert Codec(tok).segments is None


def test_pieces_that_differ_from_the_whole_turn_the_cache_off_and_the_whole_is_used():
    # A start-marking tokenizer given a cache without its anchor: later pieces encode
    # differently alone (each gains the prefix the whole text gives only its start).
    tok = metaspace_tokenizer()
    codec = Codec(tok)
    cache = SegmentCache(codec._plain, codec._encode_whole)
    text = "the user " * (MIN_CHARS // 9 + 1)
    chat = "<|im_start|>" + text + "<|im_end|>" + text
    want = tok.encode(chat, add_special_tokens=False)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    alone = tok.encode(text, add_special_tokens=False)  # the second piece gains a prefix space
    assert [start] + alone + [end] + alone != want
    assert cache.encode(chat, False) == want  # compared with the whole, which is taken
    assert not cache.enabled and cache.encode(chat, False) is None


def _spec(tok) -> dict:
    import json

    return json.loads(tok.backend_tokenizer.to_str())


def test_texts_not_kept_leave_the_cache_as_it_was():
    # embeddings' inputs (encode_many(..., keep=False)): encoded whole, nothing kept
    tok = build_tokenizer()
    codec = Codec(tok)
    texts = [long_text(30 + i) for i in range(3)]
    assert codec.encode_many(texts, True, keep=False) == [tok.encode(t) for t in texts]
    assert codec.segments is not None and codec.segments.tokens == 0 and codec.segments.misses == 0
