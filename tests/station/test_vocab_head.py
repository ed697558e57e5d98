"""The runner's own vocab head (``VocabHead``): the same logits as the model's ``lm_head``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from station.model_runner import VocabHead
from tests.support.tiny_models import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("head"), "llama")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_head_matches_lm_head(model, rows):
    head = VocabHead.for_model(model, torch.device("cpu"))
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
    assert VocabHead.for_model(model, torch.device("cpu")) is None
