"""Engine calls other than ``generate``: KV session ops, held sequences, embeddings.

Everything here runs on the engine thread, at a step boundary (``PagedEngine.call`` queues
it), so session and block bookkeeping is never touched concurrently with a step.
``EngineCalls`` is handed the parts it works on (the KV cache manager, the scheduler, the
sequence limits, the model, and the disk tier once attached), never the engine.

Held sequences (``forward`` / ``decode_next`` / ``kv_session.load``) belong to the
connection (``owner``) that made them and are freed when it closes (``release_owner``).
Between calls they are ``PARKED``: they keep their blocks and the logits of their last
position and are not scheduled. A call appends tokens and resumes the sequence in the
scheduler, so its KV is computed in the same batched forward as every other request; the
call is answered (``done``) when that step produced the last position's logits.
``decode_next`` samples from the kept logits first, so one call = one token = one step.

``embed`` is a stepped call: the engine loop embeds a bounded share of its inputs per
iteration (``embed_step``), between the batched steps, so running generations keep
producing tokens while a long embed is in flight.

Cancelling (``cancel``, by the ``done`` callback a call was queued with): an embed in
progress is dropped with what it computed; a ``forward`` or ``decode_next`` in flight frees
its sequence, since the client can no longer know which of its tokens have KV.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError, pack_array
from station.core.disk_sessions import DiskSession
from station.core.requests import CallDone, EngineCallHandler, SamplingParams, SequenceLimits
from station.core.kv_manager import KVCacheManager
from station.core.kv_results import LoadPlan, SessionOutcome
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence, SequenceKind, SequenceStatus
from station.core.sessions import KVSession
from station.engine import pinning
from station.engine.state import HeldState, RequestState
from station.sampling.sample import make_generator, sample

if TYPE_CHECKING:
    from station.tier.disk_tier import DiskTier

log = get_logger(__name__)

_PENDING = object()  # the call is answered later, from on_logits / fail


def _error(code: ErrorCode, message: str) -> OpError:
    return OpError(code, message)


@dataclass(slots=True, eq=False)
class EmbedJob:
    owner: Any
    done: CallDone
    token_lists: list[list[int]]
    vectors: list[torch.Tensor] = field(default_factory=list)  # one per input embedded so far


class EngineCalls:
    """Each public call method is an op's engine-thread handler (``station.serving.op_registry``)."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, limits: SequenceLimits,
                 model: Any, device: torch.device) -> None:
        """``model``: the loaded transformers model (``embed`` runs its ``base_model``)."""
        self.kv = kv
        self.scheduler = scheduler
        self.limits = limits
        self.model = model
        self.device = device
        self.tier: DiskTier | None = None  # the disk tier, once the engine attached it
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count(1)
        self.embeds: collections.deque[EmbedJob] = collections.deque()  # in progress, round robin
        self.embed_inputs_done = 0  # inputs embedded since start (stats)
        # kv_session.load calls waiting for a disk read: (DiskSession, owner, done)
        self.disk_waits: list[tuple[DiskSession, Any, CallDone]] = []

    # -- dispatch
    @staticmethod
    def makes_sequence(handler: EngineCallHandler, kwargs: dict[str, Any]) -> bool:
        """A call that adds a new sequence to the waiting queue (the engine bounds those)."""
        return (handler is EngineCalls.forward and kwargs.get("seq_id") is None
                and not kwargs.get("release"))

    def run(self, handler: EngineCallHandler, owner: Any, done: CallDone | None,
            kwargs: dict[str, Any]) -> None:
        if handler is EngineCalls.release_owner:  # queued by the engine itself: no answer
            self.release_owner(owner)
            return
        assert done is not None
        try:
            result = handler(self, owner, done, **kwargs)
        except OpError as exc:
            answer(done, None, exc)
            return
        except Exception as exc:  # a bug in one call must not take the engine down
            log.exception("engine_call_failed", call=handler.__name__)
            answer(done, None, _error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if result is not _PENDING:
            answer(done, result, None)

    # -- KV sessions
    def kv_save(self, owner: Any, done: CallDone, session_id: str, prefix_len: int,
                tenant: str = "", tokens: list[int] | None = None,
                seq_id: str | None = None) -> dict[str, Any]:
        if seq_id is not None:
            seq = self._owned(owner, seq_id)
            if prefix_len > seq.num_tokens:
                raise _error(ErrorCode.BAD_REQUEST, f"prefix_len {prefix_len} exceeds the "
                             f"sequence's {seq.num_tokens} tokens")
            num = self.kv.pin_sequence(session_id, seq, prefix_len)
            return {"session_id": session_id, "num_tokens": num}
        tokens = list(tokens or [])
        if prefix_len > len(tokens):
            raise _error(ErrorCode.BAD_REQUEST, f"prefix_len {prefix_len} exceeds the "
                         f"{len(tokens)} tokens given")
        bs = self.kv.block_size
        num_blocks = prefix_len // bs
        blocks = self.kv.resident_blocks(tokens[:num_blocks * bs], tenant)
        if len(blocks) < num_blocks:
            raise _error(ErrorCode.NOT_FOUND, f"the KV of the first {num_blocks * bs} tokens "
                         f"is not resident (block {len(blocks)} missing)")
        self.kv.pin(session_id, tenant, tokens[:num_blocks * bs], blocks)
        return {"session_id": session_id, "num_tokens": num_blocks * bs}

    def kv_load(self, owner: Any, done: CallDone, session_id: str) -> Any:
        session = self.kv.get_session(session_id)
        if session is not None:
            return self._park_session(owner, session)
        on_disk = self.kv.disk.get(session_id)
        if on_disk is None or self.tier is None:
            raise _error(ErrorCode.NOT_FOUND, f"no KV session {session_id!r}")
        if not on_disk.loading:  # else a request is reading it back already: wait for that
            plan = self.kv.begin_load(on_disk)
            if plan is None:
                raise _error(ErrorCode.CAPACITY, f"no room in the KV pool to read KV session "
                             f"{session_id!r} back from disk")
            self.tier.submit_loads([plan])
        self.disk_waits.append((on_disk, owner, done))
        return _PENDING

    def _park_session(self, owner: Any, session: KVSession) -> dict[str, Any]:
        seq = self._new_seq(owner, list(session.token_ids), session.tenant, None)
        self.scheduler.park_loaded(seq, session)
        return {"seq_id": seq.seq_id, "num_tokens": seq.num_tokens}

    def on_load_done(self, plan: LoadPlan, error: SessionOutcome | None) -> None:
        """The disk tier read a session back (or could not): admit the scheduler's waiters,
        answer the ``kv_session.load`` calls waiting for it."""
        self.scheduler.on_load_done(plan, error)
        for wait in [w for w in self.disk_waits if w[0] is plan.session]:
            self.disk_waits.remove(wait)
            _, owner, done = wait
            session = self.kv.get_session(plan.session.session_id)
            if session is None:
                answer(done, None, _error(ErrorCode.NOT_FOUND, f"KV session "
                       f"{plan.session.session_id!r} could not be read back ({error or 'deleted'})"))
            else:
                answer(done, self._park_session(owner, session), None)

    def kv_delete(self, owner: Any, done: CallDone, session_id: str | None = None,
                  tenant: str | None = None, forget: bool = False,
                  every: bool = False) -> dict[str, Any]:
        return pinning.delete_sessions(self.kv, self.tier, session_id, tenant, forget, every)

    def kv_list(self, owner: Any, done: CallDone, include_tokens: bool = False,
                tenant: str | None = None) -> dict[str, Any]:
        return pinning.list_sessions(self.kv, include_tokens, tenant)

    # -- held sequences
    def forward(self, owner: Any, done: CallDone, tokens: list[int], seq_id: str | None = None,
                tenant: str = "", load_session: str | None = None,
                release: bool = False) -> Any:
        if seq_id is None:
            if release:
                raise _error(ErrorCode.BAD_REQUEST, "release needs a seq_id")
            if not tokens:
                raise _error(ErrorCode.BAD_REQUEST, "forward of a new sequence needs tokens")
            self._check_room(tokens)
            seq = self._new_seq(owner, list(tokens), tenant, load_session)
            state = held_state(seq)
            state.pending, state.kind, state.new = done, "forward", True
            self.scheduler.add(seq)
            return _PENDING
        seq = self._owned(owner, seq_id)
        state = held_state(seq)
        if release:
            if tokens:
                raise _error(ErrorCode.BAD_REQUEST, "release takes no tokens")
            num = seq.num_tokens
            self._free(seq, _error(ErrorCode.CANCELLED, "the sequence was released"))
            return {"seq_id": seq_id, "num_tokens": num, "cached_tokens": 0, "released": True}
        self._check_idle(seq)
        if not tokens:
            raise _error(ErrorCode.BAD_REQUEST, "forward needs tokens (or release: true)")
        self._check_room(tokens, held=seq.num_tokens)
        seq.token_ids.extend(tokens)
        state.pending, state.kind, state.new = done, "forward", False
        self.scheduler.resume(seq)
        return _PENDING

    def decode_next(self, owner: Any, done: CallDone, seq_id: str, temperature: float = 1.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Any:
        seq = self._owned(owner, seq_id)
        state = held_state(seq)
        self._check_idle(seq)
        if state.logits is None:
            raise _error(ErrorCode.BAD_REQUEST, "the sequence has no logits yet: forward at "
                         "least one token first")
        self._check_room([], held=seq.num_tokens, room=1)
        # Checked on the wire (its bounds raise bad_request): a call from code meets them too.
        params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed)
        generator = make_generator(seed, self.device)
        token = int(sample(state.logits[None], [params], [generator])[0])
        seq.token_ids.append(token)
        state.pending, state.kind, state.token_id = done, "decode_next", token
        self.scheduler.resume(seq)  # its KV is computed in the next batched step
        return _PENDING

    def on_logits(self, seq: Sequence, logits: torch.Tensor) -> None:
        """A step produced the last position's logits of a held sequence: answer its call."""
        state = held_state(seq)
        assert seq.num_uncomputed_tokens == 0
        state.logits = logits.clone()  # a row of the step's [K, V]: do not keep the whole tensor
        self.scheduler.park(seq)
        done, state.pending = state.pending, None
        assert done is not None, "a held sequence ran without a call"
        if state.kind == "decode_next":
            answer(done, {"token_id": state.token_id, "num_tokens": seq.num_tokens}, None)
            return
        answer(done, {"seq_id": seq.seq_id, "num_tokens": seq.num_tokens,
                      "cached_tokens": seq.num_admitted_cached_tokens if state.new else 0,
                      **session_fields(seq)}, None)

    def fail(self, seq: Sequence, error: OpError) -> None:
        """The sequence ended (its blocks are released): forget it, fail its pending call."""
        self.seqs.pop(seq.seq_id, None)
        state = held_state(seq)
        done, state.pending = state.pending, None
        if done is not None:
            answer(done, None, error)

    def release_owner(self, owner: Any) -> None:
        closed = _error(ErrorCode.CANCELLED, "the connection closed")
        for seq in [s for s in self.seqs.values() if held_state(s).owner == owner]:
            self._free(seq, closed)
        self._drop_waits(lambda wait: wait[1] == owner, closed)
        for job in [j for j in self.embeds if j.owner == owner]:
            self.embeds.remove(job)
            answer(job.done, None, closed)

    def cancel(self, dones: set[CallDone]) -> None:
        """Drop the in-flight calls whose ``done`` is in ``dones``, freeing what they held."""
        cancelled = _error(ErrorCode.CANCELLED, "request cancelled")
        for seq in [s for s in self.seqs.values() if held_state(s).pending in dones]:
            self._free(seq, cancelled)
        self._drop_waits(lambda wait: wait[2] in dones, cancelled)
        for job in [j for j in self.embeds if j.done in dones]:
            self.embeds.remove(job)
            answer(job.done, None, cancelled)

    def _drop_waits(self, which: Callable[[Any], bool], error: OpError) -> None:
        """Answer and forget the disk waits ``which`` picks (the read goes on: its session
        becomes resident)."""
        for wait in [w for w in self.disk_waits if which(w)]:
            self.disk_waits.remove(wait)
            answer(wait[2], None, error)

    def shutdown(self) -> None:
        self._drop_waits(lambda wait: True, _error(ErrorCode.SHUTTING_DOWN, "the station is shutting down"))
        for seq in list(self.seqs.values()):
            self.fail(seq, _error(ErrorCode.SHUTTING_DOWN, "the station is shutting down"))
        while self.embeds:
            answer(self.embeds.popleft().done, None,
                   _error(ErrorCode.SHUTTING_DOWN, "the station is shutting down"))

    # -- embeddings
    def embed(self, owner: Any, done: CallDone, token_lists: list[list[int]]) -> Any:
        self.embeds.append(EmbedJob(owner, done, token_lists))
        return _PENDING

    def embed_step(self, token_budget: int) -> None:
        """One share of the oldest embed's work: its next input, then more while they fit
        ``token_budget`` tokens; the job then goes to the back of the line."""
        job = self.embeds.popleft()
        try:
            spent = 0
            while len(job.vectors) < len(job.token_lists):
                ids = job.token_lists[len(job.vectors)]
                if spent and spent + len(ids) > token_budget:
                    break
                job.vectors.append(self._embed_one(ids))
                self.embed_inputs_done += 1
                spent += len(ids)
        except Exception as exc:  # a bug or a failed forward ends this call only
            log.exception("embed_failed")
            answer(job.done, None, _error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        if len(job.vectors) < len(job.token_lists):
            self.embeds.append(job)
            return
        array = torch.stack(job.vectors).cpu().numpy()
        answer(job.done, {"embeddings": pack_array(array), "dim": int(array.shape[1]),
                          "num_tokens": [len(ids) for ids in job.token_lists]}, None)

    def _embed_one(self, ids: list[int]) -> torch.Tensor:
        """Mean of the final hidden states, L2-normalised. One text per forward: no padding,
        so no mask (outside a step the paged attention function is plain causal SDPA)."""
        base = self.model.base_model  # the decoder without lm_head
        with torch.inference_mode():
            hidden = base(input_ids=torch.tensor([ids], device=self.device),
                          use_cache=False).last_hidden_state[0].float()  # [T, H]
            pooled = hidden.mean(dim=0)
            return pooled / pooled.norm().clamp_min(1e-12)

    # -- internals
    def _new_seq(self, owner: Any, tokens: list[int], tenant: str,
                 load_session: str | None) -> Sequence:
        seq_id = f"h{next(self._ids)}"
        seq = Sequence(
            seq_id, tokens, SamplingParams(max_tokens=1), kind=SequenceKind.HELD,
            extra_keys=self.kv.extra_keys(tenant), tenant=tenant, load_session=load_session,
            user=RequestState(None, frozenset(), held=HeldState(owner)),
        )
        self.seqs[seq_id] = seq
        return seq

    def _owned(self, owner: Any, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None or held_state(seq).owner != owner:  # another connection's: not yours
            raise _error(ErrorCode.NOT_FOUND, f"no held sequence {seq_id!r} on this connection")
        return seq

    def _check_idle(self, seq: Sequence) -> None:
        if held_state(seq).pending is not None:
            raise _error(ErrorCode.BAD_REQUEST, f"sequence {seq.seq_id!r} already has a call "
                         "in flight")
        assert seq.status is SequenceStatus.PARKED

    def _check_room(self, token_ids: list[int], *, held: int = 0, room: int = 0) -> None:
        self.limits.check(token_ids, room=room, held=held, what="the sequence")

    def _free(self, seq: Sequence, error: OpError) -> None:
        self.scheduler.finish(seq, "cancelled")  # releases its blocks, whatever its state
        self.fail(seq, error)


def request_state(seq: Sequence) -> RequestState:
    """The engine's bookkeeping of ``seq`` (every sequence the engine made has one)."""
    assert seq.user is not None, f"sequence {seq.seq_id!r} has no request state"
    return seq.user


def held_state(seq: Sequence) -> HeldState:
    """The pending-call state of a held sequence."""
    held = request_state(seq).held
    assert held is not None, f"sequence {seq.seq_id!r} is not held"
    return held


def session_fields(seq: Sequence) -> dict[str, Any]:
    """What became of a sequence's ``load_session``, as the prefill event and ``forward`` report it."""
    loaded = seq.session_outcome == SessionOutcome.LOADED
    return {"session_loaded": loaded, "session_id": seq.loaded_session,
            "session_tokens": seq.num_session_tokens if loaded else 0,
            "session_tier": seq.session_tier if loaded else None,
            "session_error": None if loaded or seq.session_outcome is None
            else str(seq.session_outcome)}


def answer(done: CallDone, result: dict[str, Any] | None, error: OpError | None) -> None:
    try:
        done(result, error)
    except Exception:  # a broken callback must not kill the engine thread
        log.exception("engine_call_callback_failed")
