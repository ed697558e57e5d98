"""What the engine keeps per sequence beside the scheduler's view (``Sequence.user``): a
generate's event callback and sessions to save, or a held sequence's pending call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from station.core.pins import PinPlan
from station.core.requests import CallDone, EventCallback

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, eq=False)
class HeldState:
    owner: Any  # the connection that made the held sequence (freed when it closes)
    pending: CallDone | None = None  # the call waiting for this sequence's next logits
    kind: str = ""  # "forward" | "decode_next"
    new: bool = False  # the pending forward created the sequence
    token_id: int | None = None  # the token decode_next sampled
    logits: torch.Tensor | None = None  # [V] float32 of the last position


@dataclass(slots=True)
class RequestState:
    """Per-request bookkeeping the scheduler never looks at (``Sequence.user``): a
    generate's event callback and sessions to save, or a held sequence's ``HeldState``."""

    on_event: EventCallback | None  # None for a held sequence
    stop_ids: frozenset[int]
    save_session: str | None = None
    save_final_session: str | None = None
    pins: tuple[PinPlan, ...] = ()  # saved when the prefill ends (station.engine.pinning)
    final_saved: bool = False
    final_save_error: str | None = None
    held: HeldState | None = None  # set for held sequences (forward/decode_next)
    prompt_lps: list[Any] | None = None  # prompt_logprobs so far (station.sampling.logprobs)
    arrival: float = field(default_factory=time.perf_counter)

