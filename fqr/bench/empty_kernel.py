"""An empty Triton kernel: the bench's floor of any launch (:func:`fqr.bench.floors.
empty_kernel_us`). Its own module so that importing the bench needs no Triton."""

import triton


@triton.jit
def empty_kernel():
    pass
