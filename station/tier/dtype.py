"""A KV block's dtype by name: what the disk tier's files and its I/O process need of a
torch dtype (its ``str`` and size), without importing torch (``station.tier.format``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DTypeName:
    """A torch dtype by its name (``str(torch.bfloat16)``) and size, torch not imported."""

    name: str
    itemsize: int

    def __post_init__(self) -> None:
        if not re.fullmatch(r"torch\.[a-z0-9_]+", self.name) or self.itemsize not in (1, 2, 4, 8):
            raise ValueError(f"not a torch dtype: {self.name!r} of {self.itemsize!r} bytes")

    def __str__(self) -> str:
        return self.name


def torch_dtype(dtype: torch.dtype | DTypeName) -> torch.dtype:
    import torch

    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or found.itemsize != dtype.itemsize:
        raise ValueError(f"not a torch dtype: {dtype}")
    return found
