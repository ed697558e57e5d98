"""A Mistral-7B-shaped model made on the device, and the figures only a model that size
makes worth measuring (used by tests/gpu/device_bench.py, ``--models mistral-7b-shape``).

The weights are random bf16 made where they run: the model is built on the meta device,
given its storage on the target device (``to_empty``) and initialised in place, so nothing
is downloaded, nothing is copied in, and no fp32 copy of 7B parameters ever exists on the
host. ``scale`` divides every dimension (layers, hidden, FFN, heads, vocabulary) and keeps
the code path: the suite runs the same functions at scale 16 on a CPU
(tests/gpu/test_device_bench_shape.py).

Besides the decode and TTFT figures every model gets, it measures the device's copy
bandwidth (the bandwidth limit of a decode step is the weights' bytes read once a step),
the disk tier's read-back of a long session, and the peak memory.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

NAME = "mistral-7b-shape"
SCALES = (1, 2, 4, 8, 16, 32)


def shape_config(scale: int = 1) -> Any:
    """Mistral-7B v0.2+'s architecture (no sliding window, rope theta 1e6) divided by ``scale``:
    32 layers, hidden 4096, FFN 14336, 32 heads of 128, 8 KV heads, vocabulary 32000 at 1. The
    head size stays 128; the vocabulary stays above the byte tokenizer's 259 ids."""
    from transformers import MistralConfig

    if scale not in SCALES:
        raise ValueError(f"shape scale must be one of {SCALES}, not {scale}")
    heads = max(1, 32 // scale)
    return MistralConfig(vocab_size=max(32000 // scale, 512), hidden_size=4096 // scale,
                         intermediate_size=14336 // scale, num_hidden_layers=max(1, 32 // scale),
                         num_attention_heads=heads, num_key_value_heads=max(1, 8 // scale),
                         head_dim=4096 // scale // heads, max_position_embeddings=32768,
                         rope_theta=1e6, sliding_window=None, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=257, eos_token_id=258,
                         pad_token_id=256)


def build_on_device(config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """The model with random weights made on ``device``: normal(0, 0.02) matrices, norms at 1,
    and the rotary tables (buffers ``to_empty`` left unset) computed again."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm scales
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                fresh = type(module)(module.config)  # a few hundred floats, made on the host
                for buffer in ("inv_freq", "original_inv_freq"):
                    if hasattr(module, buffer):
                        getattr(module, buffer).copy_(getattr(fresh, buffer))
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def loaded_model(model: Any, settings: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A ``LoadedModel`` of an in-memory model, made as ``load_model`` makes one after reading
    the weights (the attention kinds read, float weights), with the tiny byte tokenizer."""
    from station.forward.attention_kinds import read_attention_kinds
    from station.forward.kv_cache import KVCacheShape
    from station.model.loader import LoadedModel, eos_token_ids, fingerprint, max_token_chars
    from station.model.tokenizing import Codec
    from station.model.weights import apply_weights
    from tests.support.tiny_models import build_tokenizer

    model.eval()
    model.requires_grad_(False)
    tokenizer = build_tokenizer()
    config = model.config
    shape = KVCacheShape.from_config(config, settings.kv_block_size, dtype)
    attention = read_attention_kinds(model, shape.num_kv_heads, shape.head_dim)
    weights = apply_weights(model, "float", device, dtype, decode_step=settings.cpu_decode_step,
                            full_attention=attention.all_full)
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, dtype=dtype,
        fingerprint=fingerprint(model, dtype, weights.tag, attention.tag), served_id=NAME,
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_model_len=min(settings.max_model_len, int(config.max_position_embeddings)),
        path=f"{NAME} (random weights made on {device})", loaded_from="(nothing read)",
        model_type=str(config.model_type), vocab_size=int(config.vocab_size),
        max_token_chars=max_token_chars(tokenizer), codec=Codec(tokenizer), weights=weights,
        attention=attention)


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes a second a copy of ``nbytes`` moves (each byte read once and written once: 2 x
    ``nbytes``), the best of ``reps``: timed with CUDA events on a GPU, ``perf_counter`` on a CPU."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for lazy setup
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        best = min(best, seconds)
    del src, dst
    return 2 * nbytes / best


def tier_read_back(loaded: Any, settings: Any, prompt: list[int]) -> dict[str, Any]:
    """Save ``prompt`` as a session through the disk tier, wait until it is durable, start a
    new engine on the same tier (the pool empty, the session on disk only) and ask the prompt
    again: -> where the hit came from, its tokens, the tier's read-back time, the hit's TTFT."""
    from tests.gpu.device_tier import TierEngine

    sid = f"alice.p.{len(prompt)}"
    writer = TierEngine(loaded, settings, num_blocks=None)
    try:
        saved = writer.generate(prompt, n=1, save_session=sid, match_session=True).prefill()
        if not saved.saved:
            raise RuntimeError(f"session not saved: {saved!r}")
        writer.expected_writes = 1
        writer.settle()
    finally:
        writer.close()
    reader = TierEngine(loaded, settings, num_blocks=None)
    try:
        t = time.perf_counter()
        hit = reader.generate(prompt, n=1, match_session=True)
        wall = time.perf_counter() - t
        pre = hit.prefill()
        stats = reader.engine.stats()
        return {"tier": pre.session_tier, "session_tokens": pre.session_tokens,
                "read_back_ms": stats.get("read_back_ms_p50"), "hit_ms": 1000 * wall,
                "error": pre.session_error, "bytes_per_block": reader.engine.kv_cache.shape.bytes_per_block,
                "block_size": reader.engine.block_size}
    finally:
        reader.close()


def peak_memory(device: torch.device) -> str:
    """The peak the run reached: torch's allocations on a GPU, the process's RSS on a CPU."""
    if device.type == "cuda":
        return (f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved (torch.cuda)")
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (peak RSS)"
