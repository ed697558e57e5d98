"""The engine proves itself before the station serves: its paged path against the model's
own forward, on a probe longer than the model's longest attention window.

``attention_kinds`` reads what each layer computes and refuses what the paged attention does
not implement; this check proves that what it does implement gives the model's answer, on
the paths a request takes. Through the engine itself (scheduler, KV pool, runner, the same
decode plan that will serve: ``station.plan.choose``; the record names the plan's path), on
the torch thread before the socket is up:

1. a probe prompt longer than the longest window (a few blocks when every layer is full),
   prefilled in the engine's chunks, then ``DECODE_TOKENS`` greedy tokens decoded alone;
2. the same prompt again (a prefix hit: its last token computed at an offset over cached KV)
   beside a second prompt (a prompt chunk next to decode rows), both then decoding as one batch.

At every decoded position the logprobs of the engine's top ``TOP`` tokens and of the token it
chose are compared with ``log_softmax`` of the model's own forward over the same tokens
(transformers' ``eager`` attention: the model's definition, with the model's own masks). A
decode position past the window depends on every layer's attention at every earlier
position (the prompt rows' K/V, made by the chunks, feed the deeper layers), so a wrong
window anywhere shows there.

How close is close enough is measured, not assumed: the model's own forward is computed
again in two chunks over transformers' own cache, and with SDPA attention where every layer
has an SDPA form, and the largest difference between its answers is the model's own
arithmetic noise on this machine. Float weights agree with themselves to about 1e-5 in a
logprob; torch's int4 and int8 kernels round their activations to bfloat16, which turns the
smallest change of summation order (SDPA against eager attention) into logprob differences
of 0.1-0.2. The tolerance is ``NOISE_FACTOR`` times that noise, and never below
``TOLERANCE`` (``STEP_TOLERANCE`` where the C step serves: its 15-bit activations are its own
arithmetic, which the model's forward does not share). A difference beyond it refuses the
model (``ModelRefused``, kind ``start check``): never served wrong. Afterwards the probe
leaves nothing behind (its blocks uncached, the engine's counters at zero).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from station.core.requests import Choices, Failed, Finished, GenerationRequest, SamplingParams, Token
from gnosis_daemon.atomic_files import write_json
from station.model.errors import ModelRefused
from station.model.loader import cache_base
from station.kernels.quantized import machine_tag

log = get_logger(__name__)

TOLERANCE = 2e-3  # the least tolerance: |logprob difference| at float precision
STEP_TOLERANCE = 0.25  # the least where the C step serves (its own arithmetic)
NOISE_FACTOR = 4.0  # tolerance = this x the model's own disagreement with itself
DECODE_TOKENS = 4
TOP = 5  # logprobs compared per decoded position: the engine's top 5 and its choice
PROBE_ID = "gnosis-start-check"


@dataclass(frozen=True, slots=True)
class StartCheck:
    """What the check ran and found (``hello``, ``health`` and the start log show it)."""

    probe_tokens: int
    longest_window: int | None
    compared: int  # logprobs compared
    max_abs_diff: float  # the engine against the model's own forward
    noise: float  # the model's own forward against itself, computed in two chunks
    tolerance: float
    seconds: float
    plan: dict[str, Any]  # the decode plan's path the probe ran through (``DecodePlan.path``)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": True, "plan": self.plan, "probe_tokens": self.probe_tokens,
                "longest_window": self.longest_window,
                "logprobs_compared": self.compared, "max_abs_logprob_diff": round(self.max_abs_diff, 6),
                "reference_noise": round(self.noise, 6), "tolerance": round(self.tolerance, 6),
                "seconds": round(self.seconds, 3)}


def probe_length(longest_window: int | None, block_size: int, max_model_len: int,
                 num_blocks: int) -> int:
    """Past the longest window by two blocks and a few tokens (so every kind of row sees a
    window's edge), four blocks and a few when no layer has a window; within the context,
    and two probes at once within the pool (no request can outgrow either: a window longer
    than both never binds)."""
    want = (longest_window or 2 * block_size) + 2 * block_size + 3
    pool = num_blocks * block_size // 2 - block_size - DECODE_TOKENS
    return max(2, min(want, max_model_len - DECODE_TOKENS - 1, pool))


def prove_engine(engine: Any, settings: Any) -> dict[str, Any]:
    """The station's start check, as ``hello`` shows it: with ``start_check = auto`` the
    record of a check that passed for exactly this model, station build, machine and decode
    plan (``record_key``) is trusted, as the host trusts a capability flag; otherwise, or
    without one, ``check_engine`` runs and a pass is recorded. Raises ``ModelRefused``."""
    path = None
    if settings.start_check == "auto":
        path = cache_base(settings) / "start-checks" / f"{record_key(engine)}.json"
        record = _read_record(path)
        if record is not None:
            log.info("start_check_trusted", record=str(path), **record)
            return {**record, "trusted": True}
    check = check_engine(engine).as_dict()
    if path is not None:
        _write_record(path, check)
    return {**check, "trusted": False}


def record_key(engine: Any) -> str:
    """What a passed check proves, and so what its record is keyed by: the model (its
    fingerprint: weights, their forms, each layer's attention), every source file of the
    station, torch, transformers, the CPU and GPU, and the decode plan and engine shape the
    probe ran through. Anything else changed: the check runs again."""
    import transformers

    loaded, settings = engine.loaded, engine.settings
    ident = {"fingerprint": loaded.fingerprint, "station": source_digest(), "machine": machine_tag(),
             "transformers": transformers.__version__, "device": str(loaded.device),
             "dtype": str(loaded.dtype), "plan": engine.runner.plan.path(),
             "engine": [engine.block_size, engine.max_model_len, engine.kv.pool.num_blocks,
                        settings.prefill_chunk_tokens, settings.max_batch_size,
                        settings.max_waiting_requests >= 2]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over every source file of the station package (names and bytes)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("passed") is True else None


def _write_record(path: Path, check: dict[str, Any]) -> None:
    """Atomically (a temp file renamed): a crash never leaves half a record to trust."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {**check, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                   mode=0o644)
    except OSError as exc:  # the check passed; only the next start will run it again
        log.warning("start_check_not_recorded", path=str(path), error=str(exc))


def check_engine(engine: Any) -> StartCheck:
    """Run the probe through ``engine`` (its loop not started: run on this thread) and
    compare with the model's own forward; raises ``ModelRefused`` when they disagree."""
    started = time.perf_counter()
    loaded, runner = engine.loaded, engine.runner
    kinds = runner.kinds
    length = probe_length(kinds.longest_window, engine.block_size, engine.max_model_len,
                          engine.kv.pool.num_blocks)
    rng = random.Random(0)
    specials = set(loaded.eos_token_ids)
    vocab = [i for i in range(min(loaded.vocab_size, len(loaded.tokenizer))) if i not in specials]
    first = [rng.choice(vocab) for _ in range(length)]
    second = [rng.choice(vocab) for _ in range(length)]
    runs = [_Probe(engine, "a", first)]
    engine.drain()  # 1: the probe alone (prefill chunks, then single-stream decodes)
    runs.append(_Probe(engine, "b", first))
    if engine.settings.max_waiting_requests < 2:
        engine.drain()  # one waiting request at most: the two run one after the other
    runs.append(_Probe(engine, "c", second))
    engine.drain()  # 2: a prefix hit beside a new prompt, then a batch of two decodes
    try:
        worst = noise = 0.0
        compared = 0
        seen: dict[tuple, torch.Tensor] = {}
        for run in runs:
            if run.error is not None or not run.done.is_set() or len(run.tokens) != DECODE_TOKENS:
                raise ModelRefused(loaded.model_type, "start check",
                                   f"the engine could not run its start-check probe: {run.error}")
            ids, got = run.compared()
            tokens = run.prompt + run.tokens
            key = (tuple(tokens), tuple(map(tuple, ids)))
            if key not in seen:  # the hit's tokens are the first probe's: computed once
                whole = _reference(loaded.model, tokens, ids, "eager", chunks=1)
                for other in _other_references(loaded.model, kinds, tokens, ids):
                    noise = max(noise, float((other - whole).abs().max()))
                seen[key] = whole
            worst = max(worst, float((got - seen[key]).abs().max()))
            compared += got.numel()
    finally:
        _forget_probe(engine)
    least = STEP_TOLERANCE if runner.plan.forward.chosen == "c-step" else TOLERANCE
    tolerance = max(least, NOISE_FACTOR * noise)
    check = StartCheck(length, kinds.longest_window, compared, worst, noise, tolerance,
                       time.perf_counter() - started, runner.plan.path())
    if not worst <= tolerance:  # NaN too
        raise ModelRefused(loaded.model_type, "start check",
                           f"the paged engine's logprobs differ from the model's own forward by "
                           f"{worst:.3g} (tolerance {tolerance:.3g}: {NOISE_FACTOR:g} x the forward's "
                           f"own noise {noise:.3g}, at least {TOLERANCE:g}) on a {length}-token probe "
                           f"(attention: {kinds.summary()['kinds']})")
    log.info("start_check_passed", **check.as_dict())
    return check


class _Probe:
    """One probe request through the engine; its events collected."""

    def __init__(self, engine: Any, name: str, prompt: list[int]) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.logprobs: list[Any] = []  # logprobs.TokenLogprobs per decoded token
        self.error: Any = None
        self.done = threading.Event()
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"{PROBE_ID}-{name}", list(prompt), params,
                                             choices=Choices(logprobs=TOP)), self)

    def __call__(self, event: Any) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.token_id)
            self.logprobs.append(event.logprobs)
        elif isinstance(event, Finished):
            self.done.set()
        elif isinstance(event, Failed):
            self.error = event.error
            self.done.set()

    def compared(self) -> tuple[list[list[int]], torch.Tensor]:
        """Per decoded position the token ids compared (the engine's top ones and its
        choice), and the engine's logprobs of them."""
        ids: list[list[int]] = []
        values: list[float] = []
        for entry in self.logprobs:
            pairs = dict(entry.top)
            pairs[entry.token_id] = entry.logprob
            ids.append(list(pairs))
            values.extend(pairs.values())
        return ids, torch.tensor(values, dtype=torch.float64)


def _other_references(model: Any, kinds: Any, tokens: list[int], ids: list[list[int]]) -> list[torch.Tensor]:
    """The same forward computed other ways the model allows, whose differences from the
    eager forward are the model's own arithmetic noise: in two halves over its cache, and
    with SDPA attention where every layer has an SDPA form (no soft-cap, no sinks)."""
    others = [_reference(model, tokens, ids, "eager", chunks=2)]
    if all(layer.fused for layer in kinds.layers):
        others.append(_reference(model, tokens, ids, "sdpa", chunks=1))
    return others


def _reference(model: Any, tokens: list[int], ids: list[list[int]], attention: str,
               chunks: int) -> torch.Tensor:
    """The model's own forward over ``tokens`` (transformers' ``attention`` implementation,
    with the model's own masks): the logprobs of ``ids[i]`` at the i-th of the last
    ``len(ids)`` positions that predict a token. ``chunks=2``: the same forward in two halves
    over transformers' own cache."""
    from transformers import DynamicCache

    from station.forward.paged_attention import ATTN_IMPLEMENTATION

    device = next(model.parameters()).device
    seq = torch.tensor([tokens[:-1]], device=device)  # the last token predicts nothing compared
    keep = len(ids)
    model.set_attn_implementation(attention)
    try:
        with torch.inference_mode():
            if chunks == 1:
                logits = model(input_ids=seq, use_cache=False, logits_to_keep=keep).logits
            else:
                half = seq.shape[1] // 2
                cache = DynamicCache(config=model.config)
                model(input_ids=seq[:, :half], cache=cache, use_cache=True, logits_to_keep=1)
                logits = model(input_ids=seq[:, half:], cache=cache, use_cache=True,
                               logits_to_keep=keep).logits
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    lp = torch.log_softmax(logits[0, -keep:].float(), dim=-1)
    return torch.cat([lp[i, row] for i, row in enumerate(ids)]).double().cpu()


def _forget_probe(engine: Any) -> None:
    """Nothing of the probe stays: no cached block, no figure."""
    engine.kv.pool.reset_prefix_cache()
    sched = engine.scheduler
    sched.prefix_cache_queries_tokens = sched.prefix_cache_hits_tokens = 0
    sched.prefill_tokens = sched.num_preemptions = 0
    engine.num_steps = 0
