from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.model.loader import (
    ModelLoadError,
    load_model,
    served_name,
)


def test_load_tiny_hf_directory(tiny_dir):
    loaded = load_model(Settings(model=str(tiny_dir), max_model_len=100_000))
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.served_id == tiny_dir.name
    assert loaded.eos_token_ids == (258,)
    assert loaded.max_model_len == 4096  # capped by max_position_embeddings
    assert loaded.loaded_from == str(tiny_dir) and not loaded.converted
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    again = load_model(Settings(model=str(tiny_dir), max_model_len=64,
                                served_model_name="tiny"))
    assert again.fingerprint == loaded.fingerprint and len(loaded.fingerprint) == 64
    assert again.max_model_len == 64 and again.served_id == "tiny"


def test_fingerprint_depends_on_weights_and_dtype(tiny_dir, tmp_path):
    from tests.support.tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", seed=123)
    base = load_model(Settings(model=str(tiny_dir)))
    assert load_model(Settings(model=str(other))).fingerprint != base.fingerprint
    assert load_model(Settings(model=str(tiny_dir), dtype="bfloat16")).fingerprint != base.fingerprint


def test_cuda_without_cuda_is_a_clear_error(tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(Settings(model=str(tiny_dir), device="cuda"))


def test_served_name_strips_quant_suffix():
    assert served_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"


def test_default_gguf_converts_once_then_loads_from_cache(default_model_cache):
    """The real default model: the first load converts and caches, the second reads the cache.

    The first load is the session's conversion (tests/conftest.py), which every test of the
    default model reads; what it reported is checked here.
    """
    cache, first = default_model_cache.cache, default_model_cache.first
    assert first["converted"] and first["loaded_from"] == str(cache)
    assert (cache / "config.json").is_file() and (cache / "model.safetensors").is_file()
    assert "quantization_config" not in (cache / "config.json").read_text()
    # no temp dir left (beside the converted checkpoint: the remembered kernel choices and,
    # where a C compiler is, the head kernel built for this machine)
    assert [e for e in first["entries"] if e not in ("kernel-choices", "kernels")] == [cache.name]
    assert first["served_id"] == "SmolLM2-135M-Instruct" and first["model_type"] == "llama"
    assert first["im_end_is_eos"]

    second = load_model(Settings(model_cache_dir=str(default_model_cache.root)))
    assert not second.converted and second.loaded_from == str(cache)
    assert second.fingerprint == first["fingerprint"]
    assert second.tokenizer.chat_template  # the chat template survived the cache round trip
    prompt = second.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([second.tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        out = second.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                    do_sample=False)
    assert "Paris" in second.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
