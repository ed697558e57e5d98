"""The embed op over the real socket: mean-pooled, L2-normalised final hidden states,
equal to the same pooling over transformers' own forward of the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.protocol import unpack_array
from tests.station.conftest import start_station
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def station(tiny_dir, tmp_path_factory):
    st = start_station(tiny_dir, tmp_path_factory.mktemp("embed") / "rt")
    yield st
    assert st.stop() == 0


def reference_embedding(path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


async def test_embed_texts_and_tokens(station, tiny_dir):
    tok = build_tokenizer()
    texts = ["hello there", "a different sentence é", "hello there"]
    async with open_station_client(station.socket) as conn:
        out = await conn.request("embed", {"texts": texts})
        by_tokens = await conn.request("embed", {"tokens": [tok.encode(texts[1])]})
        with pytest.raises(StationError) as err:
            await conn.request("embed", {"texts": [""]})
        assert err.value.code == "bad_request"
        with pytest.raises(StationError) as err:
            await conn.request("embed", {"texts": ["a"], "tokens": [[1]]})
        assert err.value.code == "bad_request"
    vectors = unpack_array(out["embeddings"])
    assert vectors.dtype == np.float32 and vectors.shape == (3, 64) and out["dim"] == 64
    assert out["num_tokens"] == [len(tok.encode(t)) for t in texts]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(vectors[0], vectors[2])  # same text, same vector
    assert not np.allclose(vectors[0], vectors[1])
    np.testing.assert_allclose(unpack_array(by_tokens["embeddings"])[0], vectors[1], atol=1e-6)
    np.testing.assert_allclose(vectors[1], reference_embedding(tiny_dir, tok.encode(texts[1])),
                               atol=1e-4)
