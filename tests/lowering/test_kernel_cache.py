"""The kernel cache under attack (issue 14, findings 1 and 7): fqr executes exactly the source
it generated, never a planted ``__pycache__`` file; it refuses a cache directory that someone
else could write; a corrupt entry is regenerated; every error names the path.

Each test lowers a program of its own (a unique ``eps``, so a unique cache key) into a private
``FQR_CACHE_DIR``, and forgets the kernels this process already loaded where a test needs a
second load from disk.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import random
import stat
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import make_problem
from support.contract import assert_contract

import fqr.lowering
from fqr.backends import BACKENDS
from fqr.lowering import loader, lower
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE

pytestmark = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("FQR_CACHE_DIR", str(d))
    return d


def _problem(gen):
    """``(call, program)``: a call's positional ``args`` and ``kwargs`` with an ``eps`` of its
    own (so a program and a cache key of its own), and its traced program."""
    pb = make_problem(gen, tokens=3, num_heads=2, num_kv_heads=1, head_dim=16)
    kwargs = pb.kwargs(eps=1e-6 * (1 + random.random()))
    call = SimpleNamespace(args=pb.args(), kwargs=kwargs)
    return call, SPLIT_QKV_RMSNORM_ROPE.program_for(*call.args, **kwargs)


def _run(call, program):
    kernel = lower(program, "interpret")
    outs = [
        torch.full((3, v.aval.shape[1]), float("nan"), dtype=v.aval.dtype) for v in program.outputs
    ]
    kernel(*call.args, out=outs)
    assert_contract(outs, call.args, call.kwargs)
    return kernel


def _forget_loaded_kernels(monkeypatch):
    """As a fresh process: nothing lowered or loaded yet."""
    monkeypatch.setattr(fqr.lowering, "_KERNELS", {})
    if hasattr(loader, "_LOADED"):
        monkeypatch.setattr(loader, "_LOADED", {})
    for name in [m for m in sys.modules if m.startswith("fqr_kernels.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_planted_pyc_is_never_executed(gen, cache, tmp_path, monkeypatch):
    """A ``__pycache__`` file whose header matches the cached .py (mtime and size) is what
    Python's import machinery would run instead of the checked text."""
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    mark = tmp_path / "planted-code-ran"
    evil = kernel.source + f"\nimport pathlib\npathlib.Path({str(mark)!r}).write_text('x')\n"
    st = os.stat(kernel.path)
    pyc = importlib.util.cache_from_source(str(kernel.path))
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    with open(pyc, "wb") as f:  # PEP 552 header: magic, flags 0 (timestamp), mtime, size
        f.write(importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little"))
        f.write(int(st.st_mtime).to_bytes(4, "little") + st.st_size.to_bytes(4, "little"))
        f.write(marshal.dumps(compile(evil, str(kernel.path), "exec")))
    _forget_loaded_kernels(monkeypatch)
    again = _run(pb, program)
    assert again.cache_hit
    assert not mark.exists(), "code from __pycache__ ran"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_cache_directory_others_can_write_is_refused(gen, tmp_path, monkeypatch, mode):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    monkeypatch.setenv("FQR_CACHE_DIR", str(d))
    _, program = _problem(gen)
    with pytest.raises(loader.KernelCacheError, match="writable by others") as e:
        lower(program, "interpret")
    assert str(d) in str(e.value) and "FQR_CACHE_DIR" in str(e.value)
    assert list(d.iterdir()) == []  # nothing written there


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_cache_directory_owned_by_another_user_is_refused(gen, tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    monkeypatch.setenv("FQR_CACHE_DIR", str(d))
    _, program = _problem(gen)
    with pytest.raises(loader.KernelCacheError, match="owned by uid 65534"):
        lower(program, "interpret")


def test_a_corrupt_entry_is_regenerated(gen, cache, monkeypatch):
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    kernel.path.write_bytes(os.urandom(4096))  # not even UTF-8
    _forget_loaded_kernels(monkeypatch)
    again = _run(pb, program)
    assert not again.cache_hit and kernel.path.read_text() == kernel.source
    kernel.path.write_text(kernel.source.replace("tl.rsqrt", "tl.sqrt"))  # valid, but not ours
    _forget_loaded_kernels(monkeypatch)
    third = _run(pb, program)
    assert not third.cache_hit and kernel.path.read_text() == kernel.source


def test_an_entry_is_written_private_with_nothing_left_beside_it(gen, cache, monkeypatch):
    """The entry is this user's alone (0600), also where it replaces one others could read (a
    user file's mode is kept, fqr.files; a cache entry's never is); no temporary file stays."""
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    assert stat.S_IMODE(os.stat(kernel.path).st_mode) == 0o600
    kernel.path.write_bytes(b"stale")
    kernel.path.chmod(0o644)
    _forget_loaded_kernels(monkeypatch)
    again = _run(pb, program)
    assert not again.cache_hit and stat.S_IMODE(os.stat(kernel.path).st_mode) == 0o600
    assert os.listdir(cache) == [kernel.path.name]


def test_a_symlinked_entry_is_replaced_not_followed(gen, cache, tmp_path, monkeypatch):
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text(kernel.source)  # even the right text: the entry is not a file of ours
    kernel.path.unlink()
    kernel.path.symlink_to(elsewhere)
    _forget_loaded_kernels(monkeypatch)
    again = _run(pb, program)
    assert not again.cache_hit
    assert stat.S_ISREG(os.lstat(kernel.path).st_mode)
    assert elsewhere.read_text() == kernel.source


def test_a_directory_at_the_entry_path_is_a_clear_error(gen, cache, monkeypatch):
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    kernel.path.unlink()
    kernel.path.mkdir()
    _forget_loaded_kernels(monkeypatch)
    with pytest.raises(loader.KernelCacheError, match="is a directory") as e:
        lower(program, "interpret")
    assert str(kernel.path) in str(e.value)


def test_cache_dir_naming_a_file_is_a_clear_error(gen, tmp_path, monkeypatch):
    f = tmp_path / "a-file"
    f.write_text("")
    monkeypatch.setenv("FQR_CACHE_DIR", str(f))
    _, program = _problem(gen)
    with pytest.raises(loader.KernelCacheError, match="not a directory") as e:
        lower(program, "interpret")
    assert f"FQR_CACHE_DIR={f}" in str(e.value)


def test_a_missing_cache_dir_is_created_private(gen, tmp_path, monkeypatch):
    d = tmp_path / "new" / "kernels"
    monkeypatch.setenv("FQR_CACHE_DIR", str(d))
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    assert kernel.path.parent == d and stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_an_unwritable_cache_dir_is_a_clear_error(gen, tmp_path, monkeypatch):
    d = tmp_path / "readonly"
    d.mkdir(mode=0o500)
    monkeypatch.setenv("FQR_CACHE_DIR", str(d))
    _, program = _problem(gen)
    with pytest.raises(loader.KernelCacheError, match="cannot write") as e:
        lower(program, "interpret")
    assert str(d) in str(e.value)


def test_the_default_cache_made_group_writable_by_an_older_fqr_is_made_private(
    gen, tmp_path, monkeypatch, caplog
):
    """Under umask 002 an older fqr created ``~/.cache/fqr/kernels`` 0775: fqr's own default
    directory is tightened (with a warning); a directory the user chose is refused instead."""
    monkeypatch.delenv("FQR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    d = tmp_path / ".cache" / "fqr" / "kernels"
    d.mkdir(parents=True)
    d.chmod(0o775)
    pb, program = _problem(gen)
    kernel = _run(pb, program)
    assert kernel.path.parent == d and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert "made the kernel cache" in caplog.text
