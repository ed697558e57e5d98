"""The decode plan's types: which forward body, decode steps, linear forms and vocabulary head
a model runs with on this machine, and why each candidate was taken or refused.

Torch-free and frozen: ``station.plan.choose`` builds one at engine start, the runner reads it,
and ``hello`` (``model.decode_plan``), ``/health`` (``station_decode_plan``) and the start log
(``decode_plan``) show ``DecodePlan.as_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a part of the step: whether it runs, and why (the reason it was
    refused, or what took it), with what was measured for the choice, if anything."""

    name: str
    used: bool
    why: str
    figures: tuple[tuple[str, float], ...] = ()  # (what, milliseconds or a count), in order
    layers: int | None = None  # linear forms: how many decoder layers run in this form

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "used": self.used, "why": self.why}
        if self.figures:
            out["measured"] = dict(self.figures)
        if self.layers is not None:
            out["layers"] = self.layers
        return out


def used(name: str, why: str, figures: tuple[tuple[str, float], ...] = (),
         layers: int | None = None) -> Candidate:
    return Candidate(name, True, why, figures, layers)


def refused(name: str, why: str, figures: tuple[tuple[str, float], ...] = (),
            layers: int | None = None) -> Candidate:
    return Candidate(name, False, why, figures, layers)


@dataclass(frozen=True, slots=True)
class Choice:
    """One part of the step: its candidates in order of preference. The first used one is
    the choice; linear forms and the head may use several (each on its own layers or rows)."""

    candidates: tuple[Candidate, ...]

    def __post_init__(self) -> None:
        if not any(c.used for c in self.candidates):
            raise ValueError(f"a choice with no candidate used: {self.candidates}")

    @property
    def chosen(self) -> str:
        return next(c.name for c in self.candidates if c.used)

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.candidates if c.used)

    def refused(self) -> dict[str, str]:
        """Each refused candidate's name -> why."""
        return {c.name: c.why for c in self.candidates if not c.used}

    def __getitem__(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)


@dataclass(frozen=True, slots=True)
class GraphShape:
    """The static decode step's bounds: pure-decode steps of up to ``max_rows`` rows whose
    longest context is at most ``max_context`` positions run it; ``capture``: as CUDA graphs."""

    max_rows: int
    max_context: int
    capture: bool


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How this model's steps are computed here, fixed for the engine's life.

    * ``forward``: the body of every step (``c-step``, ``lean``, ``transformers``);
    * ``decode_steps``: what a pure-decode step runs (``cuda-graphs``, ``static-step``, or
      ``forward-body``: the same body as every step); ``graphs``: its bounds, None: no static step;
    * ``linears``: the decoder's linear forms (``int4``, ``int8``, ``onednn``, ``dense``);
    * ``head``: the vocabulary head (``q8-kernel`` for steps of few rows, ``onednn``,
      ``dense``, or ``model-forward``: the model's own forward, when its logits are
      post-processed).
    """

    forward: Choice
    decode_steps: Choice
    linears: Choice
    head: Choice
    graphs: GraphShape | None = None

    def parts(self) -> dict[str, Choice]:
        return {"forward": self.forward, "decode_steps": self.decode_steps, "linears": self.linears,
                "head": self.head}

    def path(self) -> dict[str, Any]:
        """What runs, by name (the start check's record names it)."""
        return {"forward": self.forward.chosen, "decode_steps": self.decode_steps.chosen,
                "linears": list(self.linears.used), "head": list(self.head.used)}

    def as_dict(self) -> dict[str, Any]:
        """``hello``'s ``model.decode_plan``: what runs, then every candidate with its why."""
        out = self.path()
        out["graphs"] = None if self.graphs is None else {
            "max_rows": self.graphs.max_rows, "max_context": self.graphs.max_context,
            "capture": self.graphs.capture}
        out["candidates"] = {role: [c.as_dict() for c in choice.candidates]
                             for role, choice in self.parts().items()}
        return out
