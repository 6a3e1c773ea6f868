"""vllm-ascend ``tests/e2e/nightly/single_node/ops/singlecard_ops/triton/
test_split_qkv_rmsnorm_rope_vnorm.py`` ported onto :func:`fqr.split_qkv_rmsnorm_rope_vnorm`.

The peer's two tests, ``test_split_qkv_rmsnorm_rope_vnorm`` and ``..._with_bias``, each over
num_tokens [1, 16, 1024, 10240] x (q heads, kv heads, head_size, rope_dim) [(16, 8, 256, 256),
(8, 4, 256, 256), (4, 2, 256, 256), (8, 1, 512, 512), (4, 1, 512, 512)] (Gemma 4 31B's sliding
and full layers per TP rank; max_position_embeddings 262144, eps 1e-6, bf16): 40 cases. Their
reference (float32 per-head RMSNorm ``* w (+ b)`` then NeoX RoPE of q and k, v RMS-normalised
with a unit weight; :mod:`support.peer_ports`) and tolerances (atol 5e-2, rtol 5e-3, v too)
are kept; every case is also checked against fqr's float64 reference
(:func:`fqr.reference.vnorm_prologue`).

CPU: the 10 cases of one token and the 2 of 16 tokens with (4, 2, 256) on the reference
backend, 3 of those on the interpreter; the full grid (40) on the GPU
(``tests/gpu/test_gpu_peers_base.py``).
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
    peer_rms_norm,
    peer_table,
    spread,
)

import fqr
from fqr import reference

ATOL, RTOL = 5e-2, 5e-3  # the peer's DEFAULT_ATOL, DEFAULT_RTOL
EPS = 1e-6
DTYPE = torch.bfloat16

PEER_GRID = grid(
    bias=[False, True],  # test_split_qkv_rmsnorm_rope_vnorm, ..._with_bias
    num_tokens=[1, 16, 1024, 10240],
    shape=[
        (16, 8, 256, 256),
        (8, 4, 256, 256),
        (4, 2, 256, 256),
        (8, 1, 512, 512),
        (4, 1, 512, 512),
    ],  # (num_q_heads, num_kv_heads, head_size, rope_dim)
)
# CPU: every case of one token, and 16 tokens of the smallest shape; 3 of them interpreted.
CPU_GRID = [
    c
    for c in PEER_GRID
    if c["num_tokens"] == 1 or (c["num_tokens"] == 16 and c["shape"] == (4, 2, 256, 256))
]
INTERPRET_GRID = spread(CPU_GRID, 3)


def _draw(case: dict, gen: torch.Generator, device: str):
    t, (hq, hkv, d, r) = case["num_tokens"], case["shape"]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=gen.device).to(DTYPE)
    q_weight, k_weight = (
        torch.randn(d, generator=gen, device=gen.device).to(DTYPE) for _ in range(2)
    )
    biases = [None, None]
    if case["bias"]:
        biases = [torch.randn(d, generator=gen, device=gen.device).to(DTYPE) for _ in range(2)]
    positions = peer_positions(t, ASCEND_MAX_POSITION, gen)
    table = peer_table(r, positions, DTYPE)
    tensors = (qkv, positions, table, q_weight, k_weight, *biases)
    return tuple(None if x is None else x.to(device) for x in tensors)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> None:
    """One case of the peer's grid: inputs drawn as the peer draws them, fqr's op on
    ``backend``, the peer's check and fqr's float64 check."""
    t, (hq, hkv, d, r) = case["num_tokens"], case["shape"]
    qkv, positions, table, q_weight, k_weight, q_bias, k_bias = _draw(case, gen, device)
    shape = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=EPS)
    biases = dict(q_bias=q_bias, k_bias=k_bias)
    q, k, v = fqr.split_qkv_rmsnorm_rope_vnorm(
        qkv, positions, table, q_weight, k_weight, **shape, **biases, backend=backend
    )

    rows = table.index_select(0, positions)
    q_in, k_in, v_in = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    per_head = dict(head_dim=d, rotary_dim=r, eps=EPS)
    q_gold = peer_norm_rope(q_in, q_weight, rows, bias=q_bias, **per_head)
    k_gold = peer_norm_rope(k_in, k_weight, rows, bias=k_bias, **per_head)
    ones = torch.ones(d, dtype=torch.float32, device=qkv.device)  # the peer's v_rms_norm
    v_gold = peer_rms_norm(v_in.reshape(t, hkv, d), ones, EPS).reshape(t, -1)
    for name, out, gold in (("q", q, q_gold), ("k", k, k_gold), ("v", v, v_gold)):
        assert_peer_close(name, out, gold, atol=ATOL, rtol=RTOL)

    exact = reference.vnorm_prologue(qkv, positions, table, q_weight, k_weight, **shape, **biases)
    for name, out, ex in zip("qkv", (q, k, v), exact):
        assert_exact(name, out, ex, head_dim=d)


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(k_bias=None), ValueError, "q_bias and k_bias must be given together"),
        (dict(q_bias=None), ValueError, "q_bias and k_bias must be given together"),
        (dict(q_bias=torch.ones(128)), ValueError, r"q_bias must be \[256\] \(head_dim\)"),
        (dict(k_bias=torch.ones(2, 256)), ValueError, "k_bias must be"),
        (dict(k_bias=torch.ones(256, dtype=torch.int32)), TypeError, "k_bias"),
    ],
)
def test_bad_biases_are_refused_naming_them(gen, changes, error, message):
    case = dict(bias=True, num_tokens=1, shape=(4, 2, 256, 256))
    qkv, positions, table, q_weight, k_weight, q_bias, k_bias = _draw(case, gen, "cpu")
    kwargs = dict(q_bias=q_bias, k_bias=k_bias) | changes
    with pytest.raises(error, match=message):
        fqr.split_qkv_rmsnorm_rope_vnorm(
            qkv, positions, table, q_weight, k_weight, num_heads=4, num_kv_heads=2, head_dim=256,
            **kwargs,
        )  # fmt: skip
