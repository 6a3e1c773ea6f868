"""The docstring of every public op (``help(fqr.<op>)``) lists its parameters with their
defaults, the backends and what ``backend="auto"`` picks, and carries an example that runs:
each example is a doctest run here (CPU tensors, tiny shapes), so CI fails when one breaks."""

from __future__ import annotations

import doctest

import pytest

import fqr
from fqr.backends import AUTO_BACKENDS, BACKENDS
from fqr.prologue import DECLARATIONS


@pytest.mark.parametrize("name", sorted(DECLARATIONS))
def test_public_op_docstring_lists_backends_defaults_and_runs_its_example(name):
    function = getattr(fqr, name)
    doc = function.__doc__
    assert doc is not None and ">>> " in doc, f"{name}: its declaration's doc= has no example"
    # the parameters with their defaults, the backends and auto's choice per device
    assert "``backend`` = 'auto'" in doc and "``numerics`` = 'fused'" in doc
    for backend in BACKENDS:
        assert backend in doc
    for device, backend in AUTO_BACKENDS.items():
        assert f"{backend} on {device}" in doc
    test = doctest.DocTestParser().get_doctest(doc, {}, f"fqr.{name}", f"fqr.{name}", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: print(text, end=""))
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
