"""What each decoder linear becomes, and the report of it (``WeightsReport``): float, or one of
torch's quantized layers (``Int4Linear`` over 4-bit groups, ``Int8Linear`` over int8 rows),
each checked against ``F.linear`` over its values and, for ``weights=auto``, kept only where
it measures faster than the float layer here (``KernelChoices``).

``weights.apply_weights`` decides which of these runs: the C step's tiles where the step may
serve (``step_layers``), else ``quantized_layers`` here.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.kernels.quantized import (
    Int4Groups,
    Int4Linear,
    Int8Linear,
    Int8Rows,
    KernelChoices,
    checked,
    int4_applies,
)
from station.model.load_kernels import Verdict, verdict

if TYPE_CHECKING:
    from station.kernels.cpu_kernels import Q8Linear
    from station.kernels.cpu_step import StepWeights

log = get_logger(__name__)


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


def quantized_layers(report: WeightsReport, model: nn.Module, layers: list, mode: str, from_file: Any,
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
        form = form_for(mode, from_file.types.get(weight_name) if from_file else None)
        if form is None:
            continue
        tried.add(form)
        if mode == "auto" and form == "int4" and weight_name not in from_file.int4:
            why[weight_name] = blocks_unused(from_file, weight_name)
            continue
        bias = None if layer.bias is None else layer.bias.detach()
        groups = from_file.int4.get(weight_name) if from_file and form == "int4" else None
        fill = mapped is not None and groups is None  # this one layer's float values, then none
        if fill:
            mapped.fill(model, weight_name)
        made = build(form, layer, groups, device, dtype)
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
        record(report, form, verdict(choices, form, f"{form}:{device.type}", "float layers measured faster than"))
        if not faster:
            report.slower.extend(e[0] for e in entries)  # the same values run faster dense here
            why.update((f"{e[0]}.weight", f"float layers measured faster than {form} here") for e in entries)
            continue
        for name, parent, attr, layer, quantized, source in entries:
            setattr(parent, attr, quantized)
            report.forms[name], report.source[name] = form, source
            report.linear_bytes_after += module_bytes(quantized) - module_bytes(layer)
        if mode != "auto":
            report.why[form] = f"setting weights={mode}"
    for form in ("int4", "int8"):
        if not report.count(form) and (form not in report.why or mode != "auto" or not built[form]):
            report.why[form] = no_form(mode, form, form in tried)
    return why


def blocks_unused(from_file: Any, weight_name: str) -> str:
    """Why a 4-bit weight under ``weights=auto`` stays float: its blocks did not check out,
    and auto never rounds a weight to 4 bits again."""
    return f"its blocks were not used: {from_file.rejected.get(weight_name, 'unread')}"


def record(report: WeightsReport, name: str, decided: Verdict | None) -> None:
    """A measured verdict on candidate ``name``, into the report's why and measured."""
    if decided is not None:
        report.why[name] = decided[0]
        if decided[1]:
            report.measured[name] = decided[1]


def no_form(mode: str, form: str, tried: bool) -> str:
    """Why no decoder layer took ``form`` (no measurement refused it)."""
    if mode in ("int4", "int8") and mode != form:
        return f"setting weights={mode}"
    if tried or mode == form:
        return f"no decoder layer's {form} form checked out"
    return "no Q8_0 tensor among the file's decoder linears" if form == "int8" else (
        "no 4-bit tensor among the file's decoder linears")


def form_for(mode: str, file_type: str | None) -> str | None:
    """The quantized form a weight of GGUF type ``file_type`` takes under ``mode`` (None: float)."""
    if mode in ("int4", "int8"):
        return mode
    if file_type in ("Q4_0", "Q4_1", "Q4_K"):
        return "int4"
    if file_type == "Q8_0":
        return "int8"
    return None  # auto: a float tensor stays float


def build(form: str, layer: nn.Linear, from_file: Int4Groups | None, device: torch.device,
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


def module_bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
