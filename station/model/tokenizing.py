"""The station's tokenizer work: encode, decode and chat prompts.

All of it takes time in proportion to its input, so the server runs it on a worker thread
(``trio.to_thread``), never on the socket's trio thread. With a ``tokenizers`` backend (every
"fast" tokenizer) the calls go through the Rust batch entry points, ``encode_batch`` (as
``encode_batch_fast`` where ``tokenizers`` has it: the same ids without the character offsets,
about a quarter faster on a 2,000-token prompt) and ``decode_batch``, which release the GIL
while they work: the trio thread keeps serving meanwhile. The single-input
``Tokenizer.encode``/``decode`` hold the GIL throughout: on a text at the size bound another
thread waits for the whole encode, where under ``encode_batch`` it waits only while the ids
become Python ints. The ids are the ones
``tokenizer.encode``/``decode`` give: transformers' fast tokenizer calls the same backend,
with truncation and padding off. Where the tokenizer allows it, a text is encoded as its pieces
between added tokens, and long pieces' ids are kept between requests
(``station.model.segment_cache``): a liquid-memory hit's prompt comes back, and so do its pieces.

Chat prompts: the template is rendered to text and encoded with special tokens recognised,
because the template writes the control tokens (``<|im_start|>``...) as text. Special-token
text inside a message's content must not become a control token (a user could forge a
system turn), so when a content holds any, each occurrence is wrapped in markers made of a
random number between private-use characters before rendering. After rendering, the markers
are removed and their places noted; the text is encoded as usual, and every stretch between
two of the template's own special tokens that holds a forged one is encoded again with
special tokens split (as plain text). Prompts whose contents hold no special-token text take
the plain path, so their ids are exactly ``encode(render(messages))``. Markers (rather than
placeholders for whole contents) keep templates that transform a content (``| trim``,
``.split(...)``) working.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from typing import Any, Callable

from gnosis_daemon.logs import get_logger
from station.model.segment_cache import SegmentCache, why_not

# Encoded in front of a stretch in the middle of a prompt, then dropped, so that a
# tokenizer that marks the start of a text (sentencepiece's prefix space, Metaspace with
# prepend_scheme "first") encodes the stretch as it would mid-text.
_ANCHOR = "\n"

Render = Callable[[list[dict[str, Any]]], str]

log = get_logger(__name__)


def _fast(backend: Any) -> Any:
    """The backend's batch encode without offsets (the ids only), or with them where it has
    no such entry point (``tokenizers`` before 0.20)."""
    return getattr(backend, "encode_batch_fast", None) or backend.encode_batch


class Codec:
    """Encode/decode through one tokenizer, safe to call from several threads at once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(int(i) for i, t in added.items() if t.special)
        self.special_tokens = tuple(sorted({t.content for t in added.values() if t.special},
                                           key=len, reverse=True))  # longest first
        self._special_re = (re.compile("|".join(re.escape(t) for t in self.special_tokens))
                            if self.special_tokens else None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._plain = self._text = None
        self._mid_needs_anchor = False
        self.segments: SegmentCache | None = None  # long pieces' ids, kept between requests
        if backend is not None:
            from tokenizers import Tokenizer

            # Copies, so that switching special-token splitting is never a shared toggle
            # (transformers flips ``encode_special_tokens`` on its one backend per call).
            spec = backend.to_str()
            self._plain, self._text = Tokenizer.from_str(spec), Tokenizer.from_str(spec)
            for copy in (self._plain, self._text):
                copy.no_truncation()
                copy.no_padding()
            self._text.encode_special_tokens = True
            parsed = json.loads(spec)
            self._mid_needs_anchor = _prepends_first(parsed.get("pre_tokenizer"))
            why = why_not(self._plain, parsed)
            if why is None:
                self.segments = SegmentCache(self._plain, self._encode_whole,
                                             anchor=_ANCHOR if self._mid_needs_anchor else None)
            log.info("tokenize_cache", on=why is None, why_not=why)
        self._anchor_ids = self.encode_as_text(_ANCHOR) if self._mid_needs_anchor else []

    # -- plain calls
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool,
                    keep: bool = True) -> list[list[int]]:
        """``keep``: through the segment cache (prompts, whose pieces come back with their
        KV); False for texts that seldom do (embeddings' inputs), which would only push the
        prompts' pieces out."""
        if self._plain is None:
            return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens))
                    for t in texts]
        if self.segments is None or not keep:
            return self._encode_whole(texts, add_special_tokens)
        out = [self.segments.encode(t, add_special_tokens) for t in texts]
        rest = [t for t, ids in zip(texts, out) if ids is None]
        whole = iter(self._encode_whole(rest, add_special_tokens) if rest else ())
        return [ids if ids is not None else next(whole) for ids in out]

    def _encode_whole(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        assert self._plain is not None
        return [e.ids for e in _fast(self._plain)(texts, add_special_tokens=add_special_tokens)]

    def encode_as_text(self, text: str) -> list[int]:
        """``text`` with special-token text split into ordinary tokens, nothing added."""
        if self._text is None:
            return list(self.tokenizer(text, add_special_tokens=False,
                                       split_special_tokens=True)["input_ids"])
        return _fast(self._text)([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._plain is None:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        return self._plain.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def has_special_text(self, text: str) -> bool:
        return self._special_re is not None and self._special_re.search(text) is not None

    # -- chat prompts
    def encode_chat(self, messages: list[dict[str, Any]], render: Render) -> list[int]:
        """Token ids of ``render(messages)``; special-token text in contents stays text."""
        if not any(self.has_special_text(m["content"]) for m in messages):
            return self.encode(render(messages), add_special_tokens=False)
        assert self._special_re is not None
        nonce = f"{secrets.randbelow(10**16):016d}"
        start, end = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"
        wrap = lambda m: start + m.group(0) + end  # noqa: E731
        marked = [{**m, "content": self._special_re.sub(wrap, m["content"])} for m in messages]
        text = render(marked)
        markers = re.compile(f"{re.escape(start)}({self._special_re.pattern}){re.escape(end)}"
                             f"|{re.escape(start)}|{re.escape(end)}")
        parts: list[str] = []
        forged: list[tuple[int, int]] = []  # spans of the contents' special-token texts
        cuts: list[int] = []  # where a lone marker was (a template string op split a pair)
        pos = last = 0
        for match in markers.finditer(text):
            kept = text[last:match.start()]
            parts.append(kept)
            pos += len(kept)
            inner = match.group(1)
            if inner is None:
                cuts.append(pos)
            else:
                forged.append((pos, pos + len(inner)))
                parts.append(inner)
                pos += len(inner)
            last = match.end()
        parts.append(text[last:])
        return self._encode_guarded("".join(parts), forged, cuts)

    def _encode_guarded(self, text: str, forged: list[tuple[int, int]],
                        cuts: list[int]) -> list[int]:
        # Both lists are in text order: a token [s, e) is forged if it overlaps a span of
        # the contents' special-token text or straddles a cut (found by bisection, so a
        # content full of special-token text costs no more than its length).
        forged_starts, forged_ends = [fs for fs, _ in forged], [fe for _, fe in forged]

        def is_forged(s: int, e: int) -> bool:
            i = bisect.bisect_right(forged_ends, s)
            if i < len(forged) and forged_starts[i] < e:
                return True
            j = bisect.bisect_right(cuts, s)
            return j < len(cuts) and cuts[j] < e

        if self._plain is None:
            pieces = self._find_specials(text)
        else:
            encoding = self._plain.encode_batch([text], add_special_tokens=False)[0]
            pieces = list(zip(encoding.ids, encoding.offsets))
        out: list[int] = []
        section: list[int] = []
        section_start, section_forged = 0, False

        def flush(section_end: int) -> None:
            if section_forged:  # encode the stretch again, its special-token text as text
                out.extend(self._encode_stretch(text[section_start:section_end],
                                                mid=section_start > 0))
            else:
                out.extend(section)

        for token_id, (s, e) in pieces:
            if token_id in self.special_ids:
                if is_forged(s, e):
                    section_forged = True
                else:  # the template's own control token: a hard boundary
                    flush(s)
                    out.append(token_id)
                    section, section_start, section_forged = [], e, False
                    continue
            section.append(token_id)
        flush(len(text))
        return out

    def _encode_stretch(self, text: str, mid: bool) -> list[int]:
        if not text:
            return []
        if mid and self._mid_needs_anchor:
            ids = self.encode_as_text(_ANCHOR + text)
            if ids[:len(self._anchor_ids)] == self._anchor_ids:
                return ids[len(self._anchor_ids):]
        return self.encode_as_text(text)

    def _find_specials(self, text: str) -> list[tuple[int, tuple[int, int]]]:
        """Without a backend (no offsets): the tokens of the text between special tokens,
        each with that stretch's span, and every special token with its own span."""
        assert self._special_re is not None
        vocab = self.tokenizer.get_vocab()
        pieces: list[tuple[int, tuple[int, int]]] = []
        last = 0
        for match in self._special_re.finditer(text):
            if match.start() > last:
                pieces.extend((t, (last, match.start()))
                              for t in self.encode(text[last:match.start()], False))
            pieces.append((vocab[match.group(0)], match.span()))
            last = match.end()
        if last < len(text):
            pieces.extend((t, (last, len(text))) for t in self.encode(text[last:], False))
        return pieces


def _prepends_first(spec: dict | None) -> bool:
    """A Metaspace pre-tokenizer that writes its prefix only at the start of the text."""
    if not spec:
        return False
    if spec.get("type") == "Sequence":
        return any(_prepends_first(inner) for inner in spec.get("pretokenizers") or ())
    return spec.get("type") == "Metaspace" and spec.get("prepend_scheme") == "first"
