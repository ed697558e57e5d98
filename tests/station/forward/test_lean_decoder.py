"""station.forward.lean_decoder: the one-loop forward is the model's own, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from gnosis_daemon.settings import Settings
from station.forward.lean_decoder import LeanDecoder
from station.model.loader import load_model
from tests.support.tiny_models import FAMILIES, build_tiny_model, tiny_config

pytestmark = pytest.mark.usefixtures("few_threads")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_lean_forward_equals_the_models_forward_bit_for_bit(tmp_path, family, weights):
    path = build_tiny_model(tmp_path / "m", family)
    model = load_model(Settings(model=str(path), model_cache_dir=str(tmp_path), weights=weights)).model
    model.set_attn_implementation("sdpa")
    lean = LeanDecoder.for_model(model, lambda: ALL_ATTENTION_FUNCTIONS["sdpa"])
    assert lean is not None
    gen = torch.Generator().manual_seed(7)
    for tokens, start in ((1, 0), (1, 40), (9, 3)):
        ids = torch.randint(0, 250, (1, tokens), generator=gen)
        pos = torch.arange(start, start + tokens)[None]
        with torch.inference_mode():
            want = model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            got = lean(ids, pos)
        assert torch.equal(got, want), (family, weights, tokens)


def test_models_of_another_shape_keep_their_own_forward():
    # A sliding window is the attention's business (paged_attention reads it from the
    # layer), so a windowed Mistral has the lean loop's shape; GPT-2 does not.
    config = tiny_config("mistral")
    config.sliding_window = 16
    model = AutoModelForCausalLM.from_config(config)
    assert LeanDecoder.for_model(model, lambda: ALL_ATTENTION_FUNCTIONS["sdpa"]) is not None
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert LeanDecoder.for_model(gpt2, lambda: ALL_ATTENTION_FUNCTIONS["sdpa"]) is None


def test_the_engine_setting_chooses_the_forward(tmp_path):
    from station.engine.loop import PagedEngine

    path = build_tiny_model(tmp_path / "m", "llama")
    loaded = load_model(Settings(model=str(path)))
    on = PagedEngine(loaded, Settings(runtime_dir=str(tmp_path)), num_blocks=8)
    assert on.runner.plan.forward.chosen == "lean"
    assert isinstance(on.runner._decoder, LeanDecoder)
    off = PagedEngine(loaded, Settings(runtime_dir=str(tmp_path), lean_decoder=False), num_blocks=8)
    assert off.runner.plan.forward.chosen == "transformers"
    assert off.runner.plan.forward.refused()["lean"] == "setting lean_decoder=off"
    assert not isinstance(off.runner._decoder, LeanDecoder)


def test_int4_layers_on_one_input_run_as_one_call_with_the_same_results():
    from station.forward.lean_decoder import FusedInt4, fuse_int4
    from station.kernels.quantized import Int4Groups, Int4Linear

    gen = torch.Generator().manual_seed(3)

    def layer(rows: int) -> Int4Linear:
        return Int4Linear(Int4Groups.quantize(torch.randn(rows, 96, generator=gen)), None, torch.device("cpu"))

    q, k, v = layer(128), layer(64), layer(32)  # every part but the last fills blocks of 64 rows
    x = torch.randn(1, 5, 96, generator=gen)
    with torch.inference_mode():
        want = [q(x), k(x), v(x)]
        fused = fuse_int4(q, k, v)
        assert isinstance(fused, FusedInt4)
        assert all(torch.equal(a, b) for a, b in zip(fused(x), want))
        # the layers now read views of the stacked weight, with the same results
        assert q.packed.data_ptr() == fused.packed.data_ptr()
        assert all(torch.equal(a, b) for a, b in zip((q(x), k(x), v(x)), want))
    assert fuse_int4(layer(32), layer(32)) is None  # a part that does not fill its blocks
