"""The lowering sits on the functional core alone (DESIGN.md, layers): every module of
fqr/lowering imports only fqr.core, its sibling modules, the standard library, torch and triton,
and no module of it branches on a primitive's name."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

LOWERING = Path(__file__).resolve().parents[2] / "fqr" / "lowering"
MODULES = sorted(LOWERING.glob("*.py"))
# torch_npu is torch's NPU device plugin (it registers torch.npu); the Ascend profile asks it
# for the chip's name when an NPU is present; platformdirs names the kernel cache's directory.
THIRD_PARTY = {"torch", "torch_npu", "triton", "platformdirs"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every import in the module, relative ones written with their dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level and not node.module:  # from . import x
                found += [(node.lineno, module + alias.name) for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def allowed(name: str) -> bool:
    if name.startswith(".."):  # relative to fqr: only the core
        return name == "..core"
    if name.startswith("."):  # a sibling module of the lowering
        return (LOWERING / f"{name[1:].split('.')[0]}.py").exists()
    top = name.split(".")[0]
    if top == "fqr":
        return name == "fqr.core"
    return top in sys.stdlib_module_names or top in THIRD_PARTY


def test_the_modules_are_found():
    assert {p.stem for p in MODULES} >= {"__init__", "plan", "emit", "targets", "kernel", "ascend"}


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_lowering_imports_only_the_core(path):
    bad = [f"{path.name}:{line}: {name}" for line, name in imports_of(path) if not allowed(name)]
    assert not bad, (
        "fqr/lowering may import only fqr.core, stdlib, torch, triton, platformdirs:\n"
        + "\n".join(bad)
    )


def test_the_checker_would_catch_a_layer_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from ..backends import BackendUnavailable\nimport fqr.presets\nfrom ..ops import rope\n"
        "import numpy\nfrom .emit import Tiling\nfrom ..core import Program\n"
    )
    verdicts = {name: allowed(name) for _, name in imports_of(bad)}
    assert verdicts == {
        "..backends": False,
        "fqr.presets": False,
        "..ops": False,
        "numpy": False,
        ".emit": True,
        "..core": True,
    }


# The issue's own check: no `name == "..."` / `prim.name in (...)` branch in the lowering.
NAME_BRANCH = re.compile(r"(prim\.name|\bname) *(==|in) *[(\"']")


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_no_primitive_name_branches(path):
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if NAME_BRANCH.search(line)
    ]
    assert not hits, "\n".join(hits)


def primitive_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """Places that decide by which primitive an equation holds: a comparison with a primitive
    (``e.prim is rope_p``) or its name (``e.prim.name in NAMES``), ``isinstance`` on a primitive,
    or any use of a module-level primitive object (``*_p``)."""

    def is_primitive(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return text.endswith((".prim", ".prim.name")) or text.endswith("_p")

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            is_primitive(n) for n in [node.left, *node.comparators]
        ):
            hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
            if any(is_primitive(a) or "Primitive" in ast.unparse(a) for a in node.args):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id.endswith("_p"):
            hits.append((node.lineno, node.id))
    return hits


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_no_primitive_object_is_compared_or_type_tested(path):
    """Nor the other tricks: comparing to a primitive object or its name, isinstance on a
    primitive, or a primitive object at all."""
    hits = primitive_tests(ast.parse(path.read_text(), str(path)))
    assert not hits, "\n".join(f"{path.name}:{line}: {text}" for line, text in hits)


def test_the_primitive_checker_would_catch_the_tricks():
    tree = ast.parse(
        "if e.prim is rope_p: pass\n"
        "if e.prim.name in NAMES: pass\n"
        "if isinstance(e.prim, RopePrimitive): pass\n"
        "if e.prim.lower is not None: pass\n"  # asking for a rule: allowed
        "x = e.facts()\n"
    )
    assert sorted(line for line, _ in primitive_tests(tree)) == [1, 1, 2, 3]
