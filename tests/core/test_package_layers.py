"""The layers of the package (ARCHITECTURE.md, "Layers"): every import in fqr, lazy ones
included, goes to the module's own layer or one below it; the float64 reference stands on the
core alone. (tests/lowering/test_layers.py holds the lowering to the core.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FQR = Path(__file__).resolve().parents[2] / "fqr"

LAYERS = {
    "fqr._version": 1,  # the version string, imports nothing
    "fqr.logger": 1,  # the fqr logger and FQR_LOG_LEVEL, imports nothing of fqr
    "fqr.text": 1,  # text from files as shown to a user (control characters escaped)
    "fqr.core": 1,
    "fqr.ops": 2,
    "fqr.lowering": 3,
    "fqr.reference": 4,
    # writing user-visible files (never through a symlink) with the kernel cache's atomic write
    "fqr.files": 4,
    "fqr.numerics": 4,
    "fqr.validate": 4,
    "fqr.rope_cache": 4,
    "fqr.presets": 4,
    "fqr.hf": 4,  # the Hugging Face mapping (families, config readers): beside the presets
    "fqr.inputs": 4,
    "fqr.ascend_on_cuda": 4,
    # the models' own unfused torch code, as vLLM / Hugging Face write it: formulations beside
    # the float64 reference that the declarations' variants name as their eager chain
    "fqr.peers": 4,
    "fqr.unfused": 4,
    "fqr.prologue": 5,
    "fqr.backends": 5,
    "fqr.projection": 5,  # the projection dispatch: the projected op or the pair, per bucket
    "fqr.golden": 6,
    "fqr.golden_cases": 6,  # the cases' contents (inputs, expectations, entries) fqr.golden stores
    "fqr.bench": 6,
    "fqr.runtime": 6,
    "fqr.fusion": 6,
    "fqr.tools": 6,
}
FACADE = {"fqr", "fqr.__main__"}  # the package's public names; `python -m fqr`


def module_name(path: Path) -> str:
    parts = path.relative_to(FQR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (a package's modules share its layer); None outside fqr."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def fqr_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every import of an fqr module in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fqr"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fqr":
                continue
            if node.module is None:  # from . import x: x may be a module
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    own = layer_of(module_name(path))
    bad = []
    for line, target in fqr_imports(path, source):
        theirs = layer_of(target)
        if theirs is None or theirs > own:
            bad.append(f"{path.relative_to(FQR.parent)}:{line}: layer {own} imports {target}")
    return bad


MODULES = sorted(p for p in FQR.rglob("*.py") if module_name(p) not in FACADE)


def test_every_module_has_a_layer():
    assert [module_name(p) for p in MODULES if layer_of(module_name(p)) is None] == []


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_go_down_the_layers(path):
    assert violations(path) == []


def test_the_reference_stands_on_the_core_alone():
    imports = {t for _, t in fqr_imports(FQR / "reference.py")}
    assert imports <= {"fqr.core"}, imports


def test_the_checker_catches_an_upward_import():
    source = "def f():\n    from ..prologue import split_qkv_rmsnorm_rope\n"
    assert violations(FQR / "ops" / "norm.py", source) == [
        "fqr/ops/norm.py:2: layer 2 imports fqr.prologue"
    ]
    assert violations(FQR / "bench" / "run.py", "from ..presets import Preset\n") == []
