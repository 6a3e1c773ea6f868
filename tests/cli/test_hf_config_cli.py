"""``fqr hf-config`` (issue 33): whether fqr builds a verified preset from a transformers config
(a config.json, a checkpoint directory, a model type). In-process through ``fqr_cli.app.main``:
exit 0 and the preset for a supported config, exit 1 and the one line ``Preset.from_hf_config``
refuses it with, exit 2 and one line on stderr (nothing on stdout) for bad input."""

from __future__ import annotations

import json

import pytest
from support.cli import fqr_in_process as fqr

from fqr.presets import Preset

transformers = pytest.importorskip("transformers")


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
    config = transformers.JetMoeConfig()
    write_config(tmp_path, config)
    with pytest.raises(ValueError) as refusal:
        Preset.from_hf_config(config)
    code, out, err = fqr(["hf-config", str(tmp_path)], capsys, monkeypatch)
    assert (code, out, err) == (1, f"refused: {refusal.value}\n", "")
    code, out, _ = fqr(["hf-config", "jetmoe", "--json"], capsys, monkeypatch)
    doc = json.loads(out)
    assert (code, doc["ok"], doc["refused"]) == (1, False, str(refusal.value))
    assert "its own attention prologue" in doc["refused"]


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


def _json(tmp_path, name: str, text: str):
    (tmp_path / name).write_text(text)
    return tmp_path / name


BIG = "9" * 401  # an int beyond every float
# Issue 41: each was a traceback (exit 1), a hang or an unbounded read before; each is exit 2
# and one line naming the argument or the key
HOSTILE = [
    ("heads 0", '{"model_type":"llama","num_attention_heads":0}', "config.num_attention_heads"),
    (
        "heads str",
        '{"model_type":"llama","num_attention_heads":"16"}',
        "config.num_attention_heads",
    ),
    ("heads nan", '{"model_type":"llama","num_attention_heads":NaN}', "config.num_attention_heads"),
    ("heads 1e12", '{"model_type":"llama","num_attention_heads":1000000000000}', "config.num_att"),
    ("layers 1e12", '{"model_type":"llama","num_hidden_layers":1000000000000}', "config.num_hid"),
    (
        "text_config heads 0",
        '{"model_type":"qwen3_vl","text_config":{"num_attention_heads":0}}',
        "config.text_config.num_attention_heads",
    ),
    ("rope_scaling str", '{"model_type":"llama","rope_scaling":"yarn"}', "config.rope_scaling"),
    ("rope_scaling list", '{"model_type":"llama","rope_scaling":[1, 2]}', "config.rope_scaling"),
    (
        "hidden not a multiple",
        '{"model_type":"llama","hidden_size":4000,"num_attention_heads":32}',
        "transformers builds no config of it",
    ),
    ("theta 401 digits", f'{{"model_type":"llama","rope_theta":{BIG}}}', "['rope_theta']"),
    (
        "linear factor 401 digits",
        f'{{"model_type":"llama","rope_scaling":{{"rope_type":"linear","factor":{BIG}}}}}',
        "['factor']",
    ),
    (
        "partial_rotary_factor 401 digits",
        f'{{"model_type":"stablelm","partial_rotary_factor":{BIG}}}',
        "['partial_rotary_factor']",
    ),
    (
        "nested 200,000 deep",
        '{"model_type":"llama","x":' + "[" * 200_000 + "]" * 200_000 + "}",
        "nested too deeply",
    ),
    (
        "nested 100 deep",
        '{"model_type":"llama","x":' + "[" * 100 + "]" * 100 + "}",
        "config.x nests",
    ),
    ("not utf-8", '{"model_type":"llama","x":"\udcff"}', "not UTF-8"),
]


@pytest.mark.parametrize("text,names", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_a_hostile_config_is_one_line_naming_its_key_and_exit_2(
    text, names, tmp_path, capsys, monkeypatch
):
    path = tmp_path / "c.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    code, out, err = fqr(["hf-config", str(path)], capsys, monkeypatch)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: CONFIG {path}: "), err
    assert names in err, err


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_device_is_refused_unread(tmp_path, capsys, monkeypatch):
    """A FIFO hung ``fqr hf-config`` forever; a link to ``/dev/zero`` read without bound."""
    import os

    os.mkfifo(tmp_path / "fifo.json")
    targets = [tmp_path / "fifo.json"]
    if os.path.exists("/dev/zero"):
        os.symlink("/dev/zero", tmp_path / "zero.json")
        targets.append(tmp_path / "zero.json")
    for path in targets:
        code, out, err = fqr(["hf-config", str(path)], capsys, monkeypatch)
        assert (code, out) == (2, "")
        assert err == f"error: CONFIG {path}: not a regular file (a config.json is one)\n"


def test_an_oversized_config_is_refused_unread(tmp_path, capsys, monkeypatch):
    from fqr_cli import hf_config

    monkeypatch.setattr(hf_config, "MAX_CONFIG_BYTES", 64)
    path = _json(tmp_path, "c.json", '{"model_type": "llama", "x": "' + "y" * 100 + '"}')
    code, out, err = fqr(["hf-config", str(path)], capsys, monkeypatch)
    assert (code, out) == (2, "") and "132 bytes, over the 64 a config.json may have" in err


def test_an_escape_sequence_in_the_config_is_printed_escaped(tmp_path, capsys, monkeypatch):
    """``_name_or_path`` was printed raw on the "supported:" line (a terminal escape)."""
    path = _json(tmp_path, "c.json", '{"model_type":"llama","_name_or_path":"\\u001b[31mred"}')
    code, out, err = fqr(["hf-config", str(path)], capsys, monkeypatch)
    assert code == 0, err
    assert "\x1b" not in out and out.startswith("supported: \\x1b[31mred: hq=32")
