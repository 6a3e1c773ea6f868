"""The launch floor (issue 12) on CPU: the direct launcher binds one compiled kernel per
specialisation and never per token count; the kernel's specialisation key and DENSE flag; the
tuned kernel variants by token bucket, each lowered once and right against float64."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import make_problem
from support.programs import check_outputs, poisoned_outputs

import fqr.lowering as lowering
from fqr.lowering.launcher import DirectLauncher, triton_supports_direct_launch
from fqr.lowering.targets import (
    TOKEN_BUCKETS,
    TUNED,
    UNTUNED,
    InterpretTarget,
    get_target,
    register_target,
    shape_key,
)
from fqr.presets import PRESETS
from fqr.prologue import program_of
from fqr.prologue.split_qkv import SPLIT_QKV, SPLIT_QKV_RMSNORM_ROPE
from fqr.reference import prologue as reference_prologue


class FakeCompiled:
    """What ``fn[grid](...)`` returns in Triton 3.6 / 3.9: a CompiledKernel whose ``run`` is
    the C launcher."""

    def __init__(self, log):
        self.function, self.packed_metadata, self.log = object(), object(), log

    @property
    def run(self):
        return lambda *a: self.log.append(("direct", a))


class FakeJit:
    """A ``@triton.jit`` function: ``fn[grid](*args, **kw)`` launches and returns the kernel."""

    def __init__(self):
        self.log, self.compiled = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            kernel = FakeCompiled(self.log)
            self.compiled.append(kernel)
            return kernel

        return launch


def _launcher(fn, hooks=False):
    chain = SimpleNamespace(calls=[print] if hooks else [])
    runtime = SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=SimpleNamespace(calls=[]))
    return DirectLauncher(
        fn, {"num_warps": 2}, runtime=runtime, stream=lambda d: 1234 + d, device=lambda: 0
    )


def test_direct_launcher_binds_once_per_key_and_calls_the_c_launcher():
    fn = FakeJit()
    launcher = _launcher(fn)
    consts = {"BLOCK_T": 1, "DENSE": True}
    for tokens in (1, 7, 300, 65536):  # T is not part of the key
        launcher.launch((tokens, 1), ["x", 6144, tokens], consts, key=("k",))
    assert launcher.compiles == 1 and len(fn.compiled) == 1
    assert fn.log[0] == ("jit", (1, 1), ("x", 6144, 1), {**consts, "num_warps": 2})
    kernel = fn.compiled[0]
    direct = [entry for kind, *entry in fn.log if kind == "direct"]
    assert len(direct) == 3
    # Triton's convention: grid x/y/z, stream, function, packed metadata, launch metadata and
    # the two hooks (none), then every parameter's value in signature order, constexprs last.
    assert direct[-1][0] == (
        65536,
        1,
        1,
        1234,
        kernel.function,
        kernel.packed_metadata,
        None,
        None,
        None,
        "x",
        6144,
        65536,
        1,
        True,
    )
    launcher.launch((1, 1), ["y", 6145, 1], consts, key=("other",))
    assert launcher.compiles == 2


def test_direct_launcher_yields_to_launch_hooks():
    """A profiler's launch hooks see every launch: the normal path is taken."""
    fn = FakeJit()
    launcher = _launcher(fn, hooks=True)
    for _ in range(3):
        launcher.launch((1, 1), ["x"], {"BLOCK_T": 1}, key=("k",))
    assert [entry[0] for entry in fn.log] == ["jit"] * 3 and launcher.compiles == 0


@pytest.mark.parametrize(
    "version,ok",
    [("3.6.0", True), ("3.9.0", True), ("3.5.1", False), ("3.60.0", False), ("3.10.0", False)],
)
def test_direct_launch_only_on_checked_triton_versions(version, ok):
    assert triton_supports_direct_launch(version) is ok


def _spec_program(gen, tokens):
    p = make_problem(gen, tokens=tokens, num_heads=4, num_kv_heads=2, head_dim=32)
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    return p, program


class KeyRecorder:
    def __init__(self):
        self.calls = []

    def launch(self, grid, args, constexprs, key):
        self.calls.append((grid, dict(constexprs), key))


def test_kernel_key_ignores_tokens_and_sees_alignment_and_strides(gen):
    p, program = _spec_program(gen, 8)
    kernel = lowering.lower(program, "interpret")
    probe = dataclasses.replace(kernel, fn=None)
    rec = probe._direct = KeyRecorder()
    ops = p.operands()
    probe.launch(ops)
    probe.launch([ops[0][:3], ops[1][:3], *ops[2:]])  # fewer tokens: same key
    wide = torch.zeros(8, ops[0].shape[1] + 8, dtype=ops[0].dtype)
    wide[:, : ops[0].shape[1]] = ops[0]
    probe.launch([wide[:, : ops[0].shape[1]], *ops[1:]])  # a strided view: not DENSE
    shifted = torch.zeros(8 * ops[0].shape[1] + 1, dtype=ops[0].dtype)[1:]
    probe.launch([shifted.view(8, -1), *ops[1:]])  # misaligned by 2 bytes
    (_, c0, k0), (_, c1, k1), (_, c2, k2), (_, c3, k3) = rec.calls
    assert k0 == k1 and c0 == c1 == {"BLOCK_T": 8, "DENSE": True}
    assert c2["DENSE"] is False and k2 != k0
    assert c3["DENSE"] is True and k3 != k0


def test_dense_and_strided_outputs_match_float64(gen):
    """DENSE (constant strides) and the runtime-stride variant compute the same outputs."""
    p, program = _spec_program(gen, 9)
    kernel = lowering.lower(program, "interpret")
    exact = reference_prologue(*p.args(), **p.kwargs())
    dense = poisoned_outputs(program, 9)
    kernel(*p.operands(), out=dense)
    wide = [torch.full((9, o.shape[1] + 16), float("nan"), dtype=o.dtype) for o in dense]
    strided = [w[:, : o.shape[1]] for w, o in zip(wide, dense)]
    kernel(*p.operands(), out=strided)
    for outs in (dense, strided):
        check_outputs(outs, exact, [32, 32, 32], copies=(2,))
    assert all(torch.isnan(w[:, o.shape[1] :]).all() for w, o in zip(wide, dense))


def test_cuda_profile_tunes_every_bench_preset_by_token_bucket():
    target = get_target("cuda")
    for name in (
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-235b-a22b",
        "gemma3-27b",
        "glm4-9b",
    ):
        plan = lowering.plan_program(program_of(PRESETS[name]))
        assert shape_key(plan) in TUNED, name
        buckets = target.token_buckets(plan)
        assert [limit for limit, _ in buckets] == list(TOKEN_BUCKETS)
        assert buckets[0][1]["chunk_mode"] == "grid"  # decode spreads heads over programs
    # qwen3.5-27b's gated mRoPE row (four chains) takes the variants of its q/k/v shape, so
    # text-only positions run plain RoPE's tiling; qwen3-vl-8b's chains have qwen3-8b's shape.
    plan = lowering.plan_program(program_of(PRESETS["qwen3.5-27b"]))
    # the same preset's plain q/k/v row (the split op's program for its spec)
    plain = lowering.plan_program(SPLIT_QKV.program(PRESETS["qwen3.5-27b"]))
    assert shape_key(plan) != shape_key(plain)
    assert target.token_buckets(plan) == target.token_buckets(plain)
    vl = lowering.plan_program(program_of(PRESETS["qwen3-vl-8b"]))
    assert shape_key(vl) == shape_key(lowering.plan_program(program_of(PRESETS["qwen3-8b"])))
    plan = lowering.plan_program(program_of(PRESETS["qwen3-8b"].shard(2)))
    assert [b[1]["chunk_mode"] for b in target.token_buckets(plan)] == [c[3] for c in UNTUNED]
    assert target.token_buckets(plan, num_warps=4) == ((None, {"num_warps": 4}),)


@dataclasses.dataclass(frozen=True)
class TwoBucketTarget(InterpretTarget):
    def token_buckets(self, plan, **options):
        return ((4, {"block_t": 2, **options}), (None, {"block_t": 8, **options}))


@pytest.fixture(scope="module")
def two_buckets():
    if "test-two-buckets" not in lowering.TARGETS:
        register_target(TwoBucketTarget("test-two-buckets", interpret=True))
    return "test-two-buckets"


def test_variants_by_tokens_lower_once_and_match_float64(gen, two_buckets, monkeypatch):
    lowered = []
    real = lowering.lower

    def counting_lower(*a, **k):
        lowered.append(k)
        return real(*a, **k)

    monkeypatch.setattr(lowering, "lower", counting_lower)
    p, program = _spec_program(gen, 1)
    variants = lowering.KernelsByTokens(program, two_buckets)
    for tokens in (1, 3, 4, 5, 11, 2, 9):
        p = make_problem(gen, tokens=tokens, num_heads=4, num_kv_heads=2, head_dim=32)
        outs = poisoned_outputs(program, tokens)
        variants(*p.operands(), out=outs)
        check_outputs(outs, reference_prologue(*p.args(), **p.kwargs()), [32] * 3, copies=(2,))
        assert variants.kernel_for(tokens)._block_t == (2 if tokens <= 4 else 8)
    assert lowered == [{"block_t": 2}, {"block_t": 8}]
    assert len(variants.kernels) == 2


@pytest.mark.parametrize("norm", ["none", "head", "full"])
@pytest.mark.parametrize("chunk_mode", ["unroll", "loop", "grid"])
def test_gptj_pairs_read_as_contiguous_rows_match_float64(gen, norm, chunk_mode):
    """``pair_access="reshape"``: GPT-J pairs loaded as the row's contiguous features and
    reshaped in registers (stored joined and reshaped back), in head chunks of 2, with and
    without a norm, on a ragged last tile, into NaN-poisoned outputs."""
    p = make_problem(
        gen, tokens=11, num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=16, is_neox=False,
        norm=norm,
    )  # fmt: skip
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    kernel = lowering.lower(
        program, "interpret", pair_access="reshape", tile_elems=64, chunk_mode=chunk_mode
    )
    assert "tl.reshape" in kernel.source and "paircols" not in kernel.source
    outs = poisoned_outputs(program, 11)
    kernel(*p.operands(), out=outs)
    check_outputs(outs, reference_prologue(*p.args(), **p.kwargs()), [32] * 3, copies=(2,))
