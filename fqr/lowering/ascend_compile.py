"""Compile check of an ``ascend`` kernel through Triton-Ascend's own stages, on any machine.

Triton-Ascend compiles a kernel for an NPU in three stages (``AscendBackend.add_stages``):

1. ``ttir``   -- the Python AST to Triton IR, then ``make_ttir``'s passes (inline, combine,
   canonicalize, CSE, LICM, loop unroll);
2. ``linalg`` -- ``ttir_to_linalg``: the bundled ``triton-adapter-opt`` lowers Triton IR to
   Ascend linalg/HIVM (``--triton-to-hivm``, ``--triton-to-linalg`` ...); it ships inside the
   ``triton-ascend`` wheel, so this runs on a CPU-only machine;
3. ``npubin`` -- ``bishengir-compile`` (part of the CANN toolkit) turns that into an NPU binary,
   and queries the NPU's SoC. Without CANN this stage is reported as *needs CANN*, not as a
   failure; with ``bishengir-compile`` on ``PATH`` it runs.

:func:`check_kernel` compiles exactly what the host launcher would launch: it runs the
kernel's launcher (:class:`fqr.lowering.kernel.Kernel`) on ``meta`` tensors with a recorder in
place of the Triton function, and builds the signature (``*bf16``, ``i32``, ``constexpr`` ...)
from the recorded arguments. The target is ``GPUTarget("npu", chip.arch, 0)``
(``Ascend910B3`` for A2 by default, see :mod:`fqr.lowering.ascend`).

This module needs the Ascend environment (``make ascend-env``): upstream Triton cannot compile
for an NPU target, and the two cannot share an environment. The sweep of every preset at each
TP size through this check is :mod:`fqr.tools.ascend_check` (``fqr lower --target ascend
--check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import TOKENS, Program
from .ascend import AscendChip, chip_of_arch, default_chip, get_chip, npu_vector_core_count
from .kernel import Kernel

STAGES = ("ttir", "linalg", "npubin")
NEEDS_CANN = "needs CANN"
_TT_OP = re.compile(r"(?:=\s*|^\s*)\"?tt\.[a-z_]+", re.M)


@dataclass
class StageResult:
    name: str
    status: str  # "ok" | "failed" | NEEDS_CANN
    seconds: float = 0.0
    detail: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class CheckReport:
    kernel_name: str
    arch: str
    signature: dict
    constants: dict
    stages: list[StageResult] = field(default_factory=list)
    linalg: str | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return all(s.status != "failed" for s in self.stages) and bool(self.stages)

    @property
    def summary(self) -> str:
        return ", ".join(f"{s.name} {s.status}" for s in self.stages)

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel_name,
            "arch": self.arch,
            "passed": self.passed,
            "signature": self.signature,
            "constants": self.constants,
            "stages": [s.to_dict() for s in self.stages],
        }


def triton_ascend_missing() -> str | None:
    """Why Triton-Ascend's compiler cannot be imported here (None: it can)."""
    try:
        import triton.backends.ascend.compiler  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------- launcher arguments


class _Recorder:
    """Stands in for the Triton function: ``fn[grid](*args, **kwargs)`` records the call."""

    def __init__(self) -> None:
        self.grid: Any = None
        self.args: tuple = ()
        self.kwargs: dict = {}

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.grid, self.args, self.kwargs = grid, args, kwargs

        return launch


def _meta_inputs(program: Program, tokens: int) -> list[torch.Tensor]:
    out = []
    for v in program.inputs:
        shape = [tokens if s == TOKENS else (64 if isinstance(s, str) else s) for s in v.aval.shape]
        out.append(torch.empty(shape, dtype=v.aval.dtype, device="meta"))
    return out


def launch_arguments(kernel: Kernel, tokens: int = 1024) -> tuple[tuple, dict, Any]:
    """(positional args, keyword args, grid) the kernel's launcher passes for ``tokens`` tokens."""
    rec = _Recorder()
    probe = dataclasses.replace(kernel, fn=rec)
    probe(*_meta_inputs(kernel.program, tokens))
    return rec.args, rec.kwargs, rec.grid


def kernel_signature(jit_fn, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Triton-Ascend's ``ASTSource`` signature and constants for one launch.

    Constexpr parameters appear in the signature as ``"constexpr"`` with their values in
    ``constants`` (triton-ascend 3.2's ``ASTSource(fn, signature, constants=...)``).
    """
    from triton.runtime.jit import mangle_type

    params = jit_fn.params
    runtime = [p for p in params if not p.is_constexpr]
    if len(args) != len(runtime):
        raise ValueError(
            f"{jit_fn.__name__}: the launcher passes {len(args)} runtime arguments, "
            f"the kernel takes {len(runtime)}"
        )
    signature, constants = {}, {}
    for p, a in zip(runtime, args):
        signature[p.name] = mangle_type(a)
    for p in params:
        if p.is_constexpr:
            if p.name not in kwargs:
                raise ValueError(
                    f"{jit_fn.__name__}: constexpr {p.name} is not set by the launcher"
                )
            signature[p.name] = "constexpr"
            constants[p.name] = kwargs[p.name]
    return signature, constants


# ----------------------------------------------------------------------- the stages


def bishengir_compile_path() -> str | None:
    """CANN's ``bishengir-compile`` (or ``$TRITON_NPU_COMPILER_PATH/npuc``), if present."""
    import os

    found = shutil.which("bishengir-compile")
    if found:
        return found
    root = os.environ.get("TRITON_NPU_COMPILER_PATH")
    if root and os.access(os.path.join(root, "npuc"), os.X_OK):
        return os.path.join(root, "npuc")
    return None


def _tool_error(e: BaseException) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        err = (
            (e.stderr or b"").decode(errors="replace")
            if isinstance(e.stderr, bytes)
            else (e.stderr or "")
        )
        tool = e.cmd[0] if isinstance(e.cmd, (list, tuple)) and e.cmd else e.cmd
        # The tool's own message comes before LLVM's stack dump.
        message = err.split("Stack dump:")[0].strip() or err.strip()
        return f"{tool} exited {e.returncode}: {message[-3000:]}"
    return f"{type(e).__name__}: {e}"


# Triton-Ascend 3.2.0 reads whether it compiles for the 950 (Ascend910_95) from a module global
# in these modules, set where it is built for that chip and False otherwise, not from the
# compile options: its frontend refuses the fp8 types while it is False.
_ON_910_95_MODULES = (
    "triton.triton_patch.language.core",
    "triton.triton_patch.language.semantic",
    "triton.backends.ascend.compiler",
)


@contextlib.contextmanager
def _compiling_for(chip: AscendChip):
    """Set Triton-Ascend's ``is_compile_on_910_95`` globals to the chip's for one compile
    (restored after), so a 950 compile check sees the frontend a 950 build has (FP8 types)."""
    import sys

    saved = {}
    for name in _ON_910_95_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "is_compile_on_910_95"):
            saved[name] = getattr(module, "is_compile_on_910_95")  # noqa: B009
            setattr(module, "is_compile_on_910_95", chip.compile_on_910_95)  # noqa: B010
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(sys.modules[name], "is_compile_on_910_95", value)  # noqa: B010


def compile_stages(
    jit_fn, signature: dict, constants: dict, chip: AscendChip, run_npubin: bool | None = None
) -> tuple[list[StageResult], str | None]:
    """Run the Ascend stages on ``jit_fn``; returns the stage results and the linalg text.
    Needs Triton-Ascend (the Ascend environment): ImportError otherwise."""
    from triton.backends.ascend.compiler import AscendBackend  # noqa: F401  (loads the modules)

    with _compiling_for(chip):
        return _compile_stages(jit_fn, signature, constants, chip, run_npubin)


ADAPTER_ATTEMPTS = 3


def _adapter_lowering(lower_to_linalg, ttir, metadata: dict) -> tuple[str, list[str]]:
    """Run ``triton-adapter-opt`` on ``ttir``; returns the linalg text and the crashes retried.

    triton-ascend 3.2.0's ``triton-adapter-opt`` aborts now and then on input it lowers on the
    next run (an MLIR assertion, "Malformed type storage object": seen once in 135 x 4 sweeps).
    A death by signal on the same input is retried up to ``ADAPTER_ATTEMPTS`` times and named
    in the stage's detail; a compile error (a non-zero exit) is the check's finding at once."""
    crashes: list[str] = []
    while True:
        try:
            return lower_to_linalg(ttir, metadata), crashes
        except subprocess.CalledProcessError as e:
            if e.returncode >= 0 or len(crashes) + 1 >= ADAPTER_ATTEMPTS:
                raise
            crashes.append(_tool_error(e).splitlines()[0][:300])


def _compile_stages(
    jit_fn, signature: dict, constants: dict, chip: AscendChip, run_npubin: bool | None
) -> tuple[list[StageResult], str | None]:
    from triton._C.libtriton import ir
    from triton.backends.ascend.compiler import AscendBackend
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    backend = AscendBackend(GPUTarget("npu", chip.arch, 0))
    options = backend.parse_options(
        {"compile_on_910_95": chip.compile_on_910_95, "multibuffer": chip.multibuffer}
    )
    stages: dict = {}
    backend.add_stages(stages, options)
    metadata = {
        "enable_nd2nz_on_vector": options.enable_nd2nz_on_vector,
        "enable_select_analysis": options.enable_select_analysis,
        "compile_on_910_95": options.compile_on_910_95,
        "force_simt_template": options.force_simt_template,
        "target": backend.target,
        **{k: getattr(options, k) for k in options.__dataclass_fields__},
    }
    results: list[StageResult] = []

    t0 = time.perf_counter()
    try:
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        src = ASTSource(jit_fn, signature, constants=constants)
        module = src.make_ir(
            options, backend.get_codegen_implementation(), backend.get_module_map(), context
        )
        ttir = stages["ttir"](module, metadata)
        ttir_text = str(ttir)
        results.append(
            StageResult(
                "ttir",
                "ok",
                time.perf_counter() - t0,
                f"{ttir_text.count(chr(10))} lines of Triton IR",
            )
        )
    except Exception as e:  # noqa: BLE001 -- any compiler error is the check's finding
        results.append(StageResult("ttir", "failed", time.perf_counter() - t0, _tool_error(e)))
        return results, None

    t0 = time.perf_counter()
    try:
        linalg, crashes = _adapter_lowering(stages["ttadapter"], ttir, metadata)
        leftover = _TT_OP.findall(linalg)
        if leftover:
            raise RuntimeError(f"triton ops left after lowering: {sorted(set(leftover))[:5]}")
        modes = dict(re.findall(r'(mix_mode|parallel_mode)\s*=\s*"([^"]+)"', linalg))
        results.append(
            StageResult(
                "linalg",
                "ok",
                time.perf_counter() - t0,
                f"triton-adapter-opt -> Ascend linalg/HIVM, {linalg.count(chr(10))} lines, "
                f"mix_mode={modes.get('mix_mode', '?')} "
                f"parallel_mode={modes.get('parallel_mode', '?')}"
                + "".join(f"; retried after a crash: {c}" for c in crashes),
            )
        )
    except Exception as e:  # noqa: BLE001
        results.append(StageResult("linalg", "failed", time.perf_counter() - t0, _tool_error(e)))
        return results, None

    compiler = bishengir_compile_path()
    if run_npubin is False or (run_npubin is None and compiler is None):
        results.append(
            StageResult(
                "npubin",
                NEEDS_CANN,
                0.0,
                "bishengir-compile (CANN toolkit) is not installed: the HIVM -> NPU binary step "
                "runs "
                "only where CANN is; everything before it passed",
            )
        )
        return results, linalg
    t0 = time.perf_counter()
    try:
        import os

        # Ask bishengir for the UB it allocates: the measure the profile's model estimates.
        previous = os.environ.get("ENABLE_PRINT_UB_BITS")
        os.environ["ENABLE_PRINT_UB_BITS"] = "1"
        try:
            binary = stages["npubin"](linalg, metadata)
        finally:
            if previous is None:
                os.environ.pop("ENABLE_PRINT_UB_BITS", None)
            else:
                os.environ["ENABLE_PRINT_UB_BITS"] = previous
        ub = metadata.get("required_ub_bits")
        results.append(
            StageResult(
                "npubin",
                "ok",
                time.perf_counter() - t0,
                f"{compiler}: {len(binary)} bytes"
                + (f", UB {ub / 8 / 1024:.1f} KiB" if ub else ""),
            )
        )
    except Exception as e:  # noqa: BLE001
        results.append(StageResult("npubin", "failed", time.perf_counter() - t0, _tool_error(e)))
    return results, linalg


def check_kernel(
    kernel, chip: AscendChip | str | None = None, tokens: int = 1024, run_npubin: bool | None = None
) -> CheckReport:
    """Compile an ``ascend``-target :class:`~fqr.lowering.kernel.Kernel` for an NPU target."""
    if kernel.target.flavour != "ascend" or kernel.target.interpret:
        raise ValueError(
            f"the ascend compile check needs a kernel lowered for target 'ascend', "
            f"got {kernel.target.name!r}"
        )
    if not isinstance(chip, AscendChip):
        named = chip or kernel.options.get("chip")
        chip = get_chip(named) if named else default_chip(kernel.plan)
    args, kwargs, _grid = launch_arguments(kernel, tokens)
    signature, constants = kernel_signature(kernel.fn, args, kwargs)
    stages, linalg = compile_stages(kernel.fn, signature, constants, chip, run_npubin)
    return CheckReport(kernel.fn.__name__, chip.arch, signature, constants, stages, linalg)


# ----------------------------------------------------------------------- environment facts


def ascend_facts() -> dict:
    """What ``fqr doctor`` reports for Ascend: CANN's compiler and the visible NPUs."""
    import importlib.util

    devices: list[str] = []
    facts: dict[str, Any] = {"bishengir-compile": bishengir_compile_path(), "npu_devices": devices}
    if importlib.util.find_spec("torch_npu") is None:
        return facts
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        npu = torch.npu  # type: ignore[attr-defined]
        for i in range(npu.device_count() if npu.is_available() else 0):
            name = npu.get_device_name(i)
            try:
                chip, cores = chip_of_arch(name).name, str(npu_vector_core_count(i))
            except Exception as e:  # noqa: BLE001 -- report, do not fail the doctor
                chip, cores = "?", f"unknown ({type(e).__name__}: {e})"
            devices.append(f"{i}: {name} ({chip}, {cores} vector cores)")
    except Exception as e:  # noqa: BLE001
        facts["npu_devices"] = [f"torch_npu failed: {type(e).__name__}: {e}"]
    return facts
