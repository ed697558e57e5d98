"""Grammars under bounds, on tiny random models: a spec past grammar_max_nodes is refused at
once while the station serves others; a compile past grammar_compile_timeout_s, or whose
request is cancelled, has its worker process killed; sampled outputs always parse and
validate; a grammar no token can start or continue is an error, never an empty stop."""

from __future__ import annotations

import json
import time

import jsonschema
import psutil
import pytest
import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.grammar_spec import check_grammar
from gnosis_daemon.protocol import OpError
from gnosis_daemon.settings import Settings
from station.core.requests import Choices, Failed, Finished, GenerationRequest, SamplingParams, Token
from station.sampling.grammar import grammars_for
from station.sampling.grammar_compile import GrammarCompiles
from station.model.loader import load_model
from tests.station.conftest import start_station
from tests.station.engine.test_paged_engine import engine_for, prompt_of
from tests.support.tiny_models import SPECIAL_TOKENS, build_tiny_model, tiny_config

pytestmark = pytest.mark.usefixtures("few_threads")

# Every value ends: enums, bounded strings and integers (a random model would otherwise
# write digits until max_tokens).
SCHEMA = {"type": "object",
          "properties": {"colour": {"enum": ["red", "green", "blue"]},
                         "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["a", "b"]}},
                         "ok": {"type": "boolean"}},
          "required": ["colour", "name", "n", "tags", "ok"], "additionalProperties": False}


def wide_schema(n: int) -> dict:
    return {"type": "json_schema", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")
    return path, load_model(Settings(model=str(path), runtime_dir=str(tmp_path_factory.mktemp("rt"))))


def run_all(engine, requests) -> dict[str, list]:
    """Submit every (rid, prompt, params, grammar, n) and collect each choice's events."""
    events: dict[str, list] = {}
    ends = {"count": 0}
    want = sum(r[4] for r in requests)

    def collect(event) -> None:
        events.setdefault(event.request_id, []).append(event)
        if isinstance(event, (Finished, Failed)):
            ends["count"] += 1

    for rid, prompt, params, grammar, n in requests:
        engine.add_request(GenerationRequest(rid, prompt, params, grammar=grammar,
                                             choices=Choices(n=n)), collect)
    deadline = time.monotonic() + 120
    while ends["count"] < want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ends["count"] == want, "requests never ended"
    return events


def test_200_samples_at_temperature_1_all_parse_and_validate(tiny):
    _, loaded = tiny
    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": SCHEMA}))
    with engine_for(loaded, num_blocks=1024) as engine:
        events = run_all(engine, [(f"r{i}", prompt_of(i, 6), SamplingParams(
            max_tokens=120, temperature=1.0, seed=i), compiled, 10) for i in range(20)])
    texts = []
    for choice in events.values():
        assert isinstance(choice[-1], Finished) and choice[-1].finish_reason == "stop", choice[-1]
        tokens = [e.token_id for e in choice if isinstance(e, Token)]
        assert tokens[-1] == 258
        texts.append(loaded.tokenizer.decode(tokens[:-1]))
    assert len(texts) == 200
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_at_temperature_2_too_and_max_tokens_cuts_short_with_length(tiny):
    _, loaded = tiny
    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": SCHEMA}))
    with engine_for(loaded, num_blocks=512) as engine:
        events = run_all(engine, [
            ("hot", prompt_of(7, 6), SamplingParams(max_tokens=120, temperature=2.0, seed=2),
             compiled, 10),
            ("short", prompt_of(8, 6), SamplingParams(max_tokens=5, temperature=1.0, seed=3),
             compiled, 1)])
    for rid, choice in events.items():
        tokens = [e.token_id for e in choice if isinstance(e, Token)]
        if rid == "short":
            assert choice[-1].finish_reason == "length" and len(tokens) == 5
            continue
        assert choice[-1].finish_reason == "stop" and tokens[-1] == 258
        jsonschema.validate(json.loads(loaded.tokenizer.decode(tokens[:-1])), SCHEMA)


def test_length_bounded_strings_hold_no_raw_control_character(tiny):
    """xgrammar's strings with minLength/maxLength let raw control characters in (a random
    walk over its masks: 26 of 40 outputs of one such schema did not parse); a JSON
    grammar's sequences mask every token holding one."""
    _, loaded = tiny
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2,
                                                     "maxLength": 5}},
              "required": ["s"], "additionalProperties": False}
    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": schema}))
    newline, letter = loaded.tokenizer.convert_tokens_to_ids(["Ċ", "a"])  # byte-level "\n"
    assert newline in compiled.forbidden_ids and letter not in compiled.forbidden_ids
    with engine_for(loaded, num_blocks=512) as engine:
        events = run_all(engine, [(f"c{i}", prompt_of(20 + i, 4), SamplingParams(
            max_tokens=60, temperature=1.5, seed=i), compiled, 10) for i in range(4)])
    for choice in events.values():
        assert choice[-1].finish_reason == "stop"
        tokens = [e.token_id for e in choice if isinstance(e, Token)]
        value = json.loads(loaded.tokenizer.decode(tokens[:-1]))["s"]  # strict: it parses
        # (a byte sequence the engine takes for one character may decode as several U+FFFD)
        assert 2 <= len(value) <= 5 or "\ufffd" in value


def test_special_tokens_are_never_grammatical(tiny):
    _, loaded = tiny
    import xgrammar as xgr

    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": {
        "type": "string"}}))
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('"')  # inside a string: any text may come
    bitmask = xgr.allocate_token_bitmask(1, loaded.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = {i for i in range(loaded.vocab_size) if bitmask[0, i // 32] >> (i % 32) & 1}
    quote = loaded.tokenizer.convert_tokens_to_ids('"')
    assert quote in allowed and len(allowed) > 100
    assert not allowed & {256, 257, 258}  # <|endoftext|>, <|im_start|>, <|im_end|> (eos)


def test_stop_ids_that_are_not_the_grammars_are_masked(tiny):
    _, loaded = tiny
    compiled = grammars_for(loaded).compile(check_grammar({"type": "json_schema", "schema": SCHEMA}))
    blocked = [loaded.tokenizer.convert_tokens_to_ids(c) for c in "xqz"]  # in "name"
    with engine_for(loaded) as engine:
        events = run_all(engine, [("s", prompt_of(3, 5), SamplingParams(
            max_tokens=120, temperature=1.0, seed=5, stop_token_ids=tuple(blocked)), compiled, 1)])
    choice = events["s"]
    assert choice[-1].finish_reason == "stop"
    tokens = [e.token_id for e in choice if isinstance(e, Token)]
    assert tokens[-1] == 258 and not set(tokens) & set(blocked)
    jsonschema.validate(json.loads(loaded.tokenizer.decode(tokens[:-1])), SCHEMA)


# -- a vocabulary without '{' (letters and space only)
@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    import torch

    path = tmp_path_factory.mktemp("letters") / "m"
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyzĠ")}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>")
    config = tiny_config("llama", vocab_size=len(vocab))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 28, 29, 27
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return load_model(Settings(model=str(path), runtime_dir=str(path.parent / "rt")))


def test_json_object_on_a_vocabulary_that_cannot_spell_json_is_refused(letters):
    with pytest.raises(OpError) as info:
        grammars_for(letters).compile(check_grammar({"type": "json_object"}))
    assert info.value.code == "bad_request"
    assert "argument 'grammar' cannot be generated" in info.value.message


def test_a_grammar_no_token_can_continue_ends_with_an_error(letters):
    compiled = grammars_for(letters).compile(check_grammar({"type": "ebnf",
                                                            "ebnf": 'root ::= "ab{"'}))
    with engine_for(letters) as engine:
        events = run_all(engine, [("d", [0, 1, 2], SamplingParams(max_tokens=20, temperature=1.0,
                                                                   seed=1), compiled, 1)])
    choice = events["d"]
    assert isinstance(choice[-1], Failed), choice[-1]
    assert choice[-1].error.code == "bad_request"
    assert "cannot be continued" in choice[-1].error.message
    assert [e.token_id for e in choice if isinstance(e, Token)] == [0, 1]  # "a", "b"; no more
    assert engine.stats()["running"] == 0


# -- the time bound and cancellation (the worker process)
def workers_of(pid: int) -> list[psutil.Process]:
    """The grammar workers still alive among ``pid``'s children (a zombie is dead)."""
    alive = []
    for child in psutil.Process(pid).children():
        try:
            if "station.sampling.grammar_worker" in " ".join(child.cmdline()) \
                    and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return alive


def test_a_compile_past_the_time_bound_is_refused_and_its_worker_killed(tiny):
    _, loaded = tiny
    compiles = GrammarCompiles(loaded, timeout_s=0.5)

    async def main():
        started = time.monotonic()
        with pytest.raises(OpError) as info:
            await compiles.compile(check_grammar(wide_schema(2500)))
        assert "grammar_compile_timeout_s" in info.value.message
        assert time.monotonic() - started < 30  # the worker's start, then 0.5 s
        assert compiles.killed == 1 and not workers_of(psutil.Process().pid)
        small = await compiles.compile(check_grammar({"type": "regex", "regex": "t[0-9]"}))
        assert small is not None and len(workers_of(psutil.Process().pid)) == 1
        assert compiles.figures() == {"probed": 1, "timed_out": 1, "workers_killed": 1,
                                      "workers_idle": 1}
        compiles.close()

    trio.run(main)


def test_a_cancelled_compile_kills_its_worker(tiny):
    _, loaded = tiny
    compiles = GrammarCompiles(loaded, timeout_s=300)

    async def main():
        await compiles.compile(check_grammar({"type": "regex", "regex": "c[0-9]"}))  # one is up
        assert len(workers_of(psutil.Process().pid)) == 1
        with trio.move_on_after(1) as scope:  # the client leaves while it compiles (~40 s)
            await compiles.compile(check_grammar(wide_schema(4000)))
        assert scope.cancelled_caught and compiles.killed == 1
        assert not workers_of(psutil.Process().pid)

    trio.run(main)


def test_slow_compiles_leave_the_tokenizer_threads_free_and_die_with_their_connection(
        tiny, tmp_path):
    """Two slow compiles (about 10 s each) once held both tokenizer threads: now a tokenize
    is answered while they run, and closing their connection kills their workers."""
    path, _ = tiny
    station = start_station(path, tmp_path / "rt")
    try:
        async def main():
            ended, leaving = [], trio.CancelScope()

            async def slow(conn, k: int):
                async with conn.open_stream("generate", {
                        "tokens": [1, 2], "max_tokens": 2,
                        "grammar": wide_schema(1990 + k)}) as stream:
                    async for _ in stream:
                        pass
                ended.append(k)

            async def client():
                with leaving:  # cancelled: the connection closes, as a host's would
                    async with open_station_client(station.socket) as conn:
                        async with trio.open_nursery() as inner:
                            inner.start_soon(slow, conn, 0)
                            inner.start_soon(slow, conn, 1)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(client)
                with trio.fail_after(60):
                    while len(workers_of(station.proc.pid)) < 2:
                        await trio.sleep(0.1)
                async with open_station_client(station.socket) as other:
                    with trio.fail_after(10):
                        got = await other.request("tokenize", {"text": "hello"})
                assert len(got["tokens"]) == 5 and not ended  # still compiling
                leaving.cancel()
            with trio.fail_after(10):
                while workers_of(station.proc.pid):
                    await trio.sleep(0.1)

        trio.run(main)
    finally:
        assert station.stop() == 0


def test_over_the_node_bound_is_refused_at_once_while_others_are_served(tiny, tmp_path):
    path, _ = tiny
    station = start_station(path, tmp_path / "rt")
    try:
        async def main():
            async with open_station_client(station.socket) as conn:
                async def huge():
                    started = time.monotonic()
                    with pytest.raises(StationError) as info:
                        async with conn.open_stream("generate", {
                                "tokens": [1, 2, 3], "max_tokens": 4,
                                "grammar": wide_schema(9000)}) as stream:
                            async for _ in stream:
                                pass
                    assert info.value.code == "bad_request"
                    assert "grammar_max_nodes" in info.value.message
                    assert time.monotonic() - started < 10

                async def other():
                    async with conn.open_stream("generate", {
                            "tokens": [4, 5, 6], "max_tokens": 16, "temperature": 1.0,
                            "grammar": {"type": "json_schema", "schema": SCHEMA}}) as stream:
                        async for _ in stream:
                            pass
                    assert stream.result["finish_reason"] in ("stop", "length")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(huge)
                    nursery.start_soon(other)

        trio.run(main)
    finally:
        assert station.stop() == 0
