"""Tiny models the daemon must handle without serving chat as usual: a model the station
refuses (no attention at all) and a base model (no chat template). Random weights and the
tiny byte-level tokenizer of ``tests.support.tiny_models``, built in-process in seconds."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import build_tiny_model, build_tokenizer


def build_tiny_mamba(path: str | Path, seed: int = 0) -> Path:
    """A tiny random Mamba: state-space layers that never call an attention function, so the
    station refuses it (``ModelRefused``, exit 78) for real."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         state_size=4, time_step_rank=4, num_hidden_layers=2,
                         bos_token_id=257, eos_token_id=258, pad_token_id=256,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    MambaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_base_model(path: str | Path) -> Path:
    """The tiny Llama with no chat template: a base model, served for ``/v1/completions``."""
    path = build_tiny_model(path, "llama", chat_template=None)  # type: ignore[arg-type]
    assert not (path / "chat_template.jinja").exists()
    return path
