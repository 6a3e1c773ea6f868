"""The CLI's conventions (issue 13): every choice listed in ``--help`` and refused by name when
wrong, one example per command, one JSON vocabulary (``schema`` ``fqr.<command>/1`` and ``ok``
on every document, fqr's dtype names), ``--json`` honoured by ``lower --ir``, text shown as
written (never read as Rich markup), ``doctor``'s facts, and the log level (``-v``,
``FQR_LOG_LEVEL``). In-process through ``fqr_cli.app.main``."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from fqr_cli.app import main

from fqr.core import ACTIVATION_DTYPE_NAMES
from fqr.presets import PRESETS
from fqr.runtime.device import DEVICE_TYPES
from fqr.validate import NUMERICS

COMMANDS = (
    ["verify"],
    ["golden", "list"],
    ["golden", "regen"],
    ["lower"],
    ["run"],
    ["fuse"],
    ["doctor"],
    ["bench"],
)


def fqr(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """``fqr ARGS`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fqr", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture(autouse=True)
def _restore_fqr_logger():
    logger = logging.getLogger("fqr")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_shows_an_example(command, capsys, monkeypatch):
    code, out, _ = fqr([*command, "--help"], capsys, monkeypatch)
    assert code == 0
    example = out.split("Example", 1)[1]
    assert f"$ fqr {' '.join(command)}" in example or f"$ fqr {command[0]}" in example


@pytest.mark.parametrize(
    "command, option, choices",
    [
        ("lower", "--dtype", ACTIVATION_DTYPE_NAMES),
        ("lower", "--numerics", NUMERICS),
        ("lower", "--preset", tuple(PRESETS)),
        ("run", "--device", DEVICE_TYPES),
        ("fuse", "--model", ("hf-qwen3", "vllm")),
        ("bench", "--backend", ("triton", "reference")),
    ],
)
def test_choices_are_listed_and_refused_by_name(command, option, choices, capsys, monkeypatch):
    _, out, _ = fqr([command, "--help"], capsys, monkeypatch)
    listed = out.split(option, 1)[1].split("\n  -", 1)[0]
    assert all(c in listed for c in choices), listed
    code, out, err = fqr([command, option, "no-such-choice", "--json"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert option in err and "no-such-choice" in err and choices[0] in err
    doc = json.loads(out)
    assert doc["schema"] == "fqr.error/1" and doc["ok"] is False and doc["exit_code"] == 2


def test_unknown_option_is_one_line(capsys, monkeypatch):
    code, out, err = fqr(["verify", "--no-such-option"], capsys, monkeypatch)
    assert (code, out) == (2, "") and err.strip() == "error: No such option: --no-such-option"


def test_lower_ir_json_is_one_document(capsys, monkeypatch):
    code, out, _ = fqr(
        ["lower", "--preset", "qwen3-0.6b", "--dtype", "fp16", "--ir", "--json"],
        capsys,
        monkeypatch,
    )
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "fqr.lower/1" and doc["ok"] is True
    assert doc["dtype"] == "fp16" and doc["preset"] == "qwen3-0.6b"
    assert doc["program"].startswith("{ lambda a:fp16[T,4096]")
    assert "@triton.jit" in doc["source"]


def test_golden_list_json_vocabulary(capsys, monkeypatch):
    code, out, _ = fqr(["golden", "list", "--case", "qwen3-0.6b*", "--json"], capsys, monkeypatch)
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "fqr.golden.list/1" and doc["ok"] is True
    assert doc["cases"] and {c["dtype"] for c in doc["cases"]} <= set(ACTIVATION_DTYPE_NAMES)


def test_doctor_reports_version_cache_and_peers(capsys, monkeypatch, tmp_path):
    from fqr._version import __version__

    monkeypatch.setenv("FQR_CACHE_DIR", str(tmp_path / "kernels"))
    code, out, _ = fqr(["doctor", "--json"], capsys, monkeypatch)
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "fqr.doctor/1" and isinstance(doc["ok"], bool)
    env = doc["environment"]
    assert env["fqr"] == __version__ and env["kernel_cache"] == str(tmp_path / "kernels")
    assert set(doc["peers"]) == {"transformers", "vllm", "liger-kernel"}
    try:
        import transformers
    except ImportError:
        assert doc["peers"]["transformers"] is None
    else:
        assert doc["peers"]["transformers"] == transformers.__version__


def test_doctor_shows_text_as_written(capsys, monkeypatch):
    """A reason with brackets (``fqr[npu]``) is not eaten as Rich markup."""
    from fqr.backends import BACKENDS

    reason = "install 'fqr[npu]' into [bold]its own[/bold] environment"
    monkeypatch.setattr(type(BACKENDS["ascend"]), "unavailable_reason", lambda self: reason)
    code, out, _ = fqr(["doctor"], capsys, monkeypatch)
    assert code == 0 and "'fqr[npu]'" in out and "[bold]its" in " ".join(out.split())


def test_verbose_sets_info_and_bad_log_level_is_usage(capsys, monkeypatch):
    monkeypatch.delenv("FQR_LOG_LEVEL", raising=False)
    code, _, _ = fqr(["-v", "golden", "list", "--case", "qwen3-0.6b*"], capsys, monkeypatch)
    assert code == 0 and logging.getLogger("fqr").level == logging.INFO
    monkeypatch.setenv("FQR_LOG_LEVEL", "loud")
    code, out, err = fqr(["golden", "list"], capsys, monkeypatch)
    assert (code, out) == (2, "") and "FQR_LOG_LEVEL" in err and "'loud'" in err


def test_info_log_names_the_lowered_kernel(monkeypatch, tmp_path, capsys):
    """At INFO fqr says which kernel was lowered, for which target, and where its source is."""
    from fqr import lowering
    from fqr.logger import configure
    from fqr.lowering import loader
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    monkeypatch.setenv("FQR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "_KERNELS", {})
    # the process's loaded kernels too: an earlier test may have loaded this one (then nothing
    # is read from or written to the cache, and the log says so: order-dependent otherwise)
    monkeypatch.setattr(loader, "_LOADED", {})
    configure("DEBUG")
    kernel = lowering.lower(program_of(get_preset("qwen3-0.6b")), "interpret")
    err = capsys.readouterr().err
    assert "lowered fqr_interpret_" in err and " for interpret: " in err and str(kernel.path) in err
    assert "kernel cache miss, written" in err or "kernel cache hit" in err


def test_ascend_advice_fits_the_install(monkeypatch, tmp_path):
    """``make ascend-env`` only in a source checkout; a wheel install is told the extra."""
    from fqr import backends

    assert "make ascend-env" in backends._ascend_env_advice()  # this checkout
    installed = tmp_path / "site-packages" / "fqr"
    installed.mkdir(parents=True)
    monkeypatch.setattr(backends, "__file__", str(installed / "backends.py"))
    advice = backends._ascend_env_advice()
    assert "make" not in advice and "'fqr[npu]'" in advice
