"""``prompt_cache_retention`` on chat, completions and responses, through the official
``openai`` client on the native-path stack (liquid memory off): ``in_memory`` is accepted,
an unknown value is a 400 naming the field, and ``24h`` is refused naming the field where
the server cannot pin (never silently kept for less)."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def call(client, route: str, retention: str):
    model = client.models.list().data[0].id
    if route == "chat":
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            prompt_cache_retention=retention)
    if route == "completions":
        return client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                         extra_body={"prompt_cache_retention": retention})
    return client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False,
                                   prompt_cache_retention=retention)


ROUTES = ("chat", "completions", "responses")


@pytest.mark.parametrize("route", ROUTES)
def test_in_memory_is_todays_behaviour(client, route):
    made = call(client, route, "in_memory")
    assert made.usage is not None
    assert made.model_extra["_gnosis"]["liquid_memory"] == "disabled"


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_retention_is_a_400_naming_the_field(client, route):
    with pytest.raises(openai.BadRequestError) as info:
        call(client, route, "7d")
    assert (info.value.body["param"], info.value.body["code"]) == (
        "prompt_cache_retention", "invalid_value")


@pytest.mark.parametrize("route", ROUTES)
def test_24h_without_liquid_memory_is_refused_naming_the_field(client, route):
    with pytest.raises(openai.BadRequestError) as info:
        call(client, route, "24h")
    assert (info.value.body["param"], info.value.body["code"]) == (
        "prompt_cache_retention", "unsupported_value")
    assert "THOTH_LIQUID_MEMORY=0" in info.value.body["message"]
