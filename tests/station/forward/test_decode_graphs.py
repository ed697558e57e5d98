"""station.forward.decode_graphs on a CPU: the static decode step that a GPU captures as a
CUDA graph, run eagerly (``decode_graphs=on``). Its buckets, its padding (padded rows write
only the scratch block), its logits against the eager step's, and the engine's greedy output
through it against ``model.generate``. tests/gpu/test_cuda.py captures and replays it."""

from __future__ import annotations

import pytest
import torch

from gnosis_daemon.settings import Settings, SettingsError
from station.core.requests import SamplingParams
from station.core.scheduler import SchedulerOutput
from station.core.sequence import Sequence
from station.forward.decode_graphs import batch_buckets, context_buckets
from station.engine.loop import PagedEngine
from station.model.loader import load_model
from tests.station.engine import test_paged_engine
from tests.station.engine.test_paged_engine import BS, engine_for, prompt_of, reference, submit
from tests.support.tiny_models import FAMILIES

pytestmark = pytest.mark.usefixtures("few_threads")

tiny = test_paged_engine.tiny  # family -> (model dir, LoadedModel), built once per module


def test_buckets_cover_every_batch_and_context_up_to_the_limits():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert context_buckets(16, 8192) == [16, 32, 64, 128, 256, 512]  # blocks of 16 positions
    assert context_buckets(4, 100) == [16, 25]
    assert context_buckets(16, 100) == [7]


def test_the_setting_is_checked():
    with pytest.raises(SettingsError, match="decode_graphs"):
        Settings(decode_graphs="always")
    with pytest.raises(SettingsError, match="decode_graph_max_context"):
        Settings(decode_graph_max_context=0)


def test_graphs_stay_off_on_a_cpu_unless_asked(tiny):
    _, loaded = tiny("llama")
    auto = PagedEngine(loaded, Settings(runtime_dir="/tmp/unused-rt", kv_block_size=BS), num_blocks=8)
    assert auto.runner._graphs is None and auto.kv_cache.scratch_block is None
    assert "decode_graph_replays" not in auto.stats()
    on = PagedEngine(loaded, Settings(runtime_dir="/tmp/unused-rt", kv_block_size=BS, decode_graphs="on",
                                      decode_graph_max_context=100), num_blocks=8)
    graphs = on.runner._graphs
    assert graphs is not None and not graphs.capture  # no CUDA: the static step runs eagerly
    assert on.kv_cache.scratch_block == 8 and on.kv_cache.kv.shape[2] == 9 and on.kv.num_blocks == 8
    assert graphs.bucket(3, 60) == (4, 16) and graphs.bucket(3, 65) == (4, 25)
    assert graphs.bucket(33, 10) is None and graphs.bucket(1, 101) is None  # eager past the limits


@pytest.mark.parametrize("family", FAMILIES + ("mistral_sw", "qwen2_sw"))
def test_greedy_output_through_the_static_step_equals_generate(tiny, family):
    """Five requests of 3 to 55 prompt tokens at once (a bucket of 8 rows, 3 of them padding),
    decoding across the 64-position context bucket; then a prefix hit on one of them. The
    windowed families (8 tokens) apply each layer's window inside the static step."""
    path, loaded = tiny(family)
    prompts = [prompt_of(40 + i, 3 + 13 * i) for i in range(5)]
    # queued before the engine starts, so that they go in one step on a busy machine too
    with engine_for(loaded, start=False, decode_graphs="on") as engine:
        results = [submit(engine, f"g{i}", p, 20) for i, p in enumerate(prompts)]
        engine.start()
        for i, (p, r) in enumerate(zip(prompts, results)):
            assert r.wait().tokens == reference(path, p, 20), f"request {i}"
        used = set(engine.runner._graphs._static)
        assert {(8, 16), (8, 32)} <= used, used  # contexts past 64 positions took the next bucket
        replays = engine.stats()["decode_graph_replays"]
        # the prompts went in one step; every step after it was a static step
        assert replays == max(len(r.tokens) for r in results) - 1
        again = submit(engine, "hit", prompts[4], 20).wait()
        assert again.tokens == reference(path, prompts[4], 20)
        assert engine.stats()["decode_graph_replays"] == replays + len(again.tokens) - 1


def changed_slots(kv: torch.Tensor, before: torch.Tensor) -> list[int]:
    """The slots of a pool ([L, 2, blocks, bs, H, D]) whose K or V differ from ``before``'s
    in any layer, in order."""
    differ = kv.flatten(2, 3) != before.flatten(2, 3)  # [L, 2, slots, H, D]
    return differ.flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()


def _decoding(engine: PagedEngine, lengths: list[int]) -> list[Sequence]:
    """Sequences whose prompts are in the pool (an eager prefill step) and whose next token
    has its slot: ready for one decode step."""
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", prompt_of(70 + i, n), SamplingParams(max_tokens=4, temperature=0.0))
        assert engine.kv.allocate_slots(seq, n)
        seqs.append(seq)
    engine.runner.run(SchedulerOutput(prefills=[(s, len(s.token_ids)) for s in seqs]))
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(7)
        assert engine.kv.allocate_slots(seq, 1)
    return seqs


@pytest.mark.parametrize(("family", "load"), [
    *((family, {}) for family in FAMILIES),
    # the GPU's usual form: a bfloat16 model whose linears are int4 (torch's path, no C step)
    ("llama", {"dtype": "bfloat16", "weights": "int4", "cpu_decode_step": "off"}),
])
def test_a_static_step_equals_the_eager_step_and_padding_writes_only_the_scratch_block(tiny, tmp_path,
                                                                                      family, load):
    path, loaded = tiny(family)
    if load:
        loaded = load_model(Settings(model=str(path), model_cache_dir=str(tmp_path), **load))
    engine = PagedEngine(loaded, Settings(runtime_dir="/tmp/unused-rt", kv_block_size=BS,
                                          decode_graphs="on"), num_blocks=64)
    runner, kv = engine.runner, engine.kv_cache.kv
    seqs = _decoding(engine, [5, 23, 12])  # 3 rows: a bucket of 4
    slots = [s.blocks[s.num_computed_tokens // BS].block_id * BS + s.num_computed_tokens % BS for s in seqs]
    before = kv.clone()
    graphs, runner._graphs = runner._graphs, None
    eager, _ = runner.run(SchedulerOutput(decodes=seqs))
    after_eager = kv.clone()
    kv.copy_(before)
    runner._graphs = graphs
    static, sampled = runner.run(SchedulerOutput(decodes=seqs))
    assert graphs.replays == 1 and sampled == seqs and runner.prompt_rows == []
    assert static.dtype == torch.float32 and static.shape == eager.shape
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    assert static.argmax(-1).tolist() == eager.argmax(-1).tolist()
    real = 64 * BS
    changed = changed_slots(kv, before)
    assert [s for s in changed if s < real] == slots  # the 3 rows' slots and nothing else
    assert changed[-1] == real  # the padded row: the scratch block's first slot
    torch.testing.assert_close(kv.flatten(2, 3)[:, :, :real], after_eager.flatten(2, 3)[:, :, :real],
                               rtol=1e-5, atol=1e-5)
