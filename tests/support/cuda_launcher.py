"""Triton's own ``CudaLauncher`` built without CUDA, over a C ``launch`` function of the test's
choosing: what fqr's direct launcher and generated host functions call on a GPU, run on the CPU
(the kernel body never runs)."""

from __future__ import annotations


def cuda_launcher(launch, **fields):
    """A ``CudaLauncher`` whose ``__call__`` runs as Triton's does, calling ``launch`` (a
    stand-in for the launcher module's C function) with the packed arguments; ``fields``
    override its metadata (the defaults: one CTA, no scratch, no PDL)."""
    from triton.backends.nvidia.driver import CudaLauncher

    runner = object.__new__(CudaLauncher)
    values = dict(
        launch=launch,
        gsan_enabled=False,
        global_scratch_size=0,
        global_scratch_align=1,
        profile_scratch_size=0,
        profile_scratch_align=1,
        num_ctas=1,
        launch_cooperative_grid=False,
        launch_pdl=False,
        arg_annotations=(),
        kernel_signature=(),
    )
    for name, value in (values | fields).items():
        setattr(runner, name, value)
    return runner
