"""The drop-in examples run as a user runs them (issue 13): ``examples/hf_qwen3_compile.py``
compiles a transformers Qwen3 from a tiny config with ``fqr.fusion.backend()`` (every layer
fused, logits against eager), ``examples/vllm_attention_layer.py`` runs its custom attention
layer in both write forms against float64 and fqr's pass in a vLLM-style pass manager. In this
process (the fusion patterns, built once per process, are shared with the other fusion tests);
tiny shapes, CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fqr.fusion.hf_models import transformers_missing

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"fqr_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(transformers_missing() is not None, reason=str(transformers_missing()))
def test_hf_qwen3_example_fuses_every_layer(capsys):
    result = load_example("hf_qwen3_compile").run(layers=1, tokens=8, device="cpu")
    assert result["sites_fused"] == result["layers"] == 1
    assert 0 <= result["logits_rel_err"] <= result["tolerance"] and result["ok"]
    assert "fused 1/1 attention prologues" in capsys.readouterr().out


@pytest.mark.slow
def test_vllm_example_layer_and_pass_manager(capsys):
    assert load_example("vllm_attention_layer").main(["--device", "cpu", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("within the contract: yes") == 2 and "fused 1/1 prologues" in out
