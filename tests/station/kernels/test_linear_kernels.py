"""station.kernels.dense: packed linears and the runner's vocab head give the model's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from station.kernels.dense import PackedLinear, VocabHead, pack_decoder_linears
from tests.support.tiny_models import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("head"), "llama")


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_head_matches_lm_head(model, rows):
    head = VocabHead.for_model(model)
    assert head is not None
    # fp32 on a CPU torch with oneDNN (every x86 build): the packed kernel is the one used
    assert (head.packed is not None) == torch.backends.mkldnn.is_available()
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        want = model.lm_head(x)
        got = head(x)
        unpacked = VocabHead(head.weight, head.bias, None)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpacked, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_post_processed_logits_keep_the_models_forward():
    config = tiny_config("llama")
    config.final_logit_softcapping = 30.0
    model = AutoModelForCausalLM.from_config(config)
    assert VocabHead.for_model(model) is None


ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                            reason="this torch build has no oneDNN")


@ONEDNN
def test_packed_decoder_gives_the_same_logits(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 7, 128]])
    with torch.inference_mode():
        want = model(ids).logits
        swapped = pack_decoder_linears(model)
        got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert swapped == 7 * layers  # q, k, v, o, gate, up, down per layer
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 7 * layers
    assert not any(type(m) is torch.nn.Linear for m in model.base_model.modules())
    assert type(model.lm_head) is torch.nn.Linear  # may be tied to the embeddings: kept
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert pack_decoder_linears(model) == 0  # already packed: nothing left to swap


def test_non_fp32_weights_are_left_alone(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    assert pack_decoder_linears(model) == 0
    assert VocabHead.for_model(model).packed is None


def test_engine_setting_off_keeps_stock_linears(model_dir, tmp_path):
    from gnosis_daemon.settings import Settings
    from station.model.loader import load_model
    from station.engine.loop import PagedEngine

    settings = Settings(model=str(model_dir), runtime_dir=str(tmp_path), cpu_packed_linears=False)
    engine = PagedEngine(load_model(settings), settings, num_blocks=8)
    assert not any(isinstance(m, PackedLinear) for m in engine.loaded.model.modules())
    assert engine.runner._head.packed is None
    settings = Settings(model=str(model_dir), runtime_dir=str(tmp_path))
    engine = PagedEngine(load_model(settings), settings, num_blocks=8)
    packed = any(isinstance(m, PackedLinear) for m in engine.loaded.model.modules())
    assert packed == torch.backends.mkldnn.is_available()
