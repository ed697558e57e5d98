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
def daemon_root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def daemon(daemon_root):
    root = daemon_root
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


def test_logit_bias_and_vllm_stop_controls_through_the_client(daemon):
    """OpenAI's logit_bias, and vLLM's stop_token_ids / min_tokens through extra_body, on
    both routes, streamed and not: the stop token ends the answer and adds no text."""
    model_dir, client = daemon
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    forced = client.chat.completions.create(model=client.models.list().data[0].id,
                                            messages=MESSAGES, max_tokens=5, temperature=0,
                                            logit_bias={"72": 100})
    assert forced.choices[0].message.content == tokenizer.decode([72] * 5)
    assert forced.choices[0].finish_reason == "length"
    held = dict(max_tokens=10, temperature=0, logit_bias={"72": 50, "73": 100},
                extra_body={"stop_token_ids": [73], "min_tokens": 3})
    stream = client.chat.completions.create(model=client.models.list().data[0].id,
                                            messages=MESSAGES, stream=True, **held)
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert "".join(pieces) == tokenizer.decode([72] * 3) and reasons == ["stop"]
    text = client.completions.create(model=client.models.list().data[0].id, prompt="ab", **held)
    assert text.choices[0].text == tokenizer.decode([72] * 3)
    assert text.choices[0].finish_reason == "stop" and text.usage.completion_tokens == 4


def test_penalties_and_seed_reproduce_and_bad_values_are_400(daemon):
    import openai

    _, client = daemon
    model = client.models.list().data[0].id
    sampled = dict(model=model, prompt="The quick brown fox", max_tokens=12, temperature=1.0,
                   seed=7, presence_penalty=0.5, frequency_penalty=0.5,
                   extra_body={"repetition_penalty": 1.2, "top_k": 40, "min_p": 0.02,
                               "ignore_eos": True})
    first = client.completions.create(**sampled)
    assert first.choices[0].text == client.completions.create(**sampled).choices[0].text
    assert first.usage.completion_tokens == 12
    for body, param in [({"logit_bias": {"100000": 1}}, "logit_bias"),
                        ({"presence_penalty": 3}, "presence_penalty"),
                        ({"extra_body": {"min_tokens": 9}}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **body)
        assert info.value.body["param"] == param


def test_the_x_session_id_header_names_the_conversation(daemon, daemon_root):
    """The router recipe: the official client sends ``X-Session-Id`` on every request
    (``default_headers``); the daemon saves the conversation under that name, as it would
    under ``session_id``, and the next turn loads it. A body field still wins."""
    from host.session_names import save_ids
    from tests.host.conftest import station_call

    model_dir, plain = daemon
    client = plain.with_options(default_headers={"X-Session-Id": "conv-header-7"})
    model = client.models.list().data[0].id
    turn1 = [{"role": "system", "content": "You keep a ship's log. " * 12},
             {"role": "user", "content": "First entry."}]
    first = client.chat.completions.with_raw_response.create(
        model=model, messages=turn1, max_tokens=4, temperature=0)
    answer = first.parse().choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Second entry."}]
    second = client.chat.completions.with_raw_response.create(
        model=model, messages=turn2, max_tokens=4, temperature=0)
    assert second.headers["X-Thoth-Liquid-Memory"] == "hit"
    sock = daemon_root / "run" / "station.sock"
    listed = {s["session_id"] for s in station_call(sock, "kv_session.list")["sessions"]}
    assert save_ids("anon", None, "conv-header-7").save_session in listed
    # a body session_id wins over the header
    client.chat.completions.create(model=model, messages=turn1, max_tokens=2, temperature=0,
                                   extra_body={"session_id": "conv-body-8"})
    listed = {s["session_id"] for s in station_call(sock, "kv_session.list")["sessions"]}
    assert save_ids("anon", None, "conv-body-8").save_session in listed
