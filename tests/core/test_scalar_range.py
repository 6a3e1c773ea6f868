"""Real scalars past float's range (issue 41): an int of 401 digits given as ``theta``,
``eps``, ``weight_offset``, ``rope_theta``, a scaling's ``factor`` or ``partial_rotary_factor``
is a ValueError naming the argument (``float(10**400)`` raised ``OverflowError`` before, and
``rope_cos_sin_cache`` built a NaN table from a NaN ``theta``). Every check of a real scalar
converts through :func:`fqr.validate.as_float`; messages show such an int by its length."""

from __future__ import annotations

import math

import pytest
import torch

from fqr.presets import Preset, PrologueSpec
from fqr.rope_cache import rope_cos_sin_cache

BIG = 10**400


def _preset(**fields) -> Preset:
    base = dict(
        name="x", hf_id="x", num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e4,
        max_position=64,
    )  # fmt: skip
    return Preset(**(base | fields))


TABLE_CASES = [
    ("theta", lambda: rope_cos_sin_cache(64, 64, BIG)),
    ("theta", lambda: rope_cos_sin_cache(64, 64, -BIG)),
    ("theta", lambda: rope_cos_sin_cache(64, 64, math.nan)),
    ("theta", lambda: rope_cos_sin_cache(64, 64, math.inf)),
    (
        r"scaling\['factor'\]",
        lambda: rope_cos_sin_cache(64, 64, 1e4, {"rope_type": "linear", "factor": BIG}),
    ),
    (
        r"scaling\['partial_rotary_factor'\]",
        lambda: rope_cos_sin_cache(
            64, 64, 1e4, {"rope_type": "proportional", "partial_rotary_factor": BIG}
        ),
    ),
    (
        r"scaling\['factor'\]",
        lambda: rope_cos_sin_cache(64, 64, 1e4, {"rope_type": "linear", "factor": math.nan}),
    ),
    ("rotary_dim", lambda: rope_cos_sin_cache(-BIG, 64, 1e4)),
    ("max_position", lambda: rope_cos_sin_cache(64, -BIG, 1e4)),
    ("eps", lambda: PrologueSpec(4, 2, 64, 64, eps=BIG)),
    ("weight_offset", lambda: PrologueSpec(4, 2, 64, 64, weight_offset=BIG)),
    ("weight_offset", lambda: PrologueSpec(4, 2, 64, 64, weight_offset=-(10**5000))),
    ("eps", lambda: PrologueSpec(4, 2, 64, 64, eps=math.nan)),
    ("rope_theta", lambda: _preset(rope_theta=BIG)),
    ("rope_theta", lambda: _preset(rope_theta=math.nan)),
    ("partial_rotary_factor", lambda: _preset(partial_rotary_factor=BIG)),
    (
        r"rope_scaling\['factor'\]",
        lambda: _preset(rope_scaling=(("rope_type", "linear"), ("factor", BIG))),
    ),
    ("eps", lambda: _preset(eps=BIG)),
    ("weight_offset", lambda: _preset(weight_offset=-BIG)),
    ("max_position", lambda: _preset(max_position=-(10**5000))),
]


@pytest.mark.parametrize("name, call", TABLE_CASES, ids=[f"{i}" for i in range(len(TABLE_CASES))])
def test_out_of_range_scalars_are_refused_naming_them(name, call):
    with pytest.raises(ValueError, match=f"^{name} must be") as raised:
        call()
    assert len(str(raised.value)) < 200  # never the 401 digits spelled out
    assert "\n" not in str(raised.value)


def test_a_huge_but_finite_int_theta_builds_the_float_table():
    """An int theta inside float's range is the float table (torch took ints as int64)."""
    torch.testing.assert_close(
        rope_cos_sin_cache(8, 4, 10**30, dtype=torch.float64),
        rope_cos_sin_cache(8, 4, 1e30, dtype=torch.float64),
        rtol=0,
        atol=0,
    )


def test_as_float_saturates_and_shown_abbreviates():
    from fqr.validate import as_float, shown

    assert as_float(BIG) == math.inf and as_float(-BIG) == -math.inf
    assert as_float(3) == 3.0
    assert shown(BIG) == "an integer of 401 digits"
    assert shown(-(10**5000)) == "a negative integer of more than 4000 digits"
    assert shown(12) == "12" and shown(0.5) == "0.5"
