"""The triton backend on a CUDA GPU (skipped without one): every preset and dtype against the
float64 formulation, poisoned outputs, and no recompilation for a new token count."""

import pytest
import torch

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.inputs import random_inputs
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
    cache = p.cos_sin_cache(min(p.max_position, 1 << 17))
    return p, random_inputs(p.spec, tokens, dtype, gen, cache, bias=bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# The split-qkv presets; every other variant's presets: tests/gpu/test_gpu_variants.py.
@pytest.mark.parametrize("name", [n for n, p in fqr.PRESETS.items() if p.variant == "split-qkv"])
def test_presets_against_float64(gen, name, dtype):
    p, pb = preset_problem(gen, name, 301, dtype, bias=name == "qwen3-8b")
    exact = reference.prologue(*pb.args(), **pb.kwargs())
    pb = pb.to("cuda")
    program = preset_program(p, dtype, bias=pb.q_bias is not None)
    kernel = lower(program, "cuda")
    outs = [
        torch.full((301, v.aval.shape[1]), float("nan"), dtype=dtype, device="cuda")
        for v in program.outputs
    ]
    kernel(*pb.operands(), out=outs)
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
        pb = pb.to("cuda")
        q, k, v = fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="triton"))
        assert compare(q, exact[0], head_dim=p.head_dim).passed
        kernel = lower(preset_program(p, torch.bfloat16), "cuda")
        counts.append(_compiled_variants(kernel.fn))
    assert counts == [1] * len(counts)
