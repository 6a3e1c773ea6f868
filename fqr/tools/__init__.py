"""Tools above the public ops: they sweep presets through the lowering and keep its goldens.

* :mod:`.ascend_check`  -- every preset at TP 1/2/4/8 through Triton-Ascend's compiler
  (``fqr lower --target ascend --check``);
* :mod:`.golden_kernels` -- generated kernel sources kept as golden files (``golden/kernels/``).
"""
