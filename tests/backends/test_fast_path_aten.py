"""What a repeat call costs on the device side (issue 24, item 3): every public op (every
declaration in :data:`fqr.prologue.DECLARATIONS`) and its ``torch.ops.fqr`` form, called a
second time with fresh tensors of the same metadata, takes the fast path (no full checks, no
general launch: the generated host function) and dispatches no aten op but the allocation of
its outputs and the views of arguments listed in :data:`VIEWS`. On CUDA any other aten op
on a device tensor is a kernel launch or a device-to-host sync (``.item()``, ``bool(t)``,
``.min()`` of positions), and each view a round trip through the dispatcher.

The calls are the ones each declaration's docstring example makes (so a new op is covered by
its example, which ``tests/docs`` requires), run on the ``interpret`` backend with the kernel
body stubbed out, along two launch paths: Triton's interpreter (``fn[grid]``) and the path the
``triton`` backend takes on CUDA (:class:`fqr.lowering.launcher.DirectLauncher` binding the
compiled kernel, the generated host function calling the C launch under Triton's own
``CudaLauncher``, here over a recording C function). The checks that read values do so only on
the host (CPU positions, slots, FP8 scales: docs/RELIABILITY.md); what they dispatch is counted
apart, and :func:`test_value_checks_read_nothing_on_a_device` checks they dispatch nothing for
device tensors.

Run as a script, it prints the audit table (op, form, launch path -> aten ops and counts);
with ``--cuda``, on a CUDA machine, the same calls on the real ``triton`` backend (nothing
stubbed): per repeat call the aten ops, the CUDA runtime / driver calls and kernels the
profiler sees, whether the fast path ran, and host µs per call beside ``F.rms_norm``'s::

    PYTHONPATH=. python tests/backends/test_fast_path_aten.py [--cuda]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import doctest
import functools
import os
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest import mock

if __name__ == "__main__":
    if "--cuda" not in sys.argv:  # as the suite runs: kernels interpreted without a GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # this folder and tests/ (support)

import pytest
import torch
from support.cuda_launcher import cuda_launcher
from torch.profiler import ProfilerActivity, profile, record_function

import fqr.backends as backends
import fqr.lowering as lowering
import fqr.lowering.kernel as kernel_module
import fqr.lowering.launcher as launcher
from fqr.bench.timers import CudaTimers
from fqr.prologue import DECLARATIONS, Declaration, forget_checked_calls
from fqr.prologue.declare import Form, TensorKind, torch_op_params

# What a repeat call may dispatch: its outputs' allocation (and, for the torch op, the
# dispatcher's entry into fqr's implementation).
ALLOWED = frozenset(("aten::empty", "aten::empty_strided", "aten::new_empty"))
# Views of arguments (by op, or by op and form): operands the program takes in another shape,
# outputs written into or returned as views of an argument. Metadata only (no device work), but
# each a round trip through the dispatcher; listed so that a new one is a decision.
VIEWS = {
    "kv_cache_insert": {"aten::view": 2},  # key, value [T, H, D] as the program's [T, H*D] rows
    "mla_q_rope": {"aten::view": 1, "aten::slice": 1},  # q's rope columns, rotated in place
    "split_qkv_rmsnorm_mrope": {"aten::unbind": 1},  # [3, T] positions: an input per plane
    "split_qkv_rmsnorm_mrope_proj": {"aten::unbind": 1},  # the same, from the hidden states
    "qk_mrope": {"aten::unbind": 1},
    "split_qkv_rmsnorm_rope public inplace=True": {"aten::slice": 3},  # q, k, v in qkv
}
HOST_VALUE_CHECK = "fqr host value check"  # the label of the checks that read CPU values
LAUNCHES = ("interpret", "cuda")


# ------------------------------------------------------------------------ the calls


@functools.cache
def example_calls(name: str) -> tuple[tuple, ...]:
    """The argument lists (in parameter order) of the calls the docstring example of
    declaration ``name`` makes of its op."""
    decl = DECLARATIONS[name]
    calls: list[tuple] = []
    call = Declaration.call

    def recording(self, values):
        if self is decl:
            calls.append(tuple(values))
        return call(self, values)

    test = doctest.DocTestParser().get_doctest(decl.function.__doc__, {}, name, name, 0)
    with mock.patch.object(Declaration, "call", recording):
        doctest.DocTestRunner().run(test, out=lambda text: None)
    assert calls, f"{name}: its docstring example does not call it"
    return tuple(calls)


def fresh(value, device: str | None = None):
    """``value`` with every tensor in it replaced by a new one of the same metadata (sizes,
    strides, dtype; on ``device`` when given, else the same) and values."""
    if isinstance(value, torch.Tensor):
        new = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=device or value.device
        )
        return new.copy_(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return dataclasses.replace(
            value, **{f.name: fresh(getattr(value, f.name), device) for f in fields}
        )
    if isinstance(value, (tuple, list)):
        return type(value)(fresh(v, device) for v in value)
    if isinstance(value, dict):
        return {k: fresh(v, device) for k, v in value.items()}
    return value


def call_of(decl: Declaration, form: str, values: tuple) -> Callable[[], object]:
    """The call of ``decl`` in ``form`` (``"public"``, with ``" flag=True"`` for each flag
    given, or ``"torch.ops.fqr"``) on fresh copies of ``values``, ready to run."""
    if form.startswith("public"):
        kwargs = fresh({p.name: v for p, v in zip(decl.params, values)})
        for flag in form.split()[1:]:
            kwargs[flag.removesuffix("=True")] = True
        return functools.partial(decl.function, **kwargs)
    op = getattr(torch.ops.fqr, decl.torch_op_name).default
    return functools.partial(
        op, *fresh([values[decl.index[p.name]] for p in torch_op_params(decl)])
    )


def cases() -> Iterator[tuple[str, int, str]]:
    """``(op, example call, form)``: each example call as made, with each of the public op's
    flags (a :class:`Form` that is False by default, ``inplace``) set, and as the torch op."""
    for name, decl in DECLARATIONS.items():
        flags = [p.name for p in decl.params if isinstance(p, Form) and p.default is False]
        for i in range(len(example_calls(name))):
            yield name, i, "public"
            for flag in flags:
                yield name, i, f"public {flag}=True"
            if decl.torch_op_name is not None:
                yield name, i, "torch.ops.fqr"


# ------------------------------------------------------------------- the launches


class _NoKernel:
    """Stands for a compiled kernel: binding it gives a CudaLauncher over a C function that
    does nothing (the kernel body never runs)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            runner = cuda_launcher(_CFunction())
            return SimpleNamespace(run=runner, function=object(), packed_metadata=object())

        return compile_and_launch


class _CFunction:
    """Stands for the C launch function of Triton's launcher module."""

    def __call__(self, *args):
        return None


@contextlib.contextmanager
def stubbed_kernels(launch: str) -> Iterator[None]:
    """The ``interpret`` backend with the kernel body stubbed out, on fresh kernel caches, and
    ``backend="auto"`` (the torch op's) picking it for CPU tensors. ``launch``: ``"interpret"``
    (``fn[grid]`` into the interpreter, whose ``run`` does nothing) or ``"cuda"`` (the
    ``triton`` backend's path: a :class:`~fqr.lowering.launcher.DirectLauncher` binds the
    kernel at the first launch, the generated host function then calls the C launch under
    Triton's ``CudaLauncher``)."""
    from triton.runtime.interpreter import InterpretedFunction

    interpret = dataclasses.replace(backends.BACKENDS["interpret"])  # its own kernel cache
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(mock.patch.object(InterpretedFunction, "run", lambda self, *a, **k: None))
        enter(mock.patch.dict(backends.BACKENDS, {"interpret": interpret}))
        enter(mock.patch.dict(backends.AUTO_BACKENDS, {"cpu": "interpret"}))
        enter(mock.patch.object(backends, "_RESOLVED", {}))
        enter(mock.patch.object(lowering, "_KERNELS", {}))
        enter(mock.patch.object(lowering, "_BY_TOKENS", {}))
        if launch == "cuda":
            import triton

            if not launcher.triton_supports_direct_launch(triton.__version__):
                pytest.skip(f"Triton {triton.__version__}: its launcher convention was not read")
            hooks = SimpleNamespace(
                launch_enter_hook=SimpleNamespace(calls=[]),
                launch_exit_hook=SimpleNamespace(calls=[]),
            )

            def direct_launcher(fn, options):
                return launcher.DirectLauncher(
                    _NoKernel(fn), options, runtime=hooks, stream=lambda d: 0, device=lambda: None
                )

            enter(mock.patch.object(kernel_module, "direct_launcher", direct_launcher))
            enter(mock.patch.object(triton.runtime.driver, "_active", object()))
            enter(
                mock.patch.object(
                    launcher, "C_FUNCTION_TYPES", (*launcher.C_FUNCTION_TYPES, _CFunction)
                )
            )
        forget_checked_calls()
        try:
            yield
        finally:
            forget_checked_calls()  # no kept call may launch the stub later


@contextlib.contextmanager
def labelled_value_checks() -> Iterator[None]:
    """Every parameter kind's per-call check of values runs under :data:`HOST_VALUE_CHECK` in
    the profile."""
    kinds = {
        type(p.kind)
        for decl in DECLARATIONS.values()
        for p in decl.tensor_params
        if type(p.kind).per_call is not TensorKind.per_call
    }
    with contextlib.ExitStack() as stack:
        for kind in kinds:

            def labelled(self, *args, _check=kind.per_call):
                with record_function(HOST_VALUE_CHECK):
                    return _check(self, *args)

            stack.enter_context(mock.patch.object(kind, "per_call", labelled))
        yield


# -------------------------------------------------------------------- the audit


def dispatched(call: Callable[[], object]) -> tuple[collections.Counter, collections.Counter]:
    """The aten ops ``call`` dispatches from fqr's Python (those nested in another aten op are
    that op's business), as counts: the call's own, and its host value checks'."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    own: collections.Counter = collections.Counter()
    checks: collections.Counter = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if parent is None or parent.name.startswith("fqr::"):
            if event.name != HOST_VALUE_CHECK:
                own[event.name] += 1
        elif parent.name == HOST_VALUE_CHECK:
            checks[event.name] += 1
    return own, checks


def audit_repeat_call(name: str, index: int, form: str) -> tuple:
    """The aten ops of a repeat call (the first call warmed the fast path), as
    :func:`dispatched` counts them; run inside :func:`stubbed_kernels`."""
    decl = DECLARATIONS[name]
    values = _interpret(name, index)
    with torch.inference_mode():  # as a serving engine calls it
        call_of(decl, form, values)()
        repeat = call_of(decl, form, values)
        with labelled_value_checks():
            return dispatched(repeat)


def _case_id(case) -> str:
    name, index, form = case
    return f"{name}-{index}-{form.replace(' ', '-')}"


def beyond_allowed(name: str, form: str, own: collections.Counter) -> dict[str, int]:
    """The aten ops of a repeat call of op ``name`` in ``form`` beyond its outputs' allocation
    and its listed :data:`VIEWS`."""
    views = VIEWS.get(f"{name} {form}", VIEWS.get(name, {}))
    extra = {
        op: n - views.get(op, 0)
        for op, n in own.items()
        if op not in ALLOWED and not op.startswith("fqr::")
    }
    return {op: n for op, n in extra.items() if n > 0}


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", list(cases()), ids=_case_id)
def test_a_repeat_call_dispatches_only_its_outputs_allocation(case, launch):
    with stubbed_kernels(launch):
        own, _ = audit_repeat_call(*case)
    extra = beyond_allowed(case[0], case[2], own)
    assert not extra, f"{_case_id(case)} on the {launch} path dispatches {extra}"
    assert own["aten::empty"] + own["aten::new_empty"] <= len(DECLARATIONS[case[0]].outputs)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", list(cases()), ids=_case_id)
def test_a_repeat_call_takes_the_fast_path(case, launch):
    """No full checks, no trace, no general launch: the kept call and its generated host
    function run it."""
    name, index, form = case
    calls: collections.Counter = collections.Counter()

    def counting(what, original):
        def counted(*args, **kwargs):
            calls[what] += 1
            return original(*args, **kwargs)

        return counted

    with stubbed_kernels(launch), torch.inference_mode():
        first = call_of(DECLARATIONS[name], form, _interpret(name, index))
        repeat = call_of(DECLARATIONS[name], form, _interpret(name, index))
        first()
        assert calls == {}
        with (
            mock.patch.object(Declaration, "validate", counting("checks", Declaration.validate)),
            mock.patch.object(
                kernel_module.Kernel, "launch", counting("general", kernel_module.Kernel.launch)
            ),
        ):
            repeat()
    assert calls == {}, f"{_case_id(case)} on the {launch} path: {dict(calls)}"


def _interpret(name: str, index: int, backend: str = "interpret") -> tuple:
    """Example call ``index`` of op ``name`` on ``backend``."""
    decl = DECLARATIONS[name]
    values = list(example_calls(name)[index])
    if "backend" in decl.index:
        values[decl.index["backend"]] = backend
    return tuple(values)


@pytest.mark.parametrize("name", sorted(DECLARATIONS))
def test_value_checks_read_nothing_on_a_device(name):
    """The per-call checks of values (positions' range, slots, FP8 scales) read them only
    where they are on the host: for tensors on a device (here ``meta``) they dispatch nothing,
    so they cost no sync and no launch."""
    decl = DECLARATIONS[name]
    for values in example_calls(name):
        for device, reads in (("cpu", True), ("meta", False)):
            call = decl.bound([v.to(device) if isinstance(v, torch.Tensor) else v for v in values])
            call._tokens = getattr(call, decl._anchor).shape[0]
            for p in decl.tensor_params:
                if decl.used(p, call) and type(p.kind).per_call is not TensorKind.per_call:
                    x = getattr(call, p.name)
                    own, _ = dispatched(lambda: p.kind.per_call(p.name, x, call))  # noqa: B023
                    assert bool(own) == reads, f"{name}: {p.name} on {device}: {dict(own)}"


def _table(launch: str) -> list[str]:
    rows = []
    with stubbed_kernels(launch):
        for case in cases():
            own, checks = audit_repeat_call(*case)
            text = ", ".join(f"{op} x{n}" for op, n in sorted(own.items()))
            if checks:
                text += " | host value checks: " + ", ".join(
                    f"{op} x{n}" for op, n in sorted(checks.items())
                )
            rows.append(f"{_case_id(case)} [{launch}]: {text}")
    return rows


def _cuda_table() -> list[str]:
    """The repeat calls on the ``triton`` backend, on CUDA: what :func:`dispatched` counts,
    the CUDA runtime / driver calls (``cu*``) and kernels of the profile, the full checks and
    general launches the call took (none on the fast path), host µs per call."""
    import torch.nn.functional as F

    x = torch.randn(2, 8, 128, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(128, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        rms_norm_us = CudaTimers().dispatch_us(lambda: F.rms_norm(x, (128,), w, 1e-6))
        rows = [f"F.rms_norm: {rms_norm_us:.1f} us/call"]
        for name, index, form in cases():
            decl = DECLARATIONS[name]
            values = fresh(_interpret(name, index, "triton"), "cuda")
            for _ in range(2):  # checks, trace, compile; then the host function is made
                call_of(decl, form, values)()
            taken: collections.Counter = collections.Counter()
            with contextlib.ExitStack() as stack:
                for what, owner, attr in (
                    ("checks", Declaration, "validate"),
                    ("general launches", kernel_module.Kernel, "launch"),
                ):
                    original = getattr(owner, attr)

                    def counted(*args, _what=what, _original=original, _taken=taken, **kwargs):
                        _taken[_what] += 1
                        return _original(*args, **kwargs)

                    stack.enter_context(mock.patch.object(owner, attr, counted))
                repeat = call_of(decl, form, values)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    repeat()
                    torch.cuda.synchronize()
            own, _ = dispatched(repeat)
            api = collections.Counter(e.name for e in prof.events() if e.name.startswith("cu"))
            kernels = collections.Counter(
                e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            )
            us = CudaTimers().dispatch_us(call_of(decl, form, values))
            rows.append(
                f"{_case_id((name, index, form))}: {us:.1f} us/call; aten {dict(own)}; "
                f"cuda api {dict(api)}; kernels {dict(kernels)}; slow path {dict(taken)}"
            )
    return rows


if __name__ == "__main__":
    if "--cuda" in sys.argv:
        print("\n".join(_cuda_table()))
    else:
        for launch in LAUNCHES:
            print("\n".join(_table(launch)))
