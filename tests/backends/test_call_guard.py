"""The per-call fast path of the declared ops (``fqr.prologue.declare.CheckedCall``): a call
takes a kept call exactly when the full checks would give it the same result. The C launch under
Triton's launcher (``fqr.lowering.launcher.
inner_c_launch``): the host function passes the C function what Triton's own
``CudaLauncher.__call__`` passes it, and keeps the bound launcher wherever that is not known to
be the same (another Triton version, scratch buffers, GSan, a Python wrapper)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import make_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cuda_launcher import cuda_launcher
from test_host_function import FakeJit, _poisoning

import fqr
import fqr.lowering as lowering
import fqr.lowering.host as host
import fqr.lowering.launcher as launcher
from fqr.lowering.launcher import DirectLauncher, inner_c_launch
from fqr.prologue import checked_calls, forget_checked_calls
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE

# ------------------------------------------------------------------ the fast path

# one call's arguments as choices: (field, options); a second call redraws a few fields
FIELDS = {
    "tokens": (0, 1, 2, 3),
    "dtype": (torch.float32, torch.bfloat16),
    "row_pad": (0, 8),  # qkv rows strided when > 0
    "positions": ("int64", "int32", "planes", "rows+1", "strided", "number"),
    "weight": ("d", "d-half", "2d", "strided", "meta", "number", "none"),
    "bias": ("none", "d"),
    "eps": (1e-6, 1e-5, 0.0, float("nan"), True, "x", [1e-6]),
    "num_heads": (2, True, 2.0, 4),
    "norm": ("head", "none", "full", "layer"),
    "numerics": ("fused", "unfused", False),
}
D, KV = 8, 1


def _build(choice: dict):
    """The arguments of one ``split_qkv_rmsnorm_rope`` call (valid or not) from the choices."""
    tokens, dtype = choice["tokens"], choice["dtype"]
    width = (2 + 2 * KV) * D
    qkv = torch.randn(tokens, width + choice["row_pad"], dtype=torch.float64).to(dtype)[:, :width]
    positions: object = {
        "int64": lambda: torch.arange(tokens, dtype=torch.int64) % 4,
        "int32": lambda: torch.arange(tokens, dtype=torch.int32) % 4,
        "planes": lambda: torch.zeros(3, tokens, dtype=torch.int64),
        "rows+1": lambda: torch.zeros(tokens + 1, dtype=torch.int64),
        "strided": lambda: torch.zeros(tokens, 2, dtype=torch.int64)[:, 0],
        "number": lambda: 3,
    }[choice["positions"]]()

    def vector():
        return {
            "d": lambda: 1 + torch.randn(D, dtype=torch.float64).to(dtype),
            "d-half": lambda: torch.ones(D, dtype=torch.float16),
            "2d": lambda: torch.ones(2 * D, dtype=dtype),
            "strided": lambda: torch.ones(2 * D, dtype=dtype)[::2],
            "meta": lambda: torch.empty(D, dtype=dtype, device="meta"),
            "number": lambda: 1.0,
            "none": lambda: None,
        }[choice["weight"]]()

    table = torch.randn(4, D, dtype=torch.float64).float()
    bias = None if choice["bias"] == "none" else torch.zeros(D, dtype=dtype)
    args = (qkv, positions, table, vector(), vector())
    kwargs = dict(
        num_heads=choice["num_heads"],
        num_kv_heads=KV,
        head_dim=D,
        eps=choice["eps"],
        q_bias=bias,
        k_bias=None if bias is None else bias.clone(),
        norm=choice["norm"],
        numerics=choice["numerics"],
        backend="reference",
    )
    return args, kwargs


def _outcome(args, kwargs):
    """What a call gives: its outputs, or the type and message of its refusal."""
    try:
        return tuple(o.clone() for o in fqr.split_qkv_rmsnorm_rope(*args, **kwargs))
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def _same(a, b) -> bool:
    if isinstance(a[0], type) or isinstance(b[0], type):
        return a == b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@st.composite
def two_calls(draw):
    first = {f: draw(st.sampled_from(options)) for f, options in FIELDS.items()}
    second = dict(first)
    for field in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2)):
        second[field] = draw(st.sampled_from(FIELDS[field]))
    return first, second


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_calls())
def test_the_fast_path_gives_what_the_full_checks_give(calls):
    """After a first call (kept when it passed), a second call with other arguments gives
    exactly what it gives on a cold table: the same outputs or the same refusal. So the fast
    path (the kept call's key and ``TensorGuards``) never takes a call the checks would refuse,
    nor changes a result."""
    first, second = calls
    args2, kwargs2 = _build(second)
    forget_checked_calls()
    cold = _outcome(args2, kwargs2)
    forget_checked_calls()
    _outcome(*_build(first))
    warm = _outcome(args2, kwargs2)
    assert _same(warm, cold), (first, second)


def test_repeats_take_the_kept_call(gen, monkeypatch):
    """Repeated calls with two metadata in turn (T = 1 and T > 1) check, trace and bind once
    each: two kept calls, and no more validation after them."""
    decl = SPLIT_QKV_RMSNORM_ROPE
    forget_checked_calls()
    validations = []
    real = decl.validate
    monkeypatch.setattr(decl, "validate", lambda call, **k: validations.append(1) or real(call))
    problems = [make_problem(gen, tokens=t, num_heads=2, num_kv_heads=1) for t in (1, 3)]
    for p in problems * 3:
        fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="reference")
    assert len(checked_calls(decl)) == 2 and len(validations) == 2


# ------------------------------------------------------------ the C launch


class FakeCompiledCuda:
    """A compiled kernel whose bound launcher is Triton's own ``CudaLauncher`` (its
    ``__call__`` runs), built without CUDA, with a recording inner ``launch``."""

    def __init__(self, log, **fields):
        self.function, self.packed_metadata = object(), object()
        fields = (
            dict(launch=Recorder(log), arg_annotations=object(), kernel_signature=object()) | fields
        )
        self.run = cuda_launcher(**fields)


class Recorder:
    """Stands for the C function of the launcher module."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(args)


class FakeJitCuda(FakeJit):
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            return FakeCompiledCuda(self.log)

        return launch


@pytest.fixture
def triton_launcher(monkeypatch):
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia.driver")
    if not launcher.triton_supports_direct_launch(triton.__version__):
        pytest.skip(f"Triton {triton.__version__}: the launcher convention was not read there")
    monkeypatch.setattr(triton.runtime.driver, "_active", object())  # no CUDA driver needed
    monkeypatch.setattr(launcher, "C_FUNCTION_TYPES", (*launcher.C_FUNCTION_TYPES, Recorder))


def test_inner_c_launch_gets_what_triton_launcher_passes_it(gen, triton_launcher):
    """The host function calls the C function (no ``CudaLauncher.__call__``) with exactly the
    arguments Triton's ``__call__`` passes it on the general path (``DirectLauncher`` ->
    bound launcher): grid, stream, function, cooperative / PDL flags, metadata, no scratch, the
    annotations, the signature and every parameter, constexprs included, each tensor as its
    address (an int, which the C function takes as the address itself)."""
    p = make_problem(gen, tokens=6, num_heads=4, num_kv_heads=2, head_dim=32)
    program = SPLIT_QKV_RMSNORM_ROPE.program_for(*p.args(), **p.kwargs())
    kernel = dataclasses.replace(lowering.lower(program, "interpret"), fn=FakeJitCuda())
    runtime = SimpleNamespace(
        launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[])
    )
    kernel._direct = DirectLauncher(
        kernel.fn, {"num_warps": 2}, runtime=runtime, stream=lambda d: 77, device=lambda: None
    )
    variants = SimpleNamespace(_kernels=[kernel], _limits=[None], kernels=[kernel])
    ops = p.operands()
    kernel.launch(ops)  # binds (through fn[grid])
    outs = kernel.launch(ops)  # general path: CudaLauncher.__call__ -> C function
    fast = host.host_function(variants, ops)
    assert fast is not None and "LAUNCH0(" in fast.source and "RUN0(" not in fast.source
    general = kernel.fn.log[-1]
    _poisoning(fast.fn)
    mine = fast.fn(ops)
    called = kernel.fn.log[-1]
    assert len(kernel.fn.log) == 2 and len(kernel.fn.jit) == 1
    assert called[:15] == general[:15] and general[3] == 77
    # the general path's tensors (its outputs swapped for the host function's), as addresses
    swapped = [next((m for o, m in zip(outs, mine) if x is o), x) for x in general[15]]
    expected = tuple(x.data_ptr() if torch.is_tensor(x) else x for x in swapped)
    assert called[15] == expected and all(type(x) is not torch.Tensor for x in called[15])
    # into the caller's ``out``: those stay tensors (the C function checks them)
    given = [torch.empty_like(o) for o in outs]
    kernel.launch(ops, given)
    into = host.host_function(variants, ops, given)
    assert into is not None and "LAUNCH0(" in into.source
    assert into.fn(ops, given) == tuple(given)
    passed = kernel.fn.log[-1][15]
    assert [x for x in passed if torch.is_tensor(x)] == given
    addresses = [x for x in passed if type(x) is int]
    assert all(o.data_ptr() in addresses for o in ops)


@pytest.mark.parametrize(
    "fields,version",
    [
        ({}, "3.5.0"),
        ({}, "3.7.1"),
        ({"gsan_enabled": True}, None),
        ({"global_scratch_size": 64}, None),
        ({"profile_scratch_size": 64}, None),
        ({"launch": lambda *a: None}, None),  # a Python wrapper (tensor descriptors)
    ],
)
def test_other_launchers_keep_the_bound_launcher(triton_launcher, fields, version):
    runner = FakeCompiledCuda([], **fields).run
    plain = FakeCompiledCuda([]).run
    assert inner_c_launch(plain, "3.6.0") is not None
    assert inner_c_launch(plain, "3.9.0") is not None
    assert inner_c_launch(runner, version or "3.9.0") is None
    assert inner_c_launch(lambda *a: None, "3.9.0") is None  # not a CudaLauncher

    class CudaLauncher:  # same name and fields, a ``__call__`` that passes other things
        def __call__(self, *args):
            return self.launch(*args)

    other = CudaLauncher()
    other.__dict__.update(vars(plain))
    assert inner_c_launch(other, "3.9.0") is None
