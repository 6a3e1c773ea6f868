"""vLLM ``tests/kernels/core/test_fused_qk_norm_rope.py`` ported onto
:func:`fqr.split_qkv_rmsnorm_rope` in its in-place form (vLLM's ``torch.ops._C.fused_qk_norm_rope``
writes q and k back into qkv).

The peer's ``test_fused_qk_norm_rope_matches_reference`` runs dtype [bf16, fp16] x is_neox
[True, False] x eps [1e-5, 1e-6] x seed [13] x rotary_ratio [1.0, 0.5, 0.25] with 16 q heads, 4
kv heads, head_dim 128, 4 tokens at positions 0..3, weights ``normal(1, 0.1)`` in the dtype and
vLLM's ``RotaryEmbedding`` table (max_position 4096, base 10000) in the dtype: 24 cases. Its
reference is vLLM's own modules (``RMSNorm.forward_native``, ``RotaryEmbedding.forward_native``),
here :func:`fqr.unfused.vllm_qk_norm_rope`, fqr's op-for-op copy of that code; its tolerances
(bf16 atol = rtol = 1e-2, fp16 2e-3) are kept, on the whole qkv buffer. That reference rounds
to the dtype between its steps; where the fused result falls outside the tolerance, the test
shows it nearer the float64 value than the peer's reference and checks ``numerics="unfused"``
bit for bit against it (:func:`support.peer_ports.assert_peer_or_nearer`). Every case is also
checked against fqr's float64 reference (:func:`fqr.reference.prologue`), v bit for bit.

CPU: all 24 cases on the reference backend, 3 on the interpreter; all 24 on the GPU
(``tests/gpu/test_gpu_peers_base.py``).
"""

from __future__ import annotations

import torch
from support.peer_ports import (
    assert_exact,
    assert_peer_or_nearer,
    cpu_backend_tests,
    grid,
    spread,
)

import fqr
from fqr import reference
from fqr.rope_cache import rope_cos_sin_cache
from fqr.unfused import vllm_qk_norm_rope

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_TOKENS = 16, 4, 128, 4
MAX_POSITION, BASE = 4096, 10000.0
TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}  # (atol, rtol)

PEER_GRID = grid(
    dtype=[torch.bfloat16, torch.float16],
    is_neox=[True, False],
    eps=[1e-5, 1e-6],
    rotary_ratio=[1.0, 0.5, 0.25],
)
CPU_GRID = PEER_GRID
# A kernel sums x^2 in its own fp32 order, torch (vLLM's native ops) in another, so a head's
# rstd may differ in its last bit and a normalised element one ULP (of the head's scale: RoPE's
# sum may cancel it down to smaller values) apart: on the GPU README's numerics
# section measured at least 0.99995 of the elements bit for bit (docs/results/
# unfused-cuda-bits-h200.log; seen at seed 1170899066, rotary 0.25, bf16), and the interpreter
# too (seed 1828606412, bf16, NeoX, eps 1e-5: three elements of one head). Only the reference
# backend reduces as torch does.
UNFUSED_ULPS_OF_A_KERNEL = 1
INTERPRET_GRID = spread(PEER_GRID, 3)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> bool:
    """One case of the peer's grid; True when the peer's tolerance holds as it is, False when
    the fused result is outside it but nearer the exact value (and ``unfused`` matches)."""
    dtype, is_neox, eps = case["dtype"], case["is_neox"], case["eps"]
    rotary_dim = int(HEAD_DIM * case["rotary_ratio"])
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(NUM_TOKENS, width, generator=gen, device=gen.device).to(dtype).to(device)
    positions = torch.arange(NUM_TOKENS, device=device)
    q_weight, k_weight = (
        (torch.randn(HEAD_DIM, generator=gen, device=gen.device) * 0.1 + 1.0).to(dtype).to(device)
        for _ in range(2)
    )
    table = rope_cos_sin_cache(rotary_dim, MAX_POSITION, BASE).to(dtype).to(device)
    shape = dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    statics = dict(shape, eps=eps, is_neox=is_neox, num_v_heads=NUM_KV_HEADS)

    def run(numerics: str) -> torch.Tensor:
        buffer = qkv.clone()
        fqr.split_qkv_rmsnorm_rope(
            buffer, positions, table, q_weight, k_weight, **statics, inplace=True,
            numerics=numerics, backend=backend,
        )  # fmt: skip
        return buffer

    fused = run("fused")
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    peer_ref = torch.cat(
        vllm_qk_norm_rope(
            qkv, positions, table, q_weight, k_weight, q_size=q_size, kv_size=kv_size, eps=eps,
            is_neox=is_neox,
        ),
        dim=-1,
    )  # fmt: skip
    exact = reference.prologue(qkv, positions, table, q_weight, k_weight, **statics)
    atol, rtol = TOLERANCES[dtype]
    within = assert_peer_or_nearer(
        "qkv", fused, peer_ref, torch.cat(exact, dim=-1), lambda: run("unfused"), atol=atol,
        rtol=rtol, ulps=0 if backend == "reference" else UNFUSED_ULPS_OF_A_KERNEL,
        head_dim=HEAD_DIM,
    )  # fmt: skip
    for name, out, ex in zip("qkv", fused.split([q_size, kv_size, kv_size], dim=-1), exact):
        assert_exact(name, out, ex, head_dim=HEAD_DIM, bitwise=name == "v")
    return within


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)
