"""Issue 12, third pass. The generated call guards (``fqr.validate.key_guard``): a guard made
from a checked call's key matches exactly the arguments whose key equals it and returns that
key object itself. The C launch under Triton's launcher (``fqr.lowering.launcher.
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
from test_host_function import FakeJit, _poisoning

import fqr.lowering as lowering
import fqr.lowering.host as host
import fqr.lowering.launcher as launcher
import fqr.prologue as prologue
from fqr.lowering.launcher import DirectLauncher, inner_c_launch
from fqr.validate import key_guard, metadata_key

# ------------------------------------------------------------------ the guards

# one call's arguments as choices: (field, options); a second call redraws a few fields
FIELDS = {
    "tokens": (0, 1, 2, 3),
    "dtype": (torch.float32, torch.bfloat16),
    "width": (8, 16),
    "row_pad": (0, 8),  # qkv rows strided when > 0
    "positions": ("int64", "int32", "planes", "rows+1", "number"),
    "weight": ("none", "w8", "w16", "w8-half", "w8-strided", "w8-meta", "number"),
    "bias": ("none", "w8"),
    "static0": (1, True, 1.0, 2),
    "static1": (1e-6, 1e-5, 0.0, -0.0, "head", None),
    "static2": ("fused", "unfused", False),
    "static_count": (2, 3),
}


def _build(choice: dict):
    tokens, dtype, width = choice["tokens"], choice["dtype"], choice["width"]
    rows = torch.empty(tokens, width + choice["row_pad"], dtype=dtype)[:, :width]
    kind = choice["positions"]
    positions: object = {
        "int64": lambda: torch.zeros(tokens, dtype=torch.int64),
        "int32": lambda: torch.zeros(tokens, dtype=torch.int32),
        "planes": lambda: torch.zeros(3, tokens, dtype=torch.int64).mT,
        "rows+1": lambda: torch.zeros(tokens + 1, dtype=torch.int64),
        "number": lambda: 3,
    }[kind]()

    def tensor(name):
        return {
            "none": lambda: None,
            "w8": lambda: torch.empty(8, dtype=dtype),
            "w16": lambda: torch.empty(16, dtype=dtype),
            "w8-half": lambda: torch.empty(8, dtype=torch.float16),
            "w8-strided": lambda: torch.empty(16, dtype=dtype)[::2],
            "w8-meta": lambda: torch.empty(8, dtype=dtype, device="meta"),
            "number": lambda: 1.0,
        }[name]()

    statics = (choice["static0"], choice["static1"], choice["static2"])
    statics = statics[: choice["static_count"]]
    return (rows, positions), (tensor(choice["weight"]), tensor(choice["bias"])), statics


@st.composite
def two_calls(draw):
    first = {f: draw(st.sampled_from(options)) for f, options in FIELDS.items()}
    second = dict(first)
    for field in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2)):
        second[field] = draw(st.sampled_from(FIELDS[field]))
    return _build(first), _build(second)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_calls())
def test_guard_hits_exactly_when_the_keys_are_equal(calls):
    """Two argument sets share a guard hit iff they share a key: the guard made from one
    call's key returns that key object for the other call exactly when the other's key is
    equal (and None otherwise: the key is then built and looked up as before)."""
    first, second = calls
    key = metadata_key(*first)
    if key is None:
        return
    guard = key_guard(key)
    assert guard(*first) is key
    other = metadata_key(*second)
    hit = guard(*second)
    assert (hit is not None) == (other == key)
    assert hit is None or hit is key


def test_guard_refuses_odd_statics_without_raising():
    """A tensor where the key holds a float (a bad ``eps``): no match, no exception (the
    types are compared before the values)."""
    args = _build({f: options[0] for f, options in FIELDS.items()} | {"static1": 1e-6})
    guard = key_guard(metadata_key(*args))
    rows, tensors, statics = args
    assert guard(rows, tensors, (statics[0], torch.tensor([1e-6, 2e-6]))) is None
    assert guard(rows, tensors, list(statics)) is None


# ------------------------------------------------------------ the C launch


class FakeCompiledCuda:
    """A compiled kernel whose bound launcher is Triton's own ``CudaLauncher`` (its
    ``__call__`` runs), built without CUDA, with a recording inner ``launch``."""

    def __init__(self, log, **fields):
        from triton.backends.nvidia.driver import CudaLauncher

        self.function, self.packed_metadata = object(), object()
        runner = object.__new__(CudaLauncher)
        values = dict(
            launch=Recorder(log),
            gsan_enabled=False,
            global_scratch_size=0,
            global_scratch_align=1,
            profile_scratch_size=0,
            profile_scratch_align=1,
            num_ctas=1,
            launch_cooperative_grid=False,
            launch_pdl=False,
            arg_annotations=object(),
            kernel_signature=object(),
        )
        values.update(fields)
        for name, value in values.items():
            setattr(runner, name, value)
        self.run = runner


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
    program = prologue.preset_program(SimpleNamespace(spec=p.spec), p.qkv.dtype)
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


def test_public_op_repeats_hit_their_guards(gen, monkeypatch):
    """Through the public op (any op that calls ``call_metadata`` and ``_checked_call``):
    every kept key has its guard, and repeated calls with two metadata in turn (T = 1 and
    T > 1) get back the kept key object itself, not a rebuilt tuple."""
    import fqr
    import fqr.validate as validate

    prologue._CALLS.clear()
    validate.forget_checked_keys()
    returned = []
    real = prologue.call_metadata

    def spy(*args):
        returned.append(real(*args))
        return returned[-1]

    monkeypatch.setattr(prologue, "call_metadata", spy)
    problems = [make_problem(gen, tokens=t, num_heads=2, num_kv_heads=1) for t in (1, 3)]
    for p in problems * 3:
        fqr.split_qkv_rmsnorm_rope(*p.args(), **p.kwargs(), backend="reference")
    assert len(prologue._CALLS) == 2 and set(validate._GUARD_OF) == set(prologue._CALLS)
    kept = list(prologue._CALLS)
    assert all(any(key is k for k in kept) for key in returned[2:])
