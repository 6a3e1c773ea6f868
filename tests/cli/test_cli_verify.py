"""`fqr verify` and `fqr golden` as a user runs them (subprocess: real exit codes, streams)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import fqr_in_process

from fqr.backends import BACKENDS, available_backends
from fqr.golden import GOLDEN_DIR, list_cases, peer_kwargs

REPO = Path(__file__).resolve().parents[2]


def fqr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fqr", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_verify_reference_passes_every_case():
    r = fqr("verify", "--backend", "reference")
    assert r.returncode == 0, r.stdout + r.stderr
    for e in list_cases():
        assert e["name"] in r.stdout
    assert "FAIL" not in r.stdout and f"{len(list_cases())} pass" in r.stderr


def test_verify_names_each_backend_it_skips_and_why():
    """A plain ``fqr verify`` runs every available backend; each other one gets one stderr line
    with the reason (an install command where installing is the remedy)."""
    r = fqr("verify", "--case", "glm4-9b-bf16-t7-*", "--json")
    assert r.returncode == 0, r.stderr
    ran = json.loads(r.stdout)["backends"]
    skipped = [line for line in r.stderr.splitlines() if line.startswith("skipped ")]
    assert sorted(ran + [line.split()[1].rstrip(":") for line in skipped]) == sorted(BACKENDS)
    for line in skipped:  # the reason as the backend gives it (this process's may differ)
        assert len(line.split(": ", 1)[1]) > 10, line
    if "ascend-interpret" not in ran:
        assert "skipped ascend-interpret: triton-ascend is not installed (" in r.stderr
    if "interpret" not in ran:
        triton_missing = "upstream triton is not installed (pip install 'fqr[triton]')"
        assert f"skipped interpret: {triton_missing}" in r.stderr
    named = fqr("verify", "--backend", "reference", "--case", "glm4-9b-bf16-t7-*")
    assert named.returncode == 0 and "skipped" not in named.stderr  # the user chose


def test_verify_json_is_one_parseable_document():
    r = fqr("verify", "--backend", "reference", "--case", "glm4-9b-*", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    names = [e["name"] for e in list_cases(pattern="glm4-9b-*")]
    assert doc["schema"] == "fqr.verify/1" and doc["ok"] is True
    assert doc["backends"] == ["reference"]
    assert [row["case"] for row in doc["results"]] == names
    inplace = {e["name"] for e in list_cases(pattern="glm4-9b-*") if "inplace" in peer_kwargs(e)}
    assert inplace
    variants = {e["name"]: e["variant"] for e in list_cases(pattern="glm4-9b-*")}
    assert set(variants.values()) == {"split-qkv", "qk-rope"}
    projected = {e["name"] for e in list_cases(pattern="glm4-9b-*") if "projected" in e}
    assert projected
    for row in doc["results"]:
        if variants[row["case"]] == "qk-rope":  # RoPE of q and k alone
            assert row["status"] == "pass" and set(row["outputs"]) == {"q", "k"}
            continue
        # an in-place case also checks every byte of the row outside q and k
        outputs = {"q", "k", "v"} | ({"qkv"} if row["case"] in inplace else set())
        assert row["status"] == "pass" and set(row["outputs"]) == outputs
        if row["case"] not in projected:  # v copied from the row (projected: the product)
            assert row["outputs"]["v"]["max_abs"] == 0.0


def test_verify_json_names_a_variant_case_outputs():
    r = fqr("verify", "--backend", "reference", "--case", "qwen3.5-27b-bf16-*-fused", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["results"]
    assert row["status"] == "pass" and set(row["outputs"]) == {"q", "k", "v", "gate"}
    assert row["outputs"]["v"]["max_abs"] == row["outputs"]["gate"]["max_abs"] == 0.0


def test_tampered_golden_file_is_reported_corrupt(tmp_path):
    case = list_cases(pattern="glm4-9b-fp16-t7-*")[0]
    shutil.copy(GOLDEN_DIR / "manifest.json", tmp_path)
    shutil.copy(GOLDEN_DIR / case["file"], tmp_path)
    data = bytearray((tmp_path / case["file"]).read_bytes())
    data[len(data) // 2] ^= 0x10
    (tmp_path / case["file"]).write_bytes(bytes(data))
    r = fqr(
        "verify",
        "--backend",
        "reference",
        "--golden-dir",
        str(tmp_path),
        "--case",
        case["name"],
        "--json",
    )
    assert r.returncode == 1, r.stderr
    (row,) = json.loads(r.stdout)["results"]
    assert row["status"] == "corrupt" and "sha256" in row["detail"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["verify", "--backend", "no-such-backend"], "--backend"),
        (["verify", "--backend", "reference", "--case", "no-such-case*"], "--case"),
        (["verify", "--backend", "ascend"], "ascend"),  # known but unavailable on this machine
        (["verify", "--golden-dir", "/nonexistent-golden"], "manifest"),
        (["golden", "list", "--case", "no-such-case*"], "--case"),
    ],
)
def test_bad_usage_exits_2_with_one_line(args, needle, capsys, monkeypatch):
    """In this process (:mod:`support.cli`): the files above run the real entry point."""
    code, out, err = fqr_in_process(args, capsys, monkeypatch)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert out == ""


def test_golden_list_json_and_regen_subset(tmp_path):
    r = fqr("golden", "list", "--json")
    assert r.returncode == 0
    assert [c["name"] for c in json.loads(r.stdout)["cases"]] == [e["name"] for e in list_cases()]
    r = fqr("golden", "regen", "--dir", str(tmp_path), "--case", "llama3-8b-fp32-*")
    assert r.returncode == 0, r.stderr
    (regenerated,) = list_cases(tmp_path)
    (shipped,) = list_cases(pattern="llama3-8b-fp32-*")
    assert regenerated["seed"] == shipped["seed"] and regenerated["name"] == shipped["name"]


@pytest.mark.slow
@pytest.mark.skipif("interpret" not in available_backends(), reason="upstream triton not installed")
def test_verify_interpret_passes_every_case():
    """The generated kernel under the Triton interpreter, on every golden case (CI's check)."""
    r = fqr("verify", "--backend", "interpret", "--json")
    doc = json.loads(r.stdout)
    failed = [
        (row["case"], row["status"], row.get("detail"))
        for row in doc["results"]
        if row["status"] != "pass"
    ]
    assert r.returncode == 0 and not failed, failed
    assert len(doc["results"]) == len(list_cases())
