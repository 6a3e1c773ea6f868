"""The wheel is the product: build it, install it into a fresh virtual environment and run
``fqr verify --backend reference`` and ``fqr golden list`` from an unrelated directory.

The fresh venv gets the wheel with ``--no-deps``; its dependencies (torch, typer, ...) come from
the test's own environment through a ``.pth`` line, so CI never downloads torch again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_verifies_from_anywhere(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        # build isolation: pip fetches the build backend pyproject.toml names (setuptools>=77,
        # for the SPDX license field), whatever setuptools this environment holds.
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("fqr-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The dependencies from this environment; a plain path line processes no .pth in it, so an
    # editable install of fqr here stays invisible to the fresh venv.
    Path(purelib, "zz_fqr_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + [str(wheel)],
        check=True,
    )
    fqr = env_dir / "bin" / "fqr"
    work = tmp_path / "elsewhere"
    work.mkdir()

    where = subprocess.run(
        [str(python), "-c", "import fqr; print(fqr.__file__, fqr.__version__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=work,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(purelib), where  # the installed copy, not the checkout
    version = subprocess.run([str(fqr), "--version"], capture_output=True, text=True, cwd=work)
    assert version.returncode == 0 and version.stdout.strip() == f"fqr {where[1]}"

    listed = subprocess.run(
        [str(fqr), "golden", "list", "--json"], capture_output=True, text=True, cwd=work
    )
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    shipped = sorted(p.name for p in (ROOT / "golden").glob("*.safetensors"))
    assert sorted(c["file"] for c in doc["cases"]) == shipped
    assert Path(doc["golden_dir"]).is_relative_to(purelib)
    kernels = sorted(p.name for p in (ROOT / "golden" / "kernels").iterdir() if p.is_file())
    installed = Path(doc["golden_dir"]) / "kernels"
    assert kernels and sorted(p.name for p in installed.iterdir() if p.is_file()) == kernels

    verified = subprocess.run(
        [str(fqr), "verify", "--backend", "reference", "--json"],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert verified.returncode == 0, verified.stderr[-2000:]
    result = json.loads(verified.stdout)
    assert result["ok"] and result["counts"]["pass"] == len(shipped)

    # Nothing is ever written into site-packages: regen there is refused, naming --dir.
    regen = subprocess.run(
        [str(fqr), "golden", "regen", "--case", "llama3-8b-fp32-*", "--dir", doc["golden_dir"]],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert regen.returncode == 2 and "--dir" in regen.stderr and not regen.stdout
    # Without --dir an installed fqr has no directory to write: the error names --dir and shows
    # the whole command, never the bare `fqr golden regen` it refuses.
    bare = subprocess.run(
        [str(fqr), "golden", "regen", "--case", "llama3-8b-fp32-*"],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert bare.returncode == 2 and not bare.stdout, bare.stderr
    assert "fqr golden regen --dir DIR" in bare.stderr, bare.stderr
    # ... and `--golden-dir` without a manifest says how to write one there.
    missing = subprocess.run(
        [str(fqr), "verify", "--backend", "reference", "--golden-dir", str(work / "none")],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert missing.returncode == 2 and f"--dir {work / 'none'}" in missing.stderr, missing.stderr
