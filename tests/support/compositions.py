"""Compositions over generalised splits, with fresh inputs and their float64 expectations.

Each builder returns a :class:`Case`: the traced program, its arguments (random activations,
weights around their model values, positions anywhere in a real RoPE table), the float64
expected outputs computed independently (index arithmetic on the packed row, then
``fqr.reference``), the head_dim of each output and which outputs are plain copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import fqr
from fqr import ops, reference
from fqr.core import Program, Section, spec
from fqr.rope_cache import rope_cos_sin_cache

MAX_POS = 4099
POS = spec("T", dtype=torch.int64)


@dataclass
class Case:
    program: Program
    args: tuple
    expected: list
    head_dims: list
    copies: tuple = ()


def randn(gen, *shape, scale=1.0, centre=0.0, dtype=torch.bfloat16):
    x = torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float64) * scale + centre
    return x.to(dtype)


def positions(gen, tokens):
    return torch.randint(0, MAX_POS, (tokens,), generator=gen, device=gen.device)


def table(gen, rotary_dim, theta=1e6):
    """The real table, built where ``gen`` draws (the inputs' device)."""
    return rope_cos_sin_cache(
        rotary_dim, MAX_POS, theta, rows=torch.arange(MAX_POS, device=gen.device)
    )


def table_spec(rotary_dim):
    return spec("P", rotary_dim, dtype=torch.float32)


def norm64(x, w, d, offset=0.0):
    return reference.rms_norm(x, w, eps=1e-6, group_size=d, weight_offset=offset)


def gated_case(gen, tokens, hq=3, hkv=1, d=64, r=16, dtype=torch.bfloat16) -> Case:
    """Qwen3.5's gated attention row ``[q0 g0 q1 g1 ... | k | v]``: q and the gate are views of
    head stride 2*D; q and k get (1 + w) norms and partial NeoX RoPE; gate and v are copied."""

    def gated(row, pos, cache, qw, kw):
        q, gate, k, v = ops.split_heads(
            row,
            [
                Section(hq, d, 0, 2 * d),
                Section(hq, d, d, 2 * d),
                Section(hkv, d, 2 * hq * d),
                Section(hkv, d, (2 * hq + hkv) * d),
            ],
        )
        q = ops.rms_norm(q, qw, eps=1e-6, group_size=d, weight_offset=1.0)
        k = ops.rms_norm(k, kw, eps=1e-6, group_size=d, weight_offset=1.0)
        return ops.rope(q, pos, cache, head_dim=d), gate, ops.rope(k, pos, cache, head_dim=d), v

    width = (2 * hq + 2 * hkv) * d
    program = fqr.trace(
        gated,
        spec("T", width, dtype=dtype),
        POS,
        table_spec(r),
        spec(d, dtype=dtype),
        spec(d, dtype=dtype),
    )
    row, pos, cache = (
        randn(gen, tokens, width, scale=2.0, dtype=dtype),
        positions(gen, tokens),
        table(gen, r),
    )
    qw, kw = randn(gen, d, scale=0.2, dtype=dtype), randn(gen, d, scale=0.2, dtype=dtype)
    pairs = row[:, : 2 * hq * d].reshape(tokens, hq, 2, d)
    q_in, gate = pairs[:, :, 0].reshape(tokens, -1), pairs[:, :, 1].reshape(tokens, -1)
    k_in, v = row[:, 2 * hq * d : (2 * hq + hkv) * d], row[:, (2 * hq + hkv) * d :]
    expected = [
        reference.rope(norm64(q_in, qw, d, 1.0), pos, cache, head_dim=d),
        gate,
        reference.rope(norm64(k_in, kw, d, 1.0), pos, cache, head_dim=d),
        v,
    ]
    return Case(program, (row, pos, cache, qw, kw), expected, [d] * 4, (1, 3))


def indexer_case(gen, tokens, hq=3, hkv=1, d=64, hi=2, di=32, r=64, ri=16) -> Case:
    """MiniMax-M3-like row ``[q | k | v | index_q | index_k]``: the indexer heads have their own
    head_dim, their own (1 + w) norms and their own GPT-J table."""
    widths = [hq * d, hkv * d, hkv * d, hi * di, di]
    offsets = [sum(widths[:i]) for i in range(5)]

    def indexed(row, pos, cache, icache, qw, kw, iqw, ikw):
        q, k, v, iq, ik = ops.split_heads(
            row,
            [
                Section(hq, d, offsets[0]),
                Section(hkv, d, offsets[1]),
                Section(hkv, d, offsets[2]),
                Section(hi, di, offsets[3]),
                Section(1, di, offsets[4]),
            ],
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        iq = ops.rms_norm(iq, iqw, eps=1e-6, group_size=di, weight_offset=1.0)
        ik = ops.rms_norm(ik, ikw, eps=1e-6, group_size=di, weight_offset=1.0)
        iq = ops.rope(iq, pos, icache, head_dim=di, is_neox=False)
        ik = ops.rope(ik, pos, icache, head_dim=di, is_neox=False)
        return q, k, v, iq, ik

    program = fqr.trace(
        indexed,
        spec("T", sum(widths)),
        POS,
        table_spec(r),
        table_spec(ri),
        spec(d),
        spec(d),
        spec(di),
        spec(di),
    )
    row, pos = randn(gen, tokens, sum(widths), scale=2.0), positions(gen, tokens)
    cache, icache = table(gen, r), table(gen, ri, 1e4)
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    iqw, ikw = randn(gen, di, scale=0.2), randn(gen, di, scale=0.2)
    part = [row[:, a : a + w] for a, w in zip(offsets, widths)]
    expected = [
        reference.rope(norm64(part[0], qw, d), pos, cache, head_dim=d),
        reference.rope(norm64(part[1], kw, d), pos, cache, head_dim=d),
        part[2],
        reference.rope(norm64(part[3], iqw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
        reference.rope(norm64(part[4], ikw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
    ]
    args = (row, pos, cache, icache, qw, kw, iqw, ikw)
    return Case(program, args, expected, [d, d, d, di, di], (2,))


def padded_case(gen, tokens, heads=(4, 2, 3), d=48, stride=64, r=32, dtype=torch.bfloat16) -> Case:
    """q, k and v with their own head counts, each head padded to ``stride`` columns
    (``[T, H, D + pad]``); the padding holds NaN, so a kernel that read it would fail."""
    offsets = [0, heads[0] * stride, (heads[0] + heads[1]) * stride]

    def padded(row, pos, cache, qw, kw):
        q, k, v = ops.split_heads(
            row, [Section(h, d, off, stride) for h, off in zip(heads, offsets)]
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        return q, k, v

    width = sum(heads) * stride
    program = fqr.trace(
        padded,
        spec("T", width, dtype=dtype),
        POS,
        table_spec(r),
        spec(d, dtype=dtype),
        spec(d, dtype=dtype),
    )
    full = randn(gen, tokens, sum(heads), stride, scale=2.0, dtype=dtype)
    full[..., d:] = float("nan")
    pos, cache = positions(gen, tokens), table(gen, r)
    qw, kw = (randn(gen, d, scale=0.2, centre=1.0, dtype=dtype) for _ in range(2))
    q_in, k_in, v = (
        full[:, a : a + h, :d].reshape(tokens, -1)
        for a, h in zip((0, heads[0], heads[0] + heads[1]), heads)
    )
    expected = [
        reference.rope(norm64(q_in, qw, d), pos, cache, head_dim=d),
        reference.rope(norm64(k_in, kw, d), pos, cache, head_dim=d),
        v,
    ]
    return Case(program, (full.reshape(tokens, width), pos, cache, qw, kw), expected, [d] * 3, (2,))


def narrow_case(gen, tokens, head_dim=512, rotary_dim=2, is_neox=True) -> Case:
    """A QK-norm + RoPE prologue (2 q heads, 1 kv head) whose table may be far narrower than
    the head (rotary_dim 2 on 512 features)."""
    d = head_dim
    program = narrow_program(d, rotary_dim, is_neox)
    row, pos, cache = (
        randn(gen, tokens, 4 * d, scale=2.0),
        positions(gen, tokens),
        table(gen, rotary_dim),
    )
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    expected = [
        reference.rope(norm64(row[:, : 2 * d], qw, d), pos, cache, head_dim=d, is_neox=is_neox),
        reference.rope(
            norm64(row[:, 2 * d : 3 * d], kw, d), pos, cache, head_dim=d, is_neox=is_neox
        ),
        row[:, 3 * d :],
    ]
    return Case(program, (row, pos, cache, qw, kw), expected, [d] * 3, (2,))


def narrow_program(head_dim, rotary_dim, is_neox=True, dtype=torch.bfloat16) -> Program:
    def prologue(row, pos, cache, qw, kw):
        q, k, v = ops.split_qkv(row, 2, 1, head_dim)
        q = ops.rms_norm(q, qw, eps=1e-6, group_size=head_dim)
        k = ops.rms_norm(k, kw, eps=1e-6, group_size=head_dim)
        q = ops.rope(q, pos, cache, head_dim=head_dim, is_neox=is_neox)
        return q, ops.rope(k, pos, cache, head_dim=head_dim, is_neox=is_neox), v

    return fqr.trace(
        prologue,
        spec("T", 4 * head_dim, dtype=dtype),
        POS,
        table_spec(rotary_dim),
        spec(head_dim, dtype=dtype),
        spec(head_dim, dtype=dtype),
    )
