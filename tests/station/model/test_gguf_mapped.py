"""GGUF files read by mapping (``station.model.gguf_mapped``): no float copy of the model on
disk or in memory, each kept weight straight from the file's blocks.

* The tiny files of ``gguf_files`` (Q4_K_M mixes: Q4_K, Q5_0, Q6_K, Q8_0, F32/F16 norms),
  mapped, make the very model their conversion makes: every tensor in memory equal bit for
  bit, the same forms, the same account of the file, the same fingerprint.
* A ~0.5B Llama-shaped file (``gguf_large``), in Q4_0 and in Q8_0, loaded in a process of
  its own (``mapped_load``): auto maps it (its float32 copy would be ~2 GB), the load's peak
  resident memory stays within 1.5 x the file's size above the process's base (torch and
  transformers imported), its 16 greedy tokens through the engine are those of ``generate``
  on transformers' dequantized model of the file, a second start converts nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.model.errors import ModelLoadError
from station.model.loader import load_model
from tests.support import gguf_large
from tests.support.gguf_files import write_gguf
from tests.support.procs import mapped_file_at

pytestmark = pytest.mark.usefixtures("few_threads")

REPO = Path(__file__).resolve().parents[3]


# auto: the kernel timings of the first load are remembered (one cache) and the second reuses
# them; int4/int8 time nothing they keep, and with the C step off (which they would time
# afresh each load) nothing hangs on a timing
@pytest.mark.parametrize("family,mix,weights", [
    ("llama", "Q4_K_M", "auto"), ("mistral", "Q4_K_M", "auto"), ("qwen2", "Q4_K_M", "auto"),
    ("qwen2", "Q5_K_M", "auto"),  # tied Q8_0 embeddings: the head on the file's blocks
    ("qwen3", "Q4_K_M", "auto"), ("llama", "Q4_K_M", "int4"), ("llama", "Q4_K_M", "int8"),
    ("qwen2", "Q4_K_M", "float")])
def test_a_mapped_file_is_the_model_its_conversion_makes(tmp_path, family, mix, weights):
    path = write_gguf(tmp_path / f"{family}-{mix}.gguf", family, mix)
    common = dict(model=str(path), model_cache_dir=str(tmp_path / "cache"), weights=weights,
                  cpu_decode_step="auto" if weights == "auto" else "off")
    converted = load_model(Settings(**common, gguf_load="convert"))
    mapped = load_model(Settings(**common, gguf_load="map"))
    assert converted.converted and not converted.mapped
    assert mapped.mapped and not mapped.converted and mapped.loaded_from == str(path)
    assert mapped.weights.forms == converted.weights.forms
    assert mapped.weights.gguf_kept == converted.weights.gguf_kept
    assert mapped.weights.gguf_dequantized == converted.weights.gguf_dequantized
    assert (mapped.weights.head is None) == (converted.weights.head is None)
    assert (mapped.weights.step is None) == (converted.weights.step is None)
    want = converted.model.state_dict()
    got = mapped.model.state_dict()
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, want[name]), name
    assert mapped.fingerprint == converted.fingerprint
    text = "hello there, the cat"
    assert mapped.tokenizer.encode(text) == converted.tokenizer.encode(text)
    assert mapped.eos_token_ids == converted.eos_token_ids
    # the cache holds the conversion's checkpoint and, for the mapped load, no weights but an
    # untied embedding table's values, which the model reads through a map of that file
    (mapped_dir,) = (tmp_path / "cache").glob("*.mapped")
    assert (mapped_dir / "config.json").is_file() and not list(mapped_dir.glob("*.safetensors"))
    embed = mapped.model.get_input_embeddings().weight
    tied = embed is getattr(mapped.model.get_output_embeddings(), "weight", None)
    values_file = mapped_dir / "embeddings.f32"
    assert values_file.is_file() == (not tied)
    if not tied:
        assert mapped_file_at(embed.data_ptr()) == str(values_file)
        written = values_file.stat().st_mtime_ns
        again = load_model(Settings(**common, gguf_load="map"))  # reads the file it wrote
        assert values_file.stat().st_mtime_ns == written
        assert torch.equal(again.model.get_input_embeddings().weight, want[_embed_name(mapped.model)])


def _embed_name(model) -> str:
    weight = model.get_input_embeddings().weight
    return next(name for name, p in model.named_parameters() if p is weight)


def test_a_family_the_map_does_not_read_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "gemma2-Q4_K_M.gguf", "gemma2", "Q4_K_M")
    with pytest.raises(ModelLoadError, match="gguf_load=map reads llama, qwen2, qwen3 files, not 'gemma2'"):
        load_model(Settings(model=str(path), model_cache_dir=str(tmp_path / "cache"), gguf_load="map"))


def test_a_small_file_is_converted_under_auto(tmp_path):
    path = write_gguf(tmp_path / "llama-Q4_K_M.gguf", "llama", "Q4_K_M")
    loaded = load_model(Settings(model=str(path), model_cache_dir=str(tmp_path / "cache"), cpu_decode_step="off"))
    assert loaded.converted and not loaded.mapped


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """(kind, weights) -> (the file's size, what its load in a process of its own reported)."""
    root = tmp_path_factory.mktemp("gguf-large")
    made: dict[tuple[str, str], tuple[int, dict]] = {}

    def get(kind: str, weights: str) -> tuple[int, dict]:
        if (kind, weights) not in made:
            path = gguf_large.write_llama(root / f"large-llama-{kind}.gguf", kind)
            out = root / f"{kind}-{weights}.json"
            subprocess.run([sys.executable, "-m", "tests.support.mapped_load", str(path), weights,
                            str(root / "cache"), str(out)], cwd=REPO, check=True, timeout=1200)
            made[kind, weights] = path.stat().st_size, json.loads(out.read_text())
            path.unlink()  # the next file need not fit beside this one
        return made[kind, weights]

    return get


# weights=int4/int8 keep every decoder linear in the file's own form without timing it
# against float: auto's first start on a machine would also hold up to 256 MB of float
# weights for that timing (KernelChoices.MEASURE_BYTES), then remember the answer.
@pytest.mark.parametrize("kind,weights", [("Q4_0", "int4"), ("Q8_0", "int8")])
def test_a_half_billion_parameter_file_loads_within_its_size_and_answers_as_its_model(large, kind, weights):
    size, got = large(kind, weights)
    assert got["mapped"]  # gguf_load=auto maps it: its float32 copy would be ~2 GB
    assert got["forms"] == {"int4": 0, "int8": 0, "float": 0, weights: gguf_large.decoder_linears()}
    assert got["peak"] - got["base"] <= 1.5 * size, (got["peak"] - got["base"]) / size
    assert len(got["answer"]) == 16 and got["answer"] == got["want"]
    assert got["second_start_same"]
    # each kept layer computes transformers' conversion of its tensor (bfloat16 activations
    # and scales: ~3 significant digits; a wrong tensor or row order is off by its own size)
    assert len(got["layer_errors"]) == gguf_large.decoder_linears()
    assert max(got["layer_errors"].values()) <= 3e-2
    assert got["floats"] > 0 and not got["float_mismatches"]
