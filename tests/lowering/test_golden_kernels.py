"""The generated sources in golden/kernels/ are what the emitter produces today."""

import difflib
from pathlib import Path

import pytest

from fqr.tools.golden_kernels import GOLDEN_KERNELS, render

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "kernels"


@pytest.mark.parametrize(
    "stem, preset, tp, dtype, numerics, target", GOLDEN_KERNELS, ids=[g[0] for g in GOLDEN_KERNELS]
)
def test_generated_source_matches_golden(stem, preset, tp, dtype, numerics, target):
    expected = (GOLDEN / f"{stem}.py").read_text()
    actual = render(preset, tp, dtype, numerics, target)
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(True),
            actual.splitlines(True),
            f"golden/kernels/{stem}.py",
            "generated",
        )
    )
    assert not diff, "emitter output changed (run `fqr golden regen` if intended):\n" + diff
