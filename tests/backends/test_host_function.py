"""The generated host function (issue 12, second pass; ``fqr/lowering/host.py``): one per
checked call, compiled once, covering every later call with the same metadata; outputs equal to
the general path's and right against float64; every bad input refused with the general path's
message; no regeneration and no recompilation for new token counts; a clean fallback wherever it
does not cover a call; on CUDA the bound C launcher called exactly as the general path calls it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import make_problem
from support.programs import check_outputs
from test_validation import BAD_INPUTS, _call

import fqr
import fqr.lowering as lowering
import fqr.lowering.host as host
from fqr.lowering.launcher import DirectLauncher
from fqr.lowering.targets import InterpretTarget, get_target, register_target
from fqr.prologue import CheckedCall, checked_calls, forget_checked_calls
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE
from fqr.reference import prologue as reference_prologue


def _poisoning(fn):
    """Make ``fn``'s one output allocation NaN-filled (unwritten elements show)."""

    def full(size, dtype, device):
        size = (size,) if isinstance(size, int) else size
        return torch.full(size, float("nan"), dtype=dtype, device=device)

    fn.__globals__["EMPTY"] = full


def _only_call() -> CheckedCall:
    (call,) = checked_calls(SPLIT_QKV_RMSNORM_ROPE)
    return call


def test_host_function_matches_general_path_and_float64(gen, monkeypatch):
    """T = 7: the first call takes the general path and makes the host function; later calls
    (T = 7, 5, 13) go through it alone (the general launch is not entered), into poisoned
    outputs, equal to the general path's outputs bit for bit and right against float64."""
    forget_checked_calls()
    p = make_problem(gen, tokens=7)
    general = fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="interpret")
    call = _only_call()
    fast = call.host[0]
    assert fast is not None and fast.covered == (0,)
    assert fast.source.count("EMPTY(") == 3  # one per output: outputs never share memory
    _poisoning(fast.fn)

    def no_general_launch(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(lowering.Kernel, "launch", no_general_launch)
    again = fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="interpret")
    assert all(torch.equal(a, b) for a, b in zip(again, general))
    for tokens in (5, 13):  # same key (T > 1), other token counts
        q = make_problem(gen, tokens=tokens)
        outs = fqr.split_qkv_rmsnorm_rope(*q.args(), **q.kwargs(), backend="interpret")
        assert all(o.is_contiguous() and o.shape[0] == tokens for o in outs)
        check_outputs(outs, reference_prologue(*q.args(), **q.kwargs()), [128] * 3, copies=(2,))


def test_new_token_counts_generate_and_compile_nothing(gen, monkeypatch):
    forget_checked_calls()
    lowered = []
    real = lowering.lower

    def counting_lower(*a, **k):
        lowered.append(a)
        return real(*a, **k)

    monkeypatch.setattr(lowering, "lower", counting_lower)
    lowering._KERNELS.clear()
    lowering._BY_TOKENS.clear()
    p = make_problem(gen, tokens=3, num_heads=2, num_kv_heads=1, head_dim=64)
    fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="interpret")
    builds = host.BUILDS
    for tokens in (2, 9, 4, 17):
        q = make_problem(gen, tokens=tokens, num_heads=2, num_kv_heads=1, head_dim=64)
        outs = fqr.split_qkv_rmsnorm_rope(*q.args(), **q.kwargs(), backend="interpret")
        check_outputs(outs, reference_prologue(*q.args(), **q.kwargs()), [64] * 3, copies=(2,))
    assert host.BUILDS == builds, "a new T regenerated the host function"
    assert len(lowered) == 1, "a new T lowered (compiled) a kernel again"


def test_in_place_calls_use_the_host_function_for_out(gen):
    forget_checked_calls()
    p = make_problem(gen, tokens=6)
    exact = reference_prologue(*p.args(), **p.kwargs())
    kw = dict(p.kwargs(), backend="interpret", inplace=True)
    first = p.qkv.clone()
    fqr.split_qkv_rmsnorm_rope(first, *p.args()[1:], **kw)
    call = _only_call()
    assert call.host[1] is not None and "EMPTY" not in call.host[1].source.split("= out")[1]
    work = p.qkv.clone()
    q, k, v = fqr.split_qkv_rmsnorm_rope(work, *p.args()[1:], **kw)
    assert q.data_ptr() == work.data_ptr()
    check_outputs((q, k, v), exact, [128] * 3, copies=(2,))
    assert torch.equal(work, first)  # the general path wrote the same bits


@pytest.fixture(scope="module")
def warm_calls():
    """The checked call (with its host function) of one valid interpreted call."""
    g = torch.Generator().manual_seed(1234)
    p = make_problem(g, tokens=7)
    forget_checked_calls()
    _call(p, backend="interpret")
    assert _only_call().host[0] is not None
    return p, dict(SPLIT_QKV_RMSNORM_ROPE._calls)


def _refusal(call):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("name,argument,override", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_refused_as_on_the_general_path(warm_calls, name, argument, override):
    """Every validation case: with the kept call and its host function in place (the valid
    call takes it), the same type and message as on a cold table, where the full checks
    run."""
    p, kept = warm_calls

    def bad():
        return _call(p, **{"backend": "interpret", **override(p)})

    forget_checked_calls()
    cold = _refusal(bad)
    SPLIT_QKV_RMSNORM_ROPE._calls.update(kept)
    _call(p, backend="interpret")
    assert checked_calls(SPLIT_QKV_RMSNORM_ROPE) == [c for v in kept.values() for c in v]
    warm = _refusal(bad)
    assert warm == cold, name


def test_fallbacks_grad_and_empty(gen):
    """Inputs that require grad under grad mode, and T = 0, take the general path."""
    forget_checked_calls()
    p = make_problem(gen, tokens=4, dtype=torch.float32)
    fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="interpret")
    assert _only_call().host[0] is not None
    qkv = p.qkv.clone().requires_grad_()
    outs = fqr.split_qkv_rmsnorm_rope(qkv, *p.args()[1:], **p.kwargs(), backend="interpret")
    assert all(o.grad_fn is not None for o in outs[:2])
    outs[0].sum().backward()
    assert qkv.grad is not None
    empty = make_problem(gen, tokens=0, dtype=torch.float32)
    outs = fqr.split_qkv_rmsnorm_rope(*empty.args(), **empty.kwargs(), backend="interpret")
    assert [o.shape[0] for o in outs] == [0, 0, 0]


@dataclasses.dataclass(frozen=True)
class TwoBucketTarget(InterpretTarget):
    def token_buckets(self, plan, **options):
        return ((4, {"block_t": 2, **options}), (None, {"block_t": 8, **options}))


def test_unbound_variant_falls_back_then_regenerates(gen):
    """A token bucket whose variant is not lowered yet: the host function declines it (None),
    the general path lowers it, and the regenerated function covers both buckets."""
    if "test-host-two-buckets" not in lowering.TARGETS:
        register_target(TwoBucketTarget("test-host-two-buckets", interpret=True))
    p = make_problem(gen, tokens=3, num_heads=2, num_kv_heads=1, head_dim=32)
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    variants = lowering.KernelsByTokens(program, "test-host-two-buckets")
    variants.launch(p.operands())
    fast = host.host_function(variants, p.operands())
    assert fast.covered == (0,) and fast.bound == 1
    big = make_problem(gen, tokens=9, num_heads=2, num_kv_heads=1, head_dim=32)
    assert fast.fn(big.operands()) is None
    variants.launch(big.operands())
    again = host.host_function(variants, big.operands())
    assert again.covered == (0, 1) and again.bound == 2
    for q in (p, big):
        outs = again.fn(q.operands())
        check_outputs(outs, reference_prologue(*q.args(), **q.kwargs()), [32] * 3, copies=(2,))


class FakeCompiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = object(), object(), log

    @property
    def run(self):
        return lambda *a: self.log.append(a)


class FakeJit:
    """``fn[grid](...)``: records the launch, returns a kernel whose C launcher records."""

    def __init__(self):
        self.log, self.jit = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            return FakeCompiled(self.log)

        return launch


def test_bound_c_launcher_called_as_the_general_path_calls_it(gen):
    """With a bound launcher (CUDA), the host function passes the C launcher exactly what
    :class:`DirectLauncher` passes it on the general path (grid, stream, function, metadata,
    every parameter in order, constexprs); an installed launch hook sends the call back to the
    general path; a misaligned input too."""
    p = make_problem(gen, tokens=6, num_heads=4, num_kv_heads=2, head_dim=32)
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    kernel = dataclasses.replace(lowering.lower(program, "interpret"), fn=FakeJit())
    enter, exit_ = SimpleNamespace(calls=[]), SimpleNamespace(calls=[])
    runtime = SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=exit_)
    kernel._direct = DirectLauncher(
        kernel.fn, {"num_warps": 2}, runtime=runtime, stream=lambda d: 77, device=lambda: None
    )
    variants = SimpleNamespace(_kernels=[kernel], _limits=[None], kernels=[kernel])
    ops = p.operands()
    kernel.launch(ops)  # binds (through fn[grid])
    outs = kernel.launch(ops)  # the general path's direct launch
    fast = host.host_function(variants, ops)
    assert fast is not None and fast.covered == (0,)
    general = kernel.fn.log[-1]
    _poisoning(fast.fn)
    mine = fast.fn(ops)
    called = kernel.fn.log[-1]
    assert len(kernel.fn.log) == 2 and len(kernel.fn.jit) == 1
    expected = [next((m for o, m in zip(outs, mine) if x is o), x) for x in general]
    assert len(called) == len(expected)
    assert all(x is y if torch.is_tensor(y) else x == y for x, y in zip(called, expected))
    assert called[:9] == (general[0], 1, 1, 77, *general[4:6], None, None, None)
    enter.calls.append(print)  # a profiler: Triton's own path sees the launch
    assert fast.fn(ops) is None
    enter.calls.clear()
    shifted = torch.zeros(6 * ops[0].shape[1] + 1, dtype=ops[0].dtype)[1:].view(6, -1)
    assert fast.fn([shifted, *ops[1:]]) is None
    assert get_target("interpret").grid_expression(8, torch.device("cpu")) == "min((T + 7) // 8, 3)"


@pytest.mark.parametrize("name", ["cuda", "interpret"])
def test_grid_expressions_equal_the_targets_grid(name):
    target = get_target(name)
    for tile, options in ((1, {}), (2, {}), (8, {}), (4, {"max_programs": 5})):
        expression = target.grid_expression(tile, torch.device("cpu"), **options)
        for tokens in (1, 2, 3, 7, 8, 9, 100, 65537):
            got = eval(expression, {"T": tokens})  # noqa: S307  (the generated expression)
            assert got == target.grid(tokens, tile, torch.device("cpu"), **options)


def test_paged_cache_outputs_are_donated_inputs(gen):
    """A program that updates a paged cache (output aliases an input): the host function
    returns the cache input itself, written in place, as the general path (``donate``)."""
    from fqr import ops
    from fqr.core import Aval, trace
    from fqr.rope_cache import rope_cos_sin_cache

    hq, hkv, d, blocks, bs, t = 2, 1, 32, 3, 4, 5

    def composition(qkv, pos, table, qw, kw, kc, vc, slots):
        q, k, v = ops.split_qkv(qkv, hq, hkv, d)
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, table, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, table, head_dim=d)
        return q, ops.cache_insert(kc, k, slots, None), ops.cache_insert(vc, v, slots, None)

    cache = Aval(("B", bs, hkv, d), torch.bfloat16)
    program = trace(
        composition,
        Aval(("T", (hq + 2 * hkv) * d), torch.bfloat16),
        Aval(("T",), torch.int64),
        Aval(("P", d), torch.float32),
        Aval((d,), torch.bfloat16),
        Aval((d,), torch.bfloat16),
        cache,
        cache,
        Aval(("T",), torch.int64),
    )
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 64, (t,), generator=gen)
    table = rope_cos_sin_cache(d, 64, 1e6)
    qw, kw = ((1 + torch.randn(d, generator=gen) * 0.3).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    poison = torch.full((blocks, bs, hkv, d), float("nan")).to(torch.bfloat16)

    def args():
        return [qkv, pos, table, qw, kw, poison.clone(), poison.clone(), slots]

    variants = lowering.KernelsByTokens(program, "interpret")
    general_args = args()
    general = variants.launch(general_args, donate=True)
    fast = host.host_function(variants, general_args)
    assert fast is not None and fast.source.count("EMPTY(") == 1
    mine_args = args()
    mine = fast.fn(mine_args)
    assert mine[1] is mine_args[5] and mine[2] is mine_args[6]
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(mine, general))


def test_an_input_misaligned_when_generated_keeps_its_own_bound_kernel(gen):
    """mRoPE's position planes sit at ``8 * T`` bytes: every odd-T (decode) call has an input
    that is 8 bytes past a 16-byte boundary. A host function generated on such a call launches
    the kernel bound for that alignment (not the general path every call), and, once the
    aligned kernel is bound too, the aligned one for aligned calls; any other misalignment (of
    the rows) still goes to the general path."""
    p = make_problem(gen, tokens=6, num_heads=4, num_kv_heads=2, head_dim=32)
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    kernel = dataclasses.replace(lowering.lower(program, "interpret"), fn=FakeJit())
    hooks = SimpleNamespace(calls=[])
    runtime = SimpleNamespace(launch_enter_hook=hooks, launch_exit_hook=hooks)
    kernel._direct = DirectLauncher(
        kernel.fn, {"num_warps": 2}, runtime=runtime, stream=lambda d: 77, device=lambda: None
    )
    variants = SimpleNamespace(_kernels=[kernel], _limits=[None], kernels=[kernel])
    aligned = p.operands()
    positions = aligned[1]
    assert positions.dtype == torch.int64 and positions.data_ptr() % 16 == 0
    shifted = torch.empty(positions.numel() + 1, dtype=torch.int64)[1:]  # 8 bytes past
    shifted.copy_(positions)
    misaligned = [aligned[0], shifted, *aligned[2:]]
    kernel.launch(misaligned)  # binds the residue-8 kernel
    fast = host.host_function(variants, misaligned)
    assert fast is not None and fast.covered == (0,)
    _poisoning(fast.fn)
    bound = {k[1][2]: v[1] for k, v in kernel._direct._bound.items()}
    assert set(bound) == {(0, 8, 0, 0, 0)}
    assert fast.fn(misaligned) is not None and kernel.fn.log[-1][4] is bound[(0, 8, 0, 0, 0)]
    assert fast.fn(aligned) is None  # the aligned kernel is not bound yet
    kernel.launch(aligned)
    again = host.host_function(variants, misaligned)
    bound = {k[1][2]: v[1] for k, v in kernel._direct._bound.items()}
    assert again.fn(aligned) is not None and kernel.fn.log[-1][4] is bound[(0, 0, 0, 0, 0)]
    assert again.fn(misaligned) is not None and kernel.fn.log[-1][4] is bound[(0, 8, 0, 0, 0)]
    rows = torch.zeros(6 * aligned[0].shape[1] + 1, dtype=aligned[0].dtype)[1:].view(6, -1)
    assert again.fn([rows, *misaligned[1:]]) is None
