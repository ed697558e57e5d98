"""What the KV cache manager's admission answers (``station.core.kv_manager``): a
sequence's session outcome, the blocks it can start from, a disk read-back's plan."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

from station.core.block_pool import KVBlock
from station.core.disk_sessions import DiskSession
from station.core.sessions import KVSession


class SessionOutcome(enum.StrEnum):
    """What became of a sequence's ``load_session`` (the values are the wire's ``session_error``)."""

    LOADED = "loaded"
    NOT_FOUND = "not_found"
    TENANT_MISMATCH = "tenant_mismatch"
    NO_COMMON_PREFIX = "no_common_prefix"
    QUARANTINED = "quarantined"  # it was on disk, and a file failed its checks on load
    UNREADABLE = "unreadable"  # it was on disk, and could not be read (file gone, I/O error, tier down)
    ON_DISK = "on_disk"  # not an outcome: the session must be read back first (begin_load)


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """The blocks a sequence can start from, found by ``find_computed_blocks`` (nothing taken yet)."""

    blocks: tuple[KVBlock, ...]  # a loaded session's blocks, then prefix-cache hits
    # Tokens whose KV is there: the blocks' and the tail's first tokens (any count past the
    # blocks, less than a block; the last prompt token only with ``end_logits``)
    num_cached_tokens: int
    session: KVSession | None = None  # the session loaded from, when one was
    session_outcome: SessionOutcome | None = None  # None: no session was asked for
    num_session_tokens: int = 0  # of num_cached_tokens: served by the session
    disk_session: DiskSession | None = None  # ON_DISK: the session to read back first
    # LOADED from a disk-tier session whose blocks the prefix cache still holds (freed, not
    # yet reused): served from the pool, nothing to read back
    cached_disk_session: DiskSession | None = None
    # A cached block (full or partial) after ``blocks`` whose first tokens are the prompt's
    # next ones: copied into the sequence's own fresh block, never shared
    tail: KVBlock | None = None
    # The tail ends the prompt (it holds its last token too), and these are the logits after
    # it (``station.core.prompt_ends``): nothing of the prompt is computed again
    end_logits: Any = None

    def __post_init__(self) -> None:
        loaded = self.session is not None or self.cached_disk_session is not None
        assert loaded == (self.session_outcome is SessionOutcome.LOADED)
        assert self.session is None or self.cached_disk_session is None
        assert (self.disk_session is not None) == (self.session_outcome is SessionOutcome.ON_DISK)

    @classmethod
    def hits_only(cls, hits: Sequence[KVBlock], block_size: int,
                  outcome: SessionOutcome | None = None) -> ComputedBlocks:
        """Prefix-cache hits and no session (``outcome``: why none served the prompt)."""
        return cls(tuple(hits), len(hits) * block_size, session_outcome=outcome)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """A disk-tier session being read back into fresh blocks (``begin_load``): the loader
    fills ``blocks`` from the files named ``session.file_hashes``; ``finish_load`` then
    caches and pins them. Until then the plan holds one reference on each block."""

    session: DiskSession
    blocks: tuple[KVBlock, ...]
