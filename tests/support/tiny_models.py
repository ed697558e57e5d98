"""Tiny random-weight causal LMs built in-process, so no test downloads anything.

``build_tiny_model(path, family)`` writes a transformers checkpoint (config, safetensors
weights, a byte-level BPE tokenizer with a ChatML template) that the station loads like
any HF model directory. Weights are initialised with a wide std so greedy argmax has
clear margins: parity tests compare token ids and must not hinge on float noise.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A Hermes/Qwen2.5-style template that renders tools and tool calls (the form Qwen2 and the
# SmolLM family use): tools in <tools></tools>, calls in <tool_call></tool_call>.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}\n<tool_call>\n"
    "{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FAMILIES = ("llama", "mistral", "qwen2")
# Families whose layers attend differently (``station.forward.attention_kinds``), each with
# windows of WINDOW tokens so that a prompt of a few dozen tokens spans several of them:
# Mistral v0.1 (every layer sliding), Qwen2/Qwen3 (full below ``max_window_layers``, sliding
# above), Phi-3 (every layer), Gemma 2 (sliding and full alternating, soft-capped scores and
# logits, query_pre_attn_scalar), Gemma 3 (its own pattern of sliding and full layers, q/k
# norms, a local rope base), gpt-oss (sinks and MoE).
WINDOW = 8
WINDOW_FAMILIES = ("mistral_sw", "qwen2_sw", "qwen3_sw", "phi3_sw", "gemma2", "gemma3")
ATTENTION_FAMILIES = ("llama",) + WINDOW_FAMILIES


def build_tokenizer(merges: list[tuple[str, str]] | tuple = (), chat_template: str = CHATML_TEMPLATE):
    """The tiny models' tokenizer: one token per byte, then the special tokens (ids 256-258).
    ``merges`` (byte-level strings, e.g. ``("Ġ", "t")``) add BPE merges, their tokens after
    the special ones: a tokenizer for tests of merges across text boundaries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template,
    )


def tiny_config(family: str = "llama", vocab_size: int = 259,
                max_position_embeddings: int = 4096, shape: dict | None = None):
    """``shape``: sizes in place of the tiny ones (``hidden_size``, heads...)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.3,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=256,
        tie_word_embeddings=False,
    )
    common.update(shape or {})
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family in WINDOW_FAMILIES + ("gpt_oss",):
        return _window_config(family, common)
    raise ValueError(f"unknown tiny model family {family!r}; expected one of "
                     f"{FAMILIES + WINDOW_FAMILIES + ('gpt_oss',)}")


def _window_config(family: str, common: dict):
    from transformers import (Gemma2Config, Gemma3TextConfig, GptOssConfig, MistralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config)

    w = WINDOW
    if family == "mistral_sw":
        return MistralConfig(**common, sliding_window=w)
    if family == "qwen2_sw":  # layer 0 full, layer 1 sliding
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=w, max_window_layers=1)
    if family == "qwen3_sw":
        return Qwen3Config(**common, head_dim=16, use_sliding_window=True, sliding_window=w,
                           max_window_layers=1)
    if family == "phi3_sw":
        return Phi3Config(**common, sliding_window=w)
    gemma = {**common, "tie_word_embeddings": True, "head_dim": 16, "sliding_window": w,
             "query_pre_attn_scalar": 16}
    if family == "gemma2":  # soft-capped attention scores (50) and final logits (30)
        return Gemma2Config(**gemma)
    if family == "gemma3":
        return Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"])
    return GptOssConfig(**common, head_dim=16, sliding_window=w, num_local_experts=4,
                        num_experts_per_tok=2)


def build_tiny_model(path: str | Path, family: str = "llama", seed: int | None = None,
                     max_position_embeddings: int = 4096,
                     chat_template: str = CHATML_TEMPLATE, shape: dict | None = None) -> Path:
    """Write a tiny random model + tokenizer to ``path`` and return it (seed: per family;
    ``chat_template``: ``TOOLS_TEMPLATE`` for a model whose template renders tools;
    ``shape``: ``tiny_config``'s)."""
    if seed is None:
        seed = FAMILIES.index(family) if family in FAMILIES else 0
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(chat_template=chat_template)
    config = tiny_config(family, vocab_size=len(tokenizer),
                         max_position_embeddings=max_position_embeddings, shape=shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference_generate(path: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy ``model.generate`` output (new tokens only): the parity oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()
