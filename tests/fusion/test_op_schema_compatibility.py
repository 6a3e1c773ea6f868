"""``torch.ops.fqr.*`` stay callable as released: vLLM-style callers (fqr's own Inductor
pass among them) pass every argument positionally, so a new argument may only be appended
after the released ones, with a default.

``data/released_op_schemas.txt`` holds the schemas as released (main 3385c09); an op is only
ever added to it, never edited.
"""

from pathlib import Path

import pytest
import torch

import fqr  # noqa: F401  (registers torch.ops.fqr)

RELEASED = [
    torch._C.parse_schema(line)
    for line in (Path(__file__).parent / "data" / "released_op_schemas.txt")
    .read_text()
    .splitlines()
    if line.strip()
]


def _current(name: str):
    op = getattr(torch.ops.fqr, name.removeprefix("fqr::"))
    return op.default._schema


@pytest.mark.parametrize("released", RELEASED, ids=lambda s: s.name)
def test_released_arguments_keep_their_positions(released):
    current = _current(released.name)
    now = [(a.name, str(a.type)) for a in current.arguments]
    then = [(a.name, str(a.type)) for a in released.arguments]
    assert now[: len(then)] == then, f"{released.name}: {current}"
    for old, new in zip(released.arguments, current.arguments, strict=False):
        assert new.has_default_value() or not old.has_default_value(), new.name
    appended = current.arguments[len(then) :]
    assert all(a.has_default_value() for a in appended), [a.name for a in appended]
    assert [str(r.type) for r in current.returns] == [str(r.type) for r in released.returns]
