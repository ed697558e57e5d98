"""A step's token rows in C calls: Llama-family models on 4-bit weights, on a CPU.

On a small model a decode token is mostly Python: 30 layers of norms, four matrix
products, rotary, attention and SiLU are a few hundred torch calls, each with its own
dispatch and OpenMP fork/join (``make profile`` shows that overhead's share of a token).
``cpu_step.c`` computes the whole forward (embedding to final norm) for
up to ``STEP_ROWS`` token rows in one call: the weights are the GGUF file's 4-bit groups
(``Int4Groups.step_layout``, read once per call for every row), K/V go straight into the
paged pool and are read back through each sequence's block table, and the work is split
over threads that outlive the call. The engine sends it every row of a step, decode tokens
and prompt tokens alike (``ModelRunner._run_stepped``; a prompt's rows in position order),
so every token's K/V comes from one arithmetic. The vocabulary head stays where it was
(``VocabHead``, the Q8_0 kernel on the step's threads, or oneDNN).

Numerics: activations are rounded to 15 bits of their row's largest for the integer
products, a 32-value group far below it keeping up to 7 bits more (torch's int4 kernels
round them to 8, bfloat16), the rest is float32. The step is not the
torch path's arithmetic, so a decode token's logits differ from ``model.generate``'s on the
same weights in the last bits (the fingerprint names the step, so KV of one is never served
to the other). What holds is what the engine promises: a row is computed from its own
values alone in the same order whatever else is in the step, so a sequence decodes alike
alone, in a batch, after a prefix hit or after a restart, and a token's K/V is the same
whether its row was a decode or a prompt's.

Used where ``StepWeights.for_model`` finds the shape it computes, the library builds, a
check against the model's own forward agrees, and a step measures faster than the torch
layers' products alone (``KernelChoices`` form ``cpu-step``, kept per machine).

The C interface is ``cpu_abi.h``: the structs below mirror its step structs field for
field (``gnosis_step_config_t`` for a step's life, ``gnosis_step_rows_t`` for a call), and
``declare_step`` sets the prototypes of the functions this module calls.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.kernels.cpu_kernels import Q8Linear, Q8Product, Status
from station.kernels.q4_tiles import Q4Matrix, TiledLinear, TiledMatrix, matrix_struct

log = get_logger(__name__)

MAX_WIDTH = 32768  # inputs of a layer: cpu_abi.h's GNOSIS_STEP_MAX_WIDTH
MAX_HEAD_DIM = 512  # cpu_abi.h's GNOSIS_STEP_MAX_HEAD_DIM
MAX_ROWS = 64  # cpu_abi.h's GNOSIS_STEP_MAX_ROWS
STEP_ROWS = MAX_ROWS  # token rows per call; more rows are more calls
# the four matrices of a layer, in gnosis_layer_weights_t's order: the projections of each stacked
PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
_int, _float, _ptr = ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
# gnosis_attention_takes(head_dim): 0 the portable loops, 1 the AVX-512 kernels in float32,
# 2 the AVX-512 kernels on bfloat16 pairs (cpu_attention.c): its name in the fingerprint
# (each gives other bits) and in the decode plan
ATTENTION_ARITHMETIC = {0: "attention-portable", 1: "attention-vector", 2: "attention-vector-bf16"}
ATTENTION_KERNELS = {0: "portable loops", 1: "AVX-512, K/V read once a row group",
                     2: "AVX-512 bfloat16 dot products (q, k, e, v rounded to bfloat16, float32 sums), "
                        "K/V read once a row group"}


class ModelShape(ctypes.Structure):
    _c_name_ = "gnosis_model_shape_t"
    _fields_ = [("layers", _int), ("hidden", _int), ("heads", _int), ("kv_heads", _int),
                ("head_dim", _int), ("intermediate", _int), ("vocab", _int),
                ("rms_eps", _float), ("attention_scale", _float)]


class LayerWeights(ctypes.Structure):
    _c_name_ = "gnosis_layer_weights_t"
    _fields_ = [("qkv", Q4Matrix), ("o", Q4Matrix), ("gate_up", Q4Matrix), ("down", Q4Matrix),
                ("input_norm", _ptr), ("post_attention_norm", _ptr)]


class ModelWeights(ctypes.Structure):
    _c_name_ = "gnosis_model_weights_t"
    _fields_ = [("embed", _ptr), ("final_norm", _ptr), ("layers", ctypes.POINTER(LayerWeights))]


class Rotary(ctypes.Structure):
    _c_name_ = "gnosis_rotary_t"
    _fields_ = [("cos", _ptr), ("sin", _ptr), ("max_positions", _int)]


class KvLayer(ctypes.Structure):
    """One layer's K and V in the pool: [slots, kv_heads, head_dim] each, in the step's
    ``kv_dtype``."""

    _c_name_ = "gnosis_kv_layer_t"
    _fields_ = [("k", _ptr), ("v", _ptr)]


class KvPool(ctypes.Structure):
    _c_name_ = "gnosis_kv_pool_t"
    _fields_ = [("layers", ctypes.POINTER(KvLayer)), ("num_blocks", _int), ("block_size", _int)]


class StepConfig(ctypes.Structure):
    """What ``gnosis_step_create`` takes; it copies the structs, the tensors must outlive it."""

    _c_name_ = "gnosis_step_config_t"
    _fields_ = [("shape", ModelShape), ("weights", ModelWeights), ("rotary", Rotary), ("kv", KvPool),
                ("max_rows", _int), ("threads", _int), ("attention_bf16", _int)]


class StepRows(ctypes.Structure):
    """One ``gnosis_step_run`` call's token rows and where their output goes."""

    _c_name_ = "gnosis_step_rows_t"
    _fields_ = [("tokens", _ptr), ("positions", _ptr), ("slots", _ptr),  # int64 [rows] each
                ("block_tables", _ptr), ("hidden_out", _ptr),  # int32 [rows, table_width]; [rows, hidden]
                ("rows", _int), ("table_width", _int)]


def declare_step(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The prototypes of the library's step functions (cpu_abi.h), set on ``lib``."""
    lib.gnosis_step_create.argtypes = [ctypes.POINTER(StepConfig), ctypes.POINTER(_ptr)]
    lib.gnosis_step_create.restype = ctypes.c_int
    lib.gnosis_step_free.argtypes = [_ptr]
    lib.gnosis_step_free.restype = None
    lib.gnosis_step_threads.argtypes = [_ptr]
    lib.gnosis_step_threads.restype = _int
    lib.gnosis_step_run.argtypes = [_ptr, ctypes.POINTER(StepRows)]
    lib.gnosis_step_run.restype = ctypes.c_int
    lib.gnosis_step_head.argtypes = [_ptr, ctypes.POINTER(Q8Product)]
    lib.gnosis_step_head.restype = ctypes.c_int
    lib.gnosis_q4_simd.argtypes = []
    lib.gnosis_q4_simd.restype = ctypes.c_char_p
    lib.gnosis_attention_takes.argtypes = [_int]
    lib.gnosis_attention_takes.restype = _int
    return lib


class StepWeights:
    """The step's view of a model: its stacked 4-bit matrices (the ``TiledLinear`` layers'
    own, ``station.model.step_layers``: no copy), norms, embeddings, shape."""

    def __init__(self, lib: ctypes.CDLL, model: nn.Module, attention: str = "auto") -> None:
        config, base = cast(Any, model.config), cast(Any, model.base_model)
        attn = base.layers[0].self_attn
        self.lib = declare_step(lib)
        self.layers: int = len(base.layers)
        self.hidden: int = config.hidden_size
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim: int = attn.head_dim
        self.inter: int = base.layers[0].mlp.gate_proj.out_features
        self.vocab: int = base.embed_tokens.weight.shape[0]
        self.eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self.scaling = float(attn.scaling)
        self.rotary = base.rotary_emb
        self.embed: torch.Tensor = base.embed_tokens.weight.detach()
        self.final_norm: torch.Tensor = base.norm.weight.detach()
        # per layer, PROJECTIONS' four matrices, in the step's tiles
        self.mats: list[list[TiledMatrix]] = [
            [getattr(getattr(layer, owner), names[0]).matrix for owner, names in PROJECTIONS]
            for layer in base.layers]
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = [
            (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
            for layer in base.layers]
        # settings' cpu_attention: auto takes bfloat16 pairs where this build has them
        self.attention_bf16 = attention == "auto" and self.lib.gnosis_attention_takes(self.head_dim) == 2

    @classmethod
    def for_model(cls, model: nn.Module, lib: ctypes.CDLL, attention: str = "auto") -> StepWeights | None:
        """Over the model's ``TiledLinear`` layers, where they stack as the step reads them;
        ``attention``: settings' ``cpu_attention``."""
        reason = shape_refusal(model) or _stacking_refusal(model)
        if reason is not None:
            log.info("cpu_step_not_used", reason=reason)
            return None
        return cls(lib, model, attention)

    @property
    def nbytes(self) -> int:
        return sum(mat.nbytes for parts in self.mats for mat in parts)

    def arithmetic(self) -> str:
        """Names what the step's bits depend on (for the fingerprint: KV one arithmetic
        wrote is never served to another): the products' (alike on every build) and which
        attention this build runs. ``norm-16-sums``: the RMS norms' sums of squares in 16
        partial sums (cpu_step.c's rms_norm; before 2026-12-08 one running sum), so KV an
        older station saved is not served as this one's. ``q4-int16-row-scale``: one
        activation scale per row, a group's integer sum shifted to it (cpu_q4.c; before
        2026-12-08 ``q4-int16-tiles``, a scale per group). ``kv-head-major``: a pool block holds
        its rows head by head (cpu_abi.h's gnosis_kv_layer_t; before, position by position),
        so a block another station wrote is not read as this one's."""
        return "q4-int16-row-scale,norm-16-sums,kv-head-major," + ATTENTION_ARITHMETIC[self.attention_kind]

    def kernels(self) -> str:
        """What this machine's build computes the step with, for the decode plan."""
        attention = ATTENTION_KERNELS[self.attention_kind]
        return (f"4-bit products {self.lib.gnosis_q4_simd().decode()} (15-bit activations), attention "
                f"{attention}, prompts in calls of up to {STEP_ROWS} rows")

    @property
    def attention_kind(self) -> int:
        """0 the portable loops, 1 the vector kernels in float32, 2 on bfloat16 pairs."""
        return 2 if self.attention_bf16 else min(1, self.lib.gnosis_attention_takes(self.head_dim))

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV pool the step reads and writes: bfloat16 where its attention
        is (K and V rounded once, as written: the values the attention would round them to,
        in half the bytes), else float32."""
        return torch.bfloat16 if self.attention_bf16 else torch.float32

    def pool(self, model: nn.Module, blocks: int, block_size: int = 16) -> Any:
        """A CPU KV pool of ``blocks`` blocks for ``model`` in this step's ``kv_dtype``."""
        from station.forward.kv_cache import KVCache, KVCacheShape

        shape = KVCacheShape.from_config(model.config, block_size, self.kv_dtype)
        return KVCache(shape, blocks, torch.device("cpu"))

    def bind(self, kv_cache: Any, max_positions: int, threads: int | None = None) -> CpuStep:
        return CpuStep(self, kv_cache, max_positions, threads or torch.get_num_threads())

    def shape(self) -> ModelShape:
        return ModelShape(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, intermediate=self.inter, vocab=self.vocab,
                          rms_eps=self.eps, attention_scale=self.scaling)

    def layer_weights(self) -> ctypes.Array[LayerWeights]:
        """Per layer, pointers into this object's tensors (valid while it lives)."""
        return (LayerWeights * self.layers)(*(
            LayerWeights(*(matrix_struct(mat) for mat in parts), input_norm=norm1.data_ptr(),
                         post_attention_norm=norm2.data_ptr())
            for parts, (norm1, norm2) in zip(self.mats, self.norms)))


class CpuStep:
    """``StepWeights`` bound to one KV pool; ``__call__`` runs a decode step."""

    def __init__(self, weights: StepWeights, kv_cache: Any, max_positions: int, threads: int) -> None:
        w = self.weights = weights
        self.handle: int | None = None
        self.lib = declare_step(w.lib)
        self.max_positions = max_positions
        self.block_size = kv_cache.block_size
        with torch.inference_mode():
            x = torch.zeros(1, 1, w.hidden)
            cos, sin = w.rotary(x, position_ids=torch.arange(max_positions)[None])
        # the step points into these, the weights' tensors and the pool: all live as long as it
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        self.kv = kv_cache.kv  # [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]
        if self.kv.dtype != w.kv_dtype:
            raise ValueError(f"cpu_step: a {self.kv.dtype} KV pool for a step that reads {w.kv_dtype}")
        kv_layers = (KvLayer * w.layers)(*(KvLayer(k=kv[0].data_ptr(), v=kv[1].data_ptr()) for kv in self.kv))
        config = StepConfig(
            shape=w.shape(),
            weights=ModelWeights(embed=w.embed.data_ptr(), final_norm=w.final_norm.data_ptr(),
                                 layers=w.layer_weights()),
            rotary=Rotary(cos=self.cos.data_ptr(), sin=self.sin.data_ptr(), max_positions=max_positions),
            kv=KvPool(layers=kv_layers, num_blocks=kv_cache.num_blocks, block_size=self.block_size),
            max_rows=STEP_ROWS, threads=threads, attention_bf16=int(w.attention_bf16))
        handle = _ptr()
        status = self.lib.gnosis_step_create(ctypes.byref(config), ctypes.byref(handle))
        if status == Status.NO_MEMORY:
            raise MemoryError("cpu_step: the step's buffers could not be allocated")
        if status != Status.OK:  # the shapes it cannot take are refused in shape_refusal first
            raise ValueError(f"cpu_step: a model shape the step does not take (status {status})")
        self.handle = handle.value
        self.threads = self.lib.gnosis_step_threads(self.handle)
        self.calls = 0  # token rows computed (tests and stats see the step was taken)

    def fits(self, positions: list[int]) -> bool:
        return max(positions) < self.max_positions

    def __call__(self, tokens: list[int], positions: list[int], slots: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        """Token rows (decode tokens, or a prompt's in position order) -> the final norm's
        output, [B, hidden] float32; calls of ``STEP_ROWS`` rows, in order."""
        out = torch.empty(len(tokens), self.weights.hidden)
        width = max(len(t) for t in tables)
        for start in range(0, len(tokens), STEP_ROWS):
            end = min(start + STEP_ROWS, len(tokens))
            ids = torch.tensor(tokens[start:end], dtype=torch.int64)
            pos = torch.tensor(positions[start:end], dtype=torch.int64)
            slot = torch.tensor(slots[start:end], dtype=torch.int64)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables[start:end]], dtype=torch.int32)
            rows = StepRows(tokens=ids.data_ptr(), positions=pos.data_ptr(), slots=slot.data_ptr(),
                            block_tables=table.data_ptr(), hidden_out=out[start:end].data_ptr(),
                            rows=end - start, table_width=width)
            if self.lib.gnosis_step_run(self.handle, ctypes.byref(rows)) != Status.OK:
                raise ValueError("cpu_step: a token, position, slot or block id out of range")
        self.calls += len(tokens)
        return out

    def head(self, kernel: Q8Linear, x: torch.Tensor) -> torch.Tensor:
        """``kernel(x)`` (a ``cpu_kernels.Q8Linear``, the same sums) on the step's threads."""
        rows = x.reshape(-1, kernel.in_features).to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], kernel.out_features)
        if self.lib.gnosis_step_head(self.handle, ctypes.byref(kernel.product(rows, y))) != Status.OK:
            raise ValueError("cpu_step: a head of a shape the kernel does not take")
        return y

    def close(self) -> None:
        if getattr(self, "handle", None):  # None: never created (or __init__ failed before)
            self.lib.gnosis_step_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


def shape_refusal(model: nn.Module) -> str | None:
    """Why the step cannot compute this model, whatever its weights (None: it can)."""
    from station.forward.lean_decoder import _unsupported as lean_unsupported

    config, base = cast(Any, model.config), cast(Any, model.base_model)
    reason = lean_unsupported(config, base)
    if reason is not None:
        return reason
    # cpu_step.c attends to the whole context on every layer (the runner checks the kinds
    # read from the model too: AttentionKinds.all_full)
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in base.layers) or (
            getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return "sliding-window attention"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)}"
    if base.embed_tokens.weight.dtype != torch.float32 or base.embed_tokens.weight.device.type != "cpu":
        return "not a float32 model on a CPU"
    for layer in base.layers:
        attn = layer.self_attn
        widths = (config.hidden_size, layer.mlp.gate_proj.out_features, attn.head_dim * config.num_attention_heads)
        if max(widths) > MAX_WIDTH:
            return f"a layer wider than {MAX_WIDTH} inputs"
        if (attn.head_dim % 2 or attn.head_dim > MAX_HEAD_DIM
                or layer.mlp.gate_proj.out_features != layer.mlp.up_proj.out_features):
            return "unexpected shapes"
    return None


def _stacking_refusal(model: nn.Module) -> str | None:
    """Why the model's projections are not the step's matrices (None: they are)."""
    for layer in cast(Any, model.base_model).layers:
        for owner, names in PROJECTIONS:
            linears = [getattr(getattr(layer, owner), name) for name in names]
            start = 0
            for name, linear in zip(names, linears):
                if type(linear) is not TiledLinear or linear.matrix is not linears[0].matrix or (
                        linear.first * 16 + linear.offset != start):
                    return f"{owner}.{name} is not a 4-bit layer on the step's tiles"
                start += linear.out_features
            if start != linears[0].matrix.rows:
                return f"{owner}.{names[0]}'s matrix holds other rows"
    return None


def checked_and_timed(weights: StepWeights, model: nn.Module, sample: Sequence[nn.Module], sample_layers: int,
                      block_size: int = 16, tokens: int = 6) -> tuple[bool, float | None, float | None]:
    """(the step agrees with the model's own forward, seconds a step, seconds torch's int4
    layers' products alone take for the same token); the times None without a ``sample``:
    torch's layers of the first ``sample_layers`` decoder layers, timed and scaled to all."""
    blocks = -(-tokens // block_size)
    step = weights.bind(weights.pool(model, blocks, block_size), max_positions=tokens)
    ids = torch.randint(0, weights.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    table = list(range(blocks))
    step_s = torch_s = None
    with torch.inference_mode():
        want = model.base_model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        got = torch.cat([step([int(ids[p])], [p], [p], [table]) for p in range(tokens)])
        agrees = bool((got - want).abs().max() <= 5e-2 * float(want.abs().max()))
        if sample and agrees:
            inputs = [torch.randn(1, m.in_features) for m in sample]
            step_s = torch_s = float("inf")
            for _ in range(7):  # alternating, best of each: both see the same machine
                start = time.perf_counter()
                step([int(ids[-1])], [tokens - 1], [tokens - 1], [table])
                step_s = min(step_s, time.perf_counter() - start)
                start = time.perf_counter()
                for m, x in zip(sample, inputs):
                    m(x)
                torch_s = min(torch_s, (time.perf_counter() - start) * weights.layers / sample_layers)
    step.close()
    if not agrees:
        log.warning("cpu_step_disagrees", max_diff=float((got - want).abs().max()),
                    scale=float(want.abs().max()))
    return agrees, step_s, torch_s
