"""The triton backend on a CUDA GPU (skipped without one): every preset and dtype against the
float64 formulation, poisoned outputs, and no recompilation for a new token count."""

import pytest
import torch
from conftest import make_problem

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.lowering import lower
from fqr.numerics import compare
from fqr.prologue import preset_program

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not BACKENDS["triton"].available, reason=BACKENDS["triton"].unavailable_reason() or ""
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def preset_problem(gen, name, tokens, dtype, bias=False):
    p = fqr.get_preset(name)
    return p, make_problem(
        gen,
        tokens=tokens,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        rotary_dim=p.rotary_dim,
        dtype=dtype,
        is_neox=p.is_neox,
        bias=bias and p.norm != "none",
        weight_offset=p.weight_offset,
        norm=p.norm,
        theta=p.rope_theta,
        max_position=min(p.max_position, 1 << 17),
    )


def to_cuda(pb):
    for f in ("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight", "q_bias", "k_bias"):
        t = getattr(pb, f)
        if t is not None:
            setattr(pb, f, t.cuda())
    return pb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(fqr.PRESETS))
def test_presets_against_float64(gen, name, dtype):
    p, pb = preset_problem(gen, name, 301, dtype, bias=name == "qwen3-8b")
    exact = reference.prologue(*pb.args(), **pb.kwargs())
    pb = to_cuda(pb)
    program = preset_program(p, dtype, bias=pb.q_bias is not None)
    kernel = lower(program, "cuda")
    outs = [
        torch.full((301, v.aval.shape[1]), float("nan"), dtype=dtype, device="cuda")
        for v in program.outputs
    ]
    args = [
        t
        for t in (
            pb.qkv,
            pb.positions,
            pb.cos_sin_cache,
            pb.q_weight,
            pb.k_weight,
            pb.q_bias,
            pb.k_bias,
        )
        if t is not None
    ]
    kernel(*args, out=outs)
    for n, o, e in zip("qkv", outs, exact):
        c = compare(o, e, head_dim=p.head_dim, bitwise=n == "v")
        assert c.passed, f"{n}: {c}"


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return len(fn.cache[torch.cuda.current_device()])


def test_new_token_counts_do_not_recompile(gen):
    p = fqr.get_preset("qwen3-0.6b")
    counts = []
    for tokens in (1, 2, 16, 17, 1000, 4096):
        _, pb = preset_problem(gen, "qwen3-0.6b", tokens, torch.bfloat16)
        exact = reference.prologue(*pb.args(), **pb.kwargs())
        pb = to_cuda(pb)
        q, k, v = fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="triton"))
        assert compare(q, exact[0], head_dim=p.head_dim).passed
        kernel = lower(preset_program(p, torch.bfloat16), "cuda")
        counts.append(_compiled_variants(kernel.fn))
    assert counts == [1] * len(counts)
