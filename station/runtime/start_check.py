"""The engine proves itself before the station serves: its paged path against the model's
own forward, on a probe longer than the model's longest attention window.

``attention_kinds`` reads what each layer computes and refuses what the paged attention does
not implement; this check proves that what it does implement gives the model's answer, on
the paths a request takes. Through the engine itself (scheduler, KV pool, runner, the same
decode plan that will serve), on the torch thread before the socket is up:

1. a probe prompt longer than the longest window (a few blocks when every layer is full),
   with ``prompt_logprobs``: every prompt position through the prefill chunks, then a few
   greedy decode tokens alone;
2. the same prompt again (a prefix hit: the offset chunk over cached blocks) beside a second
   prompt (a prompt chunk next to decode rows), both then decoding as one batch.

Every logprob of a prompt or generated token is compared with ``log_softmax`` of the model's
own forward (transformers' ``eager`` attention, the model's definition, with the model's
own masks) over the same tokens. A disagreement beyond ``tolerance`` refuses the model
(``ModelRefused``, kind ``start check``): never served wrong. Afterwards the probe leaves
nothing behind (its blocks uncached, the engine's counters at zero).

The tolerance is the path's arithmetic, not the attention's: float paths agree with the
model's forward to about 1e-5 in a logprob; the C step (``cpu_step``, only for models whose
layers all attend to the whole context) rounds activations to 15 bits where torch's int4
kernels round them to bfloat16, so its logprobs part from the model's int4 forward by about
1e-2 and its check is looser (``STEP_TOLERANCE``).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from station.core.requests import Failed, Finished, GenerationRequest, SamplingParams, Token
from station.runtime.model_errors import ModelRefused

log = get_logger(__name__)

TOLERANCE = 2e-3  # largest |logprob difference| a float or torch-quantized path may show
STEP_TOLERANCE = 0.25  # the C step's own arithmetic (see the module docstring)
DECODE_TOKENS = 3
PROBE_ID = "gnosis-start-check"


@dataclass(frozen=True, slots=True)
class StartCheck:
    """What the check ran and found (``hello``, ``health`` and the start log show it)."""

    probe_tokens: int
    longest_window: int | None
    compared: int  # logprobs compared
    max_abs_diff: float
    tolerance: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"passed": True, "probe_tokens": self.probe_tokens, "longest_window": self.longest_window,
                "logprobs_compared": self.compared, "max_abs_logprob_diff": round(self.max_abs_diff, 6),
                "tolerance": self.tolerance, "seconds": round(self.seconds, 3)}


def probe_length(longest_window: int | None, block_size: int, max_model_len: int,
                 num_blocks: int) -> int:
    """Past the longest window by two blocks and a few tokens (so every kind of row sees a
    window's edge), four blocks and a few when no layer has a window; within the context,
    and two probes at once within the pool (no request can outgrow either: a window longer
    than both never binds)."""
    want = (longest_window or 2 * block_size) + 2 * block_size + 3
    pool = num_blocks * block_size // 2 - block_size - DECODE_TOKENS
    return max(2, min(want, max_model_len - DECODE_TOKENS - 1, pool))


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
    tolerance = STEP_TOLERANCE if runner.stepped else TOLERANCE
    runs = [_Probe(engine, "a", first, prompt_logprobs=True)]
    engine.drain()  # 1: the probe alone (prefill chunks, then single-stream decodes)
    runs.append(_Probe(engine, "b", first, prompt_logprobs=False))
    if engine.settings.max_waiting_requests < 2:
        engine.drain()  # one waiting request at most: the two run one after the other
    runs.append(_Probe(engine, "c", second, prompt_logprobs=True))
    engine.drain()  # 2: a prefix hit beside a new prompt, then a batch of two decodes
    try:
        worst, compared = 0.0, 0
        for run in runs:
            if run.error is not None or not run.done.is_set():
                raise ModelRefused(loaded.model_type, "start check",
                                   f"the engine could not run its start-check probe: {run.error}")
            got = run.logprobs()
            want = _reference(loaded.model, run.prompt + run.tokens, run.positions())
            worst = max(worst, float((got - want).abs().max()))
            compared += got.numel()
    finally:
        _forget_probe(engine)
    check = StartCheck(length, kinds.longest_window, compared, worst, tolerance,
                       time.perf_counter() - started)
    if not worst <= tolerance:  # NaN too
        raise ModelRefused(loaded.model_type, "start check",
                           f"the paged engine's logprobs differ from the model's own forward by "
                           f"{worst:.3g} (tolerance {tolerance:g}) on a {length}-token probe "
                           f"(attention: {kinds.summary()['kinds']})")
    log.info("start_check_passed", **check.as_dict())
    return check


class _Probe:
    """One probe request through the engine; its events collected."""

    def __init__(self, engine: Any, name: str, prompt: list[int], prompt_logprobs: bool) -> None:
        self.prompt = prompt
        self.prompt_lps: list[float] = []
        self.token_lps: list[float] = []
        self.tokens: list[int] = []
        self.error: Any = None
        self.done = threading.Event()
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"{PROBE_ID}-{name}", list(prompt), params, logprobs=0,
                                             prompt_logprobs=0 if prompt_logprobs else None), self)

    def __call__(self, event: Any) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.token_id)
            self.token_lps.append(event.logprobs.logprob)
        elif isinstance(event, Finished):
            self.done.set()
        elif isinstance(event, Failed):
            self.error = event.error
            self.done.set()
        elif getattr(event, "prompt_logprobs", None):
            self.prompt_lps = [entry.logprob for entry in event.prompt_logprobs[1:]]

    def positions(self) -> list[int]:
        """The positions whose next-token logprob is compared (row p predicts token p + 1)."""
        n = len(self.prompt)
        prompt = list(range(n - 1)) if self.prompt_lps else []
        return prompt + list(range(n - 1, n - 1 + len(self.tokens)))

    def logprobs(self) -> torch.Tensor:
        return torch.tensor(self.prompt_lps + self.token_lps, dtype=torch.float64)


def _reference(model: Any, tokens: list[int], positions: list[int]) -> torch.Tensor:
    """log_softmax of the model's own forward (eager attention) at ``positions``, for the
    token after each."""
    from station.runtime.paged_attention import ATTN_IMPLEMENTATION

    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    rows = torch.tensor(positions, device=device)
    targets = ids[0, rows + 1]
    lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    return lp.gather(1, targets[:, None])[:, 0].double().cpu()


def _forget_probe(engine: Any) -> None:
    """Nothing of the probe stays: no cached block, no figure."""
    engine.kv.pool.reset_prefix_cache()
    sched = engine.scheduler
    sched.prefix_cache_queries_tokens = sched.prefix_cache_hits_tokens = 0
    sched.prefill_tokens = sched.num_preemptions = 0
    engine.num_steps = 0
