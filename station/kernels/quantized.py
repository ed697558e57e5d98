"""Linear layers whose weights stay quantized: 4-bit groups and int8 rows, in torch's kernels.

* ``Int4Groups``: a weight as groups of 32 along the input dimension,
  ``w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]`` with ``q`` in 0..15.
  That is torch's weight-only int4 form, and GGUF's Q4_0 (``d * (q - 8)``: zero 0),
  Q4_1 (``d * q + m``: zero ``m + 8 d``) and Q4_K (each 32 of a 256-weight super-block
  ``d * sc * q - dmin * mn``: scale ``d * sc``, zero ``8 d sc - dmin mn``) map onto it
  group for group. ``Int4Linear`` runs it through ``_weight_int4pack_mm_for_cpu`` (CPU)
  or ``_weight_int4pack_mm`` (CUDA). Both take bfloat16 activations, scales and zeros only
  (their float32 paths are far slower on CPU), so a layer rounds its input and its group
  scales to bfloat16, and returns float32 to a float32 model: the KV cache and everything
  around the layer keep the model's dtype.
* ``Int8Rows``: ``w[n, k] = q[n, k] * scale[n]``, symmetric, one scale per output row, run
  through ``_weight_int8pack_mm``.

Which kernel runs is measured, not assumed (``KernelChoices``): each quantized form is
timed against the float layers it replaces (oneDNN, packed) over a pass through the
model's layers at one row, a decode step's shape, and the faster wins. The answer is
remembered per machine, model and torch version in a file, so a restart makes the same
choice and the model's fingerprint (which names the choice) does not change under saved
sessions. Every packed layer is checked against its
own dequantized weights once, as ``station.kernels.dense`` does for oneDNN.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gnosis_daemon.logs import get_logger

log = get_logger(__name__)

GROUP = 32  # GGUF's block size; torch's int4 kernels take 32, 64, 128 or 256
_LOAD_BLOCK = 1 << 20  # values packed or dequantized at once at load: bounds the temporaries (4 MB)


def _row_step(rows: int, cols: int) -> int:
    """Rows per block of about ``_LOAD_BLOCK`` values: a multiple of 64 (the CPU int4
    packing's tile of output rows: blocks of it pack as the whole does) where ``rows`` is
    one, else all of them."""
    return max(64, _LOAD_BLOCK // cols // 64 * 64) if rows % 64 == 0 else rows


@dataclass(slots=True)
class Int4Groups:
    q: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // GROUP] float32
    zero: torch.Tensor  # [N, K // GROUP] float32: the value q = 8 stands for

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The values of rows ``start:stop``, float32; in place, so they are the only float copy."""
        values = self.q[start:stop].float()
        n, k = values.shape
        groups = values.sub_(8).view(n, k // GROUP, GROUP)
        groups.mul_(self.scale[start:stop, :, None]).add_(self.zero[start:stop, :, None])
        return values

    def step_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The C decode step's form (``cpu_step.c``): per row the 4-bit values as GGUF packs
        them (byte j of a group: value j low, value j + 16 high), and per group float16
        ``step`` and ``min`` with ``w = step * q + min``. Float16 holds a Q4_0 or Q4_1 file's
        scales and minimums exactly (they are float16 there), others to 11 bits (torch's
        kernels take bfloat16, 8); None where a value does not fit in float16."""
        n, k = self.q.shape
        if k % GROUP:
            return None
        q = self.q.view(n, k // GROUP, 2, GROUP // 2)
        packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        step = self.scale.to(torch.float16)
        low = (self.zero - 8 * self.scale).to(torch.float16)
        if not (torch.isfinite(step).all() and torch.isfinite(low).all()):
            return None
        return packed, step.contiguous(), low.contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Groups:
        """Asymmetric min/max groups (as GGUF's Q4_1): the group's ends are exact."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // GROUP, GROUP)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = (hi - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round((w - lo[:, :, None]) / safe[:, :, None]), 0, 15)
        return cls(q.view(n, k).to(torch.uint8), scale, lo + 8 * scale)


@dataclass(slots=True)
class Int8Rows:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.q[start:stop].float() * self.scale[start:stop, None]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Rows:
        w = weight.detach().float()
        scale = w.abs().amax(1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return cls(torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8), scale)


def int4_applies(groups: Int4Groups) -> bool:
    n, k = groups.q.shape
    return k % GROUP == 0 and n % 8 == 0


class Int4Linear(nn.Module):
    """A linear layer over ``Int4Groups`` in torch's packed int4 layout (inference only)."""

    packed: torch.Tensor  # buffers (registered in __init__)
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.q.shape
        q = groups.q.to(device)
        if device.type == "cuda":
            tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            pairs = (q[:, ::2].to(torch.int32) << 4 | q[:, 1::2].to(torch.int32)).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
        else:  # a block of rows at a time (the layout is per row): no whole int32 copy
            step = _row_step(*q.shape)
            packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q[at:at + step].to(torch.int32), 2) for at in range(0, self.out_features, step)])
        self.register_buffer("packed", packed)
        # [K // GROUP, N, 2]: (scale, zero) per group and output, as the kernels take them
        self.register_buffer("scales_and_zeros", torch.stack([groups.scale.t(), groups.zero.t()], -1)
                             .to(device, torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(device))
        # The same values in the C decode step's form (``Int4Groups.step_layout``), where
        # ``weights`` keeps them for it; the step takes them or they are dropped.
        self.step_form: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if rows.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, GROUP, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                                            self.scales_and_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}"


class Int8Linear(nn.Module):
    """A linear layer over ``Int8Rows`` through ``_weight_int8pack_mm`` (inference only).

    On a CPU it computes in bfloat16 (activations and row scales rounded to it, as the int4
    layers do): the float32 path of that kernel is several times slower at one row, slower
    even than a float32 layer through oneDNN.
    """

    weight_int8: torch.Tensor  # buffers (registered in __init__)
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = rows.q.shape
        compute = torch.bfloat16 if device.type == "cpu" else dtype
        self.register_buffer("weight_int8", rows.q.to(device).contiguous())
        self.register_buffer("scales", rows.scale.to(device, compute))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def checked(layer: nn.Module, weight: torch.Tensor | Int4Groups | Int8Rows, bias: torch.Tensor | None,
            device: torch.device | None = None) -> bool:
    """The packed layer agrees with ``F.linear`` over ``weight``: its own dequantized values,
    or its quantized form, dequantized a block of rows at a time (no whole float copy); on
    ``device`` (default: the values')."""
    values, form = (weight, None) if isinstance(weight, torch.Tensor) else (None, weight)
    device = device or (values.device if values is not None else torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, form.q.shape[1] if form is not None else values.shape[1], generator=gen)
    x = x.to(device, values.dtype if values is not None else torch.float32)
    with torch.inference_mode():
        try:
            got = layer(x).float()
        except RuntimeError as exc:  # a torch build or device without this kernel
            log.info("quantized_kernel_unavailable", kind=type(layer).__name__, reason=str(exc))
            return False
        if form is None:
            want = F.linear(x.float(), values.float(), None if bias is None else bias.float())
        else:
            rows = form.q.shape[0]
            step = _row_step(rows, x.shape[1])
            want = torch.cat([F.linear(x, form.dequantize(at, at + step).to(device))
                              for at in range(0, rows, step)], -1)
            want = want if bias is None else want + bias.float()
    scale = float(want.abs().max()) or 1.0
    # bfloat16 activations and scales: ~3 significant digits
    return bool((got - want).abs().max() <= 3e-2 * scale)


def _time_passes(sides: list[list], inputs: list[torch.Tensor], reps: int = 5) -> list[float]:
    """Best of ``reps`` passes through every layer in turn (as a decode step streams them),
    per side; the sides alternate pass by pass, so both see the same machine."""
    best = [float("inf")] * len(sides)
    with torch.inference_mode():
        for rep in range(reps + 1):
            order = range(len(sides)) if rep % 2 == 0 else reversed(range(len(sides)))
            for side in order:
                layers = sides[side]
                if inputs[0].is_cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for layer, x in zip(layers, inputs):
                    layer(x)
                if inputs[0].is_cuda:
                    torch.cuda.synchronize()
                if rep:  # the first pass warms up
                    best[side] = min(best[side], time.perf_counter() - start)
    return best


class KernelChoices:
    """Per form: does the quantized kernel beat the float one here? Measured once, kept.

    A decode step reads every layer's weights once, from memory rather than cache, so both
    sides are timed as a pass over the model's layers at one row (up to ``MEASURE_BYTES``
    of float weights, enough to spill any CPU cache), passes alternating: a single layer
    timed in a loop stays in cache and flatters float weights. Float wins only by a clear
    margin (``FLOAT_MARGIN``).
    """

    MEASURE_BYTES = 256 * 1024 * 1024
    # The quantized form is kept unless float is faster by this factor: it is what the file
    # holds and it takes less memory, and a busy machine's timings must not flip the choice.
    FLOAT_MARGIN = 1.25

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.answers: dict[str, bool] = {}
        if path is not None and path.is_file():
            try:
                self.answers = {str(k): bool(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                log.warning("kernel_choices_unreadable", path=str(path))
        self.measured: dict[str, tuple[float, float]] = {}

    def choose(self, form: str, layers: list[tuple[nn.Module, torch.Tensor]], device: torch.device,
               dtype: torch.dtype) -> bool:
        """``layers``: (quantized layer, the dense values it stands for) -> use the quantized?
        The pairs are taken off the list as they are packed, so each float copy goes once its
        packed twin exists (a load holds one of them at a time, not both)."""
        key = f"{form}:{device.type}"
        if key not in self.answers and layers:
            from station.kernels.dense import pack_weight  # what float would run

            quantized, dense, inputs, total = [], [], [], 0
            while layers and total < self.MEASURE_BYTES:
                layer, values = layers.pop(0)
                weight = values.to(device, dtype)
                packed = pack_weight(weight, None)
                dense.append(_OneDnn(packed) if packed is not None else _Dense(weight))
                quantized.append(layer)
                inputs.append(torch.randn(1, layer.in_features).to(device, dtype))
                total += weight.numel() * 4
                del values, weight
            quantized_s, float_s = _time_passes([quantized, dense], inputs)
            del dense
            self.measured[key] = (quantized_s, float_s)
            self.answers[key] = quantized_s < float_s * self.FLOAT_MARGIN
            log.info("quantized_kernel_measured", form=key, layers=len(quantized),
                     quantized_ms=round(quantized_s * 1e3, 2), float_ms=round(float_s * 1e3, 2),
                     chosen="quantized" if self.answers[key] else "float")
        return self.answers.get(key, False)

    def save(self) -> None:
        if self.path is None or not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.answers, sort_keys=True, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            log.warning("kernel_choices_not_saved", path=str(self.path), exc_info=True)


class _OneDnn:
    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class _Dense:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def machine_tag() -> str:
    """What a kernel timing depends on: torch version, CPU model and core count, GPU name."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"
    return f"torch {torch.__version__} | {cpu} | {os.cpu_count()} cpus | {gpu}"
