"""End to end: the official openai client against `gnosis-daemon run` on a tiny random model.

Greedy output through the whole stack (supervisor -> host -> station socket -> engine)
must equal transformers' `model.generate`, token for token.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.support.procs import free_port, run_daemon
from tests.support.tiny_models import build_tiny_model, reference_generate

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model_dir = build_tiny_model(root / "tiny-llama", "llama")
    port = free_port()
    with run_daemon(model_dir, root / "run", port, log_path=root / "daemon.log"):
        yield model_dir, OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                max_retries=0, timeout=120)


def expected_completion(model_dir, messages):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    ref_ids = reference_generate(model_dir, prompt_ids, MAX_TOKENS)
    return prompt_ids, ref_ids, tokenizer.decode(ref_ids, skip_special_tokens=True)


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours, s'il vous plaît."}]


def test_non_streaming_equals_model_generate(daemon):
    model_dir, client = daemon
    prompt_ids, ref_ids, ref_text = expected_completion(model_dir, MESSAGES)
    resp = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.completion_tokens == len(ref_ids)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    expected_reason = "stop" if len(ref_ids) < MAX_TOKENS else "length"
    assert resp.choices[0].finish_reason == expected_reason


def test_streaming_equals_model_generate(daemon):
    model_dir, client = daemon
    prompt_ids, ref_ids, ref_text = expected_completion(model_dir, MESSAGES)
    stream = client.chat.completions.create(
        messages=MESSAGES, model=client.models.list().data[0].id, max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(pieces) == ref_text
    assert usage is not None and usage.completion_tokens == len(ref_ids)
    assert usage.prompt_tokens == len(prompt_ids)
    assert len(reasons) == 1


def test_completions_endpoint_equals_model_generate(daemon):
    model_dir, client = daemon
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref_ids = reference_generate(model_dir, prompt_ids, MAX_TOKENS)
    resp = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                     max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(ref_ids)
