"""The ``weights`` setting: which of the decoder's linear layers stay quantized, and how.

* ``float``: every weight dense in the model's dtype (a GGUF file is dequantized).
* ``auto`` (default): a GGUF file's Q4_0/Q4_1/Q4_K weights stay 4-bit groups (``gguf_groups``:
  its own blocks, no new rounding of the weights) and its Q8_0 weights become int8 rows; a
  float checkpoint stays float. Each layer runs the quantized kernel only where it measures
  faster than the float one on this machine (``KernelChoices``), else the same values dense.
* ``int4`` / ``int8``: every decoder linear quantized (a GGUF file's 4-bit blocks are kept
  as they are for ``int4``; the rest is quantized from the dense weights at load), always
  with the quantized kernel: the operator asked for the memory.

For a GGUF file the report also accounts for every quantized tensor of the file: kept
(``gguf_kept``: int4 from its own blocks, int8 rows of a Q8_0 tensor, the Q8_0 head) or
dequantized and why (``gguf_dequantized``: Q5_0/Q5_K/Q6_K have no kept form, embeddings
are looked up as float, ...), logged at start as ``gguf_tensors_dequantized``.

Each load-time candidate of the decode plan (``station.plan``: the int4 and int8 forms, the
Q8_0 head, the C step of ``station.model.load_kernels``) records why it runs or not in
``WeightsReport.why``, and what was measured for it in ``WeightsReport.measured``.

Only the decoder's ``nn.Linear`` layers change. Embeddings, norms, the vocabulary head (tied
to the embeddings in small models), the KV cache and everything the engine keeps are as
before. The summary (``WeightsReport.tag``) joins the model's fingerprint, so KV computed
with one set of weights is never served to another.
"""

from __future__ import annotations

import hashlib
from collections import Counter
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.model.load_kernels import HEAD_SLOWER, Verdict, cpu_step, q8_head, step_key, verdict
from station.kernels.quantized import (
    Int4Groups,
    Int4Linear,
    Int8Linear,
    Int8Rows,
    KernelChoices,
    checked,
    int4_applies,
    machine_tag,
)

if TYPE_CHECKING:
    from station.kernels.cpu_kernels import Q8Linear
    from station.kernels.cpu_step import StepWeights

log = get_logger(__name__)

MODES = ("auto", "float", "int8", "int4")
STEP_MODES = ("auto", "on", "off")


@dataclass(slots=True)
class WeightsReport:
    mode: str
    forms: dict[str, str] = field(default_factory=dict)  # layer name -> int4 | int8 | float
    source: dict[str, str] = field(default_factory=dict)  # layer name -> gguf | load (quantized here)
    slower: list[str] = field(default_factory=list)  # quantized kernel measured slower: kept float
    linear_bytes_before: int = 0
    linear_bytes_after: int = 0
    # The vocabulary head over the file's Q8_0 blocks, which the decode plan runs instead of
    # the float32 head for steps of few rows; None: the float32 head.
    head: Q8Linear | None = None
    # The whole step in C over the 4-bit layers, which the decode plan's ``c-step`` body
    # binds to the KV pool; None: the step runs through torch.
    step: StepWeights | None = None
    # The decode plan's load-time candidates (int4, int8, q8-head, c-step) -> why each was
    # taken or refused, and what was measured for it (name, milliseconds) where it was.
    why: dict[str, str] = field(default_factory=dict)
    measured: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    # A GGUF file's quantized tensors (F32/F16/BF16 ones are not counted), by GGUF name:
    # those whose blocks run as they are stored or in a form of their own type -> (type,
    # form: int4 | int8 | q8-head), and those dequantized to float -> (type, why).
    gguf_kept: dict[str, tuple[str, str]] = field(default_factory=dict)
    gguf_dequantized: dict[str, tuple[str, str]] = field(default_factory=dict)

    def count(self, form: str) -> int:
        return sum(1 for f in self.forms.values() if f == form)

    @property
    def tag(self) -> str:
        """What the fingerprint must change with: every layer's form (and so its numerics)."""
        if not any(f != "float" for f in self.forms.values()):
            return "float"
        digest = hashlib.sha256(json.dumps(sorted(self.forms.items())).encode()).hexdigest()[:16]
        step = f",cpu-step:{self.step.arithmetic()}" if self.step is not None else ""  # its own (cpu_step)
        return f"int4:{self.count('int4')},int8:{self.count('int8')},{digest}{step}"

    def summary(self) -> dict[str, Any]:
        out = {"mode": self.mode, "int4_layers": self.count("int4"), "int8_layers": self.count("int8"),
               "float_layers": self.count("float"), "kept_float_faster": len(self.slower),
               "linear_bytes": self.linear_bytes_after, "linear_bytes_dense": self.linear_bytes_before}
        if self.gguf_kept or self.gguf_dequantized:
            out.update(gguf_tensors_kept=len(self.gguf_kept),
                       gguf_tensors_dequantized=len(self.gguf_dequantized))
        return out

    def dequantized_by_reason(self) -> dict[str, int]:
        """How many of the file's quantized tensors were dequantized, by why."""
        return dict(sorted(Counter(why for _, why in self.gguf_dequantized.values()).items()))


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(parameter name prefix, parent, attribute, layer) for the decoder's ``nn.Linear``s."""
    head = model.get_output_embeddings()
    prefix = next(name for name, module in model.named_modules() if module is model.base_model)
    found = []
    for parent_name, parent in model.base_model.named_modules():
        for attr, child in parent.named_children():
            if type(child) is nn.Linear and child is not head:
                name = ".".join(p for p in (prefix, parent_name, attr) if p)
                found.append((name, parent, attr, child))
    return found


def apply_weights(model: nn.Module, mode: str, device: torch.device, dtype: torch.dtype, *,
                  gguf: Path | None = None, choices_dir: Path | None = None,
                  decode_step: str = "auto", full_attention: bool = True,
                  mapped: Any = None) -> WeightsReport:
    """Swap the decoder's linears for quantized ones as ``mode`` says; -> what was done, and
    why each load-time candidate of the decode plan was taken or refused (``report.why``).
    ``full_attention``: every layer attends causally to its whole context (the C step's).
    ``mapped``: the ``gguf_mapped.MappedFile`` of a model built empty from ``gguf``, whose
    decoder weights are filled from the file only where a float one is needed."""
    if mode not in MODES:
        raise ValueError(f"weights must be one of {', '.join(MODES)}, not {mode!r}")
    if decode_step not in STEP_MODES:
        raise ValueError(f"cpu_decode_step must be one of {', '.join(STEP_MODES)}, not {decode_step!r}")
    report = WeightsReport(mode)
    report.why["q8-head"] = "not a GGUF file" if gguf is None else f"setting weights={mode}"
    report.why["c-step"] = _step_refusal(decode_step, full_attention, device, dtype)
    layers = decoder_linears(model)
    for name, _, _, layer in layers:
        report.forms[name] = "float"
        report.linear_bytes_before += _bytes(layer)
    report.linear_bytes_after = report.linear_bytes_before
    if mode == "float" or not layers or (mode == "auto" and gguf is None):
        reason = ("the model has no decoder linears" if not layers else f"setting weights={mode}"
                  if mode == "float" else "weights=auto keeps a float checkpoint's floats")
        report.why.update({"int4": reason, "int8": reason})
        report.why["c-step"] = report.why["c-step"] or "no 4-bit decoder layers"
        if mapped is not None:
            mapped.fill_rest(model)
        if gguf is not None:
            _account_gguf(report, model, gguf, None, {}, "the model has no decoder linears")
        return report
    from_file = None if mapped is None else mapped.weights  # mode is auto, int4 or int8 from here on
    if gguf is not None and mapped is None:
        from station.model.gguf_groups import read_gguf_weights

        from_file = read_gguf_weights(gguf, model)
    choices = KernelChoices(_choices_path(choices_dir, model, gguf) if mode == "auto" else None)
    # the C step first: where it serves, its tiles are the 4-bit layers' only copy (step_layers)
    why: dict[str, str] = {}  # weight name -> why its layer stayed float (for the file's account)
    if report.why["c-step"] or not _step_first(report, model, layers, mode, from_file, mapped, choices,
                                               choices_dir, decode_step):
        why = _quantized_layers(report, model, layers, mode, from_file, mapped, choices, device, dtype)
    if mapped is not None:  # what stays float: layers measured slower, or whose form did not check
        mapped.fill_rest(model)
    if gguf is not None:
        head_why = "not a float32 model on a CPU"
        if device.type == "cpu" and dtype == torch.float32:
            report.head, head_why = q8_head(model, gguf, choices, choices_dir, device, dtype)
        report.why["q8-head"] = head_why
        if report.head is not None or head_why == HEAD_SLOWER:
            _record(report, "q8-head", verdict(choices, "q8-head", "q8-head:cpu",
                                               "the float32 head measured faster than"))
        _account_gguf(report, model, gguf, from_file, why, head_why)
    if any(form != "float" for form in report.forms.values()):
        _own_memory(model, copy=mapped is None)
    choices.save()
    log.info("weights_applied", **report.summary())
    return report


def _step_first(report: WeightsReport, model: nn.Module, layers: list, mode: str, from_file: Any,
                mapped: Any, choices: KernelChoices, choices_dir: Path | None, decode_step: str) -> bool:
    """The C step over every decoder linear, built into its tiles one decoder layer at a time
    (``step_layers``); -> whether it serves. Where not, ``report.why["c-step"]`` says why and
    the model's linears are as they were."""
    from station.kernels.cpu_kernels import load_library
    from station.kernels.cpu_step import shape_refusal
    from station.model import step_layers

    refusal = shape_refusal(model) or ("setting weights=int8" if mode == "int8" else None)
    if refusal is None and len(layers) != 7 * len(cast(Any, model.base_model).layers):
        refusal = "the decoder has linear layers the step does not compute"
    lib = load_library(choices_dir) if refusal is None else None
    if refusal is None and lib is None:
        refusal = "the C step's library could not be built here"
    if refusal is not None or lib is None:
        report.why["c-step"] = refusal or "the C step's library could not be built here"
        return False

    def groups_for(weight_name: str, linear: nn.Linear) -> tuple[Int4Groups, str] | str:
        kind = from_file.types.get(weight_name) if from_file else None
        if _form(mode, kind) != "int4":
            return f"a {kind or 'float'} tensor, not 4-bit groups"
        if from_file is not None and weight_name in from_file.int4:
            return from_file.int4[weight_name], "gguf"
        if mode == "auto":  # a block that did not check out is never re-rounded
            return f"its blocks were not used: {from_file.rejected.get(weight_name, 'unread')}"
        if mapped is not None:  # weights=int4 over another type: its float values, for a moment
            mapped.fill(model, weight_name)
        try:
            return Int4Groups.quantize(linear.weight.detach()), "load"
        finally:
            if mapped is not None:
                mapped.empty(model, weight_name)

    timed = decode_step == "auto" and step_key() not in choices.answers
    built = step_layers.build(model, lib, groups_for, sample=timed)
    if isinstance(built, str):
        report.why["c-step"] = built
        return False
    report.step, step_verdict = cpu_step(model, lib, choices, decode_step, built.sample, built.sample_layers)
    built.sample.clear()  # torch's twins go once timed
    _record(report, "c-step", step_verdict)
    if report.step is None:
        built.restore()
        _own_memory(model, copy=False)  # the tiles' heap back
        return False
    for name, *_ in layers:
        report.forms[name], report.source[name] = "int4", built.source[name]
    report.linear_bytes_after = built.nbytes
    report.why["int4"] = "the C step's tiles: every decoder linear, the step's own copy"
    report.why["int8"] = "the C step computes every decoder linear in 4 bits"
    return True


def _quantized_layers(report: WeightsReport, model: nn.Module, layers: list, mode: str, from_file: Any,
                      mapped: Any, choices: KernelChoices, device: torch.device,
                      dtype: torch.dtype) -> dict[str, str]:
    """Each decoder linear as torch's int4 or int8 layer where its form checks out and (auto)
    measures faster than float here; ``report`` says what was done and why; -> why each
    weight that stayed float did (for the file's account)."""
    built: dict[str, list] = {"int4": [], "int8": []}  # form -> [(name, parent, attr, layer, new, source)]
    timing: dict[str, list] = {"int4": [], "int8": []}  # form -> [(new, its values)] for choose
    why: dict[str, str] = {}  # weight name -> why its layer stayed float
    tried: set[str] = set()  # the forms some layer would take
    kept_values = {"int4": 0, "int8": 0}  # float bytes kept per form for choose (it takes so many)
    for name, parent, attr, layer in layers:
        weight_name = f"{name}.weight"
        form = _form(mode, from_file.types.get(weight_name) if from_file else None)
        if form is None:
            continue
        tried.add(form)
        if mode == "auto" and form == "int4" and weight_name not in from_file.int4:
            # auto: a block that did not check out stays float, never re-rounded
            why[weight_name] = f"its blocks were not used: {from_file.rejected.get(weight_name, 'unread')}"
            continue
        bias = None if layer.bias is None else layer.bias.detach()
        groups = from_file.int4.get(weight_name) if from_file and form == "int4" else None
        fill = mapped is not None and groups is None  # this one layer's float values, then none
        if fill:
            mapped.fill(model, weight_name)
        made = _build(form, layer, groups, device, dtype)
        if fill:
            mapped.empty(model, weight_name)
        if made is None:
            why[weight_name] = f"the {form} kernel does not take a {tuple(layer.weight.shape)} weight"
            continue
        quantized, stored, source = made
        if not checked(quantized, stored, bias, device):
            log.warning("quantized_layer_disagrees", layer=name, form=form)
            why[weight_name] = f"its {form} layer disagreed with F.linear over its values"
            continue
        if mode == "auto" and kept_values[form] < choices.MEASURE_BYTES:  # values to time float with
            timing[form].append((quantized, stored.dequantize()))
            kept_values[form] += timing[form][-1][1].numel() * 4
        built[form].append((name, parent, attr, layer, quantized, source))
    for form, entries in built.items():
        faster = mode != "auto" or choices.choose(form, timing[form], device, dtype)
        _record(report, form, verdict(choices, form, f"{form}:{device.type}", "float layers measured faster than"))
        if not faster:
            report.slower.extend(e[0] for e in entries)  # the same values run faster dense here
            why.update((f"{e[0]}.weight", f"float layers measured faster than {form} here") for e in entries)
            continue
        for name, parent, attr, layer, quantized, source in entries:
            setattr(parent, attr, quantized)
            report.forms[name], report.source[name] = form, source
            report.linear_bytes_after += _bytes(quantized) - _bytes(layer)
        if mode != "auto":
            report.why[form] = f"setting weights={mode}"
    for form in ("int4", "int8"):
        if not report.count(form) and (form not in report.why or mode != "auto" or not built[form]):
            report.why[form] = _no_form(mode, form, form in tried)
    return why


def _step_refusal(mode: str, full_attention: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Why the C step cannot run here whatever the weights ("": it may)."""
    if mode == "off":
        return "setting cpu_decode_step=off"
    if not full_attention:
        return "not every layer attends causally to its whole context (windows, soft-capping or sinks)"
    if device.type != "cpu" or dtype != torch.float32:
        return "not a float32 model on a CPU"
    return ""


def _record(report: WeightsReport, name: str, decided: Verdict | None) -> None:
    if decided is not None:
        report.why[name] = decided[0]
        if decided[1]:
            report.measured[name] = decided[1]


def _no_form(mode: str, form: str, tried: bool) -> str:
    """Why no decoder layer took ``form`` (no measurement refused it)."""
    if mode in ("int4", "int8") and mode != form:
        return f"setting weights={mode}"
    if tried or mode == form:
        return f"no decoder layer's {form} form checked out"
    return "no Q8_0 tensor among the file's decoder linears" if form == "int8" else (
        "no 4-bit tensor among the file's decoder linears")


def _account_gguf(report: WeightsReport, model: nn.Module, gguf: Path, from_file: Any,
                  why: dict[str, str], head_why: str) -> None:
    """Which of the file's quantized tensors run on their own blocks (or as int8 rows of a
    Q8_0 tensor), and which were dequantized and why; logged as ``gguf_tensors_dequantized``
    (counts by type and by reason, the first names; every name at debug level)."""
    from station.model.gguf_groups import FLOAT_TYPES, KEPT_TYPES, file_tensors

    tensors = from_file.tensors if from_file is not None and from_file.tensors else file_tensors(gguf, model)
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    head_names = {p for p, t in model.named_parameters(remove_duplicate=False) if t is head_weight}
    embeddings = model.get_input_embeddings()
    embedding_names = {p for p, t in model.named_parameters(remove_duplicate=False)
                       if t is getattr(embeddings, "weight", None)}
    forms = {f"{name}.weight": form for name, form in report.forms.items()}
    sources = {f"{name}.weight": source for name, source in report.source.items()}
    for gguf_name, (kind, param) in tensors.items():
        if kind in FLOAT_TYPES:
            continue
        if report.mode == "float":
            report.gguf_dequantized[gguf_name] = (kind, "weights=float")
        elif param is None:
            report.gguf_dequantized[gguf_name] = (kind, "no parameter of the model reads it")
        elif param in forms:  # a decoder linear
            form = forms[param]
            if (form == "int4" and sources.get(param) == "gguf") or (form == "int8" and kind == "Q8_0"):
                report.gguf_kept[gguf_name] = (kind, form)
            elif form != "float":
                report.gguf_dequantized[gguf_name] = (
                    kind, f"{kind}: no kept form as {form}; weights={report.mode} quantized it again at load")
            elif param in why:
                report.gguf_dequantized[gguf_name] = (kind, why[param])
            elif kind not in KEPT_TYPES:
                report.gguf_dequantized[gguf_name] = (kind, f"{kind}: no kept form")
            else:
                report.gguf_dequantized[gguf_name] = (kind, f"weights={report.mode}")
        elif param in head_names:  # the vocabulary head, maybe tied to the embeddings
            if report.head is not None:
                report.gguf_kept[gguf_name] = (kind, "q8-head")
            elif kind != "Q8_0":
                report.gguf_dequantized[gguf_name] = (kind, f"{kind}: no kept form for the vocabulary head")
            else:
                report.gguf_dequantized[gguf_name] = (kind, f"vocabulary head: {head_why}")
        elif param in embedding_names:
            report.gguf_dequantized[gguf_name] = (kind, "embeddings: looked up as float")
        else:
            report.gguf_dequantized[gguf_name] = (kind, "not a linear layer")
    by_type = Counter(kind for kind, _ in report.gguf_dequantized.values())
    kept = Counter(f"{kind} as {form}" for kind, form in report.gguf_kept.values())
    names = list(report.gguf_dequantized)
    log.info("gguf_tensors_dequantized", count=len(names), of=len(names) + len(report.gguf_kept),
             by_type=dict(sorted(by_type.items())), reasons=report.dequantized_by_reason(),
             kept=dict(sorted(kept.items())), first=names[:8], more=max(0, len(names) - 8))
    log.debug("gguf_tensors_dequantized_names",
              tensors={name: f"{kind}: {why}" if not why.startswith(kind) else why
                       for name, (kind, why) in report.gguf_dequantized.items()})


def _own_memory(model: nn.Module, copy: bool = True) -> None:
    """Copy what stays float out of the checkpoint's mapping, so the mapping is released.

    transformers maps a safetensors file and hands out views of it: the weights we replaced
    keep their file pages resident for as long as any tensor of that file lives. One copy
    of the embeddings and norms frees the rest, then glibc is asked to give back the heap
    that loading left behind. A mapped model (``copy`` False) owns its tensors already, and
    so do the quantized layers (the step's tiles are shared by three layers: never copied).
    """
    from station.kernels.q4_tiles import TiledLinear

    with torch.no_grad():
        for module in model.modules() if copy else ():
            if isinstance(module, (TiledLinear, Int4Linear, Int8Linear)):
                continue
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if tensor.device.type == "cpu":
                    tensor.data = tensor.data.clone()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def _form(mode: str, file_type: str | None) -> str | None:
    if mode in ("int4", "int8"):
        return mode
    if file_type in ("Q4_0", "Q4_1", "Q4_K"):
        return "int4"
    if file_type == "Q8_0":
        return "int8"
    return None  # auto: a float tensor stays float


def _build(form: str, layer: nn.Linear, from_file: Int4Groups | None, device: torch.device,
           dtype: torch.dtype) -> tuple[nn.Module, Int4Groups | Int8Rows, str] | None:
    """(the quantized layer, the form of the values it stands for, where they came from) or None."""
    weight = layer.weight.detach()
    bias = None if layer.bias is None else layer.bias.detach()
    if form == "int4":
        groups, source = (from_file, "gguf") if from_file is not None else (None, "load")
        if groups is None:
            if weight.shape[1] % 32:
                return None
            groups = Int4Groups.quantize(weight)
        if not int4_applies(groups):
            return None
        return Int4Linear(groups, bias, device), groups, source
    rows = Int8Rows.quantize(weight)
    return Int8Linear(rows, bias, device, dtype), rows, "load"


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _choices_path(base: Path | None, model: nn.Module, gguf: Path | None) -> Path | None:
    if base is None:
        return None
    config = model.config
    ident = json.dumps([machine_tag(), str(gguf or ""), config.model_type, config.hidden_size,
                        config.num_hidden_layers])
    return base / "kernel-choices" / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
