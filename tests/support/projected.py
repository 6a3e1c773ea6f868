"""A projected call at a preset's real shapes on the GPU tests' device (``tests/gpu``): the
preset's variant draws the prologue's inputs, the hidden states ``x ~ N(0, 1)`` and the packed
weight ``w ~ N(0, 1) / sqrt(hidden)`` are drawn in float64 and rounded to the activation dtype,
so the packed row ``x @ w.T`` has unit-scale heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fqr.presets import Preset, get_preset
from fqr.prologue import DECLARATIONS, variant_of
from fqr.prologue.declare import Declaration
from fqr.prologue.variant import Variant

MAX_POSITION = 4096


@dataclass
class ProjectedCase:
    preset: Preset
    variant: Variant  # the prologue's (its float64 expectation takes the packed row)
    proj: Declaration  # its projected form, ``<op>_proj``
    table: torch.Tensor
    inputs: dict  # the prologue's drawn inputs (``qkv`` among them, not an argument here)
    x: torch.Tensor
    w: torch.Tensor
    rest: dict  # the projected form's arguments but x and w_qkv

    @property
    def given(self) -> dict:
        """Every argument of the projected call."""
        return dict(self.rest, x=self.x, w_qkv=self.w)


def projected_case(gen, name: str, tp: int, tokens: int, device, dtype=torch.bfloat16):
    """The projected call of preset ``name`` at TP ``tp`` for ``tokens`` tokens on ``device``
    (``gen`` on ``device`` too; on ``meta`` shapes only)."""
    preset = get_preset(name, tp)
    variant = variant_of(preset)
    proj = DECLARATIONS[variant.declaration.name + "_proj"]
    table = preset.cos_sin_cache(MAX_POSITION).to(device)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    width, hidden = inputs["qkv"].shape[1], preset.hidden_size
    x = torch.randn(tokens, hidden, generator=gen, device=gen.device, dtype=torch.float64)
    w = torch.randn(width, hidden, generator=gen, device=gen.device, dtype=torch.float64)
    x, w = x.to(device, dtype), (w / hidden**0.5).to(device, dtype)
    values = variant.arguments(preset, inputs, table)
    rest = {k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in values.items() if k in proj.index and k != "qkv"}  # fmt: skip
    return ProjectedCase(preset, variant, proj, table, inputs, x, w, rest)
