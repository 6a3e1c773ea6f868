"""Pattern helpers that decide soundness, on small make_fx graphs (fast): HF's cos/sin must be
proven to repeat their halves before the fused op (which reads the first half) replaces them."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fqr.fusion.patterns import halves_repeated


def output_node(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return out.args[0][0] if isinstance(out.args[0], (list, tuple)) else out.args[0]


FREQS = torch.randn(2, 5, 8)


@pytest.mark.parametrize(
    "fn",
    [
        lambda f: (torch.cat((f, f), -1).cos() * 1.0).to(torch.bfloat16),  # HF's form
        lambda f: torch.cat((f, f), dim=2).sin(),
        # Inductor's rewrite of cat((f, f), -1): expand over a new pair dim, then flatten
        lambda f: f.unsqueeze(-2).expand(2, 5, 2, 8).clone().reshape(2, 5, 16).cos(),
    ],
    ids=["cat", "cat-dim2", "expand"],
)
def test_repeated_halves_are_recognised(fn):
    assert halves_repeated(output_node(fn, FREQS))


@pytest.mark.parametrize(
    "fn",
    [
        lambda f: torch.cat((f, f * 2), -1).cos(),  # two different halves
        lambda f: torch.cat((f, f), 1).cos(),  # repeated along the sequence, not the features
        lambda f: torch.cat((f, f), -1).cos() + torch.arange(16.0),  # a second tensor operand
        lambda f: f.unsqueeze(-1).expand(2, 5, 8, 2).clone().reshape(2, 5, 16),  # interleaved
        lambda f: torch.cat((f, f), -1).flip(-1),  # not pointwise
    ],
    ids=["different", "other-dim", "binary", "interleaved", "flip"],
)
def test_anything_else_is_not(fn):
    assert not halves_repeated(output_node(fn, FREQS))


def test_a_graph_input_is_not_proven():
    gm = make_fx(lambda c: c * 1.0, tracing_mode="fake")(torch.randn(2, 5, 16))
    (placeholder,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert not halves_repeated(placeholder)
