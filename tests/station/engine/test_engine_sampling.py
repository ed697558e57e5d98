"""Sampling controls in the paged engine on a tiny real model, with exact outcomes: logit
bias, min_tokens against eos and stop_token_ids, penalties against a step-by-step
computation on the model's own logits, and greedy rows untouched in a mixed batch."""

from __future__ import annotations

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.core.requests import Finished
from station.model.loader import load_model
from tests.station.engine.test_paged_engine import (assert_pool_clean, engine_for, prompt_of, reference,
                                             submit)
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("few_threads")

EOS = 258


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    settings = Settings(model=str(path), runtime_dir=str(tmp_path_factory.mktemp("rt")))
    return path, load_model(settings)


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    return model.eval()


def next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def penalized_greedy(model, prompt: list[int], n: int, presence: float, frequency: float,
                     repetition: float) -> list[int]:
    """Greedy decoding with the penalties applied by hand, one token at a time."""
    out: list[int] = []
    for _ in range(n):
        logits = next_logits(model, prompt + out)
        for token in set(prompt) | set(out):
            logits[token] = (logits[token] / repetition if logits[token] > 0
                             else logits[token] * repetition)
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        out.append(int(logits.argmax()))
    return out


def test_logit_bias_plus_100_makes_greedy_repeat_that_token(tiny):
    _, loaded = tiny
    with engine_for(loaded) as engine:
        result = submit(engine, "a", prompt_of(1, 9), 6, logit_bias=((42, 100.0),)).wait()
        assert result.tokens == [42] * 6
        assert_pool_clean(engine)


def test_logit_bias_minus_100_on_the_greedy_token_gives_the_runner_up(tiny, hf_model):
    path, loaded = tiny
    prompt = prompt_of(2, 11)
    first, second = torch.topk(next_logits(hf_model, prompt), 2).indices.tolist()
    assert reference(path, prompt, 1) == [first]
    with engine_for(loaded) as engine:
        result = submit(engine, "a", prompt, 1, logit_bias=((first, -100.0),)).wait()
    assert result.tokens == [second]


def test_min_tokens_masks_eos_until_enough_tokens(tiny):
    _, loaded = tiny
    prompt = prompt_of(3, 8)
    with engine_for(loaded) as engine:
        eager = submit(engine, "a", prompt, 10, logit_bias=((EOS, 100.0),)).wait()
        assert eager.tokens == [EOS] and eager.one(Finished).finish_reason == "stop"
        held = submit(engine, "b", prompt, 10, logit_bias=((EOS, 100.0),), min_tokens=4).wait()
        assert len(held.tokens) == 5 and held.tokens[-1] == EOS and EOS not in held.tokens[:4]
        assert held.one(Finished).finish_reason == "stop"
        # ignore_eos: eos is not a stop id, so min_tokens has nothing to mask.
        ignored = submit(engine, "c", prompt, 3, logit_bias=((EOS, 100.0),), min_tokens=2,
                         ignore_eos=True).wait()
        assert ignored.tokens == [EOS] * 3


def test_min_tokens_masks_stop_token_ids(tiny, hf_model):
    path, loaded = tiny
    prompt = prompt_of(4, 10)
    greedy = reference(path, prompt, 3)
    with engine_for(loaded) as engine:
        stopped = submit(engine, "a", prompt, 8, stop_token_ids=(greedy[0],)).wait()
        assert stopped.tokens == greedy[:1] and stopped.one(Finished).finish_reason == "stop"
        late = submit(engine, "b", prompt, 8, stop_token_ids=(42,), logit_bias=((42, 100.0),),
                      min_tokens=3).wait()
        assert len(late.tokens) == 4 and late.tokens[-1] == 42 and 42 not in late.tokens[:3]
        assert late.one(Finished).finish_reason == "stop"
    runner_up = torch.topk(next_logits(hf_model, prompt), 2).indices.tolist()[1]
    with engine_for(loaded) as engine:
        masked = submit(engine, "c", prompt, 2, stop_token_ids=(greedy[0],), min_tokens=1).wait()
    assert masked.tokens[0] == runner_up


def test_penalties_in_a_batch_match_a_direct_computation_and_leave_greedy_rows_alone(tiny, hf_model):
    path, loaded = tiny
    prompts = [prompt_of(20 + i, 5 + 3 * i) for i in range(4)]
    penalized = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3)
    with engine_for(loaded, prefill_chunk_tokens=16) as engine:
        plain = [submit(engine, f"g{i}", p, 10, ignore_eos=True) for i, p in enumerate(prompts)]
        pen = submit(engine, "p", prompts[1], 10, ignore_eos=True, **penalized)
        for p, r in zip(prompts, plain):
            assert r.wait().tokens == reference(path, p, 10)
        got = pen.wait().tokens
        assert_pool_clean(engine)
    assert got == penalized_greedy(hf_model, prompts[1], 10, 0.5, 1.5, 1.3)
    assert got != reference(path, prompts[1], 10)


def test_top_k_one_equals_greedy(tiny):
    path, loaded = tiny
    prompt = prompt_of(5, 13)
    with engine_for(loaded) as engine:
        result = submit(engine, "a", prompt, 8, temperature=1.0, top_k=1).wait()
    assert result.tokens == reference(path, prompt, 8)


def test_seeded_sampling_with_controls_is_reproducible_in_any_batch(tiny):
    _, loaded = tiny
    prompt = prompt_of(6, 12)
    controls = dict(temperature=1.0, seed=4321, ignore_eos=True, frequency_penalty=0.7,
                    min_p=0.01, top_k=50, logit_bias=((7, 3.0),))
    with engine_for(loaded) as engine:
        alone = submit(engine, "a", prompt, 16, **controls).wait()
        crowd = [submit(engine, f"n{i}", prompt_of(40 + i, 7), 16, temperature=1.0,
                        ignore_eos=True, presence_penalty=1.0) for i in range(3)]
        again = submit(engine, "b", prompt, 16, **controls)
        for c in crowd:
            c.wait()
        assert again.wait().tokens == alone.tokens and len(alone.tokens) == 16
        assert len(set(alone.tokens)) > 1
