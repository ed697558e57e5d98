"""The C step's 4-bit matrices (``cpu_abi.h``'s ``gnosis_q4_matrix_t``), and a linear layer
over a slice of one.

Where the C step serves (``station.kernels.cpu_step``), its tiled matrices are the only copy
of the decoder's 4-bit weights: ``station.model.step_layers`` writes them from a GGUF file's
groups one decoder layer at a time (q, k and v stacked into one matrix, gate and up into
another), and each of the model's linear layers becomes a ``TiledLinear`` over its rows of
its layer's matrix, so a load never holds torch's int4 form of them beside the step's (a 7B
file would take twice its size). The model's own forward, which the load's checks and the
start check run, then computes its products as the step does (``gnosis_q4_linear``:
15-bit activations per 32-value group, exact integer sums; cpu_q4.c).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

_int, _ptr = ctypes.c_int32, ctypes.c_void_p


class Q4Matrix(ctypes.Structure):
    """GGUF's 4-bit groups in tiles (``TiledMatrix``); float16 ``step``/``min`` a group."""

    _c_name_ = "gnosis_q4_matrix_t"
    _fields_ = [("q", _ptr), ("step", _ptr), ("min", _ptr), ("bias", _ptr),  # bias: None, or [rows]
                ("rows", _int), ("cols", _int)]


TILE = 16  # cpu_abi.h's GNOSIS_Q4_TILE: output rows of a tile of the C step's matrices


@dataclass(frozen=True)
class TiledMatrix:
    """A 4-bit matrix in ``gnosis_q4_matrix_t``'s tiles of 16 output rows (cpu_abi.h):
    ``q`` [tiles, groups, 8, 32] bytes, ``step``/``min`` [tiles, groups, 16] float16,
    ``bias`` [tiles * 16] float32 or None."""

    q: torch.Tensor
    step: torch.Tensor
    min: torch.Tensor
    bias: torch.Tensor | None
    rows: int
    cols: int

    @classmethod
    def from_groups(cls, packed: torch.Tensor, step: torch.Tensor, low: torch.Tensor,
                    bias: torch.Tensor | None) -> TiledMatrix:
        """From a GGUF file's groups: ``packed`` [rows, cols / 2] (byte j of a group holds
        value j low, j + 16 high), ``step``/``low`` [rows, groups] float16."""
        rows, cols, groups = packed.shape[0], 2 * packed.shape[1], packed.shape[1] // 16
        tiles = -(-rows // TILE)
        pad = tiles * TILE - rows
        g = torch.nn.functional.pad(packed, (0, 0, 0, pad)).view(tiles, TILE, groups, 16)
        low_values, high_values = g & 15, g >> 4  # values j and 16 + j of each group
        # slab c, byte 2i + j: value 2c + j low, 2c + 16 + j high, of the tile's row i
        slabs = (low_values | (high_values << 4)).view(tiles, TILE, groups, 8, 2).permute(0, 2, 3, 1, 4)

        def per_tile(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, 0, pad)).view(tiles, TILE, groups).transpose(1, 2).contiguous()

        return cls(q=slabs.reshape(tiles, groups, 8, 2 * TILE).contiguous(), step=per_tile(step),
                   min=per_tile(low), rows=rows, cols=cols,
                   bias=None if bias is None else torch.nn.functional.pad(bias, (0, pad)).contiguous())

    def dense(self) -> torch.Tensor:
        """The values, w = step * q + min, float64 [rows, cols] (for checks)."""
        tiles, groups = self.q.shape[0], self.q.shape[1]
        slabs = self.q.view(tiles, groups, 8, TILE, 2).permute(0, 3, 1, 2, 4)  # [tiles, i, groups, c, j]
        values = torch.cat([(slabs & 15).reshape(tiles, TILE, groups, 16),
                            (slabs >> 4).reshape(tiles, TILE, groups, 16)], -1).double()
        scale = self.step.transpose(1, 2).double()[..., None]
        low = self.min.transpose(1, 2).double()[..., None]
        return (values * scale + low).reshape(tiles * TILE, self.cols)[: self.rows]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.step, self.min, self.bias) if t is not None)


def matrix_struct(m: TiledMatrix) -> Q4Matrix:
    """The C struct pointing into ``m``'s tensors (valid while they live)."""
    return Q4Matrix(q=m.q.data_ptr(), step=m.step.data_ptr(), min=m.min.data_ptr(),
                    bias=None if m.bias is None else m.bias.data_ptr(), rows=m.rows, cols=m.cols)


def declare_q4(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``gnosis_q4_linear``'s prototype (cpu_abi.h), set on ``lib``."""
    lib.gnosis_q4_linear.argtypes = [ctypes.POINTER(Q4Matrix), _int, _int, _ptr, _int, _ptr, _int]
    lib.gnosis_q4_linear.restype = ctypes.c_int
    return lib


class TiledLinear(nn.Module):
    """Output rows ``[start, start + out_features)`` of a ``TiledMatrix`` as a linear layer
    (its bias included), computed by ``gnosis_q4_linear`` on the calling thread and as many
    more as torch has. The matrix's tensors are buffers, shared with the other layers over
    the same matrix and with the step: the fingerprint sees them, no copy is made."""

    q: torch.Tensor  # buffers (registered in __init__): the whole matrix's
    step: torch.Tensor
    min: torch.Tensor
    tiled_bias: torch.Tensor | None

    def __init__(self, lib: ctypes.CDLL, matrix: TiledMatrix, start: int, out_features: int) -> None:
        super().__init__()
        assert 0 <= start and start + out_features <= matrix.rows
        self.lib = declare_q4(lib)
        self.matrix = matrix
        self.in_features, self.out_features = matrix.cols, out_features
        self.first, self.offset = start // TILE, start % TILE
        self.tiles = -(-(start + out_features) // TILE) - self.first
        for name in ("q", "step", "min"):
            self.register_buffer(name, getattr(matrix, name))
        self.register_buffer("tiled_bias", matrix.bias)
        self._struct = matrix_struct(matrix)
        self.threads = torch.get_num_threads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from station.kernels.cpu_kernels import Status

        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], self.tiles * TILE)
        status = self.lib.gnosis_q4_linear(ctypes.byref(self._struct), self.first, self.tiles, rows.data_ptr(),
                                           rows.shape[0], y.data_ptr(), self.threads)
        if status not in (Status.OK, Status.NO_THREAD):  # NO_THREAD: its tiles ran on this one
            raise ValueError(f"q4_tiles: gnosis_q4_linear refused the product (status {status})")
        out = y[:, self.offset:self.offset + self.out_features].to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"4-bit tiles {self.first}..{self.first + self.tiles - 1} of the step's matrix")
