"""``fqr bench --cold-start`` on a machine without a GPU: refused with one line before any
process is started or any bundle built (its measurement runs on the GPU: docs/PERFORMANCE.md,
"Cold start")."""

from __future__ import annotations

import sys

import pytest
import torch


@pytest.mark.parametrize(
    "args, line",
    [
        (["--bundle", "/tmp"], "error: --bundle is the kernel bundle of --cold-start"),
        (["--cold-start", "--from-json", "x.json"], "error: --cold-start measures; it takes no"),
        (["--cold-start", "--preset", "nope"], "error: --preset:"),
        (["--cold-start"], "error: fqr bench needs a CUDA GPU"),
    ],
    ids=["bundle-alone", "from-json", "preset", "no-gpu"],
)
def test_cold_start_misuse_is_one_line(args, line, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the no-GPU refusal needs a machine without one")
    from fqr_cli.app import main

    monkeypatch.setattr(sys, "argv", ["fqr", "bench", *args])
    with pytest.raises(SystemExit) as e:
        main()
    _, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.count("\n") == 1 and err.startswith(line), err
