"""Token ids of long stretches of prompt text, kept between requests (``SegmentCache``).

A liquid-memory hit skips the prompt's prefill, and what is left of its first-token time is
mostly tokenizing: a 2,000-token prompt takes ~4 ms to encode here, more than the station
spends on the hit. The stretches that come back are the ones whose KV comes back: the same
long system prompt, the earlier turns of a conversation, the same prompt sent again.
(Embeddings' texts do not go through it: ``Codec.encode_many(..., keep=False)``.)

What makes a cache of stretches exact: a ``tokenizers`` encode first cuts the text at the
tokenizer's added tokens (``<|im_start|>``, ``<|im_end|>``...), then normalizes, pre-tokenizes
and runs the model on each piece between them on its own. So the ids of a text are the ids
of its pieces, each encoded alone, with each added token's id between them. A chat prompt's
pieces are its messages (with their role headers); a raw prompt without added tokens is one
piece. The cache keeps the ids of pieces of at least ``MIN_CHARS`` characters, least
recently used first out, ``max_tokens`` ids in all (4 bytes each).

That holds where no added token strips the whitespace beside it or matches only whole words
(``lstrip``/``rstrip``/``single_word``) and no normalized added token meets a normalizer;
``why_not`` names the first such token, and the codec then encodes whole texts as before. A
byte-level ``add_prefix_space`` and the normalizers act on each piece already. A pre-tokenizer
that marks only the start of the text (Metaspace ``prepend_scheme: first``: sentencepiece's
shape, Llama 2 and Mistral) gets ``anchor``: a piece after the first is encoded behind it,
as mid-text, and the anchor's ids taken off (a token across the join sends the text to the
whole encode); the first piece and the later ones are kept apart.

As a guard against a case this reasoning misses, the first ``CHECKS`` texts
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
CHECKS = 16  # texts encoded in pieces that are also encoded whole and compared

Encode = Callable[[list[str], bool], list[list[int]]]  # texts, add_special_tokens -> ids


def why_not(backend: Any, spec: dict[str, Any]) -> str | None:
    """Why pieces of a text cannot be encoded apart with this tokenizer, or None."""
    normalizer = spec.get("normalizer")
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"added token {token.content!r} strips whitespace or matches whole words"
        if token.normalized and normalizer is not None:
            return f"added token {token.content!r} is matched after normalization"
    return None


class SegmentCache:
    """Encode texts piece by piece (the pieces between added tokens), reusing the ids of
    long pieces seen before. Thread-safe: the station's tokenizer threads share one."""

    def __init__(self, backend: Any, encode: Encode, max_tokens: int = MAX_TOKENS,
                 anchor: str | None = None) -> None:
        self._encode = encode  # the codec's batch encode: the very calls a whole text takes
        self._anchor = anchor  # encoded in front of a piece after the first (see above)
        self._anchor_ids = encode([anchor], False)[0] if anchor else []
        added = backend.get_added_tokens_decoder()
        self._added_ids = {token.content: int(i) for i, token in added.items()}
        contents = sorted(self._added_ids, key=len, reverse=True)  # leftmost, then longest
        self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if contents else None
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[bool, str], array] = OrderedDict()  # (mid, piece)
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
        key = self._key
        found: dict[int, array] = {}
        with self._lock:
            for i in range(0, len(pieces), 2):  # even: text between added tokens
                ids = self._entries.get(key(pieces, i)) if len(pieces[i]) >= MIN_CHARS else None
                if ids is not None:
                    self._entries.move_to_end(key(pieces, i))
                    found[i] = ids
        todo = [i for i in range(0, len(pieces), 2) if pieces[i] and i not in found]
        fresh = dict(zip(todo, self._encode_pieces(pieces, todo))) if todo else {}
        if any(ids is None for ids in fresh.values()):
            return None  # a token across an anchor's join: the whole text's encode
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(self._added_ids[piece])
            elif i in found:
                out.extend(found[i])
            elif piece:
                out.extend(fresh[i] or ())
        if add_special_tokens:
            assert self._around is not None
            out = self._around[0] + out + self._around[1]
        with self._lock:
            self.hits += len(found)
            self.misses += sum(1 for i in todo if len(pieces[i]) >= MIN_CHARS)
            for i in todo:
                if len(pieces[i]) >= MIN_CHARS:
                    self._keep(key(pieces, i), array("i", fresh[i] or ()))
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

    def _key(self, pieces: list[str], i: int) -> tuple[bool, str]:
        """A piece's cache key: with an anchor, a piece after the first is kept apart."""
        return self._anchor is not None and i > 0, pieces[i]

    def _encode_pieces(self, pieces: list[str], todo: list[int]) -> list[list[int] | None]:
        """The ids of ``pieces[i]`` for each ``i`` in ``todo``, in one batch call; None for a
        piece behind the anchor whose ids do not start with the anchor's own."""
        anchor, n = self._anchor, len(self._anchor_ids)
        if anchor is None:
            return list(self._encode([pieces[i] for i in todo], False))
        got = self._encode([anchor + pieces[i] if i > 0 else pieces[i] for i in todo], False)
        return [ids if i == 0 else (ids[n:] if ids[:n] == self._anchor_ids else None)
                for i, ids in zip(todo, got)]

    def _keep(self, piece: tuple[bool, str], ids: array) -> None:
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
