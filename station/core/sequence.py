"""One generation request's state inside the engine (pure Python).

A sequence's status changes only through ``Sequence.change_status``, which asserts the
change is in ``TRANSITIONS``::

    WAITING --admitted / forked--> RUNNING --preempted--> WAITING
    WAITING --kv_session.load--> PARKED <--call done-- RUNNING
    PARKED --resumed (a call appended tokens)--> RUNNING
    WAITING | RUNNING | PARKED --finished / aborted / no room--> FINISHED (terminal)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from station.core.block_pool import BlockHash, ExtraKeys, KVBlock
from station.core.disk_sessions import DiskSession
from station.core.requests import SamplingParams

if TYPE_CHECKING:  # the engine's per-sequence state: named here, never used by the core
    from station.engine.state import RequestState
    from station.sampling.logits import SequenceSampling


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # a held sequence between calls: holds blocks, not scheduled
    FINISHED = "finished"


S = SequenceStatus
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    S.WAITING: frozenset({S.RUNNING, S.PARKED, S.FINISHED}),
    S.RUNNING: frozenset({S.WAITING, S.PARKED, S.FINISHED}),
    S.PARKED: frozenset({S.RUNNING, S.FINISHED}),
    S.FINISHED: frozenset(),  # terminal: its blocks are released
}


class IllegalTransition(AssertionError):
    """A status change the table does not allow: a bug in the engine, never user input."""


class SequenceKind(enum.Enum):
    GENERATE = "generate"  # a generate request: the engine samples and streams its tokens
    HELD = "held"  # a held sequence (forward/decode_next): its caller drives it, call by call


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt + generated so far
    params: SamplingParams
    extra_keys: ExtraKeys = ()
    kind: SequenceKind = SequenceKind.GENERATE
    tenant: str = ""  # whose sessions it may load (its blocks are keyed by extra_keys)
    load_session: str | None = None  # the KV session it starts from, if any
    match_session: bool = False  # without load_session: start from the tenant's best match
    num_prompt_tokens: int = 0
    # Tokens whose K/V are in the pool; the tokens after it are fed in the next forward.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at (first) admission
    num_admitted_cached_tokens: int = 0  # the same at the latest admission
    num_pin_read_tokens: int = 0  # of num_cached_tokens: held by the tenant's live TTL pins
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    # What became of load_session at (first) admission: a kv_manager.SessionOutcome value,
    # None when no session was asked for; and the prompt tokens the session served.
    session_outcome: str | None = None
    num_session_tokens: int = 0
    loaded_session: str | None = None  # the session it started from (asked for or matched)
    session_tier: str | None = None  # where that session's KV was: "pool" | "host" | "disk"
    # The disk tier: admission found its session on disk and is reading it back (the
    # sequence waits, others are admitted past it); or that read failed its checks.
    awaiting_load: DiskSession | None = None  # the disk session being read back
    loaded_tier: str | None = None  # its session was read back from this tier: "host" | "disk"
    load_error: str | None = None  # its disk session could not be read back (a SessionOutcome)
    prefill_reported: bool = False  # PREFILL is sent once, not again after a preemption
    finish_reason: str | None = None
    num_preemptions: int = 0
    # The engine's sampling state (generator, token counts for penalties; opaque here),
    # None for a held sequence (its caller samples).
    sampling: SequenceSampling | None = None
    user: RequestState | None = None  # the engine's per-request bookkeeping (callback, timings)
    # Top alternatives to report per sampled token / per prompt token (None:
    # not asked; a prompt_logprobs sequence keeps every prompt row's logits and takes no
    # prefix-cache hit); the choices forked from this one once its prompt is prefilled.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    forks: list[Sequence] = field(default_factory=list)
    # The logits after the prompt's last token (a copy of its prefill's row), kept with the
    # block that ends the prompt when it leaves the pool (``station.core.prompt_ends``);
    # ``start_logits``: admission took every prompt token's KV and these logits after the
    # last one, so its first step samples them and computes nothing.
    end_logits: Any = None
    start_logits: Any = None
    _status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    # -- the one place the status changes
    @property
    def status(self) -> SequenceStatus:
        return self._status

    def change_status(self, new: SequenceStatus) -> None:
        """Move to ``new``; raises ``IllegalTransition`` when ``TRANSITIONS`` does not allow it."""
        if new not in TRANSITIONS[self._status]:
            raise IllegalTransition(f"sequence {self.seq_id!r}: {self._status.value} -> "
                                    f"{new.value} is not allowed")
        self._status = new

    def finish(self, reason: str | None) -> None:
        """End the sequence with ``reason`` (its owner has released its blocks)."""
        self.change_status(SequenceStatus.FINISHED)
        self.finish_reason = reason

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the one newest token still needs a forward (prompt or recompute)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
