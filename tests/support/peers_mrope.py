"""The peers' own mRoPE tests, ported onto fqr (issue 26, items 3 and 7a): each peer's grid,
its reference re-written from its formulas (vectorised over tokens where the peer loops), its
tolerance, and one runner per peer test that the CPU ports (``tests/peers``) and the GPU file
(``tests/gpu/test_gpu_peers_mrope.py``) share; the tables, the peers' float32 formulas and
the checks are :mod:`support.peer_ports`'.

Every case checks fqr's fused output against the independent float64 formulation
(:mod:`fqr.reference`) under fqr's contract and against the peer's reference with the peer's
tolerance; where the second misses, the peer's reference must be the farther from float64 and
fqr's ``numerics="unfused"`` output must equal it (:func:`check_like_peer`). Copies (v, the
gate) are bit-exact.

fqr gets the tensors the peer's op gets: the same q, k (or packed row), weights, and the
``cos_sin_cache`` in the dtype the peer's op reads it in (vLLM casts it to the query dtype;
vllm-ascend's tests pass cos/sin in the activation dtype), a real RoPE table where the
vllm-ascend tests draw random cos/sin (:func:`support.peer_ports.peer_table`: the rows no
token reads are NaN).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

import fqr
from fqr import reference
from fqr.backends import auto_backend_name
from fqr.unfused import vllm_apply_interleaved_rope, vllm_mrotary_embedding, vllm_rms_norm
from support.devices import has_values
from support.peer_ports import (
    ASCEND_MAX_POSITION,
    ASCEND_THETA,
    assert_exact,
    assert_peer_or_nearer,
    peer_neox_rope,
    peer_positions,
    peer_rms_norm,
    peer_table,
)


def planes_table(rotary_dim, positions, dtype, *, max_position, theta, device):
    """:func:`support.peer_ports.peer_table` for ``[3, T]`` positions (the rows of every
    plane real, the others NaN), built on ``device``."""
    return peer_table(
        rotary_dim, positions, dtype, max_position=max_position, theta=theta, device=device
    )


def _plane_positions(tokens, high, gen, device):
    return torch.stack([peer_positions(tokens, high, gen) for _ in range(3)]).to(device)


# ----------------------------------------------------------------------------- the check


def check_like_peer(
    name: str,
    fused: torch.Tensor,
    peer: torch.Tensor,
    exact: torch.Tensor,
    unfused: torch.Tensor | None,
    *,
    atol: float,
    rtol: float,
    head_dim: int,
    backend: str,
) -> str:
    """``fused`` meets fqr's contract against ``exact`` (float64,
    :func:`support.peer_ports.assert_exact`) and the peer's ``assert_close(atol, rtol)``
    against ``peer``, or is nearer float64 than the peer's reference with ``unfused`` equal
    to it (:func:`support.peer_ports.assert_peer_or_nearer`; one ULP of each head's largest
    element on a kernel, whose fp32 reduction order is not torch's). Returns ``"close"`` or
    ``"peer farther"``."""
    assert_exact(name, fused, exact, head_dim=head_dim)
    within = assert_peer_or_nearer(
        name,
        fused,
        peer,
        exact,
        None if unfused is None else lambda: unfused,
        atol=atol,
        rtol=rtol,
        ulps=0 if backend == "reference" else 1,
        # a kernel's rstd may differ from torch's in its last bit before RoPE's sums cancel:
        # one ULP of the head's largest element, as the qk-norm-rope port allows (on the
        # H200, seed 174566212: 2 element ULPs at a cancelled fp16 element)
        head_dim=None if backend == "reference" else head_dim,
    )
    if not within:
        print(f"{name}: the peer's {peer.dtype} reference is the farther from float64")
    return "close" if within else "peer farther"


def assert_identical(name: str, out: torch.Tensor, want: torch.Tensor) -> None:
    """``out`` equals ``want`` bit for bit (a copied v or gate, a compiled op against the op
    run eagerly; nothing to check on ``meta``)."""
    if has_values(out, want):
        assert torch.equal(out, want.to(out.device)), f"{name}: differs bit for bit"


# ------------------------------------------------- vLLM tests/kernels/core/test_mrope.py


@dataclass(frozen=True)
class VlmText:
    """The text config numbers of one model in vLLM's ``MODELS_TO_TEST`` (its config.json)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    theta: float
    max_position: int
    mrope_section: tuple[int, int, int]
    interleaved: bool


VLLM_MROPE_MODELS = (
    # zai-org/GLM-4.1V-9B-Thinking text_config: hidden 4096, 32 heads, 2 kv heads,
    # partial_rotary_factor 0.5, rope_theta 1e4, max_position_embeddings 65536, [8, 12, 12]
    VlmText("zai-org/GLM-4.1V-9B-Thinking", 32, 2, 128, 64, 1e4, 65536, (8, 12, 12), False),
    # Qwen/Qwen2-VL-7B-Instruct: hidden 3584, 28 heads, 4 kv, rope_theta 1e6, 32768, [16, 24, 24]
    VlmText("Qwen/Qwen2-VL-7B-Instruct", 28, 4, 128, 128, 1e6, 32768, (16, 24, 24), False),
    # Qwen/Qwen2-VL-72B-Instruct: hidden 8192, 64 heads, 8 kv, rope_theta 1e6, 32768
    VlmText("Qwen/Qwen2-VL-72B-Instruct", 64, 8, 128, 128, 1e6, 32768, (16, 24, 24), False),
    # Qwen/Qwen2.5-VL-72B-Instruct: 64 heads, 8 kv, rope_theta 1e6, 128000
    VlmText("Qwen/Qwen2.5-VL-72B-Instruct", 64, 8, 128, 128, 1e6, 128000, (16, 24, 24), False),
    # Qwen/Qwen3-VL-4B-Instruct text_config: 32 heads, 8 kv, head_dim 128, rope_theta 5e6,
    # 262144, mrope_section [24, 20, 20], mrope_interleaved true
    VlmText("Qwen/Qwen3-VL-4B-Instruct", 32, 8, 128, 128, 5e6, 262144, (24, 20, 20), True),
    # Qwen/Qwen3-VL-30B-A3B-Instruct text_config: 32 heads, 4 kv, head_dim 128, as Qwen3-VL-4B
    VlmText("Qwen/Qwen3-VL-30B-A3B-Instruct", 32, 4, 128, 128, 5e6, 262144, (24, 20, 20), True),
)
VLLM_MROPE_GRID = list(
    itertools.product(VLLM_MROPE_MODELS, (1, 2), (torch.bfloat16,), (11, 8192))
)  # model, tp_size, dtype, num_tokens: 24 cases (test_mrope; tracing repeats them)


def vllm_mrope_case(model: VlmText, tp: int, dtype, tokens: int, *, backend, device, gen):
    """vLLM ``test_mrope``: ``MRotaryEmbedding.forward_native`` (the peer's reference) against
    the fused op on ``[3, T]`` positions below ``max_position // 4``; atol 1e-2, rtol 1.6e-2."""
    hq, hkv = model.num_heads // tp, max(1, model.num_kv_heads // tp)
    d, rows = model.head_dim, model.max_position // 4
    positions = torch.randint(0, rows, (3, tokens), generator=gen, device=gen.device).to(device)
    q = torch.randn(tokens, hq * d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    k = torch.randn(tokens, hkv * d, generator=gen, device=gen.device).to(
        device=device, dtype=dtype
    )
    # vLLM's table has 4 * max_position rows (MRotaryEmbedding); the tokens read below rows
    cache = planes_table(
        model.rotary_dim, positions, dtype, max_position=rows, theta=model.theta, device=device
    )
    layout = dict(mrope_section=model.mrope_section, mrope_interleaved=model.interleaved)
    section, interleaved = model.mrope_section, model.interleaved
    peer = vllm_mrotary_embedding(positions, q, k, d, cache, True, section, interleaved)
    fused = fqr.qk_mrope(q, k, positions, cache, head_dim=d, backend=backend, **layout)
    unfused = fqr.qk_mrope(
        q, k, positions, cache, head_dim=d, backend=backend, numerics="unfused", **layout
    )
    exact = reference.qk_mrope(q, k, positions, cache, head_dim=d, **layout)
    return [
        check_like_peer(
            f"{model.name} tp{tp} T{tokens} {n}",
            *outs,
            atol=1e-2,
            rtol=1.6e-2,
            head_dim=d,
            backend=backend,
        )
        for n, outs in zip("qk", zip(fused, peer, exact, unfused))
    ]


def vllm_mrope_compiled_case(
    model: VlmText, tp: int, dtype, tokens: int, *, compile_backend, device, gen, mode=None
):
    """vLLM ``test_mrope_torch_compile_tracing``: ``torch.ops.fqr.qk_mrope`` under
    ``torch.compile(fullgraph=True, dynamic=False)`` (the peer: Inductor, ``reduce-overhead``)
    equals the op run eagerly, and both meet ``forward_native`` at atol 1e-2 / rtol 1.6e-2 or,
    as every port's check (:func:`check_like_peer`), are nearer float64 than ``forward_native``
    is, with the op's ``numerics="unfused"`` equal to it (at 8,192 tokens a few of the 16-67M
    elements fall outside the peer's tolerance, ``forward_native`` the farther)."""
    hq, hkv = model.num_heads // tp, max(1, model.num_kv_heads // tp)
    d, rows = model.head_dim, model.max_position // 4
    positions = torch.randint(0, rows, (3, tokens), generator=gen, device=gen.device).to(device)
    q = torch.randn(tokens, hq * d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    k = torch.randn(tokens, hkv * d, generator=gen, device=gen.device).to(
        device=device, dtype=dtype
    )
    # vLLM's table has 4 * max_position rows (MRotaryEmbedding); the tokens read below rows
    cache = planes_table(
        model.rotary_dim, positions, dtype, max_position=rows, theta=model.theta, device=device
    )
    section, interleaved = list(model.mrope_section), model.interleaved
    # every case compiles its own closure: Dynamo's recompile limit (8) counts them per code
    # object and would refuse the 9th case of a process (fullgraph=True)
    torch._dynamo.reset()

    def functional_forward(pos, q, k, numerics="fused"):
        return torch.ops.fqr.qk_mrope(q, k, pos, cache, d, section, interleaved, True, numerics)

    compiled = torch.compile(
        functional_forward, fullgraph=True, backend=compile_backend, mode=mode, dynamic=False
    )
    got = compiled(positions, q, k)
    eager = functional_forward(positions, q, k)
    unfused = functional_forward(positions, q, k, "unfused")
    native = vllm_mrotary_embedding(positions, q, k, d, cache, True, section, interleaved)
    layout = dict(mrope_section=model.mrope_section, mrope_interleaved=model.interleaved)
    exact = reference.qk_mrope(q, k, positions, cache, head_dim=d, **layout)
    backend = auto_backend_name(q.device)  # the one torch.ops.fqr runs on
    for n, out, same, want, ex, rounded in zip("qk", got, eager, native, exact, unfused):
        name = f"{model.name} tp{tp} T{tokens} compiled {n}"
        assert_identical(f"{name} (against the op run eagerly)", out, same)
        check_like_peer(
            name, out, want, ex, rounded, atol=1e-2, rtol=1.6e-2, head_dim=d, backend=backend
        )


# ------------------------------------ vLLM tests/kernels/core/test_fused_qk_norm_mrope.py

VLLM_FUSED_HEAD_CONFIGS = (
    (16, 4, 128, (16, 24, 24)),
    (16, 2, 64, (8, 12, 12)),
    (8, 8, 256, (32, 48, 48)),
)
VLLM_FUSED_GRID = list(
    itertools.product(
        (torch.bfloat16, torch.float16),  # DTYPES
        (True, False),  # IS_NEOX
        (False, True),  # MROPE_INTERLEAVED
        (1e-5, 1e-6),  # EPS_VALUES
        VLLM_FUSED_HEAD_CONFIGS,
    )
)  # 48 cases (seed 13, T = 7)


def vllm_fused_qk_norm_mrope_case(
    dtype, is_neox, interleaved, eps, config, *, backend, device, gen
):
    """vLLM ``test_fused_qk_norm_mrope_matches_reference``: per-head ``RMSNorm.forward_native``
    then ``MRotaryEmbedding.forward_native`` (rotary_dim = head_dim, base 1e4, the cache in
    the model dtype) against the fused op on 7 tokens, positions below 1000; fp16 atol/rtol
    2e-3, bf16 4e-2. The interleaved configs are read as vLLM reads them ([16, 24, 24] over 64
    frequencies: 22/21/21)."""
    hq, hkv, d, section = config
    tokens = 7
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen, device=gen.device).to(
        device=device, dtype=dtype
    )
    positions = torch.randint(0, 1000, (3, tokens), generator=gen, device=gen.device).to(device)
    q_weight = (1 + 0.1 * torch.randn(d, generator=gen, device=gen.device)).to(
        device=device, dtype=dtype
    )
    k_weight = (1 + 0.1 * torch.randn(d, generator=gen, device=gen.device)).to(
        device=device, dtype=dtype
    )
    # MRotaryEmbedding(max_position_embeddings=4096): 4 * 4096 rows, base 1e4, model dtype
    cache = planes_table(d, positions, dtype, max_position=4 * 4096, theta=1e4, device=device)
    # the peer's reference: qkv.split, q_norm / k_norm per head, rope.forward_native
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = vllm_rms_norm(q.reshape(tokens, hq, d), q_weight, eps).reshape(tokens, -1)
    k = vllm_rms_norm(k.reshape(tokens, hkv, d), k_weight, eps).reshape(tokens, -1)
    peer_q, peer_k = vllm_mrotary_embedding(
        positions, q, k, d, cache, is_neox, section, interleaved
    )
    kw = dict(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        mrope_section=section,
        mrope_interleaved=interleaved,
        eps=eps,
        is_neox=is_neox,
    )
    args = (qkv, positions, cache, q_weight, k_weight)
    fused = fqr.split_qkv_rmsnorm_mrope(*args, backend=backend, **kw)
    unfused = fqr.split_qkv_rmsnorm_mrope(*args, backend=backend, numerics="unfused", **kw)
    exact = reference.mrope_prologue(*args, **kw)
    atol = rtol = 2e-3 if dtype == torch.float16 else 4e-2
    name = f"{dtype} neox={is_neox} interleaved={interleaved} eps={eps} {config}"
    outcomes = [
        check_like_peer(f"{name} {n}", *outs, atol=atol, rtol=rtol, head_dim=d, backend=backend)
        for n, outs in zip("qk", zip(fused, (peer_q, peer_k), exact, unfused))
    ]
    assert_identical(f"{name} v", fused[2], v)
    return outcomes


# ------------------ vllm-ascend tests/e2e/nightly/.../triton/test_mrope.py (triton_mrope)

ASCEND_TRITON_MROPE_GRID = list(
    itertools.product(
        ((32, 32, 32),),  # MROPE_SECTION: interleaved over 64 frequencies, 22/21/21
        (1, 4, 8, 16),  # NUM_TOKENS
        (torch.bfloat16, torch.float16),  # DTYPES
    )
)  # 8 cases: 64 q heads, 1 k head, head_size = rotary_dim = 128, seed 0


def ascend_interleaved_rows(cos: torch.Tensor, sin: torch.Tensor, section) -> tuple:
    """vllm-ascend's test masks over ``cos/sin [3, T, R/2]``: h where ``i % 3 == 1 and
    i <= 3*h``, w where ``i % 3 == 2 and i <= 3*w``, t elsewhere (``<=`` reads as ``<``:
    ``3*h`` is never 1 mod 3)."""
    i = torch.arange(cos.shape[-1], device=cos.device)
    on_h = (i % 3 == 1) & (i <= 3 * section[1])
    on_w = (i % 3 == 2) & (i <= 3 * section[2])

    def pick(x):
        return torch.where(on_w, x[2], torch.where(on_h, x[1], x[0]))

    return pick(cos), pick(sin)


def ascend_triton_mrope_case(section, tokens, dtype, *, backend, device, gen):
    """vllm-ascend ``test_mrotary_embedding_triton_kernel``: ``pytorch_forward_native`` (NeoX
    halves rotated in the activation dtype by the interleaved cos/sin rows) against the fused
    op; bf16 atol/rtol 1e-2, fp16 1e-3. cos/sin are the real table's rows at ``[3, T]``
    positions (the peer draws random unit pairs)."""
    hq, hk, d, r = 64, 1, 128, 128
    q = torch.randn(tokens, hq * d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    k = torch.randn(tokens, hk * d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    positions = _plane_positions(tokens, ASCEND_MAX_POSITION, gen, device)
    cache = planes_table(
        r, positions, dtype, max_position=ASCEND_MAX_POSITION, theta=ASCEND_THETA, device=device
    )
    cos, sin = cache[positions].chunk(2, dim=-1)  # [3, T, R/2] each, as the peer passes them
    cos_row, sin_row = ascend_interleaved_rows(cos, sin, section)
    cos_row, sin_row = cos_row[:, None, :], sin_row[:, None, :]

    def rotate(x, heads):  # in the activation dtype: every product and sum rounded
        x = x.view(tokens, heads, d)
        x1, x2 = x[..., : r // 2], x[..., r // 2 :]
        return torch.cat([x1 * cos_row - x2 * sin_row, x2 * cos_row + x1 * sin_row], -1)

    peer = (rotate(q, hq).reshape(tokens, -1), rotate(k, hk).reshape(tokens, -1))
    kw = dict(head_dim=d, mrope_section=section, mrope_interleaved=True)
    fused = fqr.qk_mrope(q, k, positions, cache, backend=backend, **kw)
    unfused = fqr.qk_mrope(q, k, positions, cache, backend=backend, numerics="unfused", **kw)
    exact = reference.qk_mrope(q, k, positions, cache, **kw)
    atol = rtol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    return [
        check_like_peer(
            f"{section} T{tokens} {dtype} {n}",
            *outs,
            atol=atol,
            rtol=rtol,
            head_dim=d,
            backend=backend,
        )  # fmt: skip
        for n, outs in zip("qk", zip(fused, peer, exact, unfused))
    ]


# -------- vllm-ascend tests/e2e/nightly/.../triton/test_split_qkv_rmsnorm_mrope.py (gate)

ASCEND_SPLIT_MROPE_GRID = list(
    itertools.product(
        (1, 4096),  # NUM_TOKENS
        ((2, 1), (16, 2)),  # NUM_QKV_HEADS
        (128, 256),  # HEAD_SIZES
        ((11, 11, 10), (24, 20, 20)),  # MROPE_SECTION (rope_dim = 2 * sum = 64)
        (True, False),  # IS_INTERLEAVED
        (True, False),  # HAS_GATE
        (torch.bfloat16, torch.float16),  # DTYPES
    )
)  # 128 cases, eps 1e-6


def ascend_split_mrope_case(
    tokens, heads, head_size, section, interleaved, gate, dtype, *, backend, device, gen
):
    """vllm-ascend ``test_split_qkv_rmsnorm_mrope``: the naive reference (fp32 RMSNorm ``x *
    (1/sqrt(mean(x^2) + eps)) * w``, then the first ``rope_dim`` features of each head
    rotated NeoX-style in fp32 by the planes' cos/sin in the activation dtype, contiguous
    sections or ``apply_interleaved_rope``; rounded once) against the fused op, gate and v
    copied; atol/rtol 1e-2. ``[24, 20, 20]`` interleaved over 32 frequencies is 11/11/10."""
    hq, hkv = heads
    d, eps, rope_dim = head_size, 1e-6, 2 * sum(section)
    q_size, kv_size = hq * d, hkv * d
    width = (2 if gate else 1) * q_size + 2 * kv_size
    qkv = torch.randn(tokens, width, generator=gen, device=gen.device).to(
        device=device, dtype=dtype
    )
    q_weight = torch.randn(d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    k_weight = torch.randn(d, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    positions = _plane_positions(tokens, ASCEND_MAX_POSITION, gen, device)
    cache = planes_table(
        rope_dim, positions, dtype, max_position=ASCEND_MAX_POSITION, theta=ASCEND_THETA,
        device=device,
    )  # fmt: skip
    cos, sin = cache[positions].chunk(2, dim=-1)  # [3, T, R/2]: the peer's cos_sin split
    if gate:
        q_gate = qkv[:, : 2 * q_size].view(tokens, hq, 2 * d)
        q, peer_gate = (x.reshape(tokens, q_size) for x in torch.chunk(q_gate, 2, dim=-1))
        k, v = qkv[:, 2 * q_size :].split([kv_size, kv_size], dim=-1)
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    half = rope_dim // 2
    if interleaved:
        cos_row = vllm_apply_interleaved_rope(cos, section)
        sin_row = vllm_apply_interleaved_rope(sin, section)
    else:
        bounds = (0, section[0], section[0] + section[1], half)
        cos_row = torch.cat([cos[p, :, bounds[p] : bounds[p + 1]] for p in range(3)], dim=-1)
        sin_row = torch.cat([sin[p, :, bounds[p] : bounds[p + 1]] for p in range(3)], dim=-1)
    rows = torch.cat([cos_row, sin_row], dim=-1)  # [T, rope_dim]: each token's cos | sin

    def norm_rope(x, w, heads):  # float32 norm, float32 NeoX rotation, rounded once
        normed = peer_rms_norm(x.reshape(tokens, heads, d), w, eps)
        return peer_neox_rope(normed, rows, rope_dim).reshape(tokens, heads * d).to(dtype)

    peer = (norm_rope(q, q_weight, hq), norm_rope(k, k_weight, hkv))
    kw = dict(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        mrope_section=section,
        mrope_interleaved=interleaved,
        eps=eps,
        output_gate=gate,
    )
    args = (qkv, positions, cache, q_weight, k_weight)
    outs = fqr.split_qkv_rmsnorm_mrope(*args, backend=backend, **kw)
    exact = reference.mrope_prologue(*args, **kw)
    name = f"T{tokens} {heads} D{d} {section} interleaved={interleaved} gate={gate} {dtype}"
    outcomes = [
        check_like_peer(
            f"{name} {n}", out, p, e, None, atol=1e-2, rtol=1e-2, head_dim=d, backend=backend
        )
        for n, out, p, e in zip("qk", outs[:2], peer, exact[:2])
    ]
    assert_identical(f"{name} v", outs[2], v)
    if gate:
        assert_identical(f"{name} gate", outs[3], peer_gate)
    return outcomes
