"""The norm-variant presets on the CLI: ``fqr lower`` shows each one's own program, and the
commands that serve only split_qkv_rmsnorm_rope's prologue (``fqr run``, ``fqr fuse``) refuse a
variant preset with one line and exit 2 instead of running the wrong prologue."""

from __future__ import annotations

import pytest
from support.cli import fqr_in_process as fqr


@pytest.mark.parametrize(
    "preset, op",
    [
        ("gemma4-31b-full", "rms_norm[count=512 eps=1e-06 group=512 offset=0.0] h _ _ _"),
        ("llama4-scout", "rms_norm[count=128 eps=1e-05 group=128 offset=0.0] g _ _ _"),
        ("llama4-scout-nope", "attn_temperature[attn_scale=0.1 floor_scale=8192.0]"),
    ],
)
def test_lower_ir_is_the_variants_program(capsys, monkeypatch, preset, op):
    code, out, err = fqr(["lower", "--preset", preset, "--tp", "8", "--ir"], capsys, monkeypatch)
    assert code == 0, err
    assert op in out


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--preset", "gemma4-31b-sliding", "--requests", "1"],
        ["fuse", "--preset", "gemma4-31b-sliding"],
        ["fuse", "--preset", "llama4-scout"],
    ],
)
def test_split_qkv_only_commands_refuse_a_variant_preset(capsys, monkeypatch, args):
    code, out, err = fqr(args, capsys, monkeypatch)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--preset" in err and "prologue" in err
