from __future__ import annotations

import pytest

from station.serving.detok import IncrementalDetokenizer
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _stream(tok, text: str, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.feed([i]).text for i in ids]
    return pieces, detok


def test_ascii_streams_one_char_per_token(tok):
    pieces, detok = _stream(tok, "hello")
    assert pieces == ["h", "e", "l", "l", "o"]
    assert detok.finish() == ""
    assert detok.text == "hello"


def test_multibyte_chars_are_never_split(tok):
    text = "aé😀b"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1 + 2 + 4 + 1  # byte-level: é and 😀 span several tokens
    pieces, detok = _stream(tok, text)
    assert pieces == ["a", "", "é", "", "", "", "😀", "b"]
    assert all("\ufffd" not in p for p in pieces)
    assert detok.text == text


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("prompt é", add_special_tokens=False)
    pieces, detok = _stream(tok, "ok", prompt_ids=prompt)
    assert "".join(pieces) == "ok"


def test_special_tokens_are_skipped(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(tok.encode("hi", add_special_tokens=False)).text == "hi"
    assert detok.feed([im_end]).text == ""
    assert detok.finish() == ""
    assert detok.text == "hi"


def test_stop_string_cuts_output_and_stops(tok):
    pieces, detok = _stream(tok, "abc STOP def", stop=["STOP"])
    assert "".join(pieces) == "abc "
    assert detok.stopped
    assert detok.text == "abc "
    assert detok.feed(tok.encode("x", add_special_tokens=False)).text == ""


def test_possible_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    ids = tok.encode("aSTx", add_special_tokens=False)
    out = [detok.feed([i]).text for i in ids]
    # "S" and "ST" might start "STOP": held until "x" proves otherwise.
    assert out == ["a", "", "", "STx"]
    assert not detok.stopped


def test_held_prefix_flushes_at_finish(tok):
    pieces, detok = _stream(tok, "aST", stop=["STOP"])
    assert "".join(pieces) == "a"
    assert detok.finish() == "ST"
    assert detok.text == "aST"


def test_earliest_of_several_stops_wins(tok):
    pieces, detok = _stream(tok, "one two three", stop=["three", "two"])
    assert detok.stopped and detok.text == "one "


def test_stop_string_spanning_a_multibyte_char(tok):
    pieces, detok = _stream(tok, "xé!y", stop=["é!"])
    assert detok.stopped and detok.text == "x"


def test_trailing_broken_byte_is_flushed_at_finish(tok):
    ids = tok.encode("a😀", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed([i]).text for i in ids) == "a"
    assert detok.finish().startswith("\ufffd")


# -- the ASCII shortcut: the same text as the window path, token for token
@pytest.fixture(scope="module", params=["bytes", "merges", "default", "metaspace"])
def any_tok(request):
    from tests.station.model.test_tokenizing import MERGES, metaspace_tokenizer

    if request.param == "default":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(request.getfixturevalue("default_model_cache").cache)
    if request.param == "metaspace":
        return metaspace_tokenizer()
    return build_tokenizer(MERGES if request.param == "merges" else ())


def _pieces(tok, ids, prompt, stop, shortcut: bool) -> tuple[list, str, str]:
    detok = IncrementalDetokenizer(tok, prompt, stop)
    if not shortcut:
        detok._ascii = []  # every token through the window's two decodes
    out = [(o.text, o.stopped) for o in (detok.feed([i]) for i in ids)]
    return out, detok.finish(), detok.text


def test_the_ascii_shortcut_streams_what_the_window_path_streams(any_tok):
    import random

    from station.serving.detok import ascii_pieces

    pieces = ascii_pieces(any_tok)
    byte_level = "ByteLevel" in type(any_tok.backend_tokenizer.decoder).__name__
    # Byte-level tokenizers list their ASCII tokens; any other decoder takes no shortcut.
    assert (sum(p is not None for p in pieces) > 90) == byte_level
    rng = random.Random(5)
    vocab = len(any_tok)
    texts = ["Hello, world! The user asked: what is 2+2?\n\n", "héllo wörld 😀 日本語 <|im_end|> ok",
             "<|im_start|>assistant\nSure.<|im_end|>"]
    for text in texts:
        ids = any_tok.encode(text, add_special_tokens=False)
        for stop in ((), ("world",), ("😀",)):
            assert _pieces(any_tok, ids, [1, 2], stop, True) == _pieces(any_tok, ids, [1, 2], stop, False)
    for _ in range(30):  # random ids: broken UTF-8, special tokens, anything a model samples
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(vocab) for _ in range(3)]
        assert _pieces(any_tok, ids, prompt, ("ab",), True) == _pieces(any_tok, ids, prompt, ("ab",), False)


def test_a_shortcut_token_after_held_back_bytes_releases_them_as_the_window_path_does(tok):
    from station.serving.detok import ascii_pieces

    euro = tok.encode("€", add_special_tokens=False)  # three byte tokens
    a = tok.encode("a", add_special_tokens=False)
    assert len(euro) == 3 and ascii_pieces(tok)[a[0]] == "a"
    for ids, want in ((euro[:2] + a, ["", "", "\ufffda"]), (euro + a, ["", "", "€", "a"])):
        for shortcut in (True, False):
            assert [t for t, _ in _pieces(tok, ids, [], (), shortcut)[0]] == want
