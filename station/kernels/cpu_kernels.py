"""A C kernel of our own for what torch's CPU kernels do slowly: the head over Q8_0 blocks.

A small GGUF model's vocabulary head is its tied embeddings, stored as Q8_0 (8-bit values
with a float16 scale per 32). Read as float32 it is the largest weight a decode token
reads (49,152 x 576 values of SmolLM2 are 113 MB). torch has no kernel that takes 8-bit
weights with per-group scales and float32 activations and gives float32 out
(``_weight_int8pack_mm`` wants one scale a row and is slower in float32; in bfloat16 its
logits come out in bfloat16, steps of 0.125 at 25). ``cpu_kernels.c`` does exactly that
product, in AVX-512, AVX2 or plain C, rows split over threads: the file's values,
unrounded activations, float32 sums in another order, 1 + 4/32 bytes read a weight
instead of 4.

The sources (``cpu_kernels.c`` and ``cpu_step.c``, both including ``cpu_abi.h``, the
library's whole interface) are compiled on the machine they run on (``cc -O3
-march=native``) into one library in ``<model_cache_dir>/kernels/``, keyed by the sources,
the header, the compiler and the CPU, and loaded with ctypes (which releases the GIL for
the call). Each ``ctypes.Structure`` here and in ``cpu_step.py`` mirrors a struct of the
header, field for field (tests/station/kernels/test_cpu_abi.py checks the layouts), and
each function's prototype is declared in the module that calls it. Where no compiler is
found, or it fails, or the build does not compute what it should, nothing changes: the
head stays the float32 one. Whether it is used is measured like the other kernels
(``KernelChoices``, form ``q8-head``).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
# compiled into the same library: the whole decode step (station.kernels.cpu_step)
SOURCES = (SOURCE, *(SOURCE.with_name(name) for name in ("cpu_step.c", "cpu_q4.c", "cpu_attention.c")))
HEADER = SOURCE.with_name("cpu_abi.h")  # included by all; part of the build's key
PARTS_HEADER = SOURCE.with_name("cpu_parts.h")  # what the C files call in one another
GROUP = 32  # cpu_abi.h's GNOSIS_GROUP
BUILD_TIMEOUT_S = 120
_loaded: dict[str, ctypes.CDLL | None] = {}  # by key: the same sources, compiler and machine


class Status(enum.IntEnum):
    """cpu_abi.h's ``gnosis_status_t``: what a call that can fail returns."""

    OK = 0
    BAD_ARGUMENT = -1  # out of range; nothing was written
    NO_MEMORY = -2
    NO_THREAD = -3  # a thread could not start; the result is still complete


class Q8Product(ctypes.Structure):
    """cpu_abi.h's ``gnosis_q8_product_t``: ``y = x @ (q * d).T`` over Q8_0 blocks."""

    _c_name_ = "gnosis_q8_product_t"
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("x", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("rows", ctypes.c_int32), ("out_features", ctypes.c_int32),
                ("in_features", ctypes.c_int32)]


def declare_q8(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The prototypes of the library's Q8_0 functions (cpu_abi.h), set on ``lib``."""
    lib.gnosis_simd.argtypes = []
    lib.gnosis_simd.restype = ctypes.c_char_p
    lib.gnosis_q8_linear.argtypes = [ctypes.POINTER(Q8Product), ctypes.c_int32]
    lib.gnosis_q8_linear.restype = ctypes.c_int
    return lib


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on PATH; None: no compiler here."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def load_library(cache_dir: Path | None) -> ctypes.CDLL | None:
    """The compiled kernels for this machine (built once, then reused); None if it cannot be."""
    from station.kernels.quantized import machine_tag

    missing = [source.name for source in (*SOURCES, HEADER, PARTS_HEADER) if not source.is_file()]
    if missing:
        log.info("cpu_kernels_unavailable", reason=f"{', '.join(missing)} not installed beside {__name__}")
        return None
    cc = compiler()
    if cc is None:
        log.info("cpu_kernels_unavailable", reason="no C compiler (cc, gcc or $CC)")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("cpu_kernels_unavailable", reason=f"{cc} --version: {exc}")
        return None
    sources = b"".join(source.read_bytes() for source in (*SOURCES, HEADER, PARTS_HEADER))
    key = hashlib.sha256(sources + repr((version, machine_tag())).encode()).hexdigest()[:16]
    if key in _loaded:  # this process has built or opened this very library already
        return _loaded[key]
    base = cache_dir if cache_dir is not None else Path(tempfile.gettempdir()) / "gnosis-daemon"
    _loaded[key] = _build_and_open(cc, base / "kernels" / f"cpu_kernels-{key}.so")
    return _loaded[key]


def _build_and_open(cc: str, path: Path, arch: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL | None:
    """Compile (unless ``path`` exists) and open; ``arch``: the target flags (tests build
    the AVX2 and plain C variants on an AVX-512 machine with these)."""
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run([cc, "-O3", *arch, "-shared", "-fPIC", "-pthread",
                                   "-o", str(tmp), *map(str, SOURCES), "-lm"],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                log.warning("cpu_kernels_build_failed", compiler=cc, stderr=done.stderr[-2000:])
                return None
            os.replace(tmp, path)  # another station building the same file wins alike
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cpu_kernels_build_failed", compiler=cc, reason=str(exc))
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("cpu_kernels_unloadable", path=str(path), reason=str(exc))
        return None
    declare_q8(lib)  # the step's prototypes: cpu_step.declare_step, where they are called
    log.info("cpu_kernels_loaded", path=str(path), simd=lib.gnosis_simd().decode())
    return lib


class Q8Linear:
    """``x @ (q * d).T`` for Q8_0 blocks, float32 in and out, through ``cpu_kernels.c``.

    q: int8 [N, K]; d: float32 [N, K // 32]. Called with [..., K] float32 (CPU).
    """

    def __init__(self, lib: ctypes.CDLL, q: torch.Tensor, d: torch.Tensor) -> None:
        assert q.dtype == torch.int8 and d.dtype == torch.float32 and q.shape[1] % GROUP == 0
        self.lib = lib
        self.q, self.d = q.contiguous(), d.contiguous()
        self.out_features, self.in_features = q.shape
        self.threads = torch.get_num_threads()  # its own threads, whatever torch has later

    def product(self, rows: torch.Tensor, y: torch.Tensor) -> Q8Product:
        """The call's struct: ``rows`` [M, in_features] and ``y`` [M, out_features], float32,
        contiguous, alive for the call."""
        return Q8Product(q=self.q.data_ptr(), d=self.d.data_ptr(), x=rows.data_ptr(), y=y.data_ptr(),
                         rows=rows.shape[0], out_features=self.out_features, in_features=self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        status = self.lib.gnosis_q8_linear(ctypes.byref(self.product(rows, y)), self.threads)
        if status not in (Status.OK, Status.NO_THREAD):  # NO_THREAD: its rows ran on this one
            raise ValueError(f"cpu_kernels: gnosis_q8_linear refused the product (status {status})")
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        from station.model.gguf_groups import q8_values

        return q8_values(self.q, self.d)
