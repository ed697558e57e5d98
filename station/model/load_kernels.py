"""The C kernels that stand in for a whole part of the forward, each checked against it and
timed at load (``station.model.weights`` asks for them): the vocabulary head over a GGUF
file's own Q8_0 blocks (``cpu_kernels.Q8Linear``) and the whole step over the 4-bit layers
(``cpu_step.StepWeights``). Each says why it runs or not, for the decode plan."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from gnosis_daemon.logs import get_logger
from station.kernels.quantized import KernelChoices

if TYPE_CHECKING:
    from station.kernels.cpu_kernels import Q8Linear
    from station.kernels.cpu_step import StepWeights

log = get_logger(__name__)

Figures = tuple[tuple[str, float], ...]  # (what, milliseconds) measured for a choice
Verdict = tuple[str, Figures]  # why a candidate runs or not, and what was measured for it


def verdict(choices: KernelChoices, name: str, key: str, slower: str) -> Verdict | None:
    """Why ``name`` was taken or refused by ``choices``' answer for ``key``, and what was
    measured for it this time (None: ``choices`` holds no answer)."""
    if key not in choices.answers:
        return None
    other = "float" if name != "q8-head" else "the float32 head"
    figures: Figures = ()
    when = "on this machine before (kept per machine)"
    if key in choices.measured:
        quantized_s, float_s = choices.measured[key]
        figures = (("quantized_ms", round(quantized_s * 1e3, 3)), ("float_ms", round(float_s * 1e3, 3)))
        when = "here"
    why = f"measured faster than {other} {when}" if choices.answers[key] else f"{slower} {name} {when}"
    return why, figures


HEAD_SLOWER = "the float32 head measured faster here"


def q8_head(model: nn.Module, gguf: Path, choices: KernelChoices, cache_dir: Path | None,
             device: torch.device, dtype: torch.dtype) -> tuple[Q8Linear | None, str]:
    """The head over the file's own Q8_0 blocks (``cpu_kernels``), where they give the float32
    head's weight bit for bit, the kernel builds, computes the same product, and is faster;
    -> (the kernel or None, why not)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or head.weight.shape[1] % 32:
        return None, "the head is not a plain linear layer over 32-wide blocks"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale")):
        # the engine runs the model's own head then (station.kernels.dense.VocabHead): no kernel to build
        return None, "the model post-processes its logits (soft-capping or a scale)"
    from station.kernels.cpu_kernels import Q8Linear, load_library
    from station.model.gguf_groups import read_q8_rows

    blocks = read_q8_rows(gguf, model, head.weight)
    if blocks is None:
        return None, "the head's tensor is not Q8_0 blocks that give its weight bit for bit"
    lib = load_library(cache_dir)
    if lib is None:
        return None, "the Q8_0 head kernel could not be built here"
    kernel = Q8Linear(lib, *blocks)
    x = torch.randn(5, kernel.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = kernel(x), F.linear(x, head.weight.detach())
        # the same product in another order (float32 sums), and a row alone as in a batch
        if not (float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
                and torch.equal(kernel(x[2:3]), got[2:3])):
            log.warning("q8_head_disagrees", simd=lib.gnosis_simd().decode())
            return None, "the Q8_0 head kernel disagreed with F.linear"
    if not choices.choose("q8-head", [(kernel, head.weight.detach())], device, dtype):
        return None, HEAD_SLOWER
    log.info("q8_head_used", bytes=kernel.q.numel() + kernel.d.numel() * 4,
             float_bytes=head.weight.numel() * 4, simd=lib.gnosis_simd().decode())
    return kernel, ""


def step_key() -> str:
    """``KernelChoices``' key for the C step's verdict on this machine."""
    return "cpu-step:cpu"


def cpu_step(model: nn.Module, lib: Any, choices: KernelChoices, mode: str, sample: Sequence[nn.Module],
             sample_layers: int, attention: str = "auto") -> tuple[StepWeights | None, Verdict]:
    """The C decode step (``cpu_step``) over the model's layers on its tiles
    (``station.model.step_layers``) where it agrees with the model's forward; ``auto``: and
    it measures no slower than torch's int4 layers' products alone for the same token (by
    ``KernelChoices.FLOAT_MARGIN``; ``sample``: torch's form of the first ``sample_layers``
    decoder layers, empty where the answer is known); ``attention``: settings' ``cpu_attention``
    (``auto``: on bfloat16 pairs where this build can); -> (the step or None, (why it runs or
    not, what was measured))."""
    from station.kernels.cpu_step import StepWeights, checked_and_timed

    weights = StepWeights.for_model(model, lib, attention)
    if weights is None:
        return None, ("the model's layers are not the step's tiles", ())
    key = step_key()
    measure = mode == "auto" and key not in choices.answers and bool(sample)  # else known, or not asked
    agrees, step_s, torch_s = checked_and_timed(weights, model, sample if measure else [], sample_layers)
    if not agrees:
        return None, ("the C step disagreed with the model's own forward", ())
    when = "on this machine before (kept per machine)"
    figures: Figures = ()
    if measure and step_s is not None and torch_s is not None:
        choices.measured[key] = (step_s, torch_s)
        choices.answers[key] = step_s < torch_s * choices.FLOAT_MARGIN
        figures = (("step_ms", round(step_s * 1e3, 3)), ("torch_linears_ms", round(torch_s * 1e3, 3)))
        when = "here"
        log.info("cpu_step_measured", step_ms=round(step_s * 1e3, 3),
                 torch_linears_ms=round(torch_s * 1e3, 3))
    used = mode == "on" or choices.answers[key]
    why = ("setting cpu_decode_step=on" if mode == "on" else
           f"measured faster than torch's layers {when}" if used else
           f"measured slower than torch's layers {when}")
    log.info("cpu_step_used" if used else "cpu_step_not_used", mode=mode, bytes=weights.nbytes,
             **({} if used else {"reason": why}))
    return (weights if used else None), (why, figures)
