"""The C kernel for a GGUF file's Q8_0 vocabulary head (station/kernels/cpu_kernels.c).

Its product is checked against ``F.linear`` over the blocks' own values in every SIMD
variant the source has (AVX-512, AVX2, plain C: each built here with its own target
flags where this CPU runs it), a row against the same row in a batch and one thread
against several, bit for bit; a failed build leaves the float32 head; and on the real
default model the engine's greedy output with the kernel as its head equals
``model.generate`` (whose head is the float32 one).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from gnosis_daemon.settings import Settings
from station.kernels.cpu_kernels import Q8Linear, _build_and_open, compiler, load_library
from station.kernels.dense import KERNEL_MAX_ROWS, VocabHead

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler here (cc, gcc or $CC)")


def _blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 1e-3).half().float()  # float16 scales, as Q8_0's
    return q, d


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return set(next(line for line in info if line.startswith("flags")).split(":")[1].split())


VARIANTS = [("native", ("-march=native",), None),
            ("avx2", ("-mavx2", "-mfma", "-mno-avx512f"), "avx2"),
            ("scalar", ("-mno-avx", "-mno-avx2", "-mno-avx512f"), None)]


@pytest.mark.parametrize(("name", "arch", "needs"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_variant_computes_the_blocks_product(tmp_path, name, arch, needs):
    if needs and needs not in _cpu_flags():
        pytest.skip(f"this CPU has no {needs}")
    lib = _build_and_open(compiler(), tmp_path / f"{name}.so", arch)
    assert lib is not None
    simd = lib.gnosis_simd().decode()
    assert simd == {"avx2": "avx2", "scalar": "scalar"}.get(name, simd)
    q, d = _blocks(203, 96, seed=1)  # rows not a multiple of the threads or the tile
    kernel = Q8Linear(lib, q, d)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got, want = kernel(x), F.linear(x, kernel.dequantize())
    assert got.dtype == torch.float32 and got.shape == (9, 203)
    # the same float32 product, summed in another order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for m in range(9):  # each row alone equals that row in the batch (tiles of 4 rows)
        assert torch.equal(kernel(x[m:m + 1]), got[m:m + 1]), m
    for threads in (1, 3):  # rows split over one thread or several: the same bits
        kernel.threads = threads
        assert torch.equal(kernel(x), got), threads


def test_a_failed_build_leaves_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert load_library(tmp_path) is None
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_the_head_calls_the_kernel_it_was_given(tmp_path):
    lib = load_library(tmp_path)
    assert isinstance(lib, ctypes.CDLL)
    q, d = _blocks(64, 32, seed=3)
    kernel = Q8Linear(lib, q, d)
    model = torch.nn.Module()
    model.config = type("C", (), {})()
    head = torch.nn.Linear(32, 64, bias=False)
    model.get_output_embeddings = lambda: head
    vocab = VocabHead.for_model(model, kernel=kernel)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 32)
    assert torch.equal(vocab(x[:KERNEL_MAX_ROWS]), kernel(x[:KERNEL_MAX_ROWS]))
    # past it, the float32 head (the arithmetic is then the bound, and oneDNN's is faster)
    with torch.inference_mode():
        torch.testing.assert_close(vocab(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(vocab(x), kernel(x))  # the float head's weight is not the blocks'


def test_the_default_gguf_head_runs_on_its_q8_blocks_and_the_engine_still_equals_generate(
        default_model_cache):
    from station.model.loader import load_model
    from tests.station.engine.test_paged_engine import engine_for, submit

    from station.model.gguf_groups import read_q8_rows
    from station.model.loader import default_model_path

    # decode through torch's layers, as model.generate does (the C decode step, which has its
    # own arithmetic, is tests/station/kernels/test_cpu_step.py's)
    loaded = load_model(Settings(model_cache_dir=str(default_model_cache.root), cpu_decode_step="off"))
    # whether the station uses it is measured at load (kernel-choices); here it is used either way
    assert loaded.weights.head is None or isinstance(loaded.weights.head, Q8Linear)
    weight = loaded.model.get_output_embeddings().weight
    head = Q8Linear(load_library(default_model_cache.root),
                    *read_q8_rows(default_model_path(), loaded.model, weight))
    loaded.weights.head = head
    assert head.out_features == loaded.vocab_size
    # the file's blocks are the float32 head's weight, bit for bit
    assert torch.equal(head.dequantize(), weight.detach())
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                     do_sample=False)[0, len(prompt):].tolist()
    with engine_for(loaded) as engine:
        assert engine.runner._head.kernel is head
        got = submit(engine, "q8", prompt, 24).wait().tokens
    assert got[:len(want)] == want
