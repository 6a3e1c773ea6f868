"""The golden cases of the projected form (issue 40: ``fqr.<op>_proj``, :mod:`fqr.prologue.
projected`): declared beside each variant's other cases (``CaseSpec.hidden``), stored as ``x``,
``w_qkv`` (``qkv_bias``) and the op's other inputs, their expectations the float64 composition
``fqr.reference.project`` then the prologue's reference. They verify on the CPU backends
(``tests/cli/test_cli_verify.py`` runs every case on reference and interpret through the CLI),
regenerate to the same bytes, and a malformed projected case is ``corrupt`` like any other
(the pattern of ``test_golden_hostile.py``)."""

from __future__ import annotations

import functools
import hashlib
import json

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from support.golden_dirs import copy_case, write_manifest
from support.peer_ports import INTERPRET

import fqr
from fqr import golden, reference
from fqr.core import DTYPE_NAMES
from fqr.golden import GOLDEN_DIR, GoldenCorrupt, list_cases, load_case, regen
from fqr.prologue import VARIANTS, get_variant

PROJECTED = [c for c in golden.CASES if c.hidden is not None]
NAMES = [c.name for c in PROJECTED]
SMALL = "qwen3-8b-tp16-fp16-t1-fused-proj80"  # the smallest projected case file
BIASED = "glm4-9b-tp16-fp16-t3-fused-proj200-qkvbias"


@pytest.fixture(scope="module")
def entries():
    return {e["name"]: e for e in list_cases(pattern="*-proj*")}


@functools.cache
def _load(name: str):
    """A shipped case, loaded once for this file's tests (none of them changes its tensors)."""
    return load_case(name)


def test_every_variant_with_a_projected_form_has_cases():
    """Derived from the declarations: each variant whose op has a projected form has cases of
    it (and only those variants), in bf16, fp16 and fp32, with and without the projection's
    bias, K at most 256 and not always a power of two, odd token counts, fused numerics."""
    forms = {name for name, v in VARIANTS.items() if v.projected is not None}
    assert {c.variant_name for c in PROJECTED} == forms
    assert {c.dtype for c in PROJECTED} == {"bf16", "fp16", "fp32"}
    assert {c.qkv_bias for c in PROJECTED} == {True, False}
    assert all(c.hidden <= 256 and c.tokens % 2 and c.numerics == "fused" for c in PROJECTED)
    assert any(c.hidden & (c.hidden - 1) for c in PROJECTED)  # K = 80, 200, ...
    assert all(c.name.split("-")[-1] in (f"proj{c.hidden}", "qkvbias") for c in PROJECTED)


def test_the_cases_cover_the_split_ops_variations(entries):
    rows = [e for e in entries.values() if e["variant"] == "split-qkv"]

    def have(**kw):
        return [e for e in rows if all(e[k] == v for k, v in kw.items())]

    for kw in (
        dict(is_neox=False),
        dict(is_neox=True),
        dict(bias=True),
        dict(weight_offset=1.0),
        dict(norm="full"),
        dict(norm="none"),
        dict(norm="head"),
    ):
        assert have(**kw), kw
    assert any(e["rotary_dim"] < e["head_dim"] for e in rows)  # partial rotary


@pytest.mark.parametrize("name", NAMES)
def test_an_entry_records_the_projection(entries, name):
    e = entries[name]
    k, n, t = e["projected"]["hidden"], e["row_stride"], e["tokens"]
    tensors = e["tensors"]
    assert tensors["x"] == [e["dtype"], [t, k]] and tensors["w_qkv"] == [e["dtype"], [n, k]]
    assert ("qkv_bias" in tensors) == e["projected"]["qkv_bias"]
    assert "qkv" not in tensors and e["numerics"] == "fused"
    # the outputs of the variant, each held to the contract (v is the product, not a copy)
    variant = get_variant(e["variant"])
    assert e["outputs"] == list(variant.outputs_of(fqr.get_preset(e["preset"], e["tp"])))
    assert set(e["tolerance_kinds"].values()) == {"contract"}
    assert _load(name).variant.declaration.name == variant.declaration.name + "_proj"


@pytest.mark.parametrize("name", NAMES)
def test_expectations_are_the_float64_composition(name):
    """A fresh float64 recomputation from the stored (already rounded) inputs: the projection
    in float64 (:func:`fqr.reference.project`) then the variant's float64 reference; and
    fqr.ops' traced program of the projected op (a second, independent formulation) computed
    in float64 agrees to its fp32 outputs' one rounding."""
    case = _load(name)
    x, variant, preset = case.inputs, get_variant(case.entry["variant"]), case.preset
    row = reference.project(x["x"], x["w_qkv"], x.get("qkv_bias"))
    rest = {k: v for k, v in x.items() if k not in ("x", "w_qkv", "qkv_bias")}
    fresh = variant.expected(preset, {"qkv": row, **rest}, case.cos_sin_cache)
    # the projected op takes activations (fp32 at most): its fp32 program, computed in float64
    program = case.variant.program(
        preset, torch.float32, bias=case.entry["bias"], positions_dtype=x["positions"].dtype
    )
    wide = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    args = case.variant.program_args(preset, wide, case.cos_sin_cache)
    traced = fqr.eval_program(program, args, compute_dtype=torch.float64)
    for out, got in zip(case.entry["outputs"], traced, strict=True):
        want = case.expected[out]
        assert want.dtype == torch.float64 and torch.isfinite(want).all()
        # float64 reductions may differ in the last bit across CPUs; the math may not
        torch.testing.assert_close(fresh[out].double(), want, atol=1e-12, rtol=1e-12)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-30, rtol=2**-24)


@pytest.mark.parametrize("backend", ["reference", INTERPRET])
def test_a_wrong_output_fails(backend):
    """The projected kernel's outputs pass, and one output two ULPs off fails: the case checks
    what the kernel computes (every case on interpret: test_verify_interpret_passes_every_case)."""
    case = _load(BIASED)
    outs = case.run(backend)
    assert all(c.passed for c in case.check(*outs).values())
    worse = outs[2].clone()  # v: the product, rounded once
    worse.view(torch.int16)[0, 3] += 2
    assert not case.check(outs[0], outs[1], worse)["v"].passed


def test_regen_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        regen(d, f"{SMALL}*")
        regen(d, f"{BIASED}*")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) == 3
    for file in files:
        assert (a / file).read_bytes() == (b / file).read_bytes(), file
    for name in (SMALL, BIASED):
        fresh, shipped = load_case(name, a), load_case(name, GOLDEN_DIR)
        assert fresh.entry["seed"] == shipped.entry["seed"]
        for n, t in shipped.inputs.items():  # the inputs bit for bit
            assert torch.equal(fresh.inputs[n], t), n
        for n, t in shipped.expected.items():
            torch.testing.assert_close(fresh.expected[n], t, atol=1e-13, rtol=1e-13)


# ------------------------------------------------------------------------- hostile files


@pytest.fixture
def copy(tmp_path):
    """A golden directory holding one shipped projected case: (directory, its entry)."""
    return copy_case(tmp_path, BIASED)


def _corrupt(d, needle: str):
    (row,) = list_cases(d)
    assert needle in row.get("corrupt", "") or "corrupt" not in row
    with pytest.raises(GoldenCorrupt, match=needle) as e:
        load_case(row, d)
    assert str(e.value).isprintable()


MALFORMED = [
    ("projected a number", lambda e: dict(e, projected=200), "'projected' must map"),
    ("hidden zero", lambda e: dict(e, projected=dict(e["projected"], hidden=0)), "'projected'"),
    ("hidden text", lambda e: dict(e, projected=dict(e["projected"], hidden="200")), "'hidden'"),
    ("hidden float", lambda e: dict(e, projected=dict(e["projected"], hidden=200.0)), "hidden"),
    ("qkv_bias text", lambda e: dict(e, projected=dict(e["projected"], qkv_bias="y")), "qkv_b"),
    ("extra key", lambda e: dict(e, projected=dict(e["projected"], rows=3)), "exactly"),
    ("unfused", lambda e: dict(e, numerics="unfused"), "must be fused"),
    ("a peer form", lambda e: dict(e, peer={"rope": True}), "'peer'"),
    ("no projected form", lambda e: dict(e, variant="kv-insert"), "no projected form"),
    # without its "projected", a split-qkv entry is a row case: its file holds no qkv
    ("projected dropped", lambda e: {k: v for k, v in e.items() if k != "projected"}, "'qkv'"),
    ("hidden not the file's", lambda e: dict(e, projected=dict(e["projected"], hidden=80)), "x"),
    (
        "no qkv_bias stored",
        lambda e: dict(e, projected=dict(e["projected"], qkv_bias=False)),
        "qkv_bias",
    ),  # fmt: skip
    ("row_stride not the file's", lambda e: dict(e, row_stride=e["row_stride"] + 1), "w_qkv"),
]


@pytest.mark.parametrize("label,mutate,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_projected_entry_is_corrupt(copy, label, mutate, needle):
    d, entry = copy
    write_manifest(d, [mutate(dict(entry))])
    _corrupt(d, needle)


def _rewrite(d, entry, tensors):
    """Replace the case file by ``tensors``, its manifest record, sha256 and size updated (a
    consistent but wrong case, as an editor of the golden directory would leave it)."""
    data = save_safetensors(tensors)
    (d / entry["file"]).write_bytes(data)
    record = {n: [DTYPE_NAMES[x.dtype], list(x.shape)] for n, x in tensors.items()}
    sha = hashlib.sha256(data).hexdigest()
    write_manifest(d, [dict(entry, tensors=record, sha256=sha, bytes=len(data))])


WRONG_TENSORS = [
    ("x narrow", lambda t: dict(t, x=t["x"][:, 1:].contiguous()), "'x'"),
    ("x fp32", lambda t: dict(t, x=t["x"].float()), "'x'"),
    ("w_qkv a row short", lambda t: dict(t, w_qkv=t["w_qkv"][1:].contiguous()), "'w_qkv'"),
    ("qkv_bias dropped", lambda t: {k: v for k, v in t.items() if k != "qkv_bias"}, "qkv_bias"),
    ("qkv stored", lambda t: dict(t, qkv=torch.zeros(3, 768, dtype=torch.float16)), "'qkv'"),
    ("a stray input", lambda t: dict(t, scale=torch.ones(1)), "not an argument"),
]


@pytest.mark.parametrize("label,change,needle", WRONG_TENSORS, ids=[w[0] for w in WRONG_TENSORS])
def test_a_projected_file_with_a_wrong_tensor_is_corrupt(copy, label, change, needle):
    d, entry = copy
    tensors = dict(load_safetensors((d / entry["file"]).read_bytes()))
    _rewrite(d, entry, change(tensors))
    _corrupt(d, needle)


def test_a_tampered_projected_file_is_corrupt_in_verify(copy, capsys, monkeypatch):
    """One flipped byte: ``fqr verify`` reports the case ``corrupt`` (sha256), exit 1."""
    from support.cli import fqr_in_process

    d, entry = copy
    path = d / entry["file"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    args = ["verify", "--backend", "reference", "--golden-dir", str(d), "--json"]
    code, out, err = fqr_in_process(args, capsys, monkeypatch)
    (row,) = json.loads(out)["results"]
    assert code == 1 and row["status"] == "corrupt" and "sha256" in row["detail"]


def test_the_commands_count_the_projected_cases(capsys, monkeypatch):
    """``fqr golden list`` (every case: one without q, a cache insert, shows its first
    output's tolerance) counts the projected cases among the others; ``fqr verify`` passes
    every one of them on the reference backend."""
    from support.cli import fqr_in_process

    code, out, err = fqr_in_process(["golden", "list"], capsys, monkeypatch)
    assert code == 0 and f"{len(golden.CASES)} cases, " in err
    assert "key_cache: " in out and all(name in out for name in NAMES)
    args = ["verify", "--backend", "reference", "--case", "*-proj*"]
    code, out, err = fqr_in_process(args, capsys, monkeypatch)
    assert code == 0 and f"{len(NAMES)} cases x 1 backends (reference): {len(NAMES)} pass" in err
