"""The decoder's forward for a step, without transformers' per-call wrappers.

A decode token of a 30-layer model calls about 400 modules through transformers'
``forward`` methods: keyword plumbing, deprecation and output-capture decorators, the
causal-mask builder (which our paged attention never reads), the attention-interface
lookup per layer, and ``nn.Module.__call__`` hooks. On a small model that Python is a
quarter of a token. ``LeanDecoder`` runs the same modules' arithmetic in one loop: the same
submodules (so quantized, packed or stock linears alike), the model's own rotary embedding
and ``apply_rotary_pos_emb``, and the same operations in the same order as the Llama-family
decoder layer, so its output is bit for bit the model's (a test compares them).

It applies to the Llama-family layer shape (Llama, Mistral, Qwen2, SmolLM): pre-norm
RMSNorm, q/k/v/o projections, gated SiLU MLP. A layer's sliding window needs nothing here:
the paged attention reads it from the layer's module (``station.forward.paged_attention``),
whoever calls it. Any other model, or one whose modules differ from that shape, keeps
transformers' forward.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class LeanDecoder:
    """``base_model(input_ids, position_ids).last_hidden_state``, computed in one loop."""

    def __init__(self, base: nn.Module, rotate: Callable, attention: Callable[[], Callable]) -> None:
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.rotate = rotate
        self.attention = attention  # -> the registered attention function (looked up per step)
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = fuse_int4(attn.q_proj, attn.k_proj, attn.v_proj) or _Separate(
                attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = fuse_int4(mlp.gate_proj, mlp.up_proj) or _Separate(mlp.gate_proj, mlp.up_proj)
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                attn, qkv, attn.o_proj, attn.head_dim, attn.scaling, gate_up, mlp.down_proj, mlp.act_fn))
        self.final_weight, self.final_eps = base.norm.weight, base.norm.variance_epsilon

    @classmethod
    def for_model(cls, model: nn.Module, attention: Callable[[], Callable]) -> LeanDecoder | None:
        reason = refusal(model)
        if reason is not None:
            log.info("lean_decoder_not_used", model_type=getattr(model.config, "model_type", None),
                     reason=reason)
            return None
        return cls(model.base_model, _rotate(model.base_model), attention)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [1, T] -> the final hidden states [1, T, H]."""
        attention = self.attention()
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        rotate = self.rotate
        num_tokens = hidden.shape[1]
        for (norm1, eps1, norm2, eps2, attn, qkv, o_proj, head_dim, scaling,
             gate_up, down_proj, act) in self.layers:
            residual = hidden
            x = _rms_norm(hidden, norm1, eps1)
            shape = (1, num_tokens, -1, head_dim)
            q, k, v = qkv(x)
            q, k = rotate(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
            v = v.view(shape).transpose(1, 2)
            out, _ = attention(attn, q, k, v, None, dropout=0.0, scaling=scaling)
            hidden = residual + o_proj(out.reshape(1, num_tokens, -1).contiguous())
            residual = hidden
            x = _rms_norm(hidden, norm2, eps2)
            gate, up = gate_up(x)
            hidden = residual + down_proj(act(gate) * up)
        return _rms_norm(hidden, self.final_weight, self.final_eps)


class _Separate:
    """Several linear layers on one input, one call each (the model's own modules)."""

    def __init__(self, *layers: nn.Module) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


class FusedInt4:
    """Int4 layers that share an input as one kernel call: q, k, v (or gate, up) at once.

    torch's packed int4 layout (CPU) holds each output row's nibbles in its own row, so
    the layers' packed weights stacked along the outputs are the packed weight of the
    stacked layer, and each output is computed alike either way: the results are the
    separate layers' bit for bit (a test checks it). The layers' own buffers become views
    of the stacked one, so memory does not grow, and ``model.generate`` still calls them.
    """

    def __init__(self, layers: tuple[nn.Module, ...]) -> None:
        from station.kernels.quantized import GROUP

        self.group = GROUP
        self.in_features = layers[0].in_features
        self.sizes = [layer.out_features for layer in layers]
        self.packed = torch.cat([layer.packed for layer in layers])
        self.scales_and_zeros = torch.cat([layer.scales_and_zeros for layer in layers], 1).contiguous()
        start = 0
        for layer in layers:
            rows = layer.packed.shape[0]
            layer.packed = self.packed[start:start + rows]
            start += rows

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group,
                                                        self.scales_and_zeros)
        return [part.to(x.dtype).view(*x.shape[:-1], part.shape[-1]) for part in y.split(self.sizes, -1)]


def fuse_int4(*layers: nn.Module) -> FusedInt4 | None:
    """One call for CPU int4 layers on the same input without biases; None: keep them apart."""
    from station.kernels.quantized import Int4Linear

    if not all(type(layer) is Int4Linear and layer.bias is None and layer.packed.device.type == "cpu"
               and layer.in_features == layers[0].in_features for layer in layers):
        return None
    # torch packs rows in blocks of 64: stacking is exact when every part but the last fills
    # whole blocks (tested below, bit for bit, before anything is changed)
    if any(layer.packed.shape[0] != layer.out_features for layer in layers) or any(
            layer.out_features % 64 for layer in layers[:-1]):
        return None
    x = torch.randn(3, layers[0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = [layer(x) for layer in layers]
        saved = [layer.packed for layer in layers]
        fused = FusedInt4(layers)
        if all(torch.equal(a, b) for a, b in zip(fused(x), want)) and all(
                torch.equal(layer(x), w) for layer, w in zip(layers, want)):
            return fused
    for layer, packed in zip(layers, saved):  # put the layers' own buffers back
        layer.packed = packed
    log.warning("int4_fusion_inexact", sizes=[layer.out_features for layer in layers])
    return None


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, operation for operation."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def refusal(model: nn.Module) -> str | None:
    """Why the lean loop would not compute ``model``'s forward exactly (None: it would)."""
    reason = _unsupported(model.config, model.base_model)
    if reason is None and _rotate(model.base_model) is None:
        return "the layers' module has no apply_rotary_pos_emb"
    return reason


def _rotate(base: nn.Module) -> Callable | None:
    return getattr(sys.modules[type(base.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)


def _unsupported(config: Any, base: nn.Module) -> str | None:
    """Why the lean loop would not compute this model's forward exactly (None: it would)."""
    if getattr(config, "model_type", None) not in FAMILIES:
        return "not a Llama-family model"
    if not all(hasattr(base, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "unexpected model layout"
    for layer in base.layers:
        if type(layer).forward.__qualname__.split(".")[0] not in {
                "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}:
            return f"decoder layer {type(layer).__name__}"
        if not all(hasattr(layer, p) for p in _LAYER_PARTS):
            return "unexpected decoder layer parts"
        if not all(hasattr(layer.self_attn, p) for p in _ATTN_PARTS + ("head_dim", "scaling")):
            return "unexpected attention parts"
        if not all(hasattr(layer.mlp, p) for p in _MLP_PARTS):
            return "unexpected MLP parts"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).forward.__qualname__.split(".")[0] not in {
                    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}:
                return f"norm {type(norm).__name__}"
    return None
