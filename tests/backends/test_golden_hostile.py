"""Malformed golden directories (issue 14, findings 5 and 6): a manifest that cannot be read
is one clear error naming it; any malformed entry or case file is a ``corrupt`` case with the
reason (never a KeyError/IndexError/SafetensorError); nothing outside the golden directory is
ever read (``..``, absolute paths, symlinks).

Issue 23: a case cannot make load_case build an unbounded table or buffer (finding 4), a
case name or text with control characters is corrupt (8), and ``regen`` never writes through a
symlink planted in the directory (3)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from support.golden_dirs import copy_case, write_manifest

from fqr import golden
from fqr.golden import GOLDEN_DIR, GoldenCorrupt, list_cases, load_case, regen

CASE = "qwen3-0.6b-bf16-t7-fused"
VARIANT_CASE = "deepseek-v3-q-rope-tp16-bf16-t1-unfused"  # the smallest variant case file


@pytest.fixture
def copy(tmp_path):
    """A golden directory holding one shipped case: (directory, its manifest entry)."""
    return copy_case(tmp_path, CASE)


def _rewrite_file(d, entry, tensors):
    """Replace the case file by ``tensors`` and update the manifest's sha256 and size (a
    consistent but wrong file, as an editor of the golden directory would leave it)."""
    data = save_safetensors(tensors)
    (d / entry["file"]).write_bytes(data)
    entry = dict(entry, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    write_manifest(d, [entry])
    return entry


def _corrupt(d, needle: str):
    """The case lists as corrupt and loads as GoldenCorrupt, both saying ``needle``."""
    (row,) = list_cases(d)
    assert needle in row.get("corrupt", "") or "corrupt" not in row
    with pytest.raises(GoldenCorrupt, match=needle):
        load_case(row["name"], d)
    with pytest.raises(GoldenCorrupt, match=needle):
        load_case(row, d)


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "not a golden manifest"),
        (b'{"format": "other/9", "cases": []}', "unknown golden format"),
        (b'{"format": "fqr-golden/1"}', "cases"),
        (b'{"format": "fqr-golden/1", "cases": {"a": 1}}', "cases"),
    ],
)
def test_an_unreadable_manifest_is_one_error_naming_it(tmp_path, data, needle):
    (tmp_path / "manifest.json").write_bytes(data)
    with pytest.raises(ValueError, match=needle) as e:
        list_cases(tmp_path)
    assert str(tmp_path / "manifest.json") in str(e.value)


def test_a_symlinked_manifest_is_refused(tmp_path, copy):
    d, _ = copy
    real = tmp_path / "elsewhere.json"
    os.replace(d / "manifest.json", real)
    (d / "manifest.json").symlink_to(real)
    with pytest.raises(ValueError, match="symlink"):
        list_cases(d)


MALFORMED_ENTRIES = [
    ("a string", lambda e: "qwen"),
    ("no name", lambda e: {k: v for k, v in e.items() if k != "name"}),
    ("no file", lambda e: {k: v for k, v in e.items() if k != "file"}),
    ("no sha256", lambda e: {k: v for k, v in e.items() if k != "sha256"}),
    ("no row_stride", lambda e: {k: v for k, v in e.items() if k != "row_stride"}),
    ("row_stride text", lambda e: dict(e, row_stride="4096")),
    ("row_stride short", lambda e: dict(e, row_stride=e["row_stride"] - 1)),
    ("max_position zero", lambda e: dict(e, max_position=0)),
    ("num_heads float", lambda e: dict(e, num_heads=16.0)),
    ("eps nan", lambda e: dict(e, eps=float("nan"))),
    ("norm unknown", lambda e: dict(e, norm="layer")),
    ("dtype unknown", lambda e: dict(e, dtype="fp8")),
    ("preset unknown", lambda e: dict(e, preset="no-such-model")),
    ("tolerance list", lambda e: dict(e, tolerance=["<=1 ulp"])),
    ("sha256 short", lambda e: dict(e, sha256="abc")),
    ("file up", lambda e: dict(e, file="../../../../etc/passwd")),
    ("file absolute", lambda e: dict(e, file="/etc/passwd")),
    ("file in a subdirectory", lambda e: dict(e, file=f"sub/{e['file']}")),
    ("file empty", lambda e: dict(e, file="")),
    # issue 23, finding 4: load_case builds the [max_position, R] table and the padded qkv
    # buffer whole (2**40 ended verify in a traceback from torch.full; 2**26 asked 32 GiB)
    ("max_position 2**40", lambda e: dict(e, max_position=2**40)),
    ("max_position 2**26", lambda e: dict(e, max_position=2**26)),
    ("row_stride 2**40", lambda e: dict(e, row_stride=2**40)),
    # issue 23, finding 8: text that would reach a terminal as an escape sequence
    ("name with an escape sequence", lambda e: dict(e, name="qwen\x1b[2J\x1b[31mred")),
    ("name with a C1 control", lambda e: dict(e, name="qwen\x9b31m")),
    ("name with a bidi override", lambda e: dict(e, name="qwen\u202eevil")),
    ("tolerance with a bell", lambda e: dict(e, tolerance=dict(e["tolerance"], q="ok\x07"))),
    ("file with an escape sequence", lambda e: dict(e, file="a\x1b]0;title\x07.safetensors")),
]


@pytest.mark.parametrize("label,mutate", MALFORMED_ENTRIES, ids=[m[0] for m in MALFORMED_ENTRIES])
def test_a_malformed_entry_is_a_corrupt_case(copy, label, mutate):
    d, entry = copy
    write_manifest(d, [mutate(dict(entry))])
    (row,) = list_cases(d)
    assert "corrupt" in row and row["corrupt"], row
    assert isinstance(row["name"], str) and row["name"]
    assert row["name"].isprintable() and row["corrupt"].isprintable()  # shown as is
    with pytest.raises(GoldenCorrupt) as e:
        load_case(row, d)
    assert str(e.value).isprintable()


def test_the_largest_preset_table_is_the_bound():
    """The bounds are what the longest real context needs (Llama 4 Scout: 10M positions of
    128), and every shipped case is within them."""
    assert golden.MAX_POSITION == 10_485_760 and golden.MAX_TABLE_ELEMENTS == 10_485_760 * 128
    for e in list_cases():
        assert e["max_position"] <= golden.MAX_POSITION


def _variant_copy(d):
    (entry,) = list_cases(pattern=VARIANT_CASE)
    shutil.copy(GOLDEN_DIR / entry["file"], d / entry["file"])
    return entry


def _wider_rows(t):
    return dict(t, cos_sin_rows=t["cos_sin_rows"].repeat(1, 64).contiguous())  # 64 -> 4096 wide


CRAFTED_TABLES = [
    # 10M rows (the bound) of 4096: 160 GiB asked of torch.full before the bound on elements
    ("too wide for its rows", _wider_rows, {"max_position": 10_485_760}, "RoPE table"),
    ("rows 1-D", lambda t: dict(t, cos_sin_rows=t["cos_sin_rows"][0].contiguous()), {}, "rotary"),
    ("index float", lambda t: dict(t, cos_sin_index=t["cos_sin_index"].float()), {}, "int64"),
    ("index 2-D", lambda t: dict(t, cos_sin_index=t["cos_sin_index"][None]), {}, "int64"),
]


@pytest.mark.parametrize(
    "label,change,fields,needle", CRAFTED_TABLES, ids=[c[0] for c in CRAFTED_TABLES]
)
def test_a_variant_case_cannot_ask_for_an_unbounded_or_malformed_table(
    tmp_path, label, change, fields, needle
):
    """A variant entry records its tensors' shapes itself: the stored RoPE rows are checked
    before load_case builds the table from them (they ended in IndexError or torch.full)."""
    entry = _variant_copy(tmp_path)
    t = change(_tensors(tmp_path, entry))
    record = {n: [golden.DTYPE_NAMES[x.dtype], list(x.shape)] for n, x in t.items()}
    entry = dict(entry, tensors=record, **fields)
    _rewrite_file(tmp_path, entry, t)
    _corrupt(tmp_path, needle)


def test_verify_reports_an_unbounded_case_and_checks_the_others(copy):
    """2**40 rows: the case is corrupt (reported with the reason); the next case still runs."""
    from fqr_cli.verify import verify_one

    d, entry = copy
    write_manifest(d, [dict(entry, name="huge", max_position=2**40), entry])
    huge, good = list_cases(d)
    assert "max_position" in huge["corrupt"] and "corrupt" not in good
    with pytest.raises(GoldenCorrupt, match="max_position"):
        load_case(huge, d)
    assert verify_one(load_case(good, d), "reference")["status"] == "pass"


# ---------------------------------------------------------------- writes (issue 23, finding 3)


def _plant(d, name, victim):
    """A symlink ``d/name`` -> ``victim`` (a file someone else owns, say)."""
    victim.write_bytes(b"precious")
    (d / name).symlink_to(victim)
    return victim


@pytest.mark.parametrize("planted", [f"{CASE}.safetensors", "manifest.json"])
def test_regen_never_writes_through_a_planted_symlink(tmp_path, planted):
    """``regen --case C`` into a directory where ``C.safetensors`` or ``manifest.json`` is a
    symlink: refused naming it, before anything is written (it overwrote the link's target)."""
    d = tmp_path / "g"
    d.mkdir()
    victim = _plant(d, planted, tmp_path / "victim")
    with pytest.raises(OSError, match="symlink") as e:
        regen(d, CASE)
    assert str(d / planted) in str(e.value)
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in d.iterdir()) == [planted] and (d / planted).is_symlink()


def test_regen_never_fills_a_planted_kernels_directory(tmp_path, monkeypatch):
    """A full regen writes golden/kernels/*.py: a ``kernels`` symlink is refused, nothing
    written (its files went into the link's target directory)."""
    monkeypatch.setattr(golden, "CASES", tuple(golden.select_cases(CASE)))
    d, elsewhere = tmp_path / "g", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    (d / "kernels").symlink_to(elsewhere)
    with pytest.raises(OSError, match="symlink") as e:
        regen(d)
    assert str(d / "kernels") in str(e.value)
    assert list(elsewhere.iterdir()) == [] and [p.name for p in d.iterdir()] == ["kernels"]


def test_regen_replaces_files_atomically_and_keeps_their_mode(tmp_path):
    """A regular file is replaced (a fresh inode: a hard link to it elsewhere is untouched),
    its permission bits kept; no temporary file is left behind."""
    d = tmp_path / "g"
    regen(d, CASE)
    case_file = d / f"{CASE}.safetensors"
    linked = tmp_path / "hard-link"
    os.link(case_file, linked)
    before = linked.read_bytes()
    case_file.write_bytes(b"stale")  # through the link too: both names, one inode
    os.chmod(case_file, 0o640)
    regen(d, CASE)
    assert case_file.read_bytes() == before and linked.read_bytes() == b"stale"
    assert (case_file.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", case_file.name]


def test_a_file_outside_the_directory_is_never_opened(copy, tmp_path, monkeypatch):
    d, entry = copy
    secret = tmp_path.parent / f"{tmp_path.name}-secret.safetensors"
    secret.write_bytes((d / entry["file"]).read_bytes())  # even a valid case file
    for file in (f"../{secret.name}", str(secret)):
        write_manifest(d, [dict(entry, file=file)])
        opened = []
        for module, name in ((os, "open"), (io, "open")):
            real = getattr(module, name)
            monkeypatch.setattr(
                module,
                name,
                lambda p, *a, _real=real, _seen=opened, **k: (
                    _seen.append(str(p)) or _real(p, *a, **k)
                ),
            )
        with pytest.raises(GoldenCorrupt, match="file"):
            load_case(entry["name"], d)
        monkeypatch.undo()
        assert not any("secret" in p for p in opened), opened
    secret.unlink()


def test_a_symlinked_case_file_is_corrupt_and_not_hashed(copy, tmp_path):
    d, entry = copy
    target = tmp_path.parent / f"{tmp_path.name}-target.safetensors"
    os.replace(d / entry["file"], target)
    (d / entry["file"]).symlink_to(target)  # the right bytes, behind a link
    with pytest.raises(GoldenCorrupt, match="symlink") as e:
        load_case(entry["name"], d)
    assert entry["sha256"][:12] not in str(e.value)
    target.unlink()


def test_a_directory_in_place_of_the_file_is_corrupt(copy):
    d, entry = copy
    (d / entry["file"]).unlink()
    (d / entry["file"]).mkdir()
    _corrupt(d, "not a regular file")


def _tensors(d, entry):
    return dict(load_safetensors((d / entry["file"]).read_bytes()))


@pytest.mark.parametrize("missing", ["qkv", "expected_q", "cos_sin_index", "k_weight"])
def test_a_file_missing_a_tensor_is_corrupt(copy, missing):
    d, entry = copy
    t = _tensors(d, entry)
    del t[missing]
    _rewrite_file(d, entry, t)
    _corrupt(d, f"no tensor '{missing}'")


def _unstored(t):
    """Positions naming a table row the file does not hold."""
    stored = set(t["cos_sin_index"].tolist())
    row = next(i for i in range(10**6) if i not in stored)
    return torch.full_like(t["positions"], row)


WRONG_TENSORS = [
    ("qkv narrow", lambda t: dict(t, qkv=t["qkv"][:, 1:].contiguous()), "qkv"),
    ("qkv fp32", lambda t: dict(t, qkv=t["qkv"].float()), "qkv"),
    ("positions 2-D", lambda t: dict(t, positions=t["positions"][None]), "positions"),
    (
        "expected_q short",
        lambda t: dict(t, expected_q=t["expected_q"][:-1].contiguous()),
        "expected_q",
    ),
    (
        "index past the table",
        lambda t: dict(t, cos_sin_index=t["cos_sin_index"] + 10**6),
        "cos_sin_index",
    ),
    ("positions outside the rows", lambda t: dict(t, positions=_unstored(t)), "positions"),
    ("extra weight", lambda t: dict(t, q_bias=torch.zeros(128, dtype=torch.bfloat16)), "q_bias"),
]


@pytest.mark.parametrize("label,change,needle", WRONG_TENSORS, ids=[w[0] for w in WRONG_TENSORS])
def test_a_file_with_a_wrong_tensor_is_corrupt(copy, label, change, needle):
    d, entry = copy
    _rewrite_file(d, entry, change(_tensors(d, entry)))
    _corrupt(d, needle)


def test_a_file_that_is_not_safetensors_is_corrupt(copy):
    d, entry = copy
    data = os.urandom(4096)
    (d / entry["file"]).write_bytes(data)
    write_manifest(d, [dict(entry, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))])
    _corrupt(d, "not a safetensors file")


def test_a_wrong_max_position_is_corrupt(copy):
    d, entry = copy
    write_manifest(d, [dict(entry, max_position=3)])
    _corrupt(d, "cos_sin_index")


def test_the_shipped_goldens_all_load():
    rows = list_cases()
    assert rows and not any("corrupt" in r for r in rows)
    for r in rows[:3]:
        assert load_case(r).qkv.shape[0] == r["tokens"]
