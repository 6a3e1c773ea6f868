"""vllm-ascend ``tests/e2e/nightly/single_node/ops/singlecard_ops/triton/
test_split_qkv_rmsnorm_rope.py`` ported onto :func:`fqr.split_qkv_rmsnorm_rope`.

The peer's two tests, ``test_split_qkv_rmsnorm_rope`` and ``..._with_bias``, each over
num_tokens [1, 16, 1024, 10240] x (q, kv heads) [(12, 1), (64, 4)] x head_size [128] x
rope_dim [64, 128] (max_position_embeddings 262144, eps 1e-6, bf16): 32 cases. Their reference
(:func:`support.peer_ports.peer_norm_rope`: float32 per-head RMSNorm ``* w (+ b)``, then NeoX
RoPE of the first rope_dim features, unrounded) and tolerances (atol 5e-2, rtol 5e-3; v too)
are kept; every case is also checked against fqr's float64 reference
(:func:`fqr.reference.prologue`), v bit for bit. The bias is added after the norm and weight,
before RoPE, as vllm-ascend's kernel adds it.

CPU: the 8 cases of one token and the 4 of 16 tokens with (12, 1) heads on the reference
backend, 3 of those on the interpreter; the full grid (32) on the GPU
(``tests/gpu/test_gpu_peers_base.py``).
"""

from __future__ import annotations

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
EPS = 1e-6
DTYPE = torch.bfloat16

PEER_GRID = grid(
    bias=[False, True],  # test_split_qkv_rmsnorm_rope, test_split_qkv_rmsnorm_rope_with_bias
    num_tokens=[1, 16, 1024, 10240],
    heads=[(12, 1), (64, 4)],
    head_size=[128],
    rope_dim=[64, 128],
)
# CPU: every case of one token, and 16 tokens of the (12, 1) heads; 3 of them interpreted.
CPU_GRID = [
    c for c in PEER_GRID if c["num_tokens"] == 1 or (c["num_tokens"] == 16 and c["heads"][0] == 12)
]
INTERPRET_GRID = spread(CPU_GRID, 3)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> None:
    """One case of the peer's grid: inputs drawn as the peer draws them, fqr's op on
    ``backend``, the peer's check and fqr's float64 check."""
    t, (hq, hkv), d, r = case["num_tokens"], case["heads"], case["head_size"], case["rope_dim"]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=gen.device).to(DTYPE)
    q_weight, k_weight = (
        torch.randn(d, generator=gen, device=gen.device).to(DTYPE) for _ in range(2)
    )
    q_bias = k_bias = None
    if case["bias"]:
        q_bias, k_bias = (
            torch.randn(d, generator=gen, device=gen.device).to(DTYPE) for _ in range(2)
        )
    positions = peer_positions(t, ASCEND_MAX_POSITION, gen)
    table = peer_table(r, positions, DTYPE)
    tensors = [qkv, positions, table, q_weight, k_weight, q_bias, k_bias]
    qkv, positions, table, q_weight, k_weight, q_bias, k_bias = (
        None if x is None else x.to(device) for x in tensors
    )
    shape = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=EPS)
    biases = dict(q_bias=q_bias, k_bias=k_bias)
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        qkv, positions, table, q_weight, k_weight, **shape, **biases, backend=backend
    )

    rows = table.index_select(0, positions)
    q_in, k_in, v_gold = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    per_head = dict(head_dim=d, rotary_dim=r, eps=EPS)
    q_gold = peer_norm_rope(q_in, q_weight, rows, bias=q_bias, **per_head)
    k_gold = peer_norm_rope(k_in, k_weight, rows, bias=k_bias, **per_head)
    for name, out, gold in (("q", q, q_gold), ("k", k, k_gold), ("v", v, v_gold)):
        assert_peer_close(name, out, gold, atol=ATOL, rtol=RTOL)

    exact = reference.prologue(qkv, positions, table, q_weight, k_weight, **shape, **biases)
    for name, out, ex in zip("qkv", (q, k, v), exact):
        assert_exact(name, out, ex, head_dim=d, bitwise=name == "v")


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)
