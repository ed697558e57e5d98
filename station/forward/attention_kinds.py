"""Each layer's attention as the model defines it, read from the model's own forward.

A model's layers need not attend alike: Mistral v0.1 attends to a sliding window of 4,096
tokens on every layer, Gemma 2 alternates 4,096-token windows with full layers and
soft-caps its scores, Gemma 3 has five 512- or 1,024-token window layers for each full one,
gpt-oss adds a learned "sink" logit per head to the softmax. The paged attention must
compute each layer as the model does, or every answer past the window is wrong while it
looks right.

How the kinds are read: not from config fields, whose meaning differs by family (Mistral
applies ``config.sliding_window`` to every layer, Qwen2 only to the layers ``layer_types``
names), but from what the model itself hands its attention function. ``read_attention_kinds``
runs one forward of two tokens with a recording attention function switched in, and keeps
what each layer passed: ``scaling``, ``sliding_window``, ``softcap``, ``s_aux`` (sinks), the
shapes of Q, K and V, and whether the module is causal. A layer whose attention the engine
does not implement is refused, naming the model type and the kind:

* ``layer_types`` entries other than full or sliding attention (chunked, linear attention,
  state-space or convolution layers);
* layers that never call the attention function (state-space, linear-attention models);
* K and V of different widths, or a KV shape other than the pool's (latent attention);
* a bidirectional (non-causal) layer, KV shared across layers;
* an argument the attention function is given that it does not know.

``station.plan.start_check`` then proves the whole engine against the model's own
forward before the station serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from station.model.errors import ModelRefused

log = get_logger(__name__)

TRACE_IMPLEMENTATION = "gnosis_trace"
FULL, SLIDING = "full_attention", "sliding_attention"
# Arguments transformers' attention modules pass that change nothing the paged path computes.
_IGNORED = frozenset({"dropout", "position_ids", "use_cache", "output_router_logits",
                      "output_attentions", "cache_position", "return_dict", "is_causal"})
# Arguments the paged path implements (``LayerAttention``).
_HANDLED = frozenset({"scaling", "sliding_window", "softcap", "s_aux"})


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention: softmax(cap(q k^T * scaling) + mask [+ sink]) v, where the
    mask lets a query at position p see the keys at p - window + 1 .. p (every earlier key
    when ``window`` is None)."""

    scaling: float
    window: int | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = field(default=None, compare=False)  # [heads]: gpt-oss's s_aux

    @property
    def fused(self) -> bool:
        """SDPA computes it (no soft-capping, no sinks); else the explicit softmax."""
        return self.softcap is None and self.sinks is None

    def lowest_key(self, position: int) -> int:
        """The first key position a query at ``position`` attends to."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def describe(self) -> str:
        parts = ["full" if self.window is None else f"sliding {self.window}"]
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        return " + ".join(parts)


class AttentionKinds:
    """The model's layers' attention, by layer index."""

    def __init__(self, layers: list[LayerAttention], modules: list[Any] | None = None) -> None:
        self.layers = tuple(layers)
        self.modules = tuple(modules or ())  # each layer's attention module (set by the trace)
        self.windows = sorted({layer.window for layer in layers if layer.window is not None})

    def __getitem__(self, layer_idx: int) -> LayerAttention:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def longest_window(self) -> int | None:
        return self.windows[-1] if self.windows else None

    @property
    def all_full(self) -> bool:
        """Every layer plain causal attention over the whole context (what the C step and
        any path that ignores ``LayerAttention`` compute)."""
        return all(layer.window is None and layer.fused for layer in self.layers)

    @property
    def tag(self) -> str:
        """What the model fingerprint changes with: "" where every layer is full causal
        attention (fingerprints as before), else each layer's kind in order."""
        return "" if self.all_full else ";".join(layer.describe() for layer in self.layers)

    def summary(self) -> dict[str, Any]:
        """For ``hello``, ``health`` and the start log: layer counts by kind."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.describe()] = counts.get(layer.describe(), 0) + 1
        return {"layers": len(self.layers), "kinds": counts, "longest_window": self.longest_window}


def _trace_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    """The recording attention function: notes what the layer passed, returns zeros of the
    output's shape (the trace needs the forward to go on, not its values)."""
    _Trace.active.append((module, tuple(query.shape), tuple(key.shape), tuple(value.shape), kwargs))
    batch, heads, tokens, _ = query.shape
    return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


class _Trace:
    active: list[tuple] = []


def read_attention_kinds(model: Any, num_kv_heads: int, head_dim: int) -> AttentionKinds:
    """Every layer's ``LayerAttention``, read from one forward of the model (see the module
    docstring); raises ``ModelRefused`` for what the paged path does not compute.
    ``num_kv_heads`` and ``head_dim``: the KV pool's shape, which every layer must fit."""
    from transformers import AttentionInterface

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(config, "model_type", "?"))
    num_layers = int(text.num_hidden_layers)
    _refuse_by_config(model_type, text)
    AttentionInterface.register(TRACE_IMPLEMENTATION, _trace_attention)
    previous = config._attn_implementation
    model.set_attn_implementation(TRACE_IMPLEMENTATION)
    _Trace.active = []
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([[1, 2]], device=device)
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False)
        calls, _Trace.active = _Trace.active, []
    finally:
        model.set_attn_implementation(previous)
    by_layer: dict[int, tuple[Any, tuple, tuple, tuple, dict[str, Any]]] = {}
    for module, q_shape, k_shape, v_shape, kwargs in calls:
        idx = getattr(module, "layer_idx", None)
        if idx is None or idx in by_layer:
            raise ModelRefused(model_type, "attention layout",
                               "an attention call that names no layer (or one layer twice): "
                               "the paged KV pool keeps one K/V per layer")
        by_layer[idx] = (module, q_shape, k_shape, v_shape, kwargs)
    missing = [i for i in range(num_layers) if i not in by_layer]
    if missing:
        raise ModelRefused(model_type, "non-attention layers",
                           f"layers {_ranges(missing)} of {num_layers} compute no softmax attention "
                           "(state-space, linear-attention or recurrent layers), which the paged "
                           "engine does not implement")
    layers = [_layer(model_type, i, *by_layer[i], num_kv_heads, head_dim) for i in range(num_layers)]
    kinds = AttentionKinds(layers, [by_layer[i][0] for i in range(num_layers)])
    log.info("attention_kinds", model_type=model_type, **kinds.summary())
    return kinds


def _refuse_by_config(model_type: str, config: Any) -> None:
    for kind in set(getattr(config, "layer_types", None) or ()):
        if kind not in (FULL, SLIDING):
            raise ModelRefused(model_type, str(kind),
                               f"layer type {kind!r} is not implemented by the paged attention "
                               f"(it computes {FULL!r} and {SLIDING!r} layers)")
    if getattr(config, "attention_chunk_size", None):
        raise ModelRefused(model_type, "chunked_attention",
                           "chunked attention (attention_chunk_size) is not implemented by the "
                           "paged attention")
    if getattr(config, "num_kv_shared_layers", 0):
        raise ModelRefused(model_type, "shared_kv", "layers that reuse another layer's K/V are "
                           "not implemented by the paged KV pool")
    if getattr(config, "kv_lora_rank", None):
        raise ModelRefused(model_type, "latent_attention",
                           "latent attention (kv_lora_rank) is not implemented by the paged "
                           "KV pool, which keeps full K and V per head")


def _layer(model_type: str, idx: int, module: Any, q_shape: tuple, k_shape: tuple, v_shape: tuple,
           kwargs: dict[str, Any], num_kv_heads: int, head_dim: int) -> LayerAttention:
    unknown = sorted(name for name, value in kwargs.items()
                     if name not in _IGNORED and name not in _HANDLED
                     and value is not None and value is not False)
    if unknown:
        raise ModelRefused(model_type, f"attention argument {unknown[0]}",
                           f"layer {idx} passes its attention {', '.join(unknown)}, which the "
                           "paged attention does not implement")
    if getattr(module, "is_causal", True) is False:
        raise ModelRefused(model_type, "bidirectional attention",
                           f"layer {idx} is not causal; the engine decodes causal models")
    if k_shape[-1] != v_shape[-1] or k_shape[1] != v_shape[1] or q_shape[-1] != k_shape[-1]:
        raise ModelRefused(model_type, "latent_attention",
                           f"layer {idx}'s Q, K and V have different widths "
                           f"({q_shape[-1]}, {k_shape[-1]}, {v_shape[-1]}); the paged KV pool "
                           "keeps K and V of one head width")
    if (k_shape[1], k_shape[-1]) != (num_kv_heads, head_dim) or q_shape[1] % k_shape[1]:
        raise ModelRefused(model_type, "kv_shape",
                           f"layer {idx} attends with {k_shape[1]} K/V heads of {k_shape[-1]} "
                           f"and {q_shape[1]} query heads; the KV pool was sized for "
                           f"{num_kv_heads} of {head_dim} from the config")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    scaling = kwargs.get("scaling")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelRefused(model_type, "sliding window", f"layer {idx}'s sliding window {window!r} "
                           "is not a positive token count")
    if sinks is not None and (not torch.is_tensor(sinks) or sinks.numel() != q_shape[1]):
        raise ModelRefused(model_type, "attention sinks", f"layer {idx}'s sinks are not one "
                           "logit per query head")
    if scaling is None:
        scaling = q_shape[-1] ** -0.5
    return LayerAttention(float(scaling), window, None if softcap is None else float(softcap),
                          None if sinks is None else sinks.detach())


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            if b is not None:
                start = b
    return ", ".join(out)
