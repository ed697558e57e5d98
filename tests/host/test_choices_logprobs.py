"""Logprobs and ``n`` choices over real HTTP with the official openai client (host + station children, tiny
model): logprobs equal a plain transformers forward's log-softmax, ``n`` choices fork from
one prefill, several prompts per completion, and bad values get OpenAI's 400 bodies."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.host.conftest import station_call
from tests.support.tiny_models import reference_generate

MESSAGES = [{"role": "user", "content": "Name a colour."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(stack):
    c = OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    c.mid = c.models.list().data[0].id  # the served model's id
    return c


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def reference_lp(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return log_softmax


def token_bytes(tok, token_id: int) -> list[int]:
    from station.serving.token_text import token_texts

    return token_texts(tok).of(token_id)[1]


def check_position(tok, row: torch.Tensor, chosen: int, logprob: float, top: list) -> None:
    """``top``: [(bytes, logprob)] most likely first, as the API returned them."""
    assert chosen == int(row.argmax())
    assert abs(logprob - float(row[chosen])) < 1e-4
    ref = row.topk(len(top))
    assert [b for b, _ in top] == [token_bytes(tok, int(i)) for i in ref.indices]
    assert max(abs(v - r) for (_, v), r in zip(top, ref.values.tolist())) < 1e-4


def test_chat_top_logprobs_equal_plain_forward(client, tok, reference_lp):
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    resp = client.chat.completions.create(model=client.mid, messages=MESSAGES, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    ids = reference_generate(tok.name_or_path, prompt_ids, 8)
    assert len(content) == len(ids) == resp.usage.completion_tokens
    rows = reference_lp(prompt_ids + ids)
    for i, entry in enumerate(content):
        assert entry.bytes == token_bytes(tok, ids[i])
        assert entry.top_logprobs[0].bytes == entry.bytes
        check_position(tok, rows[len(prompt_ids) - 1 + i], ids[i], entry.logprob,
                       [(t.bytes, t.logprob) for t in entry.top_logprobs])
    # Streamed: the same entries, chunk by chunk.
    streamed = []
    for chunk in client.chat.completions.create(model=client.mid, messages=MESSAGES, max_tokens=8,
                                                temperature=0, logprobs=True, top_logprobs=5,
                                                stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    # (the prompt now hits the prefix cache: another float path, the same values to 1e-4)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4


def test_completion_logprobs_and_echo_equal_plain_forward(client, tok, reference_lp):
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    resp = client.completions.create(model=client.mid, prompt=PROMPT, max_tokens=6, temperature=0,
                                     logprobs=5, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = reference_generate(tok.name_or_path, prompt_ids, 6)
    rows = reference_lp(prompt_ids + ids)
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(prompt_ids) + len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[p] - float(rows[p - 1][prompt_ids[p]])) < 1e-4
        assert len(lp.top_logprobs[p]) <= 5
    for i in range(len(ids)):
        at = len(prompt_ids) + i
        assert abs(lp.token_logprobs[at] - float(rows[at - 1][ids[i]])) < 1e-4
        best = max(lp.top_logprobs[at].values())
        assert abs(best - float(rows[at - 1].max())) < 1e-4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Streamed: the echo first, then the same logprobs.
    streamed = []
    for chunk in client.completions.create(model=client.mid, prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=5, echo=True, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs
    assert streamed[0] is None and len(streamed) == len(lp.token_logprobs)
    assert max(abs(a - b) for a, b in zip(streamed[1:], lp.token_logprobs[1:])) < 1e-4


def test_n_choices_share_one_prefill_and_next_request_hits(stack, client, tok):
    prompt = "Colours of the rainbow, in order, with a note on each one:"
    before = station_call(stack.socket, "stats")
    resp = client.completions.create(model=client.mid, prompt=prompt, max_tokens=6, temperature=1.0,
                                     seed=1234, n=4)
    after = station_call(stack.socket, "stats")
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert len({c.text for c in resp.choices}) == 4
    prompt_len = len(tok(prompt)["input_ids"])
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == 24
    bs = after["block_size"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len
    # Every choice: KV for prompt + 5 tokens; the prompt's full blocks are shared.
    own = -(-(prompt_len + 5) // bs) - prompt_len // bs
    assert after["blocks_allocated"] - before["blocks_allocated"] == prompt_len // bs + 4 * own
    again = client.completions.create(model=client.mid, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    same = client.completions.create(model=client.mid, prompt=prompt, max_tokens=6, temperature=1.0,
                                     seed=1234, n=4)
    assert [c.text for c in same.choices] == [c.text for c in resp.choices]


def test_greedy_n2_equals_model_generate(client, tok):
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    ids = reference_generate(tok.name_or_path, prompt_ids, 10)
    text = tok.decode(ids, skip_special_tokens=True)
    resp = client.chat.completions.create(model=client.mid, messages=MESSAGES, max_tokens=10,
                                          temperature=0, n=2)
    assert [c.message.content for c in resp.choices] == [text, text]
    assert resp.usage.completion_tokens == 2 * len(ids)
    pieces: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=client.mid, messages=MESSAGES, max_tokens=10,
                                                temperature=0, n=2, stream=True):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    assert pieces == {0: text, 1: text}


def test_several_prompts_each_equal_its_own(client, tok):
    prompts = ["The quick brown fox", "Once upon a time", [5, 9, 77, 120, 33]]
    alone = [client.completions.create(model=client.mid, prompt=p, max_tokens=6, temperature=0)
             .choices[0].text for p in prompts]
    resp = client.completions.create(model=client.mid, prompt=prompts, max_tokens=6, temperature=0,
                                     n=2)
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [t for t in alone for _ in range(2)]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=client.mid, prompt=prompts, max_tokens=6,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == dict(enumerate(alone))


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "n": 0}, "n"),
    ("chat/completions", {"messages": MESSAGES, "n": 17}, "n"),
    ("chat/completions", {"messages": MESSAGES, "echo": True}, "echo"),
    ("completions", {"prompt": "a", "logprobs": "5"}, "logprobs"),
    ("completions", {"prompt": ["a", "b" * 10_000_000]}, "prompt[1]"),
])
def test_bad_values_name_the_field(stack, path, body, param):
    r = httpx.post(f"{stack.base_url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_raw_socket_bad_values_get_error_frames(stack):
    from gnosis_daemon.client import StationError

    for args in ({"n": 0}, {"n": 17}, {"logprobs": 21}, {"prompt_logprobs": -1},
                 {"logprobs": "5"}):
        with pytest.raises(StationError) as info:
            station_call(stack.socket, "generate", {"tokens": [1, 2], "max_tokens": 1, **args})
        assert info.value.code == "bad_request" and next(iter(args)) in info.value.message
    assert station_call(stack.socket, "stats")["blocks_held"] == 0
