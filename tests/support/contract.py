"""Check a call's outputs against the independent float64 formulation under the numerics
contract (``fqr.numerics.compare``); ``v`` must be bit-exact."""

from __future__ import annotations

from fqr.numerics import compare
from fqr.reference import prologue as exact_prologue
from support.devices import has_values


def assert_contract(outs, args: tuple, kwargs: dict, numerics: str = "fused") -> None:
    """``outs`` of ``fqr.split_qkv_rmsnorm_rope(*args, **kwargs)`` (``backend``/``numerics``
    keys of ``kwargs`` are ignored) match the float64 expectation (nothing to check on
    ``meta``)."""
    if not has_values(*outs):
        return
    static = {k: v for k, v in kwargs.items() if k not in ("backend", "numerics")}
    exact = exact_prologue(*args, **static)
    for name, out, ref in zip("qkv", outs, exact):
        c = compare(out, ref, head_dim=static["head_dim"], numerics=numerics, bitwise=name == "v")
        assert c.passed, f"{name}: {c}"
