"""GGUF files as users download them: Q4_K_M and Q5_K_M mixes of seven families, loaded
through the station's ``load_model`` (transformers' conversion, then ``apply_weights``).

The files are tiny synthetic ones (``tests.support.gguf_files``) with llama.cpp's layout and
a mix of Q4_K, Q5_0, Q5_K, Q6_K and Q8_0 tensors. For each family and mix:

* every quantized tensor of the file is either kept (Q4_K as the file's own 4-bit groups,
  Q8_0 as int8 rows or, tied to the embeddings, as the Q8_0 head) or reported dequantized
  with its reason, and the start log's ``gguf_tensors_dequantized`` line says the same;
* each kept 4-bit layer computes with transformers' own conversion of that tensor (its
  blocks are checked bit for bit at load; here its output is checked against ``F.linear``
  over the reference model's weight, which a wrong name or row order would fail), and
  every weight that stays float equals the reference's bit for bit;
* the loaded model's logits agree with transformers' ``from_pretrained(gguf_file=...)``
  model: equal where everything was dequantized, within what the 4-bit layers' bfloat16
  arithmetic moves otherwise, with the same argmax along the reference's greedy answer.

Greedy decoding through the ``PagedEngine`` is checked on the full-attention families
(Llama, Qwen2, Qwen3, Phi-3): the float load's tokens equal the reference's ``generate``,
the quantized load's equal that model's own ``generate``. Mistral (a 4,096 window) and
Gemma 2/3 (64-token windows, soft-capping) are compared through the model's forward only,
so these tests do not depend on the engine's window handling.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnosis_daemon.settings import Settings
from station.model import weights as weights_module
from station.model.gguf_groups import FLOAT_TYPES, read_gguf_weights
from station.model.loader import load_model
from station.kernels.q4_tiles import TiledLinear
from station.kernels.quantized import Int4Linear, Int8Linear, KernelChoices
from tests.station.engine.test_paged_engine import engine_for, submit
from tests.support.gguf_files import (
    FAMILIES,
    MIXES,
    SPECS,
    WINDOW,
    file_types,
    reference_model,
    reference_tokenizer,
    write_gguf,
)

pytestmark = pytest.mark.usefixtures("few_threads")

CASES = [(family, mix) for family in FAMILIES for mix in MIXES]
ENGINE_FAMILIES = ("llama", "qwen2", "qwen3", "phi3")  # full attention in every layer
PROMPT = [104, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]  # "hello there"
NEW_TOKENS = 10
assert len(PROMPT) + NEW_TOKENS < WINDOW


class Recorder:
    """Stands in for ``weights.log``: every call as (level, event, fields)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.calls.append((level, event, fields))

    def events(self, event: str) -> list[tuple[str, dict]]:
        return [(level, fields) for level, name, fields in self.calls if name == event]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(family, mix, weights) -> (file, LoadedModel, what weights logged); files and the
    converted checkpoints shared by the module's tests."""
    root = tmp_path_factory.mktemp("gguf-families")
    cache: dict[tuple, tuple] = {}

    def get(family: str, mix: str, weights: str = "auto"):
        key = (family, mix, weights)
        if key not in cache:
            path = root / f"{family}-{mix}.gguf"
            if not path.exists():
                write_gguf(path, family, mix)
            recorder, saved = Recorder(), weights_module.log
            choose = KernelChoices.choose
            weights_module.log = recorder
            # Whether a quantized kernel beats float is measured on the machine (a tiny model's
            # layers are close, and a busy machine could flip it); what is kept must not hang
            # on that here, so every quantized form is taken, as weights=int4 takes it.
            KernelChoices.choose = lambda self, form, layers, device, dtype: True
            try:
                loaded = load_model(Settings(model=str(path), model_cache_dir=str(root / "cache"),
                                             weights=weights, cpu_decode_step="off"))
            finally:
                weights_module.log, KernelChoices.choose = saved, choose
            cache[key] = (path, loaded, recorder)
        return cache[key]

    return get


_REFERENCES: dict = {}


def reference(path, family: str):
    """transformers' own model of ``path``. Its reading of a file named exactly "mistral"
    fails in transformers 5.24 (gguf_convert), so for Mistral the reference is transformers'
    conversion of a twin file, the same tensors under another name, which it reads as Llama
    (the same arithmetic at these lengths)."""
    key = str(path)
    if key not in _REFERENCES:
        if family == "mistral":
            twin = path.with_name(f"twin-{path.name}")
            write_gguf(twin, family, path.stem.split("-")[-1], name="Mistral-7B-v0.3-tiny")
            path = twin
        _REFERENCES[key] = reference_model(path)
    return _REFERENCES[key]


def _role(name: str) -> str:
    if name == "token_embd.weight":
        return "embd"
    return "output" if name == "output.weight" else "linear"


def _expected(family: str, name: str, kind: str, kept_q8_head: bool) -> tuple[str, str] | None:
    """(form, None) for a tensor that must be kept, (None, reason) for one that must be
    dequantized; None where either may hold (the Q8_0 head: needs a C compiler here)."""
    role, tied = _role(name), SPECS[family].tied
    if role == "embd" and not tied:
        return None, "embeddings: looked up as float"
    if role in ("embd", "output"):  # the vocabulary head
        if kind != "Q8_0":
            return None, f"{kind}: no kept form for the vocabulary head"
        if family == "gemma2":  # final-logit soft-capping: the engine runs the model's own head
            return None, "vocabulary head: the model post-processes its logits (soft-capping or a scale)"
        return ("q8-head", None) if kept_q8_head else None
    if kind == "Q4_K":
        return "int4", None
    if kind == "Q8_0":
        return "int8", None
    return None, f"{kind}: no kept form"


@pytest.mark.parametrize("family,mix", CASES)
def test_a_file_loads_and_says_what_it_dequantized(made, family, mix):
    path, loaded, recorder = made(family, mix)
    report = loaded.weights
    quantized = {n: k for n, k in file_types(path).items() if k not in FLOAT_TYPES}
    assert set(report.gguf_kept) | set(report.gguf_dequantized) == set(quantized)
    assert not set(report.gguf_kept) & set(report.gguf_dequantized)
    assert not report.slower
    for name, kind in quantized.items():
        want = _expected(family, name, kind, report.head is not None)
        got = report.gguf_kept.get(name, (kind, None))[1], report.gguf_dequantized.get(name, (kind, None))[1]
        assert report.gguf_kept.get(name, report.gguf_dequantized.get(name))[0] == kind
        if want is None:
            assert got[0] == "q8-head" or got[1].startswith("vocabulary head: "), (name, got)
        else:
            assert got == want, name
    # the start log says it: one line with the counts, the reasons and the first names
    (level, line), = recorder.events("gguf_tensors_dequantized")
    assert level == "info" and line["count"] == len(report.gguf_dequantized)
    assert line["of"] == len(quantized) and line["reasons"] == report.dequantized_by_reason()
    by_type: dict[str, int] = {}
    for kind, _ in report.gguf_dequantized.values():
        by_type[kind] = by_type.get(kind, 0) + 1
    assert line["by_type"] == by_type
    assert line["first"] == list(report.gguf_dequantized)[:8]
    (level, names), = recorder.events("gguf_tensors_dequantized_names")
    assert level == "debug" and set(names["tensors"]) == set(report.gguf_dequantized)
    if mix == "Q4_K_M":  # every family keeps its Q4_K linears (Phi-3's fused QKV and gate/up too)
        assert any(form == "int4" for _, form in report.gguf_kept.values())
        assert "Q6_K" in line["by_type"]


@pytest.mark.parametrize("family,mix", CASES)
def test_the_loaded_model_is_transformers_model_of_the_file(made, family, mix):
    path, loaded, _ = made(family, mix)
    ref = reference(path, family)
    model = loaded.model
    assert type(model).__name__ == ("MistralForCausalLM" if family == "mistral" else type(ref).__name__)
    # The kept blocks, checked against transformers' own conversion rather than our cache:
    # every 4-bit tensor of the file checks out bit for bit (names and row order included)
    read = read_gguf_weights(path, ref)
    assert not read.rejected
    kept4 = {n for n, (kind, form) in loaded.weights.gguf_kept.items() if form == "int4"}
    assert set(read.int4) >= {read.tensors[n][1] for n in kept4}
    ref_params = dict(ref.named_parameters())
    modules = dict(model.named_modules())
    for name, form in loaded.weights.forms.items():
        layer, want = modules[name], ref_params[f"{name}.weight"].detach()
        if form == "float":
            assert torch.equal(layer.weight, want), name
            continue
        # int4: torch's layer, or the C step's tiles where it serves
        assert isinstance(layer, (Int4Linear, TiledLinear) if form == "int4" else Int8Linear), name
        x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(1))
        bias = ref_params.get(f"{name}.bias")
        with torch.inference_mode():
            got, exact = layer(x), F.linear(x, want, None if bias is None else bias.detach())
        # bfloat16 activations and scales (int8: rows re-rounded too): ~3 significant digits;
        # a wrong tensor or row order is off by the weights' own size
        torch.testing.assert_close(got, exact, rtol=3e-2, atol=3e-2 * float(exact.abs().max()))
    # everything else (embeddings, norms, biases, the head) is transformers' conversion bit for bit
    ref_state = ref.state_dict()
    for name, tensor in model.state_dict().items():
        if loaded.weights.forms.get(name.rsplit(".", 1)[0], "float") == "float":
            assert torch.equal(tensor, ref_state[name]), name
    # logits: equal where nothing is kept 4-bit, the same argmax where the margin is clear
    prompt = torch.tensor([PROMPT])
    with torch.inference_mode():
        seq = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                           do_sample=False)
        want, got = ref(seq).logits[0], model(seq).logits[0]
    scale = float(want.abs().max())
    if not any(form != "float" for form in loaded.weights.forms.values()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    else:  # measured: at most 3% of the largest logit; a wrong weight moves them by their size
        assert float((got - want).abs().max()) <= 0.06 * scale
    # the reference's greedy tokens are the quantized model's argmax too, near ties aside
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_agrees_with_transformers(made, family):
    """The float load decodes as transformers' own model of the file (through the engine for
    the full-attention families, the model's forward for the windowed ones), and the
    quantized load through the engine as its own ``generate``; the tokenizer is the file's."""
    path, floated, _ = made(family, "Q4_K_M", "float")
    assert floated.weights.count("int4") == 0 and not floated.weights.gguf_kept
    assert set(floated.weights.dequantized_by_reason()) == {"weights=float"}
    ref = reference(path, family)
    text = "hello there, the cat in the hat"
    assert floated.tokenizer.encode(text) == reference_tokenizer(path).encode(text)
    prompt = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                            do_sample=False)[0, len(PROMPT):].tolist()
        own = floated.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):].tolist()
    assert own == want
    if family not in ENGINE_FAMILIES:
        return
    _, quantized, _ = made(family, "Q4_K_M")
    assert quantized.weights.count("int4") > 0
    with torch.inference_mode():  # before the engine: it leaves the model's attention its own
        quantized_own = quantized.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                 max_new_tokens=NEW_TOKENS,
                                                 do_sample=False)[0, len(PROMPT):].tolist()
    with engine_for(floated) as engine:
        assert submit(engine, "float", PROMPT, NEW_TOKENS).wait().tokens == want
    with engine_for(quantized) as engine:
        assert submit(engine, "quantized", PROMPT, NEW_TOKENS).wait().tokens == quantized_own


def test_int4_keeps_the_files_4_bit_blocks_and_says_what_it_quantized_again(made):
    """weights=int4: the Q4_K tensors keep their own blocks, every other linear is quantized
    from its dequantized values, and the account says which were."""
    path, loaded, _ = made("llama", "Q4_K_M", "int4")
    report = loaded.weights
    assert report.count("float") == 0
    kinds = file_types(path)
    for name, (kind, form) in report.gguf_kept.items():
        assert (kind, form) == ("Q4_K", "int4"), name
    assert {n for n, k in kinds.items() if k == "Q4_K" and n != "token_embd.weight"} == set(report.gguf_kept)
    for name, (kind, why) in report.gguf_dequantized.items():
        if name not in ("token_embd.weight", "output.weight"):
            assert why == f"{kind}: no kept form as int4; weights=int4 quantized it again at load", name


def test_a_kernel_measured_slower_keeps_float_and_says_so(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "llama-Q4_K_M.gguf", "llama", "Q4_K_M")
    monkeypatch.setattr(KernelChoices, "choose", lambda self, form, layers, device, dtype: form == "q8-head")
    loaded = load_model(Settings(model=str(path), model_cache_dir=str(tmp_path / "cache"),
                                 cpu_decode_step="off"))
    report = loaded.weights
    assert report.count("int4") == report.count("int8") == 0 and not report.gguf_kept
    for name, kind in file_types(path).items():
        if kind in ("Q4_K", "Q8_0") and name != "token_embd.weight":
            form = "int4" if kind == "Q4_K" else "int8"
            assert report.gguf_dequantized[name] == (kind, f"float layers measured faster than {form} here")
