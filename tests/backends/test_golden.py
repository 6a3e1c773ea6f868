"""The golden files: coverage, storage, integrity, deterministic regeneration, and that the
expectations agree with the pure ops run in float64 (a second, independent formulation)."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

import fqr
from fqr import golden
from fqr.golden import GOLDEN_DIR, GoldenCorrupt, list_cases, load_case, peer_kwargs, regen

SUBSET = "glm4-9b-bf16-t7-*"  # cheap cases for regeneration tests
SUBSET_2 = "olmo2-7b-tp4-*"


@pytest.fixture(scope="module")
def entries():
    return list_cases()


def test_manifest_lists_every_case_with_its_metadata(entries):
    assert [e["name"] for e in entries] == [c.name for c in golden.CASES]
    keys = {
        "name",
        "file",
        "sha256",
        "seed",
        "preset",
        "tp",
        "dtype",
        "numerics",
        "tokens",
        "bias",
        "is_neox",
        "rotary_dim",
        "norm",
        "eps",
        "weight_offset",
        "max_position",
        "tolerance",
    }
    for e in entries:
        assert keys <= e.keys(), keys - e.keys()
        assert hashlib.sha256((GOLDEN_DIR / e["file"]).read_bytes()).hexdigest() == e["sha256"]


def test_cases_cover_the_required_variations(entries):
    def have(**kw):
        return [e for e in entries if all(e[k] == v for k, v in kw.items())]

    # every preset, the stand-alone cache insert's (no positions, no RoPE table) included
    assert {e["preset"] for e in entries} == set(fqr.PRESETS)
    assert {e["dtype"] for e in entries} == {"bf16", "fp16", "fp32"}
    assert {e["tokens"] for e in entries} >= {1, 7, 257}
    for kw in (
        dict(bias=True),
        dict(bias=False),
        dict(is_neox=False),
        dict(is_neox=True),
        dict(norm="full"),
        dict(norm="none"),
        dict(norm="head"),
        dict(weight_offset=1.0),
        dict(numerics="fused"),
        dict(numerics="unfused"),
        dict(norm_stats=True),
        dict(positions_dtype="int32"),
        dict(variant="mrope"),
        dict(variant="mrope-gate"),
    ):
        assert have(**kw), kw
    assert any(e["rotary_dim"] < e["head_dim"] for e in entries)
    assert any(
        e["row_stride"] > (e["num_heads"] + 2 * e["num_kv_heads"]) * e["head_dim"] for e in entries
    )
    assert max(e["max_position"] for e in entries) >= 1 << 18  # MiniMax-M3: 2^20


def test_golden_dir_stays_small():
    """The goldens ship in the wheel. (30 MB since the MLA cases: a paged MLA cache's
    expectation is a whole 64-entry block in float64, 295 KB a case; 32 MB since the MLA
    forms engines call (issue 32: the stand-alone insert, FP8 caches as vLLM allocates them,
    FlashInfer's two caches), one case per cache flavour. 33 MB since issue 39's new forms:
    checkpoint row layouts, LayerNorm on q/k, RMSNorm after RoPE, small cases of each. 37 MB
    since issue 40's projected cases: each stores its weight w_qkv, K <= 256 columns of a TP
    view's few heads, 90-300 KB a case.)"""
    total = sum(f.stat().st_size for f in GOLDEN_DIR.rglob("*") if f.is_file())
    assert total < 37e6, f"golden/ is {total / 1e6:.1f} MB"


# the cases of the packed row (a projected case's float64 check: test_golden_projected.py)
ROW_CASES = [c for c in golden.CASES if c.hidden is None]
SPLIT_QKV_CASES = [c.name for c in ROW_CASES if c.variant_name == "split-qkv"]
MROPE_CASES = [c.name for c in ROW_CASES if c.variant_name in ("mrope", "mrope-gate")]


@pytest.mark.parametrize("name", SPLIT_QKV_CASES)
def test_expectations_agree_with_the_ops_in_float64(name):
    """fqr.ops composed in float64 (not the code that wrote the goldens) reproduces them."""
    case = load_case(name)
    e = case.entry
    if e.get("variant", "split-qkv") != "split-qkv":  # the variant's program, in float64
        program = case.variant.program(
            case.preset, torch.float64, positions_dtype=case.inputs["positions"].dtype
        )
        inputs = {n: x.double() if x.is_floating_point() else x for n, x in case.inputs.items()}
        outs = fqr.eval_program(
            program, case.variant.program_args(case.preset, inputs, case.cos_sin_cache)
        )
        for out_name, out in zip(e["outputs"], outs):
            want = case.expected[out_name]
            if e["tolerance_kinds"][out_name] == "bitwise":
                assert torch.equal(out.to(want.dtype), want), out_name
            else:
                torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
        return
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    stats = case.norm_stats()
    q, k, v = fqr.attention_prologue(
        to64(case.qkv),
        case.positions,
        case.cos_sin_cache,
        to64(case.q_weight),
        to64(case.k_weight),
        to64(case.q_bias),
        to64(case.k_bias),
        None if stats is None else stats.q_sum_sq,
        None if stats is None else stats.k_sum_sq,
        num_heads=e["num_heads"],
        num_kv_heads=e["num_kv_heads"],
        head_dim=e["head_dim"],
        eps=e["eps"],
        is_neox=e["is_neox"],
        weight_offset=e["weight_offset"],
        norm=e["norm"],
        numerics="fused",
        q_count=None if stats is None else stats.q_count,
        k_count=None if stats is None else stats.k_count,
        **{k: v for k, v in peer_kwargs(e).items() if k != "inplace"},  # the layout
    )
    torch.testing.assert_close(q, case.expected_q, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(k, case.expected_k, atol=1e-12, rtol=1e-12)
    assert torch.equal(v.to(case.expected_v.dtype), case.expected_v)


@pytest.mark.parametrize("name", MROPE_CASES)
def test_mrope_expectations_agree_with_the_ops_in_float64(name):
    """fqr.ops' mRoPE composition (fqr.prologue.mrope_attention_prologue) in float64 on the
    stored inputs reproduces the stored float64 expectations and copies."""
    from fqr.prologue.mrope import mrope_attention_prologue

    case = load_case(name)
    e, x = case.entry, case.inputs
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    planes = x["positions"].unbind(0)
    outs = mrope_attention_prologue(
        to64(x["qkv"]),
        *planes,
        case.cos_sin_cache,
        to64(x["q_weight"]),
        to64(x["k_weight"]),
        to64(x.get("q_bias")),
        to64(x.get("k_bias")),
        num_heads=e["num_heads"],
        num_kv_heads=e["num_kv_heads"],
        head_dim=e["head_dim"],
        mrope_section=tuple(e["variant_params"]["mrope_section"]),
        mrope_interleaved=e["variant_params"]["mrope_interleaved"],
        eps=e["eps"],
        is_neox=e["is_neox"],
        weight_offset=e["weight_offset"],
        output_gate=e["variant"] == "mrope-gate",
        numerics="fused",
    )
    assert len(outs) == len(e["outputs"])
    for out_name, got in zip(e["outputs"], outs):
        want = case.expected[out_name]
        if case.variant.tolerance(out_name) == "bitwise":
            assert torch.equal(got.to(want.dtype), want), out_name
        else:
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_loaded_table_is_real_where_used_and_nan_elsewhere():
    case = load_case("olmo2-7b-bf16-t7-fused")
    preset = fqr.get_preset("olmo2-7b")
    table, used = case.cos_sin_cache, torch.unique(case.positions.long())
    assert table.shape == (case.entry["max_position"], preset.rotary_dim)
    assert torch.equal(table[used], preset.cos_sin_cache(case.entry["max_position"])[used])
    unused = torch.ones(table.shape[0], dtype=torch.bool)
    unused[used] = False
    assert torch.isnan(table[unused]).all()


def test_a_kernel_reading_the_wrong_table_row_fails_loudly():
    case = load_case("qwen3-8b-fp16-t7-unfused")
    kwargs = case.kwargs()
    wrong = (case.positions + 1) % case.entry["max_position"]
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        case.qkv,
        wrong,
        case.cos_sin_cache,
        case.q_weight,
        case.k_weight,
        **kwargs,
        backend="reference",
    )
    checks = case.check(q, k, v)
    assert not checks["q"].passed and checks["q"].nonfinite > 0


def test_strided_case_places_qkv_in_a_wider_nan_buffer():
    case = load_case("qwen3-8b-tp8-bf16-t257-fused-i32-strided")
    width = case.qkv.shape[1]
    assert case.qkv.stride(0) == case.entry["row_stride"] > width
    assert torch.isnan(case.qkv_buffer[:, width:]).all() and not torch.isnan(case.qkv).any()
    assert case.positions.dtype == torch.int32


def test_reference_backend_passes_and_fails_on_a_wrong_output():
    case = load_case("gemma3-27b-fp16-t1-fused")
    q, k, v = case.run("reference")
    assert all(c.passed for c in case.check(q, k, v).values())
    worse = q.clone()
    worse.view(torch.int16)[0, 5] += 2  # two ULPs off
    assert not case.check(worse, k, v)["q"].passed
    v_bad = v.clone()
    v_bad.view(torch.int16)[0, 0] += 1
    assert not case.check(q, k, v_bad)["v"].passed


def test_tampered_or_missing_file_is_corrupt(tmp_path):
    regen(tmp_path, SUBSET)
    entry = list_cases(tmp_path)[0]
    path = tmp_path / entry["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenCorrupt, match="sha256"):
        load_case(entry["name"], tmp_path)
    path.unlink()
    with pytest.raises(GoldenCorrupt, match="missing"):
        load_case(entry["name"], tmp_path)


def test_regen_is_deterministic_and_matches_the_bundled_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        regen(d, SUBSET)
        regen(d, SUBSET_2)  # a filtered regen keeps the entries it did not rebuild
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) == 3
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    bundled = {e["name"]: e for e in list_cases()}
    for e in list_cases(a):
        fresh, shipped = load_case(e["name"], a), load_case(e["name"], GOLDEN_DIR)
        assert e["seed"] == bundled[e["name"]]["seed"]
        assert torch.equal(fresh.qkv, shipped.qkv) and torch.equal(
            fresh.positions, shipped.positions
        )
        # float64 reductions may differ in the last bit across CPUs; the math may not
        torch.testing.assert_close(fresh.expected_q, shipped.expected_q, atol=1e-13, rtol=1e-13)


def test_regen_rejects_a_pattern_matching_nothing(tmp_path):
    with pytest.raises(ValueError, match="pattern"):
        regen(tmp_path, "no-such-case*")


def test_regen_into_a_copy_keeps_unselected_entries(tmp_path):
    shutil.copy(GOLDEN_DIR / "manifest.json", tmp_path / "manifest.json")
    regen(tmp_path, SUBSET)
    assert [e["name"] for e in list_cases(tmp_path)] == [c.name for c in golden.CASES]
