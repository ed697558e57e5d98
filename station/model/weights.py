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
import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.kernels.quantized import Int4Groups, Int4Linear, Int8Linear, KernelChoices, machine_tag
from station.model.layer_forms import (
    WeightsReport,
    blocks_unused,
    form_for,
    module_bytes,
    no_form,
    quantized_layers,
    record,
)
from station.model.load_kernels import HEAD_SLOWER, cpu_step, q8_head, step_key, verdict

log = get_logger(__name__)

MODES = ("auto", "float", "int8", "int4")
STEP_MODES = ("auto", "on", "off")


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
                  decode_step: str = "auto", step_attention: str = "auto", full_attention: bool = True,
                  mapped: Any = None) -> WeightsReport:
    """Swap the decoder's linears for quantized ones as ``mode`` says; -> what was done, and
    why each load-time candidate of the decode plan was taken or refused (``report.why``).
    ``full_attention``: every layer attends causally to its whole context (the C step's);
    ``step_attention``: the C step's attention arithmetic (settings' ``cpu_attention``).
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
        report.linear_bytes_before += module_bytes(layer)
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
                                               choices_dir, decode_step, step_attention):
        why = quantized_layers(report, model, layers, mode, from_file, mapped, choices, device, dtype)
    if mapped is not None:  # what stays float: layers measured slower, or whose form did not check
        mapped.fill_rest(model)
    if gguf is not None:
        head_why = "not a float32 model on a CPU"
        if device.type == "cpu" and dtype == torch.float32:
            report.head, head_why = q8_head(model, gguf, choices, choices_dir, device, dtype)
        report.why["q8-head"] = head_why
        if report.head is not None or head_why == HEAD_SLOWER:
            record(report, "q8-head", verdict(choices, "q8-head", "q8-head:cpu",
                                               "the float32 head measured faster than"))
        _account_gguf(report, model, gguf, from_file, why, head_why)
    if report.step is None and any(form != "float" for form in report.forms.values()):
        _own_memory(model, copy=mapped is None)  # (the step's path did it before its views)
    choices.save()
    log.info("weights_applied", **report.summary())
    return report


def _step_first(report: WeightsReport, model: nn.Module, layers: list, mode: str, from_file: Any,
                mapped: Any, choices: KernelChoices, choices_dir: Path | None, decode_step: str,
                step_attention: str = "auto") -> bool:
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
    if lib is None:
        report.why["c-step"] = refusal or "the C step's library could not be built here"
        return False

    def groups_for(weight_name: str, linear: nn.Linear) -> tuple[Int4Groups, str] | str:
        kind = from_file.types.get(weight_name) if from_file else None
        if form_for(mode, kind) != "int4":
            return f"a {kind or 'float'} tensor, not 4-bit groups"
        if from_file is not None and weight_name in from_file.int4:
            return from_file.int4[weight_name], "gguf"
        if mode == "auto":  # a block that did not check out is never re-rounded
            return blocks_unused(from_file, weight_name)
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
    # what stays float out of the checkpoint's map first: the step keeps views of it (embed)
    _own_memory(model, copy=mapped is None)
    report.step, step_verdict = cpu_step(model, lib, choices, decode_step, built.sample, built.sample_layers,
                                         step_attention)
    built.sample.clear()  # torch's twins go once timed
    record(report, "c-step", step_verdict)
    if report.step is None:
        built.restore()
        _own_memory(model, copy=False)  # the tiles' heap back
        return False
    for name, *_ in layers:
        report.forms[name], report.source[name] = "int4", built.source[name]
    report.linear_bytes_after = built.nbytes
    report.why["int4"] = (f"setting weights={mode}" if mode != "auto"
                          else "the file's 4-bit blocks, in the C step's tiles (its only copy)")
    report.why["int8"] = no_form(mode, "int8", False)
    return True


def _step_refusal(mode: str, full_attention: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Why the C step cannot run here whatever the weights ("": it may)."""
    if mode == "off":
        return "setting cpu_decode_step=off"
    if not full_attention:
        return "not every layer attends causally to its whole context (windows, soft-capping or sinks)"
    if device.type != "cpu" or dtype != torch.float32:
        return "not a float32 model on a CPU"
    return ""


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


def _choices_path(base: Path | None, model: nn.Module, gguf: Path | None) -> Path | None:
    if base is None:
        return None
    config = model.config
    ident = json.dumps([machine_tag(), str(gguf or ""), config.model_type, config.hidden_size,
                        config.num_hidden_layers])
    return base / "kernel-choices" / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
