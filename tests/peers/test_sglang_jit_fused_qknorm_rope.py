"""SGLang ``python/sglang/jit_kernel/tests/test_fused_qknorm_rope.py`` (the JIT build of
``fused_qk_norm_rope``) ported onto :func:`fqr.split_qkv_rmsnorm_rope` in its in-place form.

The peer's tests against its pure-PyTorch reference, all bf16 with weights of ones and
positions ``arange(T)`` int32, eps 1e-5:

- ``test_fused_qknorm_rope_vs_ref``: head_dim [64, 128, 256] x num_tokens [1, 16, 128] x is_neox
  [False, True], (4, 2, 2) heads, full rotary, base 10000: 18 cases;
- ``test_fused_qknorm_rope_partial_rotary``: head_dim [64, 128, 256] x is_neox, 16 tokens, (2, 2,
  2) heads, rotary_dim = head_dim / 2: 6 cases;
- ``test_fused_qknorm_rope_yarn_scaling``: head_dim [64, 128, 256], 32 tokens, GPT-J, base
  500000, YaRN factor 2.5 over the correction range [4, 32] with attention_factor 0.9: 3 cases.

Its reference (float32 per-head RMSNorm ``* w``; the angles ``position * inv_freq`` in float32
with YaRN's blend of interpolated and extrapolated frequencies; the rotated part times
attention_factor; rounded once to bf16: :func:`sglang_jit_reference`) and its tolerance
(``allclose(atol=5e-3, rtol=1e-2)`` over the whole buffer) are kept; fqr takes the same
angles as a real table (:func:`fqr.rope_cache.rope_cos_sin_cache`, YaRN as DeepSeek's with the
betas that give the range [4, 32] and ``attn_factor`` 0.9). Every case is also checked
against fqr's float64 reference (:func:`fqr.reference.prologue`), v bit for bit.

Not ported: ``test_fused_qknorm_rope_default_rotary_dim`` (1 case: that the kernel's
``rotary_dim=None`` means head_dim; fqr's rotary width is the table's) and
``test_fused_qknorm_rope_vs_aot`` (6 cases: SGLang's JIT kernel against its AOT one, no
reference). CPU: the 21 of up to 32 tokens on the reference backend, 3 on the interpreter;
all 27 on the GPU (``tests/gpu/test_gpu_peers_base.py``).
"""

from __future__ import annotations

import math

import torch
from support.peer_ports import (
    assert_exact,
    assert_peer_close,
    cpu_backend_tests,
    grid,
)

import fqr
from fqr import reference
from fqr.rope_cache import rope_cos_sin_cache

ATOL, RTOL = 5e-3, 1e-2  # the peer's torch.allclose(atol=5e-3, rtol=1e-2)
EPS, DTYPE = 1e-5, torch.bfloat16
MAX_POSITION = 4096  # rows of fqr's table (the kernel computes its angles; positions < 128)
YARN_ORIGINAL_MAX_POSITION = 4096

PLAIN = dict(base=10000.0, factor=1.0, low=1.0, high=32.0, attention_factor=1.0)
PEER_GRID = (
    [
        dict(test="vs_ref", heads=(4, 2, 2), rotary="full", **c, **PLAIN)
        for c in grid(head_dim=[64, 128, 256], num_tokens=[1, 16, 128], is_neox=[False, True])
    ]
    + [
        dict(test="partial_rotary", heads=(2, 2, 2), rotary="half", num_tokens=16, **c, **PLAIN)
        for c in grid(head_dim=[64, 128, 256], is_neox=[False, True])
    ]
    + [
        dict(
            test="yarn_scaling",
            heads=(2, 2, 2),
            rotary="full",
            num_tokens=32,
            head_dim=d,
            is_neox=False,
            base=500000.0,
            factor=2.5,
            low=4.0,
            high=32.0,
            attention_factor=0.9,
        )
        for d in (64, 128, 256)
    ]
)
CPU_GRID = [c for c in PEER_GRID if c["num_tokens"] <= 32]  # the 128-token cases: the GPU's
INTERPRET_GRID = [
    c for c in PEER_GRID if c["num_tokens"] <= 16 and c["head_dim"] == 64 and c["is_neox"]
][:2] + [c for c in PEER_GRID if c["test"] == "yarn_scaling"][:1]


def _rotary_dim(case: dict) -> int:
    return case["head_dim"] if case["rotary"] == "full" else case["head_dim"] // 2


def sglang_jit_reference(qkv, q_weight, k_weight, positions, case: dict):
    """The peer's ``fused_qk_norm_rope_ref``, re-written: float32 RMSNorm per head of q and k
    times the weight; inverse frequencies ``base^(-2i/R)`` blended with YaRN's ``(f / factor) *
    ramp + f * (1 - ramp)``, ``ramp = clamp((i - low) / (high - low), 0, 1)``; angles ``position
    * f`` in float32; NeoX halves or GPT-J pairs rotated and times attention_factor; the whole
    buffer rounded once to bf16."""
    hq, hk, hv = case["heads"]
    d, r, t = case["head_dim"], _rotary_dim(case), qkv.shape[0]
    heads = qkv.float().view(t, hq + hk + hv, d).clone()
    for lo, hi, w in ((0, hq, q_weight), (hq, hq + hk, k_weight)):
        x = heads[:, lo:hi]
        heads[:, lo:hi] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
    i = torch.arange(r // 2, dtype=torch.float32, device=qkv.device)
    inv_freq = case["base"] ** (-2.0 * i / r)
    if case["factor"] != 1.0:
        low, high = case["low"], case["high"]
        high = high if abs(high - low) > 1e-6 else high + 0.001
        ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (inv_freq / case["factor"]) * ramp + inv_freq * (1.0 - ramp)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    part = heads[:, : hq + hk, :r]
    if case["is_neox"]:
        x1, x2 = part[..., : r // 2], part[..., r // 2 :]
    else:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if case["is_neox"]:
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    heads[:, : hq + hk, :r] = rotated * case["attention_factor"]
    return heads.view(t, -1).to(DTYPE)


def fqr_table(case: dict, device: str) -> torch.Tensor:
    """The angles of the case as a real float32 table; YaRN as fqr.rope_cache's (DeepSeek's)
    with the betas whose correction range is [low, high] and ``attn_factor``."""
    r, base = _rotary_dim(case), case["base"]
    scaling = None
    if case["factor"] != 1.0:
        # d(b) = R ln(L / (2 pi b)) / (2 ln base): b for d = low + 0.5 (floor: low) and
        # d = high - 0.5 (ceil: high)
        def beta(d: float) -> float:
            return YARN_ORIGINAL_MAX_POSITION / (2 * math.pi) * base ** (-2 * d / r)

        scaling = {
            "rope_type": "yarn",
            "factor": case["factor"],
            "original_max_position_embeddings": YARN_ORIGINAL_MAX_POSITION,
            "beta_fast": beta(case["low"] + 0.5),
            "beta_slow": beta(case["high"] - 0.5),
            "mscale": 0.0,  # g(s, 0) = 1: the multiplier is attn_factor alone
            "mscale_all_dim": 0.0,
            "attn_factor": case["attention_factor"],
        }
    return rope_cos_sin_cache(r, MAX_POSITION, base, scaling=scaling).to(device)


def check_case(case: dict, backend: str, gen: torch.Generator, device: str = "cpu") -> None:
    """One case of the peer's tests: inputs drawn as the peer draws them, fqr's in-place op on
    ``backend``, the peer's check of the whole buffer and fqr's float64 check."""
    (hq, hk, hv), d, t = case["heads"], case["head_dim"], case["num_tokens"]
    qkv = torch.randn(t, (hq + hk + hv) * d, generator=gen, device=gen.device).to(DTYPE).to(device)
    q_weight = torch.ones(d, dtype=DTYPE, device=device)
    k_weight = torch.ones(d, dtype=DTYPE, device=device)
    positions = torch.arange(t, dtype=torch.int32, device=device)
    table = fqr_table(case, device)
    statics = dict(num_heads=hq, num_kv_heads=hk, head_dim=d, eps=EPS, is_neox=case["is_neox"])
    out = qkv.clone()
    fqr.split_qkv_rmsnorm_rope(
        out, positions, table, q_weight, k_weight, **statics, num_v_heads=hv, inplace=True,
        backend=backend,
    )  # fmt: skip

    peer_ref = sglang_jit_reference(qkv, q_weight, k_weight, positions, case)
    assert_peer_close("qkv", out, peer_ref, atol=ATOL, rtol=RTOL)
    exact = reference.prologue(qkv, positions, table, q_weight, k_weight, **statics, num_v_heads=hv)
    for name, o, ex in zip("qkv", out.split([hq * d, hk * d, hv * d], dim=-1), exact):
        assert_exact(name, o, ex, head_dim=d, bitwise=name == "v")


test_reference_backend, test_interpreted_kernel = cpu_backend_tests(
    check_case, CPU_GRID, INTERPRET_GRID
)
