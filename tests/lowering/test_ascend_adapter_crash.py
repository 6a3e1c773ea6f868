"""The Ascend compile check retries ``triton-adapter-opt`` only when it dies by a signal.

triton-ascend 3.2.0's adapter aborts now and then on input it lowers on the next run; the check
retries such a crash and names it, and reports a compile error (a non-zero exit) at once."""

from __future__ import annotations

import subprocess

import pytest

from fqr.lowering.ascend_compile import ADAPTER_ATTEMPTS, _adapter_lowering


class Adapter:
    """Stands in for the backend's ``ttadapter`` stage: raises the given exit codes, then lowers."""

    def __init__(self, *exit_codes: int) -> None:
        self.exit_codes = list(exit_codes)
        self.calls = 0

    def __call__(self, ttir: str, metadata: dict) -> str:
        self.calls += 1
        if self.exit_codes:
            code = self.exit_codes.pop(0)
            raise subprocess.CalledProcessError(
                code, ["triton-adapter-opt", "kernel.ttir.mlir"], stderr=b"Assertion failed"
            )
        return f"linalg of {ttir}"


def test_a_crash_is_retried_and_named() -> None:
    adapter = Adapter(-6)
    linalg, crashes = _adapter_lowering(adapter, "module", {})
    assert linalg == "linalg of module"
    assert adapter.calls == 2
    assert len(crashes) == 1
    assert "triton-adapter-opt exited -6" in crashes[0]


def test_a_compile_error_is_reported_at_once() -> None:
    adapter = Adapter(1)
    with pytest.raises(subprocess.CalledProcessError) as raised:
        _adapter_lowering(adapter, "module", {})
    assert raised.value.returncode == 1
    assert adapter.calls == 1


def test_a_crash_on_every_attempt_is_a_failure() -> None:
    adapter = Adapter(*([-11] * ADAPTER_ATTEMPTS))
    with pytest.raises(subprocess.CalledProcessError) as raised:
        _adapter_lowering(adapter, "module", {})
    assert raised.value.returncode == -11
    assert adapter.calls == ADAPTER_ATTEMPTS
