"""SGLang ``sgl-kernel/tests/test_fused_qk_norm_rope.py`` ported onto
:func:`fqr.split_qkv_rmsnorm_rope` in its in-place form (``sgl_kernel.fused_qk_norm_rope``
writes q and k back into qkv and leaves v; v's head count is its own argument).

The peer's ``test_fused_qk_norm_rope`` runs head_dim [64, 128] x (q, k, v heads) [(16, 8, 8),
(32, 8, 8), (40, 8, 8), (64, 8, 8), (12, 1, 1)] x num_tokens [1, 3, 8, 32, 256] x is_neox [False,
True] x dtype [bf16] x partial_rotary_factor [1.0, 0.5] (positions ``arange(T) + 100`` int32,
weights ``5 * randn`` bf16, eps 1e-5, base 10000): 200 cases. Its reference is SGLang's own
modules on CUDA: ``RMSNorm`` (sgl_kernel/flashinfer ``rmsnorm``: float32 ``x * rsqrt(mean(x^2) +
eps) * w``, rounded once to bf16) then ``get_rope(...)``'s ``RotaryEmbedding`` (flashinfer
``apply_rope_with_cos_sin_cache_inplace``: the float32 table of 8192 rows, the rotation in
float32 of the rounded norm, rounded once), re-written in :func:`sglang_reference`; its
tolerances (rtol 5e-2, atol 1e-1, over the whole buffer) are kept. The fused kernel computes
its angles from ``base``; fqr takes the same angles as a real float32 table. Every case is also
checked against fqr's float64 reference (:func:`fqr.reference.prologue`), v bit for bit.

CPU: the 40 cases of one token and the 8 of 3 tokens with (12, 1, 1) heads on the reference
backend, 4 of those on the interpreter; all 200 on the GPU (``tests/gpu/test_gpu_peers_base.py``).
"""

from __future__ import annotations

import torch
from support.peer_ports import (
    assert_exact,
    assert_peer_close,
    cpu_backend_tests,
    grid,
    spread,
)

import fqr
from fqr import reference
from fqr.rope_cache import rope_cos_sin_cache

RTOL, ATOL = 5e-2, 1e-1  # the peer's assert_close(rtol=5e-2, atol=1e-1)
EPS, BASE, MAX_POSITION, POSITION_OFFSET = 1e-5, 10000.0, 8192, 100

PEER_GRID = grid(
    head_dim=[64, 128],
    heads=[(16, 8, 8), (32, 8, 8), (40, 8, 8), (64, 8, 8), (12, 1, 1)],
    num_tokens=[1, 3, 8, 32, 256],
    is_neox=[False, True],
    dtype=[torch.bfloat16],
    partial_rotary_factor=[1.0, 0.5],
)
CPU_GRID = [
    c
    for c in PEER_GRID
    if c["num_tokens"] == 1 or (c["num_tokens"] == 3 and c["heads"] == (12, 1, 1))
]
INTERPRET_GRID = spread(CPU_GRID, 4)


def sglang_reference(x, weight, rows, *, head_dim: int, rotary_dim: int, is_neox: bool):
    """SGLang's reference of q or k ``[T, H*D]`` on CUDA: the float32 RMSNorm rounded once to
    x's dtype, then RoPE of the first ``rotary_dim`` features with the float32 table rows
    ``[T, R]`` (cos | sin), computed in float32 and rounded once (NeoX halves or GPT-J pairs)."""
    t, dtype = x.shape[0], x.dtype
    heads = x.reshape(t, -1, head_dim).to(torch.float32)
    normed = heads * torch.rsqrt(heads.pow(2).mean(dim=-1, keepdim=True) + EPS)
    normed = (normed * weight.to(torch.float32)).to(dtype).to(torch.float32)
    half = rotary_dim // 2
    cos, sin = rows[:, None, :half].float(), rows[:, None, half:rotary_dim].float()
    part = normed[..., :rotary_dim]
    if is_neox:
        x1, x2 = part[..., :half], part[..., half:]
    else:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.cat([o1, o2], -1) if is_neox else torch.stack([o1, o2], -1).flatten(-2)
    return torch.cat([rotated, normed[..., rotary_dim:]], dim=-1).to(dtype).reshape(t, -1)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> None:
    """One case of the peer's grid: inputs drawn as the peer draws them, fqr's in-place op on
    ``backend``, the peer's check of the whole buffer and fqr's float64 check."""
    d, (hq, hk, hv), t = case["head_dim"], case["heads"], case["num_tokens"]
    dtype, is_neox = case["dtype"], case["is_neox"]
    rotary_dim = int(d * case["partial_rotary_factor"])
    qkv = torch.randn(t, (hq + hk + hv) * d, generator=gen, device=gen.device).to(dtype).to(device)
    positions = (torch.arange(t, dtype=torch.int32) + POSITION_OFFSET).to(device)
    q_weight, k_weight = (
        (torch.randn(d, generator=gen, device=gen.device) * 5.0).to(dtype).to(device) for _ in "qk"
    )
    table = rope_cos_sin_cache(rotary_dim, MAX_POSITION, BASE).to(device)  # float32, as SGLang's
    statics = dict(num_heads=hq, num_kv_heads=hk, head_dim=d, eps=EPS, is_neox=is_neox)
    out = qkv.clone()
    fqr.split_qkv_rmsnorm_rope(
        out, positions, table, q_weight, k_weight, **statics, num_v_heads=hv, inplace=True,
        backend=backend,
    )  # fmt: skip

    rows = table.index_select(0, positions.long())
    q, k, v = qkv.split([hq * d, hk * d, hv * d], dim=-1)
    rope = dict(head_dim=d, rotary_dim=rotary_dim, is_neox=is_neox)
    peer_ref = torch.cat(
        [
            sglang_reference(q, q_weight, rows, **rope),
            sglang_reference(k, k_weight, rows, **rope),
            v,
        ],
        dim=-1,
    )
    assert_peer_close("qkv", out, peer_ref, atol=ATOL, rtol=RTOL)

    exact = reference.prologue(qkv, positions, table, q_weight, k_weight, **statics, num_v_heads=hv)
    for name, o, ex in zip("qkv", out.split([hq * d, hk * d, hv * d], dim=-1), exact):
        assert_exact(name, o, ex, head_dim=d, bitwise=name == "v")


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)
