"""Structured output: grammars compiled by xgrammar, one matcher per sequence, and the token
bitmask applied to a step's grammar rows.

``Grammars`` (one per loaded model, ``grammars_for``) compiles a checked grammar spec
(``gnosis_daemon.grammar_spec``) against the model's tokenizer: its ``TokenizerInfo`` is
built from the tokenizer already loaded, with the model's logits vocabulary size, so nothing
is downloaded. Compiled grammars are cached by the spec's canonical JSON text (LRU,
``MAX_CACHED``); compiling runs on the grammar thread after the spec compiled in time in a
grammar worker process (``station.sampling.grammar_compile``), never on the socket's trio
thread, a tokenizer thread or the engine thread. The model's special tokens other than its
stop tokens are never allowed (``tokenizer_info``), and a grammar no token can start is
refused when it is compiled.

``SequenceGrammar`` is one sequence's state: its ``GrammarMatcher`` (made on the engine
thread at its first step), advanced with every token the sequence accepts. ``apply_masks``
fills the bitmask of every grammar row of a step in one batched call
(``BatchGrammarMatcher.batch_fill_next_token_bitmask``) and applies it to those rows of the
logits in place (``apply_token_bitmask_inplace``): tokens the grammar forbids become -inf.
Rows without a grammar are not touched. The matcher terminates when the grammar is complete
and a stop token (eos) was accepted; the engine then ends the sequence with ``stop``. A row
whose mask allows no token at all (the vocabulary cannot spell what the grammar needs next)
is a dead end: the engine ends that sequence with an error instead of sampling a forbidden
token, so an incomplete output never ends as ``stop``.

JSON is generated compact (``any_whitespace=False``: ``{"a": 1, "b": [2, 3]}``), so a small
model cannot spend its tokens on whitespace; ``json_object`` is any object
(``{"type": "object"}`` without strict mode), ``json_schema`` is strict (a property the
schema does not name is never generated, whatever ``additionalProperties`` says).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

import torch

from gnosis_daemon.grammar_spec import canonical
from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError
from station.sampling.grammar_worker import compile_spec, message

log = get_logger(__name__)

MAX_CACHED = 64  # compiled grammars kept per model (each is a few KiB to a few MiB)
JSON_KINDS = ("json_object", "json_schema")  # compact JSON: no raw control character at all
_LOCK = threading.Lock()


def _xgr() -> Any:
    import xgrammar

    return xgrammar


class Grammars:
    """Compiles grammar specs for one model's tokenizer (thread-safe), with an LRU cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # Our own cache bounds what is kept; xgrammar's would grow without one.
        self._compiler = _xgr().GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._max = max_cached
        self.compiled = 0  # grammars compiled (cache misses)
        # Tokens holding a control character (U+0000-U+001F): compact JSON never has one
        # raw, but xgrammar's strings with minLength/maxLength let them in, and then the
        # output does not parse; a JSON grammar's sequences mask them (``forbidden_ids``).
        self.control_ids = tuple(i for i, piece in enumerate(self.info.decoded_vocab)
                                 if any(byte < 0x20 for byte in piece))

    def cached(self, spec: dict[str, Any]) -> Any:
        """The spec's compiled grammar if it is in the cache, else None."""
        key = canonical(spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def serialized_info(self) -> str:
        """The tokenizer info as xgrammar serializes it (for the grammar worker)."""
        return self.info.serialize_json()

    def compile(self, spec: dict[str, Any]) -> Any:
        """A checked spec -> xgrammar ``CompiledGrammar``; ``OpError`` bad_request when the
        engine cannot compile it, or when no token of the vocabulary can start the output
        it describes (the message names the problem)."""
        found = self.cached(spec)
        if found is not None:
            return found
        try:
            compiled = compile_spec(self._compiler, spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its C++ message
            raise OpError(ErrorCode.BAD_REQUEST,
                          f"argument 'grammar' cannot be compiled: {message(exc)}") from None
        if not _startable(compiled):
            raise OpError(ErrorCode.BAD_REQUEST, "argument 'grammar' cannot be generated by "
                          "this model: no token of its vocabulary can start the output the "
                          "grammar describes")
        compiled.forbidden_ids = self.control_ids if spec["type"] in JSON_KINDS else ()
        with self._lock:
            self.compiled += 1
            self._cache[canonical(spec)] = compiled
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return compiled


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary, with the model's special tokens (``<|im_start|>``,
    ``<|endoftext|>``...) other than the stop tokens made unreachable: xgrammar reads a
    byte-level special token as its literal text and would let it into a JSON string, where
    the detokenizer (special tokens skipped) would drop it from what the client receives."""
    xgr = _xgr()
    stops = [int(t) for t in stop_token_ids]
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {int(i) for i, t in added.items() if t.special} - set(stops)
    if not special:
        return base
    vocab = [b"" if i in special else piece for i, piece in enumerate(base.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=base.add_prefix_space)


def _startable(compiled: Any) -> bool:
    """Some token (a stop token included, for a grammar that matches nothing) is allowed
    in the grammar's first state."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.ne(0).any())


def grammars_for(loaded: Any) -> Grammars:
    """The loaded model's ``Grammars``, made at first use (any thread)."""
    with _LOCK:
        grammars = getattr(loaded, "grammars", None)
        if grammars is None:
            grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
            loaded.grammars = grammars
        return grammars


class SequenceGrammar:
    """One sequence's grammar state (engine thread only, but for construction).
    ``failure``: why the sequence cannot go on (no token continues the grammar, or the
    grammar refused the sampled token); the engine then ends it with an error."""

    __slots__ = ("compiled", "matcher", "terminated", "dead", "failure")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.matcher: Any = None
        self.terminated = False
        self.dead = False  # the last mask allowed no token at all
        self.failure: str | None = None

    def matcher_now(self) -> Any:
        if self.matcher is None:
            self.matcher = _xgr().GrammarMatcher(self.compiled)
        return self.matcher

    def accept(self, token: int) -> None:
        """Advance with the sequence's new token. A dead end (the mask allowed nothing, so
        the token is no choice at all) or a token the grammar refuses is a failure."""
        matcher = self.matcher_now()
        if self.dead:
            self.failure = ("cannot be continued by this model: no token of its vocabulary "
                            "continues the output the grammar describes")
        elif not matcher.accept_token(int(token)):
            log.warning("grammar_rejected_token", token=int(token))
            self.failure = f"refused token {int(token)}, which its own mask allowed"
        elif matcher.is_terminated():
            self.terminated = True


_batch: Any = None  # the engine thread's BatchGrammarMatcher
_backend = "auto"  # xgrammar's kernel for the masked write; torch_native if auto fails


def apply_masks(logits: torch.Tensor, rows: list[int], grammars: list[SequenceGrammar]) -> None:
    """Set the tokens each grammar forbids to -inf in ``logits[rows[i]]`` (float32, in
    place): one batched bitmask fill, one masked write over those rows."""
    global _batch
    xgr = _xgr()
    if _batch is None:
        _batch = xgr.BatchGrammarMatcher(max_threads=1)
    vocab = grammars[0].compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    _batch.batch_fill_next_token_bitmask([g.matcher_now() for g in grammars], bitmask, rows)
    global _backend
    mask = bitmask.to(logits.device, non_blocking=True)
    width = min(vocab, logits.shape[-1])
    try:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=width, indices=rows,
                                        backend=_backend)
    except Exception:  # a device kernel that cannot run here (no triton...): plain torch ops
        if _backend == "torch_native":
            raise
        log.warning("grammar_bitmask_kernel_unavailable", backend=_backend, exc_info=True)
        _backend = "torch_native"
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=width, indices=rows,
                                        backend=_backend)
    index = torch.tensor(rows, device=logits.device)
    if logits.shape[-1] > vocab:  # logits past the tokenizer's ids are never grammatical
        logits[index, vocab:] = float("-inf")
    dead = logits.index_select(0, index).amax(dim=-1) == float("-inf")
    for grammar, none_left in zip(grammars, dead.tolist()):
        grammar.dead = none_left  # every token masked: the sampled one is no choice
