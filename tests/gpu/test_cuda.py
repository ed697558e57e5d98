"""The CUDA path: device choice, dtype, KV budget from free GPU memory, parity on the GPU.

Marked ``gpu``: these run only where CUDA is (tests/conftest.py skips them elsewhere, with
the reason). Run them on a GPU host with ``.venv/bin/python -m pytest -m gpu``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.core.requests import Failed, Finished, Token, GenerationRequest, SamplingParams
from station.model.loader import load_model
from station.engine.loop import PagedEngine
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpu-llama"), "llama")


def test_auto_device_is_cuda_in_bf16(tiny_dir, tmp_path):
    loaded = load_model(Settings(model=str(tiny_dir), runtime_dir=str(tmp_path)))
    assert str(loaded.device).startswith("cuda")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).device.type == "cuda"


def test_kv_pool_is_sized_from_free_gpu_memory(tiny_dir, tmp_path):
    settings = Settings(model=str(tiny_dir), runtime_dir=str(tmp_path), kv_cache_gpu_fraction=0.05)
    loaded = load_model(settings)
    free_before, _ = torch.cuda.mem_get_info()
    engine = PagedEngine(loaded, settings)
    try:
        pool_bytes = engine.kv_cache.bytes_total
        # the pool takes about 5% of the memory that was free (never more than that share)
        assert 0.5 * 0.05 * free_before <= pool_bytes <= 0.05 * free_before * 1.01
        assert engine.kv_cache.kv.device.type == "cuda"
        assert engine.kv_cache.kv.dtype == torch.bfloat16
    finally:
        engine.shutdown()


def test_greedy_parity_on_cuda_float32(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    settings = Settings(model=str(tiny_dir), runtime_dir=str(tmp_path), dtype="float32",
                        kv_cache_gpu_fraction=0.02)
    loaded = load_model(settings)
    prompt = list(range(3, 40))
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to("cuda")
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                      do_sample=False)[0, len(prompt):].tolist()
    engine = PagedEngine(loaded, settings)
    engine.start()
    tokens, done = [], threading.Event()

    def on_event(event):
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, (Finished, Failed)):
            done.set()

    try:
        engine.add_request(GenerationRequest("gpu-1", prompt, SamplingParams(max_tokens=16, temperature=0)),
                           on_event)
        assert done.wait(60)
        assert tokens == expected
        # decode_graphs=auto on a GPU: every step after the prompt's replayed a CUDA graph
        assert engine.runner.graph_stats() == {"decode_graphs_captured": 1, "decode_graph_capture_failures": 0,
                                               "decode_graph_replays": len(expected) - 1}
    finally:
        engine.shutdown()


def test_sampling_controls_on_cuda_tensors():
    """The batched sampler with its state on the GPU: greedy rows with bias, min_tokens and
    penalties pick what the CPU picks; a seeded row is reproducible in any batch."""
    from station.sampling.logits import SequenceSampling, sample_sequences

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3

    def states(device, seed_rows=()):
        controls = [dict(logit_bias=((7, 100.0),)), dict(min_tokens=2),
                    dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
                    dict()]
        out = []
        for i, c in enumerate(controls):
            sampled = dict(temperature=1.0, seed=11 + i, top_k=20, min_p=0.01) if i in seed_rows else {}
            p = SamplingParams(max_tokens=8, **{"temperature": 0.0, **c, **sampled})
            out.append(SequenceSampling(p, [1, 2, 3], [int(logits[1].argmax())], device))
        return out

    cpu, gpu = states("cpu"), states("cuda")
    for _ in range(4):
        expected = sample_sequences(logits, cpu).tolist()
        assert sample_sequences(logits.cuda(), gpu).tolist() == expected
    assert torch.equal(gpu[2].counts.cpu(), cpu[2].counts)
    alone = states("cuda", seed_rows=(0, 1, 2, 3))
    crowd = states("cuda", seed_rows=(0, 1, 2, 3))
    first = [sample_sequences(logits[2:3].cuda(), alone[2:3]).tolist() for _ in range(6)]
    mixed = [sample_sequences(logits.cuda(), crowd).tolist()[2:3] for _ in range(6)]
    assert first == mixed


def test_grammar_rows_masked_on_cuda_match_the_cpu():
    """Structured output with the logits on the GPU: the bitmask is copied to the device
    and applied there; a greedy grammar row picks what the CPU picks, the greedy row beside
    it is untouched, and the output is the grammar's."""
    import json

    from station.sampling.grammar import Grammars
    from station.sampling.logits import SequenceSampling, sample_sequences
    from tests.support.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    grammars = Grammars(tokenizer, 259, [258])
    compiled = grammars.compile({"type": "json_schema", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}})
    generator = torch.Generator().manual_seed(0)

    def states(device):
        params = SamplingParams(max_tokens=40, temperature=0.0)
        return [SequenceSampling(params, [1], [258], device, compiled),
                SequenceSampling(params, [1], [258], device)]

    cpu, gpu = states("cpu"), states("cuda")
    out = []
    for _ in range(40):
        logits = torch.randn(2, 259, generator=generator) * 3
        expected = sample_sequences(logits, cpu).tolist()
        assert sample_sequences(logits.cuda(), gpu).tolist() == expected
        assert expected[1] == int(logits[1].argmax())
        out.append(expected[0])
        if gpu[0].finished:
            break
    assert out[-1] == 258 and json.loads(tokenizer.decode(out[:-1]))["ok"] in (True, False)


def test_int4_weights_and_the_lean_decoder_on_cuda_equal_that_models_generate(tiny_dir, tmp_path):
    """Quantized weights on the GPU: the decoder's linears as 4-bit groups through
    ``_weight_int4pack_mm`` (bfloat16 model), the lean one-loop forward, and the engine's
    greedy output equal to the same quantized model's ``model.generate``."""
    from station.kernels.quantized import Int4Linear

    settings = Settings(model=str(tiny_dir), runtime_dir=str(tmp_path), model_cache_dir=str(tmp_path),
                        weights="int4", kv_cache_gpu_fraction=0.02)
    loaded = load_model(settings)
    assert sum(isinstance(m, Int4Linear) for m in loaded.model.modules()) == 14
    assert all(m.packed.device.type == "cuda" for m in loaded.model.modules() if isinstance(m, Int4Linear))
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(4)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expected.append(loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                  do_sample=False)[0, len(prompt):].tolist())
    engine = PagedEngine(loaded, settings)
    assert engine.runner.plan.forward.chosen == "lean"
    engine.start()
    results = [([], threading.Event()) for _ in prompts]

    def on_event_for(tokens, done):
        def on_event(event):
            if isinstance(event, Token):
                tokens.append(event.token_id)
            elif isinstance(event, (Finished, Failed)):
                done.set()
        return on_event

    try:
        for i, (prompt, (tokens, done)) in enumerate(zip(prompts, results)):
            engine.add_request(GenerationRequest(f"int4-{i}", prompt, SamplingParams(max_tokens=12, temperature=0)),
                               on_event_for(tokens, done))
        for i, (tokens, done) in enumerate(results):
            assert done.wait(60)
            assert tokens == expected[i], f"prompt {i} in a batch"
        graphs = engine.runner.graph_stats()  # the quantized path, graph-captured
        assert graphs["decode_graphs_captured"] >= 1 and graphs["decode_graph_replays"] >= 11, graphs
        assert graphs["decode_graph_capture_failures"] == 0
    finally:
        engine.shutdown()


def test_a_decode_graph_is_captured_once_and_replays_the_eager_step(tiny_dir, tmp_path):
    """Decode graphs on the GPU: a pure-decode step of 3 rows is captured as the 4-row bucket's CUDA graph
    on its first use and replayed after; its logits equal the eager step's, and its padded
    row writes only the pool's scratch block."""
    from station.core.scheduler import SchedulerOutput
    from tests.station.forward.test_decode_graphs import _decoding, changed_slots
    from tests.station.engine.test_paged_engine import BS

    settings = Settings(model=str(tiny_dir), runtime_dir=str(tmp_path), dtype="float32", kv_block_size=BS)
    loaded = load_model(settings)
    engine = PagedEngine(loaded, settings, num_blocks=64)
    runner, kv = engine.runner, engine.kv_cache.kv
    graphs = runner._graphs
    assert graphs is not None and graphs.capture and engine.kv_cache.scratch_block == 64
    seqs = _decoding(engine, [5, 23, 12])
    slots = [s.blocks[s.num_computed_tokens // BS].block_id * BS + s.num_computed_tokens % BS for s in seqs]
    before = kv.clone()
    runner._graphs = None
    eager, _ = runner.run(SchedulerOutput(decodes=seqs))
    kv.copy_(before)
    runner._graphs = graphs
    first, _ = runner.run(SchedulerOutput(decodes=seqs))
    assert graphs.stats() == {"decode_graphs_captured": 1, "decode_graph_replays": 1,
                              "decode_graph_capture_failures": 0}
    again, _ = runner.run(SchedulerOutput(decodes=seqs))  # the same graph, replayed
    assert graphs.stats() == {"decode_graphs_captured": 1, "decode_graph_replays": 2,
                              "decode_graph_capture_failures": 0}
    assert torch.equal(first, again)
    torch.testing.assert_close(first, eager, rtol=1e-4, atol=1e-4)
    assert first.argmax(-1).tolist() == eager.argmax(-1).tolist()
    real = 64 * BS
    changed = changed_slots(kv, before)
    assert [s for s in changed if s < real] == slots and changed[-1] == real
