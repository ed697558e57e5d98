"""Structured output: grammars compiled by xgrammar, one matcher per sequence, and the token
bitmask applied to a step's grammar rows.

``Grammars`` (one per loaded model, ``grammars_for``) compiles a checked grammar spec
(``gnosis_daemon.grammar_spec``) against the model's tokenizer: its ``TokenizerInfo`` is
built from the tokenizer already loaded, with the model's logits vocabulary size, so nothing
is downloaded. Compiled grammars are cached by the spec's canonical JSON text (LRU,
``MAX_CACHED``); compiling runs on a worker thread (the ``generate`` parser's
``Tokenizing``), never on the socket's trio thread or the engine thread.

``SequenceGrammar`` is one sequence's state: its ``GrammarMatcher`` (made on the engine
thread at its first step), advanced with every token the sequence accepts. ``apply_masks``
fills the bitmask of every grammar row of a step in one batched call
(``BatchGrammarMatcher.batch_fill_next_token_bitmask``) and applies it to those rows of the
logits in place (``apply_token_bitmask_inplace``): tokens the grammar forbids become -inf.
Rows without a grammar are not touched. The matcher terminates when the grammar is complete
and a stop token (eos) was accepted; the engine then ends the sequence with ``stop``.

JSON is generated compact (``any_whitespace=False``: ``{"a": 1, "b": [2, 3]}``), so a small
model cannot spend its tokens on whitespace; ``json_object`` is any object
(``{"type": "object"}`` without strict mode), ``json_schema`` is strict (a property the
schema does not name is never generated, whatever ``additionalProperties`` says).
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any, Sequence

import torch

from gnosis_daemon.grammar_spec import canonical
from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError

log = get_logger(__name__)

MAX_CACHED = 64  # compiled grammars kept per model (each is a few KiB to a few MiB)
_LOCK = threading.Lock()


def _xgr() -> Any:
    import xgrammar

    return xgrammar


class Grammars:
    """Compiles grammar specs for one model's tokenizer (thread-safe), with an LRU cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        # Our own cache bounds what is kept; xgrammar's would grow without one.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._max = max_cached
        self.compiled = 0  # grammars compiled (cache misses)

    def compile(self, spec: dict[str, Any]) -> Any:
        """A checked spec -> xgrammar ``CompiledGrammar``; ``OpError`` bad_request when the
        engine cannot compile it (the message names the problem)."""
        key = canonical(spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError with its C++ message
            raise OpError(ErrorCode.BAD_REQUEST,
                          f"argument 'grammar' cannot be compiled: {_message(exc)}") from None
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: dict[str, Any]) -> Any:
        kind, compiler = spec["type"], self._compiler
        if kind == "json_object":
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                strict_mode=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(spec["schema"]),
                                                any_whitespace=False, strict_mode=True)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(spec["structural_tag"]))
        if kind == "regex":
            return compiler.compile_regex(spec["regex"])
        return compiler.compile_grammar(spec["ebnf"])


def _message(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text[:500]


def grammars_for(loaded: Any) -> Grammars:
    """The loaded model's ``Grammars``, made at first use (any thread)."""
    with _LOCK:
        grammars = getattr(loaded, "grammars", None)
        if grammars is None:
            grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
            loaded.grammars = grammars
        return grammars


class SequenceGrammar:
    """One sequence's grammar state (engine thread only, but for construction)."""

    __slots__ = ("compiled", "matcher", "terminated")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.matcher: Any = None
        self.terminated = False

    def matcher_now(self) -> Any:
        if self.matcher is None:
            self.matcher = _xgr().GrammarMatcher(self.compiled)
        return self.matcher

    def accept(self, token: int) -> None:
        """Advance with the sequence's new token; a token the grammar refuses (it cannot be,
        the mask forbade it) ends the sequence rather than the engine."""
        matcher = self.matcher_now()
        if not matcher.accept_token(int(token)):
            log.warning("grammar_rejected_token", token=int(token))
            self.terminated = True
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
    if logits.shape[-1] > vocab:  # logits past the tokenizer's ids are never grammatical
        logits[torch.tensor(rows, device=logits.device), vocab:] = float("-inf")
