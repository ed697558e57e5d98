"""Token ids of long stretches of prompt text, kept between requests (``SegmentCache``).

A liquid-memory hit skips the prompt's prefill, and what is left of its first-token time is
mostly tokenizing: a 2,000-token prompt takes ~4 ms to encode here, more than the station
spends on the hit. The stretches that come back are the ones whose KV comes back: the same
long system prompt, the earlier turns of a conversation, the same prompt sent again.

What makes a cache of stretches exact: a ``tokenizers`` encode first cuts the text at the
tokenizer's added tokens (``<|im_start|>``, ``<|im_end|>``...), then normalizes, pre-tokenizes
and runs the model on each piece between them on its own. So the ids of a text are the ids
of its pieces, each encoded alone, with each added token's id between them. A chat prompt's
pieces are its messages (with their role headers); a raw prompt without added tokens is one
piece. The cache keeps the ids of pieces of at least ``MIN_CHARS`` characters, least
recently used first out, ``max_tokens`` ids in all (4 bytes each).

That holds where no added token strips the whitespace beside it or matches only whole words
(``lstrip``/``rstrip``/``single_word``), where no normalized added token meets a normalizer,
and where the pre-tokenizer does not treat the start of the text differently from the start
of a piece, as a Metaspace ``prepend_scheme: first`` does (sentencepiece's shape: Llama 2,
Mistral). A byte-level ``add_prefix_space`` and the normalizers act on each piece already.
``why_not`` names the first of these a tokenizer has, and the codec then encodes whole texts
as before. As a guard against a case this reasoning misses, the first ``CHECKS`` texts
encoded in pieces are also encoded whole and compared; a difference turns the cache off for
good (logged as ``tokenize_cache_disabled``) and the whole text's ids are used.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)

MIN_CHARS = 256  # shorter pieces encode in well under 0.1 ms: not worth a slot
MAX_TOKENS = 1 << 20  # ids kept in all: 4 MiB of ids plus the pieces' text
CHECKS = 16  # encodes that reuse a piece and are compared with the whole text's encode

Encode = Callable[[list[str], bool], list[list[int]]]  # texts, add_special_tokens -> ids


def why_not(backend: Any, spec: dict[str, Any]) -> str | None:
    """Why pieces of a text cannot be encoded apart with this tokenizer, or None."""
    normalizer = spec.get("normalizer")
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"added token {token.content!r} strips whitespace or matches whole words"
        if token.normalized and normalizer is not None:
            return f"added token {token.content!r} is matched after normalization"
    for part in (spec.get("pre_tokenizer"), spec.get("normalizer")):
        reason = _start_sensitive(part)
        if reason:
            return reason
    return None


def _start_sensitive(spec: dict[str, Any] | None) -> str | None:
    if not spec:
        return None
    for key in ("pretokenizers", "normalizers"):
        for inner in spec.get(key) or ():
            reason = _start_sensitive(inner)
            if reason:
                return reason
    if spec.get("type") == "Metaspace" and spec.get("prepend_scheme", "always") != "always":
        return "the Metaspace pre-tokenizer marks the start of the text only"
    return None


class SegmentCache:
    """Encode texts piece by piece (the pieces between added tokens), reusing the ids of
    long pieces seen before. Thread-safe: the station's tokenizer threads share one."""

    def __init__(self, backend: Any, encode: Encode, max_tokens: int = MAX_TOKENS) -> None:
        self._encode = encode  # the codec's batch encode: the very calls a whole text takes
        added = backend.get_added_tokens_decoder()
        self._added_ids = {token.content: int(i) for i, token in added.items()}
        contents = sorted(self._added_ids, key=len, reverse=True)  # leftmost, then longest
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if contents else None
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.checks_left = CHECKS
        self.enabled = True
        self.hits = self.misses = 0
        self._around = _specials_around(encode)  # what add_special_tokens puts around the ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids of ``text`` (as the codec's encode), or None where the caller should
        encode the whole text (the cache is off, or no piece is long enough to keep)."""
        if not self.enabled or (add_special_tokens and self._around is None):
            return None
        pieces = self._split.split(text) if self._split is not None else [text]
        if not any(len(p) >= MIN_CHARS for p in pieces[::2]):
            return None  # nothing to keep or reuse: one encode of the whole is cheaper
        found: dict[int, array] = {}
        with self._lock:
            for i in range(0, len(pieces), 2):  # even: text between added tokens
                ids = self._entries.get(pieces[i]) if len(pieces[i]) >= MIN_CHARS else None
                if ids is not None:
                    self._entries.move_to_end(pieces[i])
                    found[i] = ids
        todo = [i for i in range(0, len(pieces), 2) if pieces[i] and i not in found]
        fresh = dict(zip(todo, self._encode([pieces[i] for i in todo], False))) if todo else {}
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(self._added_ids[piece])
            elif i in found:
                out.extend(found[i])
            elif piece:
                out.extend(fresh[i])
        if add_special_tokens:
            assert self._around is not None
            out = self._around[0] + out + self._around[1]
        with self._lock:
            self.hits += len(found)
            self.misses += sum(1 for i in todo if len(pieces[i]) >= MIN_CHARS)
            for i in todo:
                if len(pieces[i]) >= MIN_CHARS:
                    self._keep(pieces[i], array("i", fresh[i]))
            # a lone piece without specials around it was encoded whole: nothing to compare
            check = self.checks_left > 0 and (len(pieces) > 1 or add_special_tokens)
            if check:
                self.checks_left -= 1
        if check:
            whole = self._encode([text], add_special_tokens)[0]
            if whole != out:
                self.enabled = False
                log.error("tokenize_cache_disabled", chars=len(text), pieces=len(pieces),
                          why="a text's pieces, encoded apart, differ from the whole text's ids")
                return whole
        return out

    def _keep(self, piece: str, ids: array) -> None:
        if piece in self._entries or len(ids) > self.max_tokens:
            return
        self._entries[piece] = ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old)

    @property
    def tokens(self) -> int:
        return self._tokens


def _specials_around(encode: Encode) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after a text's (a BOS, an EOS), found
    around a probe text; None if the probe's own ids are not among them unchanged."""
    bare, full = encode(["probe"], False)[0], encode(["probe"], True)[0]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return None
