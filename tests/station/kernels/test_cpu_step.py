"""The decode step in one C call (station/kernels/cpu_step.c) on tiny 4-bit models.

Its arithmetic is checked against transformers' own forward in float64 over the very
values the step holds (so only the step's 15-bit activation rounding and float32 sums
remain), and shown closer to it than torch's int4 kernels (bfloat16 activations). A row
gives the same bits alone as in a batch, through the engine a sequence decodes alike
alone, in a batch, after a prefix hit and after a restart, and bad arguments are refused
without touching the pool.
"""

from __future__ import annotations

import pytest
import torch

from gnosis_daemon.settings import Settings
from station.core.requests import Choices, GenerationRequest, SamplingParams
from station.kernels.cpu_kernels import _build_and_open, compiler
from station.kernels.cpu_step import STEP_ROWS, StepWeights
from station.forward.kv_cache import KVCache
from station.model.loader import load_model
from tests.station.engine.test_paged_engine import BS, Collector, engine_for, prompt_of, submit
from tests.support.procs import mapped_file_at
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler here (cc, gcc or $CC)")


# head_dim 64 (the default model's) beside the tiny models' 16: a head four tiles of the
# q/k/v product, a bfloat16 K/V row two cache lines, the attention's blocks at that width
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    models = {family: build_tiny_model(root / family, family) for family in ("llama", "qwen2")}
    models["llama_hd64"] = build_tiny_model(root / "llama_hd64", "llama", shape=WIDE_HEADS)
    return models


def _load(path, cache, **overrides):
    overrides.setdefault("cpu_decode_step", "on")  # not left to a timing on a busy machine
    return load_model(Settings(model=str(path), model_cache_dir=str(cache), weights="int4", **overrides))


def _dense(weights: StepWeights) -> list[list[torch.Tensor]]:
    """Per layer, the four fused matrices' values (w = step * q + min), float64."""
    return [[mat.dense() for mat in parts] for parts in weights.mats]


def _pool(loaded, blocks: int) -> KVCache:
    """A pool for the loaded model's step, in the dtype it keeps K/V in."""
    return loaded.weights.step.pool(loaded.model, blocks, BS)


def _run_alone(step, ids: list[int], table: list[int]) -> torch.Tensor:
    """Each token at its position, one call each (a decode loop): -> [T, hidden]."""
    return torch.cat([step([t], [p], [table[p // BS] * BS + p % BS], [table]) for p, t in enumerate(ids)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_hd64"])
def test_the_step_computes_the_models_forward_on_its_own_values(tiny, tmp_path, family):
    loaded = _load(tiny[family], tmp_path, cpu_attention="float32")
    weights = loaded.weights.step
    assert isinstance(weights, StepWeights) and loaded.weights.tag.endswith(f",cpu-step:{weights.arithmetic()}")
    assert any(mat.bias is not None for mat in weights.mats[0]) == (family == "qwen2")
    assert weights.head_dim == (64 if family == "llama_hd64" else 16)
    # transformers' forward in float64 over the values the step holds
    reference = load_model(Settings(model=str(tiny[family]), model_cache_dir=str(tmp_path / "f"),
                                    weights="float")).model.double()
    for layer, (qkv, o, gate_up, down) in zip(reference.base_model.layers, _dense(weights)):
        attn, mlp = layer.self_attn, layer.mlp
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        for linear, part in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.split(sizes)):
            linear.weight.data = part.clone()
        attn.o_proj.weight.data = o
        mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate_up.chunk(2)
        mlp.down_proj.weight.data = down
    ids = prompt_of(7, 40)
    table = [3, 0, 5, 1, 2, 4, 7, 6, 9, 8]  # blocks out of order, as a pool hands them out
    step = weights.bind(_pool(loaded, 10), max_positions=64)
    with torch.inference_mode():
        got = _run_alone(step, ids, table).double()
        want = reference.base_model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        # the model's own forward runs its layers on the step's tiles (station.model.step_layers)
        tiled = loaded.model.base_model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        # without the step the same values are torch's int4 layers (bfloat16 activations)
        torch_model = _load(tiny[family], tmp_path, cpu_decode_step="off").model
        torch_int4 = torch_model.base_model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
    scale = float(want.abs().max())
    step_error = float((got - want).abs().max()) / scale
    tiled_error = float((tiled.double() - want).abs().max()) / scale
    torch_error = float((torch_int4.double() - want).abs().max()) / scale
    # activations rounded to 15 bits of their row's largest (8.7e-4 to 1.1e-3 here; torch's
    # bfloat16 2.6e-2 to 3.4e-2); the wide model's 128-wide rows carry larger sums: the tiles'
    # own forward is as far from it
    bound = 4e-3 if family == "llama_hd64" else 2e-3
    assert step_error < bound and tiled_error < bound, (step_error, tiled_error, torch_error)
    assert step_error < torch_error / 4, (step_error, torch_error)  # 15-bit activations, not 8


def test_the_step_reads_the_models_own_float_tensors_not_a_map_of_its_checkpoint(tiny, tmp_path):
    # transformers hands out views of the safetensors file it maps: a view the step kept would
    # keep every page of that file resident (the default model's steady RSS rose by 400 MiB)
    loaded = _load(tiny["llama"], tmp_path)
    weights, base = loaded.weights.step, loaded.model.base_model
    assert isinstance(weights, StepWeights)
    for held, own in ((weights.embed, base.embed_tokens.weight), (weights.final_norm, base.norm.weight)):
        assert held.data_ptr() == own.data_ptr()
        assert mapped_file_at(held.data_ptr()) is None  # owned memory, not the checkpoint's file


# the step's attention: auto takes bfloat16 pairs where this CPU has AVX512_BF16 (else it is
# float32 too); float32 the float32 kernels: each arithmetic keeps the step's promises
ATTENTIONS = ("auto", "float32")


@pytest.mark.parametrize("family", ["llama", "llama_hd64"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(tiny, tmp_path, attention, family):
    loaded = _load(tiny[family], tmp_path, cpu_attention=attention)
    rows = STEP_ROWS + 3  # two calls' worth
    step = loaded.weights.step.bind(_pool(loaded, 10 * rows), max_positions=64, threads=2)
    prompts = [prompt_of(100 + i, 5 + 3 * (i % 11)) for i in range(rows)]  # up to 35 tokens
    tables = [[10 * i + j for j in range(10)] for i in range(rows)]
    with torch.inference_mode():
        for prompt, table in zip(prompts, tables):  # each sequence's context, written alone
            _run_alone(step, prompt[:-1], table)
        last = [len(p) - 1 for p in prompts]
        slots = [t[p // BS] * BS + p % BS for t, p in zip(tables, last)]
        batch = step([p[-1] for p in prompts], last, slots, tables)
        for i in range(rows):
            alone = step([prompts[i][-1]], [last[i]], [slots[i]], [tables[i]])
            assert torch.equal(alone[0], batch[i]), i
    assert step.calls == sum(len(p) - 1 for p in prompts) + 2 * rows


@pytest.mark.parametrize("family", ["llama", "llama_hd64"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_prompts_rows_in_one_call_equal_the_same_rows_one_by_one(tiny, tmp_path, attention, family):
    """Consecutive rows of one sequence share their attention jobs (each K/V row read once
    for all of them); a row's output and K/V are still the bits it has alone."""
    loaded = _load(tiny[family], tmp_path, cpu_attention=attention)
    ids = prompt_of(9, 45)
    table = list(range(-(-45 // BS)))[::-1]  # the blocks out of order; the last one is the other's
    alone_step = loaded.weights.step.bind(_pool(loaded, len(table) + 1), max_positions=64, threads=2)
    grouped_step = loaded.weights.step.bind(_pool(loaded, len(table) + 1), max_positions=64, threads=2)
    spare = len(table)
    with torch.inference_mode():
        alone = _run_alone(alone_step, ids, table)
        # calls of 8 rows (the last one 5), the prompt's positions in order, plus a row of
        # another sequence in the middle of one call (it splits that call's group)
        other = prompt_of(10, 3)
        _run_alone(grouped_step, other[:-1], [spare])
        grouped = []
        for start in range(0, len(ids), 8):
            rows = list(range(start, min(start + 8, len(ids))))
            tokens, pos = [ids[p] for p in rows], rows
            slots = [table[p // BS] * BS + p % BS for p in rows]
            tables = [table] * len(rows)
            if start == 16:
                tokens.insert(4, other[-1]), pos.insert(4, 2), slots.insert(4, spare * BS + 2)
                tables.insert(4, [spare])
            out = grouped_step(tokens, pos, slots, tables)
            grouped.append(torch.cat([out[:4], out[5:]]) if start == 16 else out)
    assert torch.equal(torch.cat(grouped), alone)
    used = torch.tensor([table[p // BS] * BS + p % BS for p in range(len(ids))])
    assert torch.equal(grouped_step.kv.flatten(2, 3)[:, :, used], alone_step.kv.flatten(2, 3)[:, :, used])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_prefix_hit_on_a_previous_answer_equals_computing_it_again(tiny, tmp_path, attention):
    """Prompts go through the step too: the K/V of a turn's answer (decode rows) and of the
    same tokens in the next turn's prompt (prompt rows) are the same bits, so the next turn
    gives the same logprobs, to the bit, with the answer's K/V from the prefix cache or
    computed again in a fresh pool."""
    first = prompt_of(60, 20)
    with engine_for(_load(tiny["llama"], tmp_path, cpu_attention=attention), prefill_chunk_tokens=16) as engine:
        answer = submit(engine, "t1", first, 14).wait().tokens
        second = first + answer + prompt_of(61, 7)
        hit = _with_logprobs(engine, "t2", second, 10).wait()
    with engine_for(_load(tiny["llama"], tmp_path, cpu_attention=attention), prefill_chunk_tokens=16) as engine:
        miss = _with_logprobs(engine, "t2", second, 10).wait()
        rows = engine.runner._step.calls
    cached = hit.events[0].cached_tokens
    assert cached > len(first) and miss.events[0].cached_tokens == 0  # the hit took answer K/V
    assert hit.tokens == miss.tokens
    logprobs = [[(e.logprobs.logprob, e.logprobs.top) for e in c.events if hasattr(e, "logprobs")]
                for c in (hit, miss)]
    assert len(logprobs[0]) == 10 and logprobs[0] == logprobs[1]
    assert rows == len(second) + 9  # every prompt row went through the step, then 9 decodes


def test_prompt_logprobs_of_an_answer_equal_its_logprobs_when_it_was_generated(tiny, tmp_path):
    """A prompt's rows (``prompt_logprobs``: every prompt row's logits) and decode rows are
    one arithmetic: the logprob of each token of an answer, read back as part of a prompt,
    is the one it had when it was sampled, to the bit."""
    first = prompt_of(70, 11)
    with engine_for(_load(tiny["llama"], tmp_path), prefill_chunk_tokens=8) as engine:
        turn = _with_logprobs(engine, "t1", first, 9).wait()
        sampled = [(e.token_id, e.logprobs.logprob) for e in turn.events if hasattr(e, "logprobs")]
        again = _with_logprobs(engine, "t2", first + [t for t, _ in sampled], 1, prompt_logprobs=1).wait()
    prompt = [e for e in again.events if getattr(e, "prompt_logprobs", None) is not None][0].prompt_logprobs
    assert len(prompt) == len(first) + 9 and prompt[0].logprob is None
    read_back = [(lp.token_id, lp.logprob) for lp in prompt[len(first):]]
    assert read_back == sampled


def _with_logprobs(engine, rid: str, prompt: list[int], n: int, **asked) -> Collector:
    asked.setdefault("logprobs", 1)
    collector = Collector()
    engine.add_request(GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0),
                                         choices=Choices(**asked)), collector)
    return collector


def test_the_head_on_the_steps_threads_equals_the_q8_kernel(tiny, tmp_path):
    from station.kernels.cpu_kernels import Q8Linear

    loaded = _load(tiny["llama"], tmp_path)
    step = loaded.weights.step.bind(_pool(loaded, 4), max_positions=16, threads=2)
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (1100, 64), generator=gen, dtype=torch.int8)  # 3 chunks of 512 rows
    d = (torch.rand(1100, 2, generator=gen) * 1e-2).half().float()
    kernel = Q8Linear(step.lib, q, d)
    x = torch.randn(6, 64, generator=gen)
    with torch.inference_mode():
        assert torch.equal(step.head(kernel, x), kernel(x))
        assert torch.equal(step.head(kernel, x[4:5]), kernel(x)[4:5])


def test_bad_arguments_are_refused_and_the_step_goes_on(tiny, tmp_path):
    loaded = _load(tiny["llama"], tmp_path)
    pool = _pool(loaded, 4)
    step = loaded.weights.step.bind(pool, max_positions=8)
    vocab = loaded.model.config.vocab_size
    with torch.inference_mode():
        good = step([5], [0], [0], [[0]])
        before = pool.kv.clone()
        for args in (([vocab], [1], [1], [[0]]),  # token past the vocabulary
                     ([5], [8], [8], [[0, 1, 2, 3]]),  # a position past max_positions
                     ([5], [BS], [BS], [[0]]),  # a position its table does not reach
                     ([5], [1], [4 * BS], [[0]]),  # a slot past the pool
                     ([5], [1], [1], [[4]])):  # a block id past the pool
            with pytest.raises(ValueError, match="out of range"):
                step(*args)
        assert torch.equal(pool.kv, before)
        assert torch.equal(step([5], [0], [0], [[0]]), good)


def test_the_plain_c_build_agrees_with_this_cpus(tiny, tmp_path):
    loaded = _load(tiny["llama"], tmp_path, cpu_attention="float32")
    plain = _build_and_open(compiler(), tmp_path / "plain.so", ("-march=x86-64",))
    assert plain is not None
    native_step = loaded.weights.step.bind(_pool(loaded, 8), max_positions=64)
    loaded.weights.step.lib = plain
    plain_step = loaded.weights.step.bind(_pool(loaded, 8), max_positions=64)
    ids, table = prompt_of(3, 30), list(range(8))
    with torch.inference_mode():
        got, want = _run_alone(plain_step, ids, table), _run_alone(native_step, ids, table)
    # float32 sums in another order; where one lands an activation across an int16 rounding
    # boundary, that activation moves by one step (1/32767 of its group's largest)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))


def test_bfloat16_attention_is_taken_where_the_cpu_has_it_and_named_in_the_fingerprint(tiny, tmp_path):
    auto = _load(tiny["llama"], tmp_path)
    float32 = _load(tiny["llama"], tmp_path, cpu_attention="float32")
    has_bf16 = auto.weights.step.lib.gnosis_attention_takes(auto.weights.step.head_dim) == 2
    assert auto.weights.step.attention_bf16 == has_bf16 and not float32.weights.step.attention_bf16
    common = "q4-int16-row-scale,norm-16-sums,kv-head-major,"
    assert float32.weights.step.arithmetic() == common + "attention-vector"
    assert auto.weights.step.arithmetic() == common + ("attention-vector-bf16" if has_bf16 else "attention-vector")
    # KV of one attention arithmetic is never served to the other
    assert (auto.fingerprint != float32.fingerprint) == has_bf16


def test_a_bfloat16_step_keeps_kv_as_bfloat16_the_rounding_of_the_float32_steps(tiny, tmp_path):
    """With bfloat16 attention the pool holds K and V in bfloat16: the values the float32
    pool holds, rounded to nearest even (layer 0's K/V, which no attention output feeds, are
    the same values on both steps). A pool of the other dtype is refused, not misread."""
    bf16 = _load(tiny["llama"], tmp_path)
    float32 = _load(tiny["llama"], tmp_path, cpu_attention="float32")
    assert float32.weights.step.kv_dtype == torch.float32
    if not bf16.weights.step.attention_bf16:
        pytest.skip("this CPU has no AVX512_BF16: the step's attention is float32 here")
    assert bf16.weights.step.kv_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="KV pool"):
        bf16.weights.step.bind(_pool(float32, 4), max_positions=64)
    ids = prompt_of(6, 40)
    table = list(range(-(-len(ids) // BS)))[::-1]  # blocks out of order
    pools = {name: _pool(loaded, len(table)) for name, loaded in (("bf16", bf16), ("float32", float32))}
    with torch.inference_mode():
        for name, loaded in (("bf16", bf16), ("float32", float32)):
            _run_alone(loaded.weights.step.bind(pools[name], max_positions=64), ids, table)
    got, want = pools["bf16"].kv[0], pools["float32"].kv[0].to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and float(want.abs().sum()) > 0
    assert torch.equal(got, want)
    assert not torch.equal(pools["bf16"].kv[1], pools["float32"].kv[1].to(torch.bfloat16))  # attention feeds it


def test_bfloat16_attention_stays_within_its_rounding_of_the_models_forward(tiny, tmp_path):
    """q, k, e and v rounded to bfloat16 (8 bits), every sum in float32: a decode row's
    output moves from the float32 attention's by that rounding, not more, and both stay
    within the load's own check of the model's forward (5e-2 of its largest value)."""
    bf16 = _load(tiny["llama"], tmp_path)
    if not bf16.weights.step.attention_bf16:
        pytest.skip("this CPU has no AVX512_BF16: the step's attention is float32 here")
    float32 = _load(tiny["llama"], tmp_path, cpu_attention="float32")
    ids, table = prompt_of(5, 40), [3, 0, 5, 1, 2, 4, 7, 6, 9, 8]
    with torch.inference_mode():
        want = float32.model.base_model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        got = {name: _run_alone(loaded.weights.step.bind(_pool(loaded, 10), max_positions=64), ids, table)
               for name, loaded in (("bf16", bf16), ("float32", float32))}
    scale = float(want.abs().max())
    bf16_error = float((got["bf16"] - want).abs().max()) / scale
    float32_error = float((got["float32"] - want).abs().max()) / scale
    assert not torch.equal(got["bf16"], got["float32"])  # the bfloat16 kernels ran
    assert float32_error < 1e-3 and bf16_error < 5e-2, (float32_error, bf16_error)


def test_engine_decodes_alike_alone_batched_after_a_hit_and_a_restart(tiny, tmp_path):
    loaded = _load(tiny["llama"], tmp_path)
    prompts = [prompt_of(40 + i, 5 + 9 * i) for i in range(5)]
    with engine_for(loaded, prefill_chunk_tokens=16) as engine:
        alone = [submit(engine, f"alone{i}", p, 12).wait().tokens for i, p in enumerate(prompts)]
        batch = [submit(engine, f"r{i}", p, 12) for i, p in enumerate(prompts)]
        batched = [r.wait().tokens for r in batch]
        hit = submit(engine, "hit", prompts[4], 12).wait()
        assert engine.runner._step.calls > 0
        assert engine.kv_cache.kv.dtype == loaded.weights.step.kv_dtype  # the step's own pool
    assert hit.events[0].cached_tokens >= len(prompts[4]) - BS
    assert batched == alone
    assert hit.tokens == alone[4]
    restarted = _load(tiny["llama"], tmp_path)
    assert restarted.fingerprint == loaded.fingerprint
    with engine_for(restarted, prefill_chunk_tokens=16) as engine:
        assert submit(engine, "again", prompts[2], 12).wait().tokens == alone[2]
    # off, the fingerprint differs: KV of one arithmetic is never served to the other
    torch_path = _load(tiny["llama"], tmp_path, cpu_decode_step="off")
    assert torch_path.weights.step is None and torch_path.fingerprint != loaded.fingerprint
