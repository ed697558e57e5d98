"""The decoder's 4-bit layers built straight into the C step's tiles, one decoder layer at a
time, where the step may serve (``weights.apply_weights`` tries this first).

A load that made torch's int4 layers first and the step's copy of them after would hold
both: a 7B Q4 file (3.8 GB) peaked at 3.8 times its size. Here each decoder layer's groups
(from the file's blocks, or quantized from its float weights for ``weights=int4``) go into
the step's stacked matrices (``q4_tiles.TiledMatrix``: q, k, v as one, o, gate and up as
one, down), and the model's seven linears become ``TiledLinear``s over their rows, so the
tiles are the only copy of the 4-bit weights from the start, and the model's own forward
(the load's checks, the start check) still runs. Each layer is checked against ``F.linear``
over its values before the next is read.

A few layers also get torch's int4 form (``Int4Linear``), up to ``SAMPLE_BYTES``, so the
step can be timed against the layers torch would run instead (``load_kernels.cpu_step``);
they are dropped once it is. Where the step is then refused, ``restore`` puts the model's
own linears back and the load goes on as without a step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from gnosis_daemon.logs import get_logger
from station.kernels.cpu_step import PROJECTIONS
from station.kernels.q4_tiles import TiledLinear, TiledMatrix
from station.kernels.quantized import Int4Groups, Int4Linear, checked, int4_applies

log = get_logger(__name__)

SAMPLE_BYTES = 96 * 1024 * 1024  # torch int4 layers kept to time the step against (one 7B layer)

# (weight name, its linear) -> (its groups, where they came from: gguf | load), or why not
GroupsFor = Callable[[str, nn.Linear], "tuple[Int4Groups, str] | str"]


@dataclass
class StepLayers:
    """What ``build`` changed: the model's own linears (to put back), where each layer's
    values came from, and the torch int4 twins of the first layers (for the timing)."""

    replaced: list[tuple[str, nn.Module, str, nn.Module]] = field(default_factory=list)
    source: dict[str, str] = field(default_factory=dict)
    sample: list[Int4Linear] = field(default_factory=list)
    sample_layers: int = 0  # decoder layers the sample covers, all of their linears
    nbytes: int = 0  # the tiles'

    def restore(self) -> None:
        """The model's own linears back, the tiles gone with the layers over them."""
        for _, parent, attr, layer in self.replaced:
            setattr(parent, attr, layer)
        self.replaced.clear()
        self.sample.clear()


def build(model: nn.Module, lib: ctypes.CDLL, groups_for: GroupsFor, sample: bool) -> StepLayers | str:
    """Every decoder layer's projections as ``TiledLinear``s over the step's tiles; -> what
    was done, or why not (the model as it was). ``sample``: keep torch int4 twins to time."""
    base = cast(Any, model.base_model)
    prefix = next(name for name, module in model.named_modules() if module is base)
    done = StepLayers()
    sample_bytes = 0
    for index, layer in enumerate(base.layers):
        twins: list[Int4Linear] = []
        for owner, names in PROJECTIONS:
            parent = getattr(layer, owner)
            linears = [getattr(parent, name) for name in names]
            weight_names = [f"{prefix}.layers.{index}.{owner}.{name}.weight" for name in names]
            made = _stacked(linears, weight_names, groups_for)
            if isinstance(made, str):
                done.restore()
                return made
            matrix, groups = made
            start = 0
            for name, weight_name, linear, values in zip(names, weight_names, linears, groups):
                tiled = TiledLinear(lib, matrix, start, linear.out_features)
                bias = None if linear.bias is None else linear.bias.detach()
                if not checked(tiled, values[0], bias):
                    done.restore()
                    return f"{weight_name}: the 4-bit tiles disagreed with F.linear over its values"
                if sample and sample_bytes < SAMPLE_BYTES:
                    twins.append(Int4Linear(values[0], bias, torch.device("cpu")))
                done.replaced.append((weight_name[:-len(".weight")], parent, name, linear))
                done.source[weight_name[:-len(".weight")]] = values[1]
                setattr(parent, name, tiled)
                start += linear.out_features
            done.nbytes += matrix.nbytes
            del groups
        if twins:
            done.sample += twins
            done.sample_layers += 1
            sample_bytes += sum(t.packed.numel() * t.packed.element_size() for t in twins)
    log.info("step_layers_built", layers=len(base.layers), bytes=done.nbytes, timed_layers=done.sample_layers)
    return done


def _stacked(linears: list[nn.Linear], weight_names: list[str],
             groups_for: GroupsFor) -> tuple[TiledMatrix, list[tuple[Int4Groups, str]]] | str:
    """The projections that read one input as one tiled matrix; -> (it, each one's groups
    and their source), or why not."""
    groups, forms, biases = [], [], []
    for linear, weight_name in zip(linears, weight_names):
        if type(linear) is not nn.Linear:
            return f"{weight_name} is not a linear layer"
        got = groups_for(weight_name, linear)
        if isinstance(got, str):
            return f"{weight_name}: {got}"
        if not int4_applies(got[0]):
            return f"{weight_name}: a {tuple(got[0].q.shape)} weight the 4-bit layers do not take"
        layout = got[0].step_layout()
        if layout is None:
            return f"{weight_name}: a scale that float16 does not hold"
        groups.append(got)
        forms.append(layout)
        biases.append(None if linear.bias is None else linear.bias.detach().float())
    q, step, low = (torch.cat([form[i] for form in forms]) for i in range(3))
    del forms
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(linear.out_features)
                          for b, linear in zip(biases, linears)])
    return TiledMatrix.from_groups(q, step, low, bias), groups
