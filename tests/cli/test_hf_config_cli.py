"""``fqr hf-config`` (issue 33): whether fqr builds a verified preset from a transformers config
(a config.json, a checkpoint directory, a model type). In-process through ``fqr_cli.app.main``:
exit 0 and the preset for a supported config, exit 1 and the one line ``Preset.from_hf_config``
refuses it with, exit 2 and one line on stderr (nothing on stdout) for bad input."""

from __future__ import annotations

import json
import sys

import pytest
from fqr_cli.app import main

from fqr.presets import Preset

transformers = pytest.importorskip("transformers")


def fqr(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["fqr", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def write_config(path, config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)


def test_a_supported_config_prints_its_preset(tmp_path, capsys, monkeypatch):
    config = transformers.MistralConfig(num_attention_heads=8, num_key_value_heads=2)
    write_config(tmp_path / "ckpt", config)
    code, out, err = fqr(["hf-config", str(tmp_path / "ckpt")], capsys, monkeypatch)
    assert code == 0, err
    preset = Preset.from_hf_config(config)
    assert out.startswith(f"supported: {preset.summary.split(':', 1)[0]}")
    assert f"hq={preset.num_heads} hkv={preset.num_kv_heads}" in out
    code, out, _ = fqr(
        ["hf-config", str(tmp_path / "ckpt" / "config.json"), "--json"], capsys, monkeypatch
    )
    doc = json.loads(out)
    assert (code, doc["schema"], doc["ok"]) == (0, "fqr.hf-config/1", True)
    assert (doc["model_type"], doc["variant"], doc["numerics"]) == (
        "mistral",
        "split-qkv",
        "unfused",
    )


def test_a_refused_config_prints_the_one_line_and_exits_1(tmp_path, capsys, monkeypatch):
    config = transformers.CodeGenConfig()
    write_config(tmp_path, config)
    with pytest.raises(ValueError) as refusal:
        Preset.from_hf_config(config)
    code, out, err = fqr(["hf-config", str(tmp_path)], capsys, monkeypatch)
    assert (code, out, err) == (1, f"refused: {refusal.value}\n", "")
    code, out, _ = fqr(["hf-config", "codegen", "--json"], capsys, monkeypatch)
    doc = json.loads(out)
    assert (code, doc["ok"], doc["refused"]) == (1, False, str(refusal.value))
    assert "a preset builder for CodeGen's config" in doc["refused"]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: d / "missing.json", "missing.json: No such file or directory"),
        (lambda d: (d / "bad.json").write_text("{") and d / "bad.json", "not JSON"),
        (lambda d: (d / "n.json").write_text("[1]") and d / "n.json", "has a model_type"),
        (lambda d: "no_such_model_type", "transformers builds no config of it"),
    ],
    ids=["missing file", "not json", "no model_type", "unknown model type"],
)
def test_bad_input_is_one_line_and_exit_2(make, message, tmp_path, capsys, monkeypatch):
    code, out, err = fqr(["hf-config", str(make(tmp_path))], capsys, monkeypatch)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: CONFIG ") and message in err, err
