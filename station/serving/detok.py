"""Incremental detokenization with stop strings, one ``IncrementalDetokenizer`` per request.

Decoding token by token breaks on two things: a multi-byte UTF-8 character split across
tokens (the partial decode ends with U+FFFD), and tokenizers whose decode of a lone token
differs from its decode in context (sentencepiece's leading space). So each step decodes a
short window ``ids[prefix_offset:]`` and emits only what grew past ``ids[prefix_offset:
read_offset]``, holding back while the text ends with U+FFFD (the TGI/vLLM scheme).

Byte-level tokenizers (GPT-2's scheme, SmolLM2's) take a shortcut for most tokens. Their
decode is the UTF-8 of the tokens' bytes put end to end (invalid bytes as U+FFFD), so once
everything before a token was emitted, a token whose bytes are ASCII completes exactly its
own text: the window's decode is the emitted prefix's decode followed by those characters
(an ASCII byte never continues a multi-byte character). ``ascii_pieces`` lists each such
token's text once per tokenizer, each entry checked against the tokenizer's own decode, and
``feed`` emits it without the two decodes. Any other token, or one after held-back bytes,
takes the window path. The stream's text is the same either way; the shortcut saves about
2.7 us a token of the station's per-step work (docs/benchmarks.md, "Per-step host overhead").

Stop strings: text that might be the start of a stop string is held back until the next
token settles it, so a stop string is never streamed; when one appears, the output is cut
before it and ``stopped`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as decode context for the first new token


@dataclass(frozen=True, slots=True)
class DetokOutput:
    text: str  # newly completed text, safe to stream
    stopped: bool = False  # a stop string was found; generation should end


class IncrementalDetokenizer:
    """Feed sampled token ids; get back the newly completed text.

    ``text`` is everything emitted so far (the result's full text once ``finish`` ran).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._rust = _rust_decoder(tokenizer)
        self._ascii = ascii_pieces(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded text held back: might begin a stop string
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _next_piece(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def feed(self, token_ids: Iterable[int]) -> DetokOutput:
        """Add sampled tokens; return the text they completed (empty once stopped)."""
        if self.stopped:
            return DetokOutput("", True)
        pieces = self._ascii
        for token_id in token_ids:
            token_id = int(token_id)
            text = pieces[token_id] if 0 <= token_id < len(pieces) else None
            caught_up = self._read_offset == len(self._ids)  # everything before it emitted
            self._ids.append(token_id)
            if text is not None and caught_up:  # what the window path would emit
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._pending += text
            else:
                self._pending += self._next_piece()
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: flush held-back text (a trailing broken byte becomes U+FFFD)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset:])
            self._pending += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(final=True).text

    def _release(self, final: bool) -> DetokOutput:
        pending = self._pending
        if not self._stop:  # nothing to hold back or cut
            self._pending = ""
            self.text += pending
            return DetokOutput(pending)
        cut = _first_stop(pending, self._stop)
        if cut is not None:
            out = pending[:cut]
            self._pending = ""
            self.stopped = True
        else:
            keep = 0 if final else _stop_prefix_len(pending, self._stop)
            out = pending[:len(pending) - keep]
            self._pending = pending[len(pending) - keep:]
        self.text += out
        return DetokOutput(out, self.stopped)


def _rust_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer whose decode is
    exactly its own (``TokenizersBackend._decode`` without the clean-up: the Rust decode and
    nothing else), else None. Two decodes a token through transformers' wrapper cost about
    7 us more than the Rust call: 0.2 ms a step at 32 streams."""
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    rust = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if isinstance(tokenizer, TokenizersBackend) and isinstance(rust, Tokenizer) \
            and kind.decode is PreTrainedTokenizerBase.decode \
            and kind._decode is TokenizersBackend._decode:
        return rust
    return None


_NO_PIECES: list[str | None] = []
_PIECES: dict[int, tuple[Any, list[str | None]]] = {}


def ascii_pieces(tokenizer: Any) -> list[str | None]:
    """By token id: the token's text where the tokenizer's decode is byte-level and the
    token's bytes are ASCII (not an added or special token), else None; empty for any other
    tokenizer. Made once per tokenizer (about 0.1 s for a 49k vocabulary: the station makes
    it while loading), each entry checked against the tokenizer's decode of that token."""
    found = _PIECES.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:
        found = _PIECES[id(tokenizer)] = (tokenizer, _byte_level_ascii(tokenizer))
    return found[1]


def _byte_level_ascii(tokenizer: Any) -> list[str | None]:
    from tokenizers import decoders

    from station.serving.token_text import byte_decoder

    rust = _rust_decoder(tokenizer)
    # Exactly the ByteLevel decoder (a Sequence may add steps that change the text).
    if rust is None or type(rust.decoder) is not decoders.ByteLevel:
        return _NO_PIECES
    chars = byte_decoder()
    added = rust.get_added_tokens_decoder()
    pieces: list[str | None] = [None] * rust.get_vocab_size(with_added_tokens=True)
    for token, token_id in rust.get_vocab(with_added_tokens=False).items():
        if token_id in added or token_id >= len(pieces):
            continue
        # the ByteLevel decoder's rule: each character's byte, or the token's own UTF-8
        # when a character is not in its table
        raw = bytes(chars[c] for c in token) if all(c in chars for c in token) else token.encode()
        if raw and raw.isascii():
            pieces[token_id] = raw.decode("ascii")
    listed = [i for i, text in enumerate(pieces) if text is not None]
    decoded = rust.decode_batch([[i] for i in listed], skip_special_tokens=True)
    if any(pieces[i] != text for i, text in zip(listed, decoded)):
        return _NO_PIECES  # not the decoder this module knows: every token takes the window
    return pieces


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    positions = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(positions) if positions else None


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
