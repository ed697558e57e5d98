"""Why a model does not serve: it could not be loaded, or the engine refuses it.

Both are torch-free, so the modules that raise them (the loader, the attention kinds, the
start check, the KV shape) and the station's entry that turns them into an exit status
share them without importing each other.
"""

from __future__ import annotations

from gnosis_daemon.refusal import REFUSED_EXIT

__all__ = ["ModelLoadError", "ModelRefused", "REFUSED_EXIT"]


class ModelLoadError(RuntimeError):
    """The model could not be found, converted or loaded; the message says which and why."""


class ModelRefused(ModelLoadError):
    """The model loaded, but the engine cannot compute it exactly: an attention kind it does
    not implement, or a start check whose paged logits disagree with the model's own
    forward. Permanent for this model and build: restarting the station changes nothing,
    so the station exits with ``REFUSED_EXIT`` (78, ``gnosis_daemon.refusal``) and the
    supervisor does not restart it."""

    def __init__(self, model_type: str, kind: str, reason: str) -> None:
        super().__init__(f"model type {model_type!r} refused: {reason}")
        self.model_type, self.kind, self.reason = model_type, kind, reason

    def as_dict(self) -> dict[str, str]:
        return {"model_type": self.model_type, "kind": self.kind, "reason": self.reason,
                "message": str(self)}
