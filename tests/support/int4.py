"""A check both int4 test modules make of an ``Int4Linear`` over a set of groups."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from station.kernels.quantized import Int4Groups, Int4Linear


def check_int4_layer(groups: Int4Groups, seed: int) -> None:
    """An ``Int4Linear`` over ``groups`` computes ``F.linear`` over their values (within what
    bfloat16 activations and scales round), and a row alone equals that row in a batch."""
    values = groups.dequantize()
    bias = torch.randn(values.shape[0], generator=torch.Generator().manual_seed(seed))
    layer = Int4Linear(groups, bias, torch.device("cpu"))
    x = torch.randn(5, values.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, values, bias)
        alone = layer(x[2:3])
    assert got.dtype == torch.float32
    # bfloat16 activations and scales: about 3 significant digits
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert torch.equal(alone, got[2:3])  # decode rows must not depend on their company
