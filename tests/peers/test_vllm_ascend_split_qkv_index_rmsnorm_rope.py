"""vllm-ascend ``tests/e2e/nightly/single_node/ops/singlecard_ops/triton/
test_split_qkv_index_rmsnorm_rope.py`` ported onto :func:`fqr.split_qkv_index_rmsnorm_rope`.

The peer's ``test_split_qkv_index_rmsnorm_rope`` runs num_tokens [1, 8, 32, 1024] x (q, kv
heads) [(12, 1), (64, 4)] x head_dim [128] x index heads [8, 16] x index head_dim [48, 64] x
rope_dim [64, 128] x bias [False, True] x FP8 outputs [(False, False), (True, True)]
(max_position_embeddings 262144, eps 1e-6, bf16 rows, float32 weights ``1 + 0.1 randn`` taken
as they are, weight_offset 0): 256 cases. Its reference (float32 per-head RMSNorm ``* w``, the
bias added to q and k after it, NeoX RoPE of each group over ``min(rope_dim, its head_dim)``
features, clamp to +-448 and a cast for FP8; :mod:`support.peer_ports`) and tolerances (atol
5e-2, rtol 5e-3; FP8 outputs atol 0.5, rtol 0.125) are kept; every case is also checked against
fqr's float64 reference (:func:`fqr.reference.index_prologue`).

Every case is ported: the 192 whose index heads rotate fewer features than the attention heads
(index head_dim 48, or rope_dim 128 with index head_dim 64) take fqr's per-head-group rotary
width (issue 26 item 2: each group over ``min(R, its head_dim)``). CPU: the 64 of one token and
the 16 of 8 tokens with (12, 1) heads and 8 index heads on the reference backend, 5 of those on
the interpreter (4 of them per-group); all 256 on the GPU (``tests/gpu/test_gpu_peers_base.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.peer_ports import (
    ASCEND_MAX_POSITION,
    assert_exact,
    assert_peer_close,
    cpu_backend_tests,
    grid,
    peer_norm_rope,
    peer_positions,
    peer_table,
    spread,
)

import fqr
from fqr import reference

ATOL, RTOL = 5e-2, 5e-3  # the peer's DEFAULT_ATOL, DEFAULT_RTOL
FP8_ATOL, FP8_RTOL = 0.5, 0.125  # the peer's FP8_ATOL, FP8_RTOL
FP8_MAX = 448.0
EPS = 1e-6
DTYPE = torch.bfloat16
E4M3 = torch.float8_e4m3fn

PEER_GRID = grid(
    num_tokens=[1, 8, 32, 1024],
    heads=[(12, 1), (64, 4)],
    head_dim=[128],
    num_idx_heads=[8, 16],
    idx_head_dim=[48, 64],
    rope_dim=[64, 128],
    bias=[False, True],
    fp8=[(False, False), (True, True)],  # (attn_out_fp8, indexer_out_fp8)
)


def per_group_rotary_width(case: dict) -> bool:
    """The index heads rotate ``min(rope_dim, idx_head_dim)`` < the attention heads' width."""
    return min(case["rope_dim"], case["idx_head_dim"]) != min(case["rope_dim"], case["head_dim"])


CPU_GRID = [
    c
    for c in PEER_GRID
    if c["num_tokens"] == 1
    or (c["num_tokens"] == 8 and c["heads"] == (12, 1) and c["num_idx_heads"] == 8)
]
PER_GROUP_48 = [c for c in CPU_GRID if per_group_rotary_width(c) and c["idx_head_dim"] == 48]
INTERPRET_GRID = spread(CPU_GRID, 3) + [
    c for c in spread(PER_GROUP_48[1:], 2) if c not in spread(CPU_GRID, 3)
]


def gpu_params() -> list:
    """The whole peer grid for the GPU file."""
    return list(PEER_GRID)


def _to_fp8(x):
    """The peer's ``_to_fp8``: clamp to +-448, cast to float8_e4m3fn."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> None:
    """One case of the peer's grid: inputs drawn as the peer draws them, fqr's op on
    ``backend``, the peer's check and fqr's float64 check."""
    t, (hq, hkv), d = case["num_tokens"], case["heads"], case["head_dim"]
    hi, di, r = case["num_idx_heads"], case["idx_head_dim"], case["rope_dim"]
    attn_fp8, index_fp8 = case["fp8"]
    widths = [hq * d, hkv * d, hkv * d, hi * di, di]
    qkv = torch.randn(t, sum(widths), generator=gen, device=gen.device).to(DTYPE)
    weights = [
        torch.randn(n, generator=gen, device=gen.device) * 0.1 + 1.0 for n in (d, d, di, di)
    ]  # float32
    biases = [None, None]
    if case["bias"]:
        biases = [torch.randn(d, generator=gen, device=gen.device) * 0.1 for _ in range(2)]
    positions = peer_positions(t, ASCEND_MAX_POSITION, gen)
    table = peer_table(r, positions, DTYPE)
    qkv, positions, table = (x.to(device) for x in (qkv, positions, table))
    weights = [w.to(device) for w in weights]
    biases = [None if b is None else b.to(device) for b in biases]
    statics = dict(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        num_index_heads=hi,
        index_head_dim=di,
        eps=EPS,
        weight_offset=0.0,  # the peer's weights are the scale itself
        attn_fp8=attn_fp8,
        index_fp8=index_fp8,
    )
    bias_kw = dict(q_bias=biases[0], k_bias=biases[1])
    outs = fqr.split_qkv_index_rmsnorm_rope(
        qkv, positions, table, *weights, **statics, **bias_kw, backend=backend
    )

    rows = table.index_select(0, positions)
    q, k, v, iq, ik = qkv.split(widths, dim=-1)
    golds = [
        peer_norm_rope(x, w, rows, head_dim=hd, rotary_dim=min(r, hd), eps=EPS, bias=b)
        for x, w, b, hd in zip((q, k, iq, ik), weights, biases + [None, None], (d, d, di, di))
    ]
    attn = [golds[0], golds[1], v.to(torch.float32)]
    index = golds[2:]
    if attn_fp8:
        attn = [_to_fp8(x) for x in attn]
    if index_fp8:
        index = [_to_fp8(x) for x in index]
    names = ("q", "k", "v", "index_q", "index_k")
    for name, out, gold in zip(names, outs, attn + index):
        fp8 = out.dtype == E4M3
        atol, rtol = (FP8_ATOL, FP8_RTOL) if fp8 else (ATOL, RTOL)
        assert_peer_close(name, out, gold, atol=atol, rtol=rtol)

    exact = reference.index_prologue(qkv, positions, table, *weights, **statics, **bias_kw)
    for name, out, ex, hd in zip(names, outs, exact, (d, d, d, di, di)):
        assert_exact(name, out, ex, head_dim=hd, bitwise=name == "v" and not attn_fp8)


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(k_bias=None), "q_bias and k_bias must be given together"),
        (dict(q_bias=torch.ones(64)), r"q_bias must be \[128\] \(head_dim\)"),
    ],
)
def test_bad_biases_are_refused_naming_them(gen, changes, message):
    qkv = torch.randn(2, (4 + 2 * 2) * 128 + (2 + 1) * 64, generator=gen, device=gen.device).to(
        DTYPE
    )
    positions = peer_positions(2, ASCEND_MAX_POSITION, gen)
    table = peer_table(64, positions, DTYPE)
    weights = [torch.randn(n, generator=gen, device=gen.device) for n in (128, 128, 64, 64)]
    kwargs = dict(q_bias=torch.ones(128), k_bias=torch.ones(128)) | changes
    with pytest.raises(ValueError, match=message):
        fqr.split_qkv_index_rmsnorm_rope(
            qkv, positions, table, *weights, num_heads=4, num_kv_heads=2, head_dim=128,
            num_index_heads=2, index_head_dim=64, **kwargs,
        )  # fmt: skip
