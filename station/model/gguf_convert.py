"""Workarounds for transformers' GGUF conversion, applied only while the station converts a file.

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

from contextlib import contextmanager
from typing import Any, Iterator

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
