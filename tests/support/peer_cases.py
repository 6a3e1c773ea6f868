"""The peer features of :func:`fqr.split_qkv_rmsnorm_rope` (issue 18, item 5), one small case
each, checked on any backend against the independent float64 formulation
(:func:`fqr.reference.prologue`) under the numerics contract: no RoPE, v with its own head count
and head_dim, padded heads (``head_stride``), and the in-place form.

Inputs are fresh random values and a real RoPE table; every column of ``qkv`` that no section
reads (head padding, row padding past the width) holds NaN, so a kernel that reads it fails; the
in-place form is checked to write q and k and not one other byte of the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache
from support.devices import has_values

HQ, HKV, D, MAX_POS = 4, 2, 32, 512


@dataclass(frozen=True)
class PeerCase:
    name: str
    kwargs: dict = field(default_factory=dict)  # the feature's arguments
    rope: bool = True
    row_pad: int = 0  # NaN columns past the row's width (row stride > width)
    tokens: int = 5
    dtype: torch.dtype = torch.bfloat16
    numerics: str = "fused"


PEER_CASES = [
    PeerCase("no-rope", rope=False),
    PeerCase("no-rope-unfused-fp16", rope=False, dtype=torch.float16, numerics="unfused"),
    PeerCase("v-heads-and-dim", dict(num_v_heads=1, v_head_dim=48)),
    PeerCase("padded-heads", dict(head_stride=40), row_pad=8),
    PeerCase("padded-heads-own-v", dict(head_stride=48, num_v_heads=3, v_head_dim=48)),
    PeerCase("inplace", dict(inplace=True), row_pad=16),
    PeerCase("inplace-no-rope-gptj", dict(inplace=True, is_neox=False), rope=False, tokens=3),
    PeerCase("inplace-gptj-unfused", dict(inplace=True, is_neox=False), numerics="unfused"),
]


def peer_inputs(case: PeerCase, gen: torch.Generator):
    """(qkv buffer with NaN in every unread column, the qkv view, positions, table, weights)."""
    kw = case.kwargs
    hv, dv = kw.get("num_v_heads", HKV), kw.get("v_head_dim", D)
    stride = kw.get("head_stride")
    sections = reference.qkv_sections(
        HQ,
        HKV,
        D,
        num_v_heads=kw.get("num_v_heads"),
        v_head_dim=kw.get("v_head_dim"),
        head_stride=stride,
    )
    width = (HQ + HKV) * D + hv * dv if stride is None else (HQ + HKV + hv) * stride
    t = case.tokens
    buffer = torch.full(
        (t, width + case.row_pad), float("nan"), dtype=case.dtype, device=gen.device
    )
    for s in sections:  # fresh values where a head is, per-head scales
        for h in range(s.heads):
            start = s.offset + h * s.head_stride
            scale = 0.5 + 3 * torch.rand((), generator=gen, device=gen.device)
            head = torch.randn(t, s.head_dim, generator=gen, device=gen.device) * scale
            buffer[:, start : start + s.head_dim] = head.to(case.dtype)
    qkv = buffer[:, :width]
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, device=gen.device)
    rows = torch.arange(MAX_POS, device=gen.device)
    table = rope_cos_sin_cache(D, MAX_POS, 1e4, rows=rows) if case.rope else None
    qw = (1 + 0.2 * torch.randn(D, generator=gen, device=gen.device)).to(case.dtype)
    kw_ = (1 + 0.2 * torch.randn(D, generator=gen, device=gen.device)).to(case.dtype)
    return buffer, qkv, positions, table, qw, kw_


def check_peer_case(
    case: PeerCase, backend: str, gen: torch.Generator, device: str | torch.device = "cpu"
) -> None:
    """``case`` on ``backend`` with its tensors on ``device`` (drawn on the CPU, the float64
    expectation computed there): q and k under the contract, v bit for bit, and where the
    outputs live (new tensors; in place: views of qkv, no other byte of the buffer written).
    Nothing is checked on ``meta`` (no values, no addresses)."""
    cpu_buffer, cpu_qkv, positions, table, qw, kw_ = peer_inputs(case, gen)
    before = cpu_buffer.clone()
    buffer = cpu_buffer.to(device, copy=True)
    qkv = buffer[:, : cpu_qkv.shape[1]]
    kwargs = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, **case.kwargs)
    inplace = kwargs.get("inplace", False)
    feature = {k: v for k, v in kwargs.items() if k != "inplace"}
    exact_q, exact_k, exact_v = reference.prologue(
        cpu_qkv.clone(), positions, table, qw, kw_, **feature
    )
    # no RoPE: positions may be None
    pos_arg = None if table is None else positions.to(device)
    table_arg = None if table is None else table.to(device)
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        qkv, pos_arg, table_arg, qw.to(device), kw_.to(device), numerics=case.numerics,
        backend=backend, **kwargs,
    )  # fmt: skip
    if not has_values(q, k, v):
        return
    for name, got, exact in (("q", q, exact_q), ("k", k, exact_k)):
        c = compare(got, exact, head_dim=D, numerics=case.numerics)
        assert c.passed, f"{case.name} {name} on {backend}: {c}"
    exact_v = exact_v.to(v.device)
    assert torch.equal(v.view(torch.int16), exact_v.view(torch.int16)), f"{case.name}: v"
    bits, was = buffer.view(torch.int16), before.to(buffer.device).view(torch.int16)
    if not inplace:
        assert torch.equal(bits, was), "qkv was written"
        for o in (q, k, v):
            assert o.is_contiguous() and o.data_ptr() != qkv.data_ptr()
        return
    # in place: q and k are views of qkv holding the results; every other byte is unchanged
    q_size, kv_size = HQ * D, HKV * D
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv[:, q_size:].data_ptr()
    assert v.data_ptr() == qkv[:, q_size + kv_size :].data_ptr()
    written = torch.zeros_like(bits, dtype=torch.bool)
    written[:, : q_size + kv_size] = True
    assert torch.equal(bits[~written], was[~written]), f"{case.name}: bytes outside q/k moved"


def check_q_only(
    backend: str,
    gen: torch.Generator,
    numerics: str = "fused",
    device: str | torch.device = "cpu",
) -> None:
    """``fqr.qk_rmsnorm_rope(q, None, ...)``: q normalised and rotated alone, as vLLM's
    ``rotary_emb(positions, q, None)`` after ``q_norm`` (Gemma 4's KV-shared / MTP layers), with
    its tensors on ``device``; q is not written."""
    t = 5
    q = (torch.randn(t, HQ * D, generator=gen, device=gen.device) * 2).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, device=gen.device)
    table = rope_cos_sin_cache(D, MAX_POS, 1e4, rows=torch.arange(MAX_POS, device=gen.device))
    qw = (0.2 * torch.randn(D, generator=gen, device=gen.device)).to(
        torch.bfloat16
    )  # Gemma: (1 + w)
    on_device = q.to(device, copy=True)
    out, none = fqr.qk_rmsnorm_rope(
        on_device,
        None,
        positions.to(device),
        table.to(device),
        qw.to(device),
        None,
        head_dim=D,
        weight_offset=1.0,
        numerics=numerics,
        backend=backend,
    )
    assert none is None
    if not has_values(out):
        return
    assert torch.equal(on_device.view(torch.int16), q.to(on_device.device).view(torch.int16))
    exact, _ = reference.qk_prologue(
        q, None, positions, table, qw, None, head_dim=D, weight_offset=1.0
    )
    c = compare(out, exact, head_dim=D, numerics=numerics)
    assert c.passed, f"q alone on {backend}: {c}"
