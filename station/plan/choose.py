"""The decode plan, chosen once as the engine starts: per part of the step a table of
candidates in order of preference, each built or refused with its reason.

* ``LINEAR_FORMS``: every form that runs some decoder layers. ``int4``/``int8`` were decided
  at load (``station.model.weights``: the file's own blocks, kernels checked and timed
  against float); the float layers left are packed for oneDNN where it applies, else dense.
* the head (``choose_head``): the file's Q8_0 blocks through ``cpu_kernels`` for steps of few
  rows (decided at load), oneDNN's packed copy, a dense product, or the model's own forward
  when its logits are post-processed (soft-capping, a scale).
* ``FORWARD_BODIES``: the first that builds computes every step: the C step
  (``station.kernels.cpu_step``), the lean decoder (``station.forward.lean_decoder``), or
  transformers' own forward (always there).
* ``DECODE_STEPS``: what a pure-decode step runs: the static step captured as CUDA graphs,
  the same static step uncaptured (``decode_graphs=on`` without CUDA), or the forward body.

Adding a forward body or a linear form is one entry in its table (a name and a function
that builds it or says why not) plus the module that computes it. ``choose_plan`` logs the
plan (``decode_plan``); the runner reads it and never chooses again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.forward.lean_decoder import LeanDecoder, refusal
from station.forward.paged_attention import registered_attention
from station.kernels.dense import KERNEL_MAX_ROWS, PackedLinear, VocabHead, pack_decoder_linears
from station.plan.plan import Candidate, Choice, DecodePlan, GraphShape, refused, used

if TYPE_CHECKING:
    from gnosis_daemon.settings import Settings
    from station.kernels.cpu_kernels import Q8Linear
    from station.kernels.cpu_step import StepWeights
    from station.model.loader import LoadedModel
    from station.model.layer_forms import WeightsReport

log = get_logger(__name__)


class Decoder(Protocol):
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids [1, T] -> the final hidden states [1, T, H]."""


class ModelForward:
    """transformers' own decoder forward (``base_model``) as a forward body."""

    def __init__(self, model: nn.Module) -> None:
        self.base = model.base_model

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state


@dataclass(frozen=True, slots=True)
class Body:
    """A forward body as built: a torch decoder over one packed row of tokens, or the C
    step's weights (every row in C calls; the runner binds it to the KV pool)."""

    decoder: Decoder | None = None
    step: StepWeights | None = None


@dataclass(frozen=True, slots=True)
class DecodeParts:
    """What the plan's choices built, for the runner to bind and call."""

    body: Body
    head: VocabHead | None  # None: the model's own forward computes the logits
    head_kernel: Q8Linear | None  # the head's Q8_0 kernel (``head.kernel``), which the C step runs
    graphs: GraphShape | None  # pure-decode steps through static steps of these bounds


@dataclass(slots=True)
class Start:
    """What every entry reads: the loaded model, its load-time choices and the settings."""

    model: nn.Module
    weights: WeightsReport
    settings: Settings
    device: torch.device
    dtype: torch.dtype
    max_positions: int
    head: VocabHead | None = None  # set once the head is chosen
    body: str = ""  # the forward body's name, once chosen


@dataclass(frozen=True, slots=True)
class Entry:
    """A candidate: ``offer(start)`` -> (what it built, or None: refused; why)."""

    name: str
    offer: Callable[[Start], tuple[object | None, str]]


def _c_step(start: Start) -> tuple[Body | None, str]:
    weights = start.weights
    if weights.step is None:
        return None, weights.why.get("c-step", "no C step was built at load")
    if start.head is None:
        return None, "the model post-processes its logits: the C step needs the runner's head"
    return Body(step=weights.step), f"{weights.why['c-step']}; {weights.step.kernels()}"


def _lean(start: Start) -> tuple[Body | None, str]:
    if not start.settings.lean_decoder:
        return None, "setting lean_decoder=off"
    decoder = LeanDecoder.for_model(start.model, registered_attention)
    if decoder is None:
        return None, refusal(start.model) or "the lean decoder does not take this model"
    return Body(decoder=decoder), "the Llama-family layers' arithmetic in one loop"


def _transformers(start: Start) -> tuple[Body | None, str]:
    return Body(decoder=ModelForward(start.model)), "the model's own forward"


FORWARD_BODIES = (Entry("c-step", _c_step), Entry("lean", _lean), Entry("transformers", _transformers))


def _static_step(start: Start, capture: bool) -> tuple[GraphShape | None, str]:
    if start.body != "lean":
        return None, f"the forward body is {start.body}, not the lean decoder"
    if start.head is None:
        return None, "the model post-processes its logits"
    rows = start.settings.max_batch_size
    context = min(start.settings.decode_graph_max_context, start.max_positions)
    if context < 1:
        return None, "no context to capture"
    how = "captured as CUDA graphs" if capture else "uncaptured (no CUDA)"
    return GraphShape(rows, context, capture), f"steps of up to {rows} rows and {context} positions, {how}"


def _cuda_graphs(start: Start) -> tuple[GraphShape | None, str]:
    if start.settings.decode_graphs == "off":
        return None, "setting decode_graphs=off"
    if start.device.type != "cuda":
        return None, "no CUDA device"
    return _static_step(start, capture=True)


def _uncaptured(start: Start) -> tuple[GraphShape | None, str]:
    if start.settings.decode_graphs != "on":
        return None, f"setting decode_graphs={start.settings.decode_graphs}: without CUDA only with on"
    return _static_step(start, capture=False)


def _forward_body(start: Start) -> tuple[object | None, str]:
    return True, f"every step through the {start.body} body"


DECODE_STEPS = (Entry("cuda-graphs", _cuda_graphs), Entry("static-step", _uncaptured),
                Entry("forward-body", _forward_body))


def _quantized(form: str) -> Callable[[Start], tuple[object | None, str]]:
    def offer(start: Start) -> tuple[object | None, str]:
        return start.weights.count(form), start.weights.why.get(form, "")
    return offer


def _float_refusal(start: Start) -> str | None:
    """Why oneDNN's packed product does not apply here (None: it may)."""
    if not start.settings.cpu_packed_linears:
        return "setting cpu_packed_linears=off"
    if start.device.type != "cpu" or start.dtype != torch.float32:
        return "not a float32 model on a CPU"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    return None


def _onednn(start: Start) -> tuple[object | None, str]:
    why = _float_refusal(start)
    if why is not None:
        return 0, why
    if not any(type(m) in (nn.Linear, PackedLinear) for m in start.model.base_model.modules()):
        return 0, "no decoder layer left in float"
    pack_decoder_linears(start.model)
    packed = sum(type(m) is PackedLinear for m in start.model.base_model.modules())
    return packed, "packed once for oneDNN" if packed else "oneDNN's packed product disagreed with F.linear"


def _dense(start: Start) -> tuple[object | None, str]:
    dense = sum(type(m) is nn.Linear for m in start.model.base_model.modules())
    return dense, "torch's F.linear over the float weight" if dense else "no decoder layer left in float"


LINEAR_FORMS = (Entry("int4", _quantized("int4")), Entry("int8", _quantized("int8")),
                Entry("onednn", _onednn), Entry("dense", _dense))


def _first(entries: tuple[Entry, ...], start: Start) -> tuple[Choice, object | None]:
    """The first entry that builds is chosen; those after it are not tried."""
    candidates: list[Candidate] = []
    chosen: object | None = None
    winner = ""
    for entry in entries:
        figures = start.weights.measured.get(entry.name, ())
        if winner:
            candidates.append(refused(entry.name, f"not tried: {winner} comes first"))
            continue
        part, why = entry.offer(start)
        if part is None:
            candidates.append(refused(entry.name, why, figures))
        else:
            chosen, winner = part, entry.name
            candidates.append(used(entry.name, why, figures))
    return Choice(tuple(candidates)), chosen


def _layers(entries: tuple[Entry, ...], start: Start) -> Choice:
    """Every linear form runs on the layers it took (none: refused, and why)."""
    out = []
    for entry in entries:
        layers, why = entry.offer(start)
        assert isinstance(layers, int)
        figures = start.weights.measured.get(entry.name, ())
        out.append(Candidate(entry.name, layers > 0, why, figures, layers))
    return Choice(tuple(out))


def choose_head(start: Start) -> tuple[Choice, VocabHead | None]:
    """The vocabulary head for the rows a step keeps (``VocabHead``), or the model's own forward."""
    model, weights = start.model, start.weights
    head = VocabHead.for_model(model, pack=start.settings.cpu_packed_linears, kernel=weights.head)
    q8_figures = weights.measured.get("q8-head", ())
    if head is None:
        why = ("the head is not a plain linear layer" if type(model.get_output_embeddings()) is not nn.Linear
               else "the model post-processes its logits (soft-capping or a scale)")
        return Choice((refused("q8-kernel", why, q8_figures), refused("onednn", why), refused("dense", why),
                       used("model-forward", "the model's own forward over the kept rows"))), None
    few = f"steps of up to {KERNEL_MAX_ROWS} rows"
    q8 = (used("q8-kernel", f"{weights.why['q8-head']}; {few}", q8_figures) if head.kernel is not None
          else refused("q8-kernel", weights.why.get("q8-head", "no Q8_0 head was built at load"), q8_figures))
    more = f"; steps of more than {KERNEL_MAX_ROWS} rows" if head.kernel is not None else ""
    onednn = (used("onednn", f"packed once for oneDNN{more}") if head.packed is not None else
              refused("onednn", _float_refusal(start) or "oneDNN's packed product disagreed with F.linear"))
    dense = (used("dense", f"torch's product over the float weight{more}") if head.packed is None
             else refused("dense", "not needed: onednn runs"))
    return Choice((q8, onednn, dense, refused("model-forward", "the logits are exactly lm_head(hidden): "
                                                               "the runner applies the head"))), head


def choose_plan(loaded: LoadedModel, settings: Settings) -> tuple[DecodePlan, DecodeParts]:
    """The decode plan for ``loaded`` under ``settings`` and what it built; logged as
    ``decode_plan``. Packs the float linears (oneDNN) and builds the head and the body."""
    from station.model.layer_forms import WeightsReport

    weights = loaded.weights if loaded.weights is not None else WeightsReport("float")
    start = Start(loaded.model, weights, settings, torch.device(loaded.device), loaded.dtype,
                  loaded.max_model_len)
    linears = _layers(LINEAR_FORMS, start)
    head, start.head = choose_head(start)
    forward, body = _first(FORWARD_BODIES, start)
    start.body = forward.chosen
    decode_steps, shape = _first(DECODE_STEPS, start)
    graphs = shape if isinstance(shape, GraphShape) else None
    plan = DecodePlan(forward, decode_steps, linears, head, graphs)
    assert isinstance(body, Body)
    log.info("decode_plan", **plan.as_dict())
    kernel = weights.head if start.head is not None and start.head.kernel is not None else None
    return plan, DecodeParts(body, start.head, kernel, graphs)

