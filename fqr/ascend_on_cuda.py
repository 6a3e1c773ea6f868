"""``ascend-on-cuda``: the Ascend kernel under true parallelism, on a CUDA GPU.

The ``ascend`` target's kernel (:mod:`fqr.lowering.ascend`: a persistent grid of one program
per vector core, each looping over UB-sized token tiles) otherwise runs only under
interpreters, which execute the programs one after another: a race between programs (a
program reading a tile another program is still writing, or a position read back from a tile
whose load is still in flight, the flaw of vllm-ascend issue 16674) could never show there.

This target takes exactly the ``ascend`` source (same tiling for the default chip, same
emitted text, same kernel name and cache entry), compiles it with upstream Triton for a CUDA
GPU, and launches it with a grid sized like an Ascend chip: :data:`DEFAULT_PROGRAMS` programs
(an Atlas A2: 20 AI cores x 2 vector cores; the ``num_vectorcore`` option sets 20..48 or any
count), never more than there are token tiles. At 10,000 tokens and 2-16-token tiles every
program runs dozens of tiles, concurrently with the others, so a race shows as wrong outputs.

* backend ``ascend-on-cuda`` (:mod:`fqr.backends`): ``fqr verify --backend ascend-on-cuda``;
* :func:`compile_offline`: the same source through upstream Triton's stages (TTIR -> TTGIR ->
  LLVM IR -> PTX -> cubin) for a CUDA arch, on any machine with upstream Triton (no GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

NAME = "ascend-on-cuda"
DEFAULT_PROGRAMS = 40  # fqr.lowering.ascend.DEFAULT_NUM_VECTORCORE: an Atlas A2's vector cores
PROGRAM_RANGE = (20, 48)  # Ascend chips' vector-core counts this target is exercised with


def register_target():
    """Register the ``ascend-on-cuda`` target profile (idempotent); returns it."""
    from .lowering.ascend import AscendTarget
    from .lowering.targets import TARGETS

    if NAME not in TARGETS:
        TARGETS[NAME] = AscendTarget(
            NAME,
            flavour="upstream",
            source_target="ascend",
            default_vector_cores=DEFAULT_PROGRAMS,
        )
    return TARGETS[NAME]


def lower_ascend_on_cuda(program, **options):
    """``fqr.lowering.lower(program, "ascend-on-cuda", **options)`` (``num_vectorcore``: the
    grid; ``chip``/``ub_bytes``: the Ascend tiling the source is emitted for)."""
    from .lowering import lower

    register_target()
    return lower(program, NAME, **options)


@dataclass
class OfflineCompile:
    kernel_name: str
    arch: int
    block_t: int
    grid: tuple
    stages: tuple[str, ...]
    seconds: float
    shared_bytes: int


def compile_offline(program, arch: int = 90, tokens: int = 10_000, **options) -> OfflineCompile:
    """Compile the ``ascend`` source of ``program`` with upstream Triton for ``sm_<arch>``,
    with exactly the arguments the launcher passes for ``tokens`` tokens. Needs upstream
    Triton loaded for compiling (``TRITON_INTERPRET=0``), not a GPU; raises what Triton raises
    when a construct of the source does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from .lowering.ascend_check import kernel_signature, launch_arguments

    kernel = lower_ascend_on_cuda(program, **options)
    args, kwargs, grid = launch_arguments(kernel, tokens)
    signature, constants = kernel_signature(kernel.fn, args, kwargs)
    names = kernel.fn.arg_names
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(kernel.fn, signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={k: v for k, v in kwargs.items() if k == "num_warps"},
    )
    return OfflineCompile(
        kernel_name=kernel.fn.__name__,
        arch=arch,
        block_t=int(kwargs["BLOCK_T"]),
        grid=tuple(grid),
        stages=tuple(compiled.asm),
        seconds=time.perf_counter() - start,
        shared_bytes=int(compiled.metadata.shared),
    )
