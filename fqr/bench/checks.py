"""The check before the timing: each implementation's outputs against the float64 formulation
(:func:`fqr.reference.prologue`) under a numerics contract, on a sample of rows."""

from __future__ import annotations

import torch

from ..numerics import compare
from ..presets import PrologueSpec


def check_row_index(
    tokens: int, check_rows: int, generator: torch.Generator, device
) -> torch.Tensor:
    """Rows to compare: all when ``check_rows`` is 0 or covers T, else the first and last 64
    rows and a random sample, ``check_rows`` in all."""
    if check_rows <= 0 or check_rows >= tokens:
        return torch.arange(tokens, device=device)
    edge = min(64, check_rows // 4)
    middle = torch.randperm(tokens - 2 * edge, generator=generator, device=device)
    middle = middle[: check_rows - 2 * edge] + edge
    ends = torch.cat(
        [torch.arange(edge, device=device), torch.arange(tokens - edge, tokens, device=device)]
    )
    return torch.cat([ends, middle]).sort().values


def check_outputs(
    outputs,
    exact,
    rows: torch.Tensor,
    spec: PrologueSpec,
    numerics: str,
    tokens: int,
    dtype: torch.dtype,
) -> dict:
    """Compare ``(q, k, v)`` with the float64 ``exact`` ``(q, k, v)`` of ``rows``: shapes and
    dtype first, then the contract on the sampled rows (``v`` bit for bit), and every output
    finite on all rows."""
    shapes = [(tokens, spec.q_size), (tokens, spec.kv_size), (tokens, spec.kv_size)]
    report = {"passed": True, "rows": int(rows.numel()), "numerics": numerics}
    for name, out, ref, shape in zip("qkv", outputs, exact, shapes):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
            got = (
                f"{list(out.shape)} {out.dtype}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            report[name] = {"passed": False, "error": f"got {got}, expected {list(shape)} {dtype}"}
            report["passed"] = False
            continue
        nonfinite_all = int((~torch.isfinite(out)).sum())
        c = compare(
            out.index_select(0, rows),
            ref,
            head_dim=spec.head_dim,
            numerics=numerics,
            bitwise=(name == "v"),
        ).to_dict()
        c["nonfinite_all_rows"] = nonfinite_all
        c["passed"] = bool(c["passed"] and nonfinite_all == 0)
        report[name] = c
        report["passed"] = report["passed"] and c["passed"]
    return report


def poison_free_memory(nbytes: int, device: torch.device) -> None:
    """Fill and free a block as large as the outputs, so that the caching allocator most likely
    hands NaN-filled memory to the next outputs: elements a kernel fails to write then show."""
    block = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)
    del block
