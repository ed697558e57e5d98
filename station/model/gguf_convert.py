"""transformers' GGUF conversion as the station runs it: its workarounds, a parse of each file
once per conversion (``gguf_parsed_once``) and the check that lets the dense result be cached
(``clear_quantized_marker``).

* A Llama-architecture file whose ``general.name`` is exactly ``mistral`` (what llama.cpp's
  older converters wrote for a directory named so) is read by transformers 5.24 as a
  Mistral model, and its tensor-name table is then looked up in gguf-py under the model
  type ``mistral``, which gguf-py does not have: the conversion fails with
  "Unknown gguf model_type: mistral in gguf-py". The file's tensors are Llama's (llama.cpp
  writes Mistral as ``llama``), so the table is looked up as ``llama``, as transformers
  already does for its other renamed types (cohere, qwen2moe, gemma3_text, ...). The
  model stays the Mistral class transformers chose; the tensors and their row order are
  the same (``gguf_groups`` reads the file's own architecture, ``llama``, too).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from station.model.errors import ModelLoadError

# transformers' model_type -> the gguf-py architecture whose tensor names the file uses
_NAME_TABLE_ARCH: dict[str | None, str | None] = {"mistral": "llama"}


@contextmanager
def conversion_fixes() -> Iterator[None]:
    """Within this, transformers' GGUF conversion has the fixes above."""
    try:
        from transformers import modeling_gguf_pytorch_utils as utils
    except ImportError:  # transformers will say what is missing
        yield
        return
    original = utils.get_gguf_hf_weights_map

    def weights_map(hf_model: Any, processor: Any, model_type: str | None = None,
                    num_layers: int | None = None, qual_name: str = "") -> Any:
        if model_type is None:
            model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        return original(hf_model, processor, _NAME_TABLE_ARCH.get(model_type, model_type), num_layers,
                        qual_name)

    utils.get_gguf_hf_weights_map = weights_map
    try:
        yield
    finally:
        utils.get_gguf_hf_weights_map = original


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within a conversion, each GGUF file is parsed once and gguf's tensor-name table built once.

    transformers parses the file three times (the config, the weights, the tokenizer; each
    parse reads the whole vocabulary in the metadata) and rebuilds the name table for every
    module it maps: most of a conversion's time. It imports both
    from the ``gguf`` module at call time, so memoizing them there for the conversion's
    duration is enough. The reader is read-only (a memory map), so sharing it is safe.
    """
    try:
        import gguf
    except ImportError:  # transformers will say what is missing
        yield
        return
    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}
    maps: dict[tuple, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    def tensor_name_map(*args: Any) -> Any:
        if args not in maps:
            maps[args] = name_map(*args)
        return maps[args]

    # A patch of the module for the conversion's duration (mypy: a class replaced by a function).
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map  # type: ignore[misc]


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
