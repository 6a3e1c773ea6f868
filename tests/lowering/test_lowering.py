"""The generated kernel, run by Triton's interpreter on CPU, against the float64 formulation.

Every test draws fresh random inputs (see conftest.gen) on real RoPE tables and poisons the
outputs with NaN before the kernel runs, so an element the kernel does not write fails.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fqr
from fqr import reference
from fqr.backends import BACKENDS
from fqr.lowering import kernel_source, lower, tiling_of
from fqr.numerics import compare
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE

pytestmark = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)


def program_of(pb, numerics="fused"):
    return SPLIT_QKV_RMSNORM_ROPE.program_for(*pb.args(), **pb.kwargs(numerics=numerics))


def run_kernel(pb, numerics="fused", **options):
    program = program_of(pb, numerics)
    kernel = lower(program, "interpret", **options)
    tokens = pb.qkv.shape[0]
    outs = [
        torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=v.aval.dtype)
        for v in program.outputs
    ]
    kernel(*pb.operands(), out=outs)
    return outs, kernel


def check_against_float64(pb, outs, numerics="fused"):
    exact = reference.prologue(*pb.args(), **pb.kwargs())
    d = pb.spec.head_dim
    for name, o, e in zip("qkv", outs, exact):
        c = compare(o, e, head_dim=d, numerics=numerics, bitwise=(name == "v"))
        assert c.passed, f"{name}: {c}"


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
def test_head_dims(gen, head_dim):
    pb = make_problem(gen, tokens=9, num_heads=3, num_kv_heads=1, head_dim=head_dim)
    outs, _ = run_kernel(pb)
    check_against_float64(pb, outs)


@pytest.mark.parametrize(
    "variant",
    [
        dict(rotary_dim=32, head_dim=128),  # partial rotary 0.25
        dict(rotary_dim=64, head_dim=256, weight_offset=1.0),  # Qwen3.5-like
        dict(is_neox=False),  # GPT-J
        dict(is_neox=False, rotary_dim=64),  # GLM-4-like
        dict(bias=True),
        dict(bias=True, is_neox=False, dtype=torch.float16),
        dict(weight_offset=1.0),  # Gemma (1 + w)
        dict(norm="full"),  # OLMo2
        dict(norm="none"),  # split + rope only (Llama 3)
        dict(norm="none", is_neox=False, rotary_dim=64),  # GLM-4
        dict(dtype=torch.float32),
        dict(dtype=torch.float16, norm="full", bias=True),
    ],
)
def test_compositions(gen, variant):
    pb = make_problem(gen, tokens=11, **variant)
    outs, _ = run_kernel(pb)
    check_against_float64(pb, outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unfused_mode_matches_the_unfused_reference(gen, dtype):
    # Same roundings in the same places: the outputs agree bit for bit except where the fp32
    # norm statistic (summed in another order) lands on the other side of a rounding boundary.
    pb = make_problem(gen, tokens=13, dtype=dtype, is_neox=dtype == torch.bfloat16)
    outs, _ = run_kernel(pb, "unfused")
    check_against_float64(pb, outs, "unfused")
    ref = fqr.split_qkv_rmsnorm_rope(
        *pb.args(), **pb.kwargs(numerics="unfused", backend="reference")
    )
    for o, r in zip(outs, ref):
        same = (o.view(torch.int16) == r.view(torch.int16)).double().mean().item()
        assert same > 0.995, same
    fused = fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="reference"))
    assert not torch.equal(outs[0], fused[0])  # the modes really differ


@pytest.mark.parametrize(
    "mode, marker",
    [
        ("loop", "for h0 in range(0, 6, 4):"),
        ("unroll", "hh = 4 + tl.arange(0, 2)"),
        ("grid", "elif block == 1:"),
    ],
)
@pytest.mark.parametrize("norm", ["head", "full"])
def test_head_chunks_and_multi_tile_persistent_loop(gen, norm, mode, marker):
    # 6 q heads in chunks of at most 4 (loop: 4 + 4 masked; unroll/grid: 4 + 2; a full-width
    # norm then needs its two-pass statistic), tiles of 4 tokens, 2 programs: every program runs
    # several tiles, the last one ragged.
    pb = make_problem(gen, tokens=17, num_heads=6, num_kv_heads=2, head_dim=64, norm=norm)
    program = program_of(pb)
    assert tiling_of(program, "interpret", tile_elems=256).head_chunks == (4, 2, 2)
    outs, kernel = run_kernel(pb, tile_elems=256, block_t=4, max_programs=2, chunk_mode=mode)
    assert marker in kernel.source
    check_against_float64(pb, outs)


@pytest.mark.parametrize("rotary_dim", [64, 128])
def test_gptj_pairs(gen, rotary_dim):
    pb = make_problem(gen, tokens=9, is_neox=False, rotary_dim=rotary_dim, bias=True)
    outs, kernel = run_kernel(pb)
    assert "tl.split(" in kernel.source and "tl.join(" in kernel.source
    check_against_float64(pb, outs)


def test_row_stride_larger_than_width(gen):
    pb = make_problem(gen, tokens=6)
    padded = torch.full((6, pb.qkv.shape[1] + 40), float("nan"), dtype=pb.qkv.dtype)
    padded[:, : pb.qkv.shape[1]] = pb.qkv
    pb.qkv = padded[:, : pb.qkv.shape[1]]
    outs, _ = run_kernel(pb)
    check_against_float64(pb, outs)


settings.register_profile("fqr", deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_configs_against_float64(gen, data):
    head_dim = data.draw(st.sampled_from([32, 48, 64, 80, 96, 128]), label="head_dim")
    rotary_dim = data.draw(
        st.sampled_from([r for r in (16, 32, 48, 64, 80, 96, 128) if r <= head_dim]),
        label="rotary_dim",
    )
    kv = data.draw(st.integers(1, 3), label="num_kv_heads")
    pb = make_problem(
        gen,
        tokens=data.draw(st.integers(1, 12), label="tokens"),
        num_heads=kv * data.draw(st.integers(1, 3), label="group"),
        num_kv_heads=kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        dtype=data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        is_neox=data.draw(st.booleans(), label="is_neox"),
        bias=data.draw(st.booleans(), label="bias"),
        weight_offset=data.draw(st.sampled_from([0.0, 1.0]), label="weight_offset"),
        norm=data.draw(st.sampled_from(["head", "full", "none"]), label="norm"),
    )
    if pb.spec.norm == "none":
        pb.q_bias = pb.k_bias = None
    outs, _ = run_kernel(pb, block_t=data.draw(st.sampled_from([1, 2, 4, 8])))
    check_against_float64(pb, outs)


def test_public_op_interpret_backend_matches_float64(problem):
    outs = fqr.split_qkv_rmsnorm_rope(*problem.args(), **problem.kwargs(backend="interpret"))
    check_against_float64(problem, outs)


def test_new_token_count_reuses_program_and_kernel(gen):
    @fqr.jit(target="interpret")
    def prologue(qkv, positions, cache, qw, kw):
        return fqr.attention_prologue(
            qkv,
            positions,
            cache,
            qw,
            kw,
            None,
            None,
            None,
            None,
            num_heads=4,
            num_kv_heads=2,
            head_dim=128,
            eps=1e-6,
            is_neox=True,
            weight_offset=0.0,
            norm="head",
            numerics="fused",
        )

    kernels = set()
    for tokens in (1, 7, 16, 33):
        pb = make_problem(gen, tokens=tokens)
        q, k, v = prologue(pb.qkv, pb.positions, pb.cos_sin_cache, pb.q_weight, pb.k_weight)
        check_against_float64(pb, (q, k, v))
        program = next(iter(prologue.programs.values()))
        kernels.add(id(lower(program, "interpret")))
        assert "T" in str(program).splitlines()[0]
    assert len(prologue.programs) == 1 and len(kernels) == 1


def test_kernel_source_is_readable_and_token_count_is_runtime():
    from fqr.prologue import program_of

    src = kernel_source(program_of(fqr.get_preset("qwen3-8b")), "cuda")
    assert src.splitlines()[3].startswith("# { lambda a:bf16[T,6144]")
    assert '@triton.jit(do_not_specialize=["T"])' in src
    assert "\n    T,\n" in src and "\n    T: tl.constexpr" not in src
    assert src.count("tl.load(") >= 8 and "tl.rsqrt" in src


def test_cache_is_reused_across_processes(tmp_path):
    script = textwrap.dedent("""
        import fqr, torch
        from fqr.lowering import lower
        from fqr.prologue import program_of
        k = lower(program_of(fqr.get_preset("gemma3-1b")), "interpret")
        print(k.cache_hit, k.path)
    """)
    env = dict(os.environ, FQR_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="1")
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs[0][0] == "False" and runs[1][0] == "True"
    assert runs[0][1] == runs[1][1] and len(list(tmp_path.glob("fqr_*.py"))) == 1


def test_out_of_range_position_rotates_by_nan_and_never_reads_outside(gen):
    # The host check covers CPU tensors; on a device the kernel itself guards the gather.
    pb = make_problem(gen, tokens=5, max_position=64)
    pb.positions[2] = 64
    pb.positions[4] = -1
    outs, _ = run_kernel(pb)
    q, k, v = outs
    bad = torch.tensor([False, False, True, False, True])
    assert torch.isnan(q[bad]).all() and torch.isnan(k[bad]).all()
    assert torch.isfinite(q[~bad]).all() and torch.isfinite(k[~bad]).all()
    assert torch.equal(v, pb.qkv[:, -v.shape[1] :])
