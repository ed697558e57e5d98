"""A step's token rows in C calls: Llama-family models on 4-bit weights, on a CPU.

On a small model a decode token is mostly Python: 30 layers of norms, four matrix
products, rotary, attention and SiLU are a few hundred torch calls, each with its own
dispatch and OpenMP fork/join, and ``make profile`` put that overhead at 8.5 ms of a 19 ms
token on 2 cores. ``cpu_step.c`` computes the whole forward (embedding to final norm) for
up to ``STEP_ROWS`` token rows in one call: the weights are the GGUF file's 4-bit groups
(``Int4Groups.step_layout``, read once per call for every row), K/V go straight into the
paged pool and are read back through each sequence's block table, and the work is split
over threads that outlive the call. The engine sends it every row of a step, decode tokens
and prompt tokens alike (``ModelRunner._run_stepped``; a prompt's rows in position order),
so every token's K/V comes from one arithmetic. The vocabulary head stays where it was
(``VocabHead``, the Q8_0 kernel on the step's threads, or oneDNN).

Numerics: activations are rounded to 15 bits per 32-value group for the integer products
(torch's int4 kernels round them to 8, bfloat16), the rest is float32. The step is not the
torch path's arithmetic, so a decode token's logits differ from ``model.generate``'s on the
same weights in the last bits (the fingerprint names the step, so KV of one is never served
to the other). What holds is what the engine promises: a row is computed from its own
values alone in the same order whatever else is in the step, so a sequence decodes alike
alone, in a batch, after a prefix hit or after a restart, and a token's K/V is the same
whether its row was a decode or a prompt's.

Used where ``StepWeights.for_model`` finds the shape it computes, the library builds, a
check against the model's own forward agrees, and a step measures faster than the torch
layers' products alone (``KernelChoices`` form ``cpu-step``, kept per machine).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch
from torch import nn

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)

MAX_WIDTH = 32768  # inputs of a layer (cpu_step.c's MAX_GROUPS groups of 32)
MAX_HEAD_DIM = 512  # cpu_step.c's MAX_HEAD_DIM
STEP_ROWS = 8  # token rows per call; more rows are more calls, each row computed alike
_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


class StepWeights:
    """The step's copy of a model: fused 4-bit matrices, norms, embeddings, shape."""

    def __init__(self, lib: ctypes.CDLL, model: nn.Module) -> None:
        config, base = model.config, model.base_model
        attn = base.layers[0].self_attn
        self.lib = lib
        self.layers = len(base.layers)
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = attn.head_dim
        self.inter = base.layers[0].mlp.gate_proj.out_features
        self.vocab = base.embed_tokens.weight.shape[0]
        self.eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self.scaling = float(attn.scaling)
        self.rotary = base.rotary_emb
        self.embed = base.embed_tokens.weight.detach()
        self.final_norm = base.norm.weight.detach()
        self.mats: list[list[tuple[torch.Tensor, ...]]] = []
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in base.layers:
            parts = []
            for owner, names in _PROJECTIONS:
                linears = [getattr(getattr(layer, owner), name) for name in names]
                forms = [linear.step_form for linear in linears]
                q, s, m = (torch.cat([f[i] for f in forms]) for i in range(3))
                bias = None
                if any(linear.bias is not None for linear in linears):
                    bias = torch.cat([linear.bias.detach().float() if linear.bias is not None else
                                      torch.zeros(linear.out_features) for linear in linears])
                parts.append((q, s, m, bias))
            self.mats.append(parts)
            self.norms.append((layer.input_layernorm.weight.detach(),
                               layer.post_attention_layernorm.weight.detach()))

    @classmethod
    def for_model(cls, model: nn.Module, lib: ctypes.CDLL) -> StepWeights | None:
        reason = _unsupported(model)
        if reason is not None:
            log.info("cpu_step_not_used", reason=reason)
            return None
        return cls(lib, model)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.mats for mat in parts
                   for t in mat if t is not None)

    def bind(self, kv_cache: Any, max_positions: int, threads: int | None = None) -> CpuStep:
        return CpuStep(self, kv_cache, max_positions, threads or torch.get_num_threads())


class CpuStep:
    """``StepWeights`` bound to one KV pool; ``__call__`` runs a decode step."""

    def __init__(self, weights: StepWeights, kv_cache: Any, max_positions: int, threads: int) -> None:
        w = self.weights = weights
        self.lib = w.lib
        self.max_positions = max_positions
        self.block_size = kv_cache.block_size
        with torch.inference_mode():
            x = torch.zeros(1, 1, w.hidden)
            cos, sin = w.rotary(x, position_ids=torch.arange(max_positions)[None])
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        self.kv = kv_cache.kv  # kept alive with the step
        ptrs = [w.embed.data_ptr(), w.final_norm.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr()]
        for layer, parts in enumerate(w.mats):
            for q, s, m, bias in parts:
                ptrs += [q.data_ptr(), s.data_ptr(), m.data_ptr(), 0 if bias is None else bias.data_ptr()]
            ptrs += [w.norms[layer][0].data_ptr(), w.norms[layer][1].data_ptr(),
                     self.kv[layer, 0].data_ptr(), self.kv[layer, 1].data_ptr()]
        dims = [w.layers, w.hidden, w.heads, w.kv_heads, w.head_dim, w.inter, self.block_size,
                max_positions, STEP_ROWS, threads, w.vocab, kv_cache.num_blocks]
        self._dims = torch.tensor(dims, dtype=torch.int64)
        self._fdims = torch.tensor([w.eps, w.scaling], dtype=torch.float32)
        self._ptrs = torch.tensor(ptrs, dtype=torch.int64)
        self.handle = self.lib.gnosis_step_create(self._dims.data_ptr(), self._fdims.data_ptr(),
                                                  self._ptrs.data_ptr())
        if not self.handle:
            # NULL: out of memory (the widths it cannot take were refused in _unsupported)
            raise MemoryError("cpu_step: the step's buffers could not be allocated")
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
            done = self.lib.gnosis_step_run(self.handle, end - start, ids.data_ptr(), pos.data_ptr(),
                                            slot.data_ptr(), table.data_ptr(), width,
                                            out[start:end].data_ptr())
            if done != 0:
                raise ValueError("cpu_step: a token, position, slot or block id out of range")
        self.calls += len(tokens)
        return out

    def head(self, kernel: Any, x: torch.Tensor) -> torch.Tensor:
        """``kernel(x)`` (a ``cpu_kernels.Q8Linear``, the same sums) on the step's threads."""
        rows = x.reshape(-1, kernel.in_features).to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], kernel.out_features)
        done = self.lib.gnosis_step_head(self.handle, kernel.q.data_ptr(), kernel.d.data_ptr(), rows.data_ptr(),
                                         y.data_ptr(), rows.shape[0], kernel.out_features, kernel.in_features)
        if done != 0:
            raise ValueError("cpu_step: a head of a shape the kernel does not take")
        return y

    def close(self) -> None:
        if self.handle:
            self.lib.gnosis_step_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


def release_step_forms(model: nn.Module) -> None:
    """Drop the int4 layers' step copies (``Int4Linear.step_form``): a step has its stacked
    copy, or there is no step."""
    for module in model.modules():
        if getattr(module, "step_form", None) is not None:
            module.step_form = None


def _unsupported(model: nn.Module) -> str | None:
    from station.forward.lean_decoder import _unsupported as lean_unsupported
    from station.kernels.quantized import Int4Linear

    config, base = model.config, model.base_model
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
        for owner, names in _PROJECTIONS:
            for name in names:
                linear = getattr(getattr(layer, owner), name)
                if type(linear) is not Int4Linear or getattr(linear, "step_form", None) is None:
                    return f"{owner}.{name} is not a 4-bit layer on a CPU"
        attn = layer.self_attn
        widths = (config.hidden_size, layer.mlp.gate_proj.out_features, attn.head_dim * config.num_attention_heads)
        if max(widths) > MAX_WIDTH:
            return f"a layer wider than {MAX_WIDTH} inputs"
        if attn.head_dim % 2 or attn.head_dim > MAX_HEAD_DIM or layer.mlp.gate_proj.out_features != layer.mlp.up_proj.out_features:
            return "unexpected shapes"
    return None


def checked_and_timed(weights: StepWeights, model: nn.Module, timed: bool, block_size: int = 16,
                      tokens: int = 6) -> tuple[bool, float | None, float | None]:
    """(the step agrees with the model's own forward, seconds a step, seconds the torch
    layers' products alone take for the same token); the times None unless ``timed``."""
    from station.forward.kv_cache import KVCache, KVCacheShape
    from station.kernels.quantized import Int4Linear

    shape = KVCacheShape.from_config(model.config, block_size, torch.float32)
    blocks = -(-tokens // block_size)
    step = weights.bind(KVCache(shape, blocks, torch.device("cpu")), max_positions=tokens)
    ids = torch.randint(0, weights.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    table = list(range(blocks))
    step_s = torch_s = None
    with torch.inference_mode():
        want = model.base_model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        got = torch.cat([step([int(ids[p])], [p], [p], [table]) for p in range(tokens)])
        agrees = bool((got - want).abs().max() <= 5e-2 * float(want.abs().max()))
        if timed and agrees:
            linears = [m for m in model.base_model.modules() if isinstance(m, Int4Linear)]
            inputs = [torch.randn(1, m.in_features) for m in linears]
            step_s = torch_s = float("inf")
            for _ in range(7):  # alternating, best of each: both see the same machine
                start = time.perf_counter()
                step([int(ids[-1])], [tokens - 1], [tokens - 1], [table])
                step_s = min(step_s, time.perf_counter() - start)
                start = time.perf_counter()
                for m, x in zip(linears, inputs):
                    m(x)
                torch_s = min(torch_s, time.perf_counter() - start)
    step.close()
    if not agrees:
        log.warning("cpu_step_disagrees", max_diff=float((got - want).abs().max()),
                    scale=float(want.abs().max()))
    return agrees, step_s, torch_s
