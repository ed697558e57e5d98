"""Structured output in the paged engine on a tiny random-weight model: the grammar forces
output that parses and validates whatever the weights prefer, ends the sequence with stop
when it is complete, and leaves the greedy rows of the same batch exactly model.generate's."""

from __future__ import annotations

import json

import pytest

from gnosis_daemon.grammar_spec import check_grammar
from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.settings import Settings
from station.core.requests import Finished, GenerationRequest, SamplingParams
from station.sampling.grammar import Grammars, grammars_for
from station.model.loader import load_model
from tests.station.engine.test_paged_engine import (Collector, assert_pool_clean, engine_for, prompt_of,
                                             reference)
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("few_threads")

EOS = 258
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    settings = Settings(model=str(path), runtime_dir=str(tmp_path_factory.mktemp("rt")))
    return path, load_model(settings)


def submit(engine, loaded, rid: str, prompt: list[int], n: int, grammar: dict | None,
           **params) -> Collector:
    collector = Collector()
    params.setdefault("temperature", 0.0)
    compiled = grammars_for(loaded).compile(check_grammar(grammar)) if grammar else None
    engine.add_request(GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=n, **params),
                                         grammar=compiled), collector)
    return collector


def text_of(loaded, tokens: list[int]) -> str:
    assert tokens[-1] == EOS
    return loaded.tokenizer.decode(tokens[:-1])


def check_instance(obj) -> None:
    assert set(obj) == {"color", "n", "ok"}
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 999
    assert isinstance(obj["ok"], bool)


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 1.0, "seed": 7},
                                    {"temperature": 1.5, "seed": 3, "top_p": 0.9,
                                     "logit_bias": ((ord("x"), 100.0),)}])
def test_json_schema_output_parses_and_validates(tiny, params):
    _, loaded = tiny
    with engine_for(loaded) as engine:
        result = submit(engine, loaded, "a", prompt_of(1, 9), 64,
                        {"type": "json_schema", "schema": SCHEMA}, **params).wait()
        assert result.one(Finished).finish_reason == "stop"
        check_instance(json.loads(text_of(loaded, result.tokens)))
        assert_pool_clean(engine)


def test_json_object_and_regex(tiny):
    _, loaded = tiny
    with engine_for(loaded) as engine:
        obj = submit(engine, loaded, "a", prompt_of(2, 7), 200, {"type": "json_object"},
                     temperature=1.0, seed=11).wait()
        regex = submit(engine, loaded, "b", prompt_of(3, 7), 40,
                       {"type": "regex", "regex": "(yes|no)-[0-9]{3}"}).wait()
    assert obj.one(Finished).finish_reason == "stop"
    assert isinstance(json.loads(text_of(loaded, obj.tokens)), dict)
    text = text_of(loaded, regex.tokens)
    assert text.split("-")[0] in ("yes", "no") and len(text.split("-")[1]) == 3


def test_grammar_row_leaves_greedy_rows_identical_to_model_generate(tiny):
    path, loaded = tiny
    prompts = [prompt_of(10 + i, 6 + 3 * i) for i in range(3)]
    with engine_for(loaded) as engine:
        greedy = [submit(engine, loaded, f"g{i}", p, 12, None) for i, p in enumerate(prompts)]
        constrained = submit(engine, loaded, "c", prompts[0], 64,
                             {"type": "json_schema", "schema": SCHEMA}, temperature=0.8, seed=5)
        sampled = [c.wait() for c in greedy]
        check_instance(json.loads(text_of(loaded, constrained.wait().tokens)))
        assert_pool_clean(engine)
    for prompt, result in zip(prompts, sampled):
        expected = reference(path, prompt, 12)
        assert result.tokens == expected[:len(result.tokens)]
        assert len(result.tokens) == 12 or result.tokens[-1] == EOS


def test_min_tokens_does_not_hold_back_the_grammars_end(tiny):
    _, loaded = tiny
    with engine_for(loaded) as engine:
        result = submit(engine, loaded, "a", prompt_of(4, 5), 64,
                        {"type": "json_schema", "schema": SCHEMA}, min_tokens=60).wait()
    assert result.one(Finished).finish_reason == "stop"
    check_instance(json.loads(text_of(loaded, result.tokens)))


def test_ignore_eos_still_ends_at_the_grammars_end(tiny):
    _, loaded = tiny
    with engine_for(loaded) as engine:
        result = submit(engine, loaded, "a", prompt_of(5, 5), 64,
                        {"type": "json_schema", "schema": SCHEMA}, ignore_eos=True).wait()
    assert result.one(Finished).finish_reason == "stop"
    check_instance(json.loads(text_of(loaded, result.tokens)))


def test_compiled_grammars_are_cached_by_spec_text_and_bounded(tiny):
    _, loaded = tiny
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, max_cached=2)
    a = {"type": "json_schema", "schema": SCHEMA}
    same = {"schema": json.loads(json.dumps(SCHEMA)), "type": "json_schema"}
    assert grammars.compile(a) is grammars.compile(same)
    assert grammars.compiled == 1
    grammars.compile({"type": "regex", "regex": "a+"})
    grammars.compile({"type": "regex", "regex": "b+"})
    assert len(grammars._cache) == 2 and grammars.compiled == 3
    grammars.compile(a)  # evicted: compiled again
    assert grammars.compiled == 4


@pytest.mark.parametrize("spec, words", [
    ({"type": "ebnf", "ebnf": "root ::= foo"}, "foo"),
    ({"type": "json_schema", "schema": {"type": "strin"}}, "strin"),
    ({"type": "regex", "regex": "(unclosed"}, "cannot be compiled"),
])
def test_a_grammar_the_engine_cannot_compile_is_bad_request(tiny, spec, words):
    _, loaded = tiny
    with pytest.raises(OpError) as info:
        grammars_for(loaded).compile(spec)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "grammar" in info.value.message and words in info.value.message


def test_the_plain_torch_fallback_masks_the_same_tokens(tiny, monkeypatch):
    """Where xgrammar's device kernel cannot run, the engine falls back to plain torch ops:
    the same output token for token."""
    from station.sampling import grammar

    _, loaded = tiny
    spec = {"type": "json_schema", "schema": SCHEMA}
    with engine_for(loaded) as engine:
        kernel = submit(engine, loaded, "a", prompt_of(6, 8), 64, spec, temperature=1.0,
                        seed=21).wait()
    monkeypatch.setattr(grammar, "_backend", "torch_native")
    with engine_for(loaded) as engine:
        native = submit(engine, loaded, "b", prompt_of(6, 8), 64, spec, temperature=1.0,
                        seed=21).wait()
    assert native.tokens == kernel.tokens
    check_instance(json.loads(text_of(loaded, native.tokens)))
