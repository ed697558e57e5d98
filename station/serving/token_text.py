"""A token's text and bytes, as logprobs report them: OpenAI's ``token`` (the
token's text; ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters, as OpenAI
writes them) and ``bytes`` (the token's own bytes: byte-level BPE pieces mapped back to
bytes, sentencepiece ``▁`` as a space and ``<0xNN>`` as that byte, special tokens as their
text). Cached per tokenizer and id: a top-20 list of every token is 21 look-ups."""

from __future__ import annotations

import functools
from typing import Any

from gnosis_daemon.wire import LogprobEntry, TopLogprob


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    # GPT-2's byte <-> printable character table (what ByteLevel pre-tokenizers write).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self._special:
            return piece.encode("utf-8")
        table = byte_decoder()
        if self._byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
        return self._tokenizer.decode([token_id]).encode("utf-8")

    def entry(self, lp: Any) -> LogprobEntry:
        """A ``station.sampling.logprobs.TokenLogprobs`` as the wire carries it."""
        text, raw = self.of(lp.token_id)
        return {"token_id": lp.token_id, "token": text, "bytes": raw, "logprob": lp.logprob,
                "top_logprobs": [self._top(t, v) for t, v in lp.top]}

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.of(token_id)
        return {"token_id": token_id, "token": text, "bytes": raw, "logprob": logprob}


_BY_TOKENIZER: dict[int, tuple[Any, TokenTexts]] = {}


def token_texts(tokenizer: Any) -> TokenTexts:
    """The one ``TokenTexts`` of ``tokenizer`` (a station serves one model)."""
    found = _BY_TOKENIZER.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:
        found = _BY_TOKENIZER[id(tokenizer)] = (tokenizer, TokenTexts(tokenizer))
    return found[1]
