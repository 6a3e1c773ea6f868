"""Every golden case on the compiled kernel (backend ``triton``) of a CUDA GPU: what ``fqr
verify --backend triton`` checks, as tests, so that the build run on ``meta``
(``tests/gpu/conftest.py``) compiles the goldens' kernels into the GPU suite's bundle too.
Skipped without a GPU (except in the build run)."""

from __future__ import annotations

import pytest
from support.devices import GPU_DEVICE, gpu_marks, has_values

from fqr.golden import list_cases, load_case

pytestmark = gpu_marks()


@pytest.mark.parametrize("entry", list_cases(), ids=lambda e: e["name"])
def test_golden_case_on_triton(entry):
    case = load_case(entry)
    outputs = case.to(GPU_DEVICE).run("triton")
    if not has_values(*outputs):
        return
    checks = case.check(*outputs)  # where the outputs are (golden.py moves its expectations)
    assert checks, entry["name"]
    for name, c in checks.items():
        assert c.passed, f"{entry['name']} {name}: {c}"
