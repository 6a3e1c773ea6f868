"""The triton backend on a CUDA GPU (skipped without one): every preset and dtype against the
float64 formulation, poisoned outputs, and no recompilation for a new token count."""

from functools import lru_cache

import pytest
import torch

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.inputs import random_inputs
from fqr.lowering import lower
from fqr.numerics import compare, compare_kind
from fqr.prologue import preset_program
from fqr.variants import variant_of

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


@lru_cache(maxsize=4)
def _table(name: str) -> torch.Tensor:
    """The preset's real table, at most 2^17 rows (built once per preset: TP views share it)."""
    p = fqr.get_preset(name)
    return p.cos_sin_cache(min(p.max_position, 1 << 17))


def _check_variant_kernel(gen, p, tokens, dtype, bias=False):
    """The preset's own program (its variant: fqr.variants) as the CUDA kernel into poisoned
    outputs, every output against the variant's float64 expectation under its tolerance."""
    variant = variant_of(p)
    cache = _table(p.name)
    drawn = variant.draw(p, tokens, dtype, gen, max_position=cache.shape[0], bias=bias)
    exact = variant.expected(p, drawn, cache)
    program = variant.program(p, dtype, bias=bias)
    kernel = lower(program, "cuda")
    outs = [
        torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=v.aval.dtype, device="cuda")
        for v in program.outputs
    ]
    on_gpu = {n: x.to("cuda") for n, x in drawn.items()}
    kernel(*variant.program_args(on_gpu, cache.to("cuda")), out=outs)
    for n, o in zip(variant.outputs, outs):
        c = compare_kind(variant.tolerance(n), o.cpu(), exact[n], head_dim=variant.head_dim(p, n))
        assert c.passed, f"{p.label} T={tokens} {n}: {c}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(fqr.PRESETS))
def test_presets_against_float64(gen, name, dtype):
    _check_variant_kernel(gen, fqr.get_preset(name), 301, dtype, bias=name == "qwen3-8b")


NORM_VARIANT_PRESETS = [
    "gemma4-31b-sliding",
    "gemma4-31b-full",
    "llama4-scout",
    "llama4-scout-nope",
]


@pytest.mark.parametrize("tokens", [1, 257, 4099])
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("name", NORM_VARIANT_PRESETS)
def test_norm_variant_presets_kernel_and_public_op(gen, name, tp, tokens):
    """Issue 15's norm variants at realistic T, whole model and a TP-8 rank: the kernel, and
    the public op (backend triton, fused and unfused) through the variant."""
    p = fqr.get_preset(name, tp)
    _check_variant_kernel(gen, p, tokens, torch.bfloat16)
    variant = variant_of(p)
    cache = _table(p.name)
    drawn = variant.draw(p, tokens, torch.bfloat16, gen, max_position=cache.shape[0])
    exact = variant.expected(p, drawn, cache)
    on_gpu = {n: x.to("cuda") for n, x in drawn.items()}
    for numerics in ("fused", "unfused"):
        outs = variant.run(p, on_gpu, cache.to("cuda"), numerics=numerics, backend="triton")
        for n, o in zip(variant.outputs, outs):
            c = compare_kind(
                variant.tolerance(n), o.cpu(), exact[n], head_dim=p.head_dim, numerics=numerics
            )
            assert c.passed, f"{p.label} T={tokens} {numerics} {n}: {c}"


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
