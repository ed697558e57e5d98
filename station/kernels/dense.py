"""The fastest linear kernels the runner has on its device (CPU: oneDNN with packed weights).

On CPU, torch's ``F.linear`` is MKL's sgemm, which repacks the weight on every call. At
the few rows of a decode step that repacking costs as much as the product, so every
weight is packed once for oneDNN (whose fp32 linear then runs at any row count; at 1 row and
at long prefill chunks it is as fast as MKL). The vocab head gains at any row count
(docs/benchmarks.md, "Past measurements (engine notes)", has the figures).

* ``pack_decoder_linears``: every ``nn.Linear`` of the decoder (not the vocab head, which
  may be tied to the input embeddings) becomes a ``PackedLinear``; the unpacked weight is
  dropped, so memory does not grow.
* ``VocabHead``: the head for the rows a step keeps, packed as a copy (the tied
  embeddings still need the original).

Every packed weight is checked against ``F.linear`` once when it is packed (relative
differences are ~1e-6, the order of any other change of summation order); a weight that
disagrees, a non-fp32 weight, a GPU, or a torch without oneDNN keeps the stock path.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)


def onednn_applies(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's packed form of ``weight``, or None where it does not apply or disagrees."""
    if not onednn_applies(weight):
        return None
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            want = F.linear(x, weight, bias)
    except (RuntimeError, AttributeError) as exc:  # a torch build without these ops
        log.info("onednn_linear_unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        log.warning("onednn_linear_disagrees", shape=list(weight.shape))
        return None
    return packed


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight packed for oneDNN (inference only)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.packed = packed
        self.bias = bias
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(),
                                               self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_decoder_linears(model: nn.Module) -> int:
    """Swap the decoder's ``nn.Linear`` modules for ``PackedLinear``; -> how many."""
    decoder = model.base_model
    swapped = kept = 0
    for module in list(decoder.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            bias = None if child.bias is None else child.bias.detach()
            packed = pack_weight(child.weight, bias)
            if packed is None:
                kept += 1
                continue
            setattr(module, name, PackedLinear(packed, bias, child.in_features, child.out_features))
            swapped += 1
    if swapped:
        log.info("decoder_linears_packed", kernel="onednn", packed=swapped, unpacked=kept)
    return swapped


# Up to this many rows the Q8_0 head kernel is the faster head: it reads a quarter of the
# bytes. Past it the arithmetic is the bound and oneDNN's float32 head wins, alone and
# inside an 8-stream decode (measured on the default model: docs/benchmarks.md).
KERNEL_MAX_ROWS = 4


class VocabHead:
    """``lm_head`` for the few rows a step keeps, with the fastest kernel at hand.

    Packed for oneDNN where that applies (a copy). Otherwise one row is a plain
    ``F.linear`` and several rows use the tall-skinny ``W @ x.T``: MKL runs ``x @ W.T``
    at 2-8 rows about as slowly as one call per row. A GGUF
    file's Q8_0 head runs through ``cpu_kernels`` where that is faster (``weights``), for
    steps of up to ``KERNEL_MAX_ROWS`` rows: the same product, its sums in another order.
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 packed: torch.Tensor | None, kernel: Callable | None = None) -> None:
        self.weight, self.bias, self.packed, self.kernel = weight, bias, packed, kernel

    @classmethod
    def for_model(cls, model: nn.Module, pack: bool = True, kernel: Callable | None = None,
                  ) -> VocabHead | None:
        """A head when the model's logits are exactly ``lm_head(last_hidden_state)``;
        ``kernel``: the same product another way (``cpu_kernels.Q8Linear``), used instead."""
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if type(head) is not nn.Linear or any(
                getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale")):
            return None  # logits post-processed: keep the model's own forward
        weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
        packed = pack_weight(weight, bias) if pack else None
        if packed is not None:
            log.info("vocab_head_packed", kernel="onednn", bytes=weight.numel() * weight.element_size())
        return cls(weight, bias, packed, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernel(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                      "none", [], "")
        assert self.weight is not None  # a head without a packed copy keeps its weight
        if x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t().contiguous()  # [K, V]
        return out if self.bias is None else out + self.bias
