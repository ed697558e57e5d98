"""Structured output on the default model (SmolLM2-135M-Instruct from its GGUF file): 40
samples at temperature 1 of a schema all parse and validate, and each ends with stop.
Its special tokens (``<|endoftext|>``, ``<|im_start|>``...) are never grammatical: the
grammar once let them into JSON strings, where the detokenizer drops them."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from gnosis_daemon.grammar_spec import check_grammar
from gnosis_daemon.settings import Settings
from station.core.requests import Choices, Failed, Finished, GenerationRequest, SamplingParams, Token
from station.sampling.grammar import grammars_for
from station.model.loader import load_model
from station.serving.chat import render_chat
from tests.station.engine.test_paged_engine import engine_for

pytestmark = pytest.mark.usefixtures("few_threads")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Oslo", "Lima", "Rome"]},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}},
                         "student": {"type": "boolean"}},
          "required": ["name", "age", "city", "pets", "student"], "additionalProperties": False}


def test_40_samples_at_temperature_1_all_parse_and_validate(default_model_cache):
    loaded = load_model(Settings(model_cache_dir=str(default_model_cache.root)))
    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": PERSON}))
    assert not {0, 1} & set(compiled.tokenizer_info.stop_token_ids)
    prompt = render_chat(loaded, [{"role": "user", "content": "Describe a person as JSON."}], True)
    events: dict[str, list] = {}

    def collect(event) -> None:
        events.setdefault(event.request_id, []).append(event)

    with engine_for(loaded, num_blocks=2048) as engine:
        for i in range(4):  # 4 requests of n=10: each choice samples with its own seed
            engine.add_request(GenerationRequest(f"p{i}", prompt, SamplingParams(
                max_tokens=120, temperature=1.0, seed=40 + i), grammar=compiled,
                choices=Choices(n=10)), collect)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and sum(
                isinstance(e[-1], (Finished, Failed)) for e in events.values()) < 40:
            time.sleep(0.05)
    assert len(events) == 40
    eos = set(loaded.eos_token_ids)
    for choice in events.values():
        assert isinstance(choice[-1], Finished) and choice[-1].finish_reason == "stop", choice[-1]
        tokens = [e.token_id for e in choice if isinstance(e, Token)]
        assert tokens[-1] in eos and not set(tokens[:-1]) & set(range(17)), tokens  # no specials
        text = loaded.tokenizer.decode(tokens[:-1])
        jsonschema.validate(json.loads(text), PERSON)
