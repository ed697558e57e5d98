"""Each layer's attention read from the model, what the engine refuses, and the start check
that proves the paged path before a station serves (``station.forward.attention_kinds``,
``station.plan.start_check``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.forward import paged_attention
from station.engine.loop import PagedEngine
from station.model.loader import ModelRefused, load_model
from station.plan.start_check import DECODE_TOKENS, check_engine, probe_length
from tests.support.tiny_models import WINDOW, build_tiny_model, build_tokenizer

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(family: str):
        """``family``, or ``family-int4``: its decoder linears as 4-bit groups through
        torch's kernels (bfloat16 activations)."""
        if family not in cache:
            name, _, weights = family.partition("-")
            path = build_tiny_model(tmp_path_factory.mktemp(name), name)
            cache[family] = load_model(Settings(model=str(path), kv_block_size=4,
                                                weights=weights or "float", cpu_decode_step="off",
                                                runtime_dir=str(tmp_path_factory.mktemp("rt"))))
        return cache[family]

    return get


def engine_of(loaded, **settings) -> PagedEngine:
    return PagedEngine(loaded, Settings(runtime_dir="/tmp/unused-rt", kv_block_size=4, **settings),
                       num_blocks=128)


@pytest.mark.parametrize(("family", "kinds"), [
    ("llama", {"full": 2}),
    ("mistral_sw", {f"sliding {WINDOW}": 2}),
    ("qwen2_sw", {"full": 1, f"sliding {WINDOW}": 1}),
    ("gemma2", {f"sliding {WINDOW} + softcap 50": 1, "full + softcap 50": 1}),
    ("gemma3", {f"sliding {WINDOW}": 1, "full": 1}),
    ("gpt_oss", {f"sliding {WINDOW} + sinks": 1, "full + sinks": 1}),
])
def test_each_layers_kind_is_read_from_the_models_own_forward(tiny, family, kinds):
    attention = tiny(family).attention
    assert attention.summary()["kinds"] == kinds
    assert attention.longest_window == (None if family == "llama" else WINDOW)
    assert attention.all_full is (family == "llama")


@pytest.mark.parametrize("family", ["mistral_sw", "gemma2", "gemma3", "gpt_oss"])
def test_the_start_check_passes_on_a_probe_past_the_window(tiny, family):
    engine = engine_of(tiny(family), prefill_chunk_tokens=8)
    check = check_engine(engine)
    assert check.probe_tokens > WINDOW and check.longest_window == WINDOW
    # three probes, four decoded positions each, the top five logprobs at each (the greedy
    # choice is among them)
    assert check.compared == 3 * 4 * 5
    # float weights: the engine and the model's forward agree to float precision, and the
    # forward with itself too, so the tolerance is the floor
    assert check.max_abs_diff <= 1e-4 and check.noise <= 1e-4 and check.tolerance == 2e-3
    # nothing of the probe stays: no cached block, no figure
    stats = engine.stats()
    assert stats["steps"] == 0 and stats["prefix_cache_hits_tokens"] == 0
    assert not engine.kv.pool.cached_block_hash_to_block
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("family", ["mistral_sw", "gemma2", "gemma3", "mistral_sw-int4"])
def test_a_window_off_by_one_is_refused_by_the_start_check(tiny, family, monkeypatch):
    """Break the paged attention on purpose: every path sees one key more than the model's
    window. The check must refuse to serve, naming the model type; with 4-bit weights too,
    whose bfloat16 arithmetic widens the tolerance."""
    engine = engine_of(tiny(family), prefill_chunk_tokens=8)
    kind_of = paged_attention.kind_of

    def one_too_many(module, scaling, kwargs):
        kind = kind_of(module, scaling, kwargs)
        return kind if kind.window is None else dataclasses.replace(kind, window=kind.window + 1)

    monkeypatch.setattr(paged_attention, "kind_of", one_too_many)
    with pytest.raises(ModelRefused) as refused:
        check_engine(engine)
    assert refused.value.kind == "start check"
    assert refused.value.model_type == tiny(family).model_type
    assert "differ from the model's own forward" in refused.value.reason


def test_torch_quantized_weights_pass_with_a_tolerance_from_the_models_own_noise(tiny):
    """4-bit layers round activations to bfloat16, so on a real model the forward disagrees
    with itself (SDPA against eager attention, two chunks against one) far beyond float
    precision (Gemma 3 270M: 0.05 in a logprob); the tolerance follows that noise."""
    check = check_engine(engine_of(tiny("mistral_sw-int4"), prefill_chunk_tokens=8))
    assert check.tolerance == max(2e-3, 4.0 * check.noise) and check.max_abs_diff <= check.tolerance


def test_a_step_that_fails_in_the_probe_refuses_too(tiny, monkeypatch):
    engine = engine_of(tiny("mistral_sw"))

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel that does not run")

    monkeypatch.setattr(engine.runner, "run", broken)
    with pytest.raises(ModelRefused, match="could not run its start-check probe"):
        check_engine(engine)


def test_the_probe_fits_the_context_and_the_pool():
    assert probe_length(None, 16, 8192, 1000) == 4 * 16 + 3
    assert probe_length(4096, 16, 8192, 10_000) == 4096 + 2 * 16 + 3
    assert probe_length(4096, 16, 2048, 10_000) == 2048 - DECODE_TOKENS - 1  # a window the context never fills
    assert probe_length(4096, 16, 8192, 100) == 100 * 16 // 2 - 16 - DECODE_TOKENS  # two probes at once in the pool


def _save(model, path):
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _loads_refused(path, tmp_path) -> ModelRefused:
    with pytest.raises(ModelRefused) as refused:
        load_model(Settings(model=str(path), runtime_dir=str(tmp_path / "rt")))
    json.dumps(refused.value.as_dict())  # what the refusal file carries
    return refused.value


def test_a_model_with_chunked_attention_is_refused_naming_the_kind(tmp_path):
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=259, hidden_size=64, intermediate_size=128,
                              intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_local_experts=2,
                              attention_chunk_size=8)
    refused = _loads_refused(_save(AutoModelForCausalLM.from_config(config), tmp_path / "m"), tmp_path)
    assert (refused.model_type, refused.kind) == ("llama4_text", "chunked_attention")
    assert "'llama4_text' refused" in str(refused)


def test_a_model_with_linear_attention_layers_is_refused_naming_the_kind(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, linear_num_value_heads=2,
                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    refused = _loads_refused(_save(AutoModelForCausalLM.from_config(config), tmp_path / "m"), tmp_path)
    assert (refused.model_type, refused.kind) == ("qwen3_next", "linear_attention")


def test_a_model_with_latent_attention_is_refused_naming_the_kind(tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=259, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                              first_k_dense_replace=1, n_group=1, topk_group=1)
    refused = _loads_refused(_save(AutoModelForCausalLM.from_config(config), tmp_path / "m"), tmp_path)
    assert (refused.model_type, refused.kind) == ("deepseek_v3", "latent_attention")


def test_layers_that_never_call_attention_are_refused(tiny, monkeypatch):
    """A model one of whose layers computes no softmax attention (as a hybrid state-space
    model's would): the trace sees fewer attention layers than the model has."""
    from station.forward.attention_kinds import read_attention_kinds

    model = tiny("llama").model
    layer = model.base_model.layers[1].self_attn
    monkeypatch.setattr(layer, "forward", lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None))
    with pytest.raises(ModelRefused) as refused:
        read_attention_kinds(model, 2, 16)
    assert refused.value.kind == "non-attention layers" and "layers 1 of 2" in refused.value.reason


def test_the_fingerprint_names_the_kinds_where_layers_differ(tmp_path):
    """KV made by an engine blind to windows (under the old fingerprint) is never read back:
    a windowed model's fingerprint names its kinds; a full-attention one's is as it was."""
    from station.model.loader import fingerprint

    for family, changed in (("mistral_sw", True), ("llama", False)):
        loaded = load_model(Settings(model=str(build_tiny_model(tmp_path / family, family)),
                                     runtime_dir=str(tmp_path / "rt")))
        blind = fingerprint(loaded.model, loaded.dtype, loaded.weights.tag)
        assert (loaded.fingerprint != blind) is changed, family
        assert (loaded.attention.tag == "") is not changed


@pytest.mark.parametrize("family", ["mistral_sw", "gemma2"])
def test_generate_on_the_served_model_outside_a_step_keeps_the_window(tmp_path, family):
    """After an engine switched the model to the paged attention, transformers' own
    ``generate`` over its cache (the queries are the last of the keys) still applies each
    layer's window and soft-cap: the same tokens as a fresh model's ``generate``."""
    from tests.support.tiny_models import reference_generate

    path = build_tiny_model(tmp_path / family, family)
    loaded = load_model(Settings(model=str(path), runtime_dir=str(tmp_path / "rt")))
    engine_of(loaded)  # installs the kinds and the paged attention on this model
    prompt = list(range(3, 40))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                    do_sample=False)
    assert out[0, len(prompt):].tolist() == reference_generate(path, prompt, 12)


def test_a_passed_check_is_trusted_for_the_same_model_build_and_plan_only(tiny, tmp_path, monkeypatch):
    """``start_check = auto``: the record of a check that passed is trusted at the next start
    with the same model, station sources, machine and decode plan (the probe does not run);
    another station source, or ``always``, runs it again."""
    from station.plan import start_check

    engine = engine_of(tiny("mistral_sw"))
    settings = Settings(runtime_dir="/tmp/unused-rt", model_cache_dir=str(tmp_path))
    ran = []
    real = start_check.check_engine
    monkeypatch.setattr(start_check, "check_engine", lambda e: ran.append(e) or real(e))
    first = start_check.prove_engine(engine, settings)
    assert first["passed"] and first["trusted"] is False and len(ran) == 1
    again = start_check.prove_engine(engine, settings)
    assert again["trusted"] is True and len(ran) == 1
    assert {k: again[k] for k in first if k != "trusted"} == {k: first[k] for k in first if k != "trusted"}
    assert start_check.prove_engine(engine, Settings(runtime_dir="/tmp/unused-rt", model_cache_dir=str(tmp_path),
                                                     start_check="always"))["trusted"] is False
    assert len(ran) == 2
    monkeypatch.setattr(start_check, "source_digest", lambda: "another build")
    assert start_check.prove_engine(engine, settings)["trusted"] is False and len(ran) == 3
    records = list((tmp_path / "start-checks").glob("*.json"))
    assert len(records) == 2  # one per build


def test_the_check_is_keyed_by_the_decode_plan(tiny):
    from station.plan.start_check import record_key

    loaded = tiny("mistral_sw")
    lean, stock = engine_of(loaded), engine_of(loaded, lean_decoder=False)
    assert lean.runner.plan.forward.chosen == "lean" and stock.runner.plan.forward.chosen == "transformers"
    assert record_key(lean) != record_key(stock)
