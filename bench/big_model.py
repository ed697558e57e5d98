"""`make bench-7b`: a 7B-class GGUF file served in its quantized size, beside llama.cpp.

Writes once, into the model cache, a synthetic GGUF of Mistral-7B's shape (32 layers, hidden
4,096, FFN 14,336, 32 heads, 8 KV heads, 32k vocabulary) with random weights, quantized
with gguf-py's own quantizer (Q4_0, ~4 GB; a tensor at a time, streamed to the file), then:

* the daemon's station on it (``gguf_load=auto`` maps it: its float32 copy would be ~29 GB):
  load time, the load's peak RSS above the process's base over the file's size (the start
  log's ``model_memory``), steady RSS after one request over the file's size, decode tok/s
  for one stream and for 4, and a 256-token prompt's first token, missed then hit;
* llama.cpp (llama-cpp-python, where installed) on the same file: load time, peak and steady
  RSS, single-stream decode tok/s; the ratio daemon / llama.cpp (goal >= 1.0).

    python -m bench.big_model [--layers 32] [--decode-tokens 32] [--cache-dir DIR]

``--layers`` writes fewer layers of the same width (a quicker drill, the same per-layer
figures). Nothing here runs in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import trio

from bench.common import make_prompt_ids, start_station, station_decode, station_ttft, stop_station
from gnosis_daemon.client import open_station_client
from gnosis_daemon.settings import load_settings

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 32000
_MIB = 1024 * 1024


def write_synthetic(path: Path, layers: int, kind: str = "Q4_0", seed: int = 0) -> Path:
    """The Mistral-7B-shaped file, written a tensor at a time (never the whole model in memory)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    # byte-level BPE: every byte, control tokens 256-258 (pad, bos, eos), one merge, fillers
    listed = [bytes_to_unicode()[b] for b in range(256)] + ["<|pad|>", "<|begin|>", "<|end|>", "Ġt"]
    listed += [f"<x{i}>" for i in range(VOCAB - len(listed))]
    types, merges = [1] * 256 + [3] * 3 + [1] * (VOCAB - 259), ["Ġ t"]
    kv = KV_HEADS * (HIDDEN // HEADS)
    plan: list[tuple[str, int, int, float]] = [("token_embd.weight", VOCAB, HIDDEN, 1.0)]
    for i in range(layers):
        plan += [(f"blk.{i}.attn_norm.weight", 1, HIDDEN, 0.0), (f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, 0.01),
                 (f"blk.{i}.attn_k.weight", kv, HIDDEN, 0.01), (f"blk.{i}.attn_v.weight", kv, HIDDEN, 0.01),
                 (f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, 0.01),
                 (f"blk.{i}.ffn_norm.weight", 1, HIDDEN, 0.0), (f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, 0.01),
                 (f"blk.{i}.ffn_up.weight", FFN, HIDDEN, 0.01), (f"blk.{i}.ffn_down.weight", HIDDEN, FFN, 0.01)]
    plan += [("output_norm.weight", 1, HIDDEN, 0.0), ("output.weight", VOCAB, HIDDEN, 0.02)]
    tmp = path.with_name(f".{path.name}.partial")
    writer = GGUFWriter(tmp, "llama")
    writer.add_name("synthetic-mistral-7b-shape")
    writer.add_file_type({"Q4_0": 2, "Q8_0": 7}[kind])
    for key, value in (("context_length", 4096), ("embedding_length", HIDDEN), ("block_count", layers),
                       ("feed_forward_length", FFN), ("head_count", HEADS), ("head_count_kv", KV_HEADS),
                       ("layer_norm_rms_eps", 1e-5), ("rope_freq_base", 1e6),
                       ("rope_dimension_count", HIDDEN // HEADS), ("vocab_size", VOCAB)):
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(listed)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_quantization_version(2)
    for name, rows, cols, _ in plan:
        if rows == 1:  # a norm: F32
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            nbytes = rows * cols // 32 * (18 if kind == "Q4_0" else 34)
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, rows, cols, std in plan:
        if rows == 1:
            writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
            continue
        out = np.empty((rows, cols // 32 * (18 if kind == "Q4_0" else 34)), dtype=np.uint8)
        for start in range(0, rows, 1024):  # 1,024 rows of float at a time
            chunk = rng.standard_normal((min(1024, rows - start), cols), dtype=np.float32) * std
            out[start:start + len(chunk)] = quants.quantize(chunk, qtype)
        writer.write_tensor_data(out)
    writer.close()
    tmp.rename(path)
    return path


def daemon_side(path: Path, cache: Path, decode_tokens: int, tmp: Path, step: str) -> dict:
    settings = replace(load_settings(cli={"model": str(path)}), model_cache_dir=str(cache),
                       cpu_decode_step=step)
    log_path = tmp / "station.log"
    start = time.perf_counter()
    proc = start_station(settings, tmp / "rt", log_path)
    out: dict = {"load_s": round(time.perf_counter() - start, 1), "peak_rss_mib": _status(proc.pid, "VmHWM")}
    try:
        memory: dict = next((json.loads(line) for line in log_path.read_text().splitlines()
                       if '"model_memory"' in line), {})
        out.update({k: memory.get(k) for k in ("mapped", "base_rss_mib", "load_peak_per_file")})
        trio.run(_daemon_requests, tmp / "rt" / "station.sock", decode_tokens, out)
        out["steady_rss_mib"] = _status(proc.pid, "VmRSS")
    finally:
        stop_station(proc)
    return out


async def _daemon_requests(sock: Path, decode_tokens: int, out: dict) -> None:
    async with open_station_client(sock) as conn:
        prompt = make_prompt_ids(VOCAB, 256, seed=1)
        miss = await station_ttft(conn, prompt, "big")
        hit = await station_ttft(conn, prompt, "big")
        out.update(miss_ttft_s=round(miss.ttft_s, 3), hit_ttft_s=round(hit.ttft_s, 3),
                   hit_cached_tokens=hit.cached_tokens)
        for streams in (1, 4):
            prompts = [make_prompt_ids(VOCAB, 32, seed=10 + i) for i in range(streams)]
            out[f"decode_tok_s_{streams}"] = round(await station_decode(conn, prompts, decode_tokens), 2)


def llama_side(path: Path, decode_tokens: int, threads: int) -> dict | None:
    try:
        import llama_cpp  # noqa: F401 - the peer extra
    except ImportError:
        return None
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bench.peers.llama_worker", "inproc", "--model", str(path),
                             "--threads", str(threads), "--ctx", "1024"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdout.readline()  # {"ready": ...}
        out: dict = {"load_s": round(time.perf_counter() - start, 1), "peak_rss_mib": _status(proc.pid, "VmHWM")}
        proc.stdin.write(json.dumps({"prompt": "hello there " * 8, "max_tokens": decode_tokens}) + "\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        out["decode_tok_s_1"] = round(answer["tokens"] / answer["decode_s"], 2)
        out["steady_rss_mib"] = _status(proc.pid, "VmRSS")
        return out
    finally:
        proc.kill()
        proc.wait()


def _status(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.big_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="model_cache_dir (default: the settings')")
    parser.add_argument("--cpu-decode-step", default="auto", choices=["auto", "on", "off"],
                        help="the station's cpu_decode_step (the C step holds its own copy of the 4-bit layers)")
    args = parser.parse_args(argv)
    settings = load_settings(cli={})
    cache = Path(args.cache_dir or settings.model_cache_dir or Path.home() / ".cache" / "gnosis-daemon")
    path = cache / "synthetic" / f"mistral-7b-shape-{args.layers}l-Q4_0.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once)", flush=True)
        write_synthetic(path, args.layers)
    size_mib = path.stat().st_size / _MIB
    with tempfile.TemporaryDirectory(prefix="gnosis-bench-7b-") as tmp:
        ours = daemon_side(path, cache, args.decode_tokens, Path(tmp), args.cpu_decode_step)
    theirs = llama_side(path, args.decode_tokens, args.threads)
    print(f"file: {path.name}, {size_mib:.0f} MiB")
    for side, figures in (("daemon", ours), ("llama.cpp", theirs)):
        if figures is None:
            print(f"{side}: not run (llama-cpp-python is not installed: pip install -e '.[peer]')")
            continue
        figures["peak_per_file"] = round(figures["peak_rss_mib"] / size_mib, 3)
        figures["steady_per_file"] = round(figures["steady_rss_mib"] / size_mib, 3)
        print(f"{side}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    if theirs is not None:
        print(f"decode tok/s daemon / llama.cpp (1 stream): {ours['decode_tok_s_1'] / theirs['decode_tok_s_1']:.2f} "
              "(goal >= 1.0)")
    ok = bool(ours.get("mapped")) and (ours.get("load_peak_per_file") or 99) <= 1.5
    print(f"served mapped with the load's peak <= 1.5 x file + base: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
