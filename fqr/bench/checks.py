"""The check before the timing: each implementation's outputs against the float64 formulation
(:func:`fqr.reference.prologue`) under a numerics contract, on a sample of rows."""

from __future__ import annotations

import zlib

import torch

from ..numerics import compare_kind
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


def cell_generator(seed: int, label: str, device) -> tuple[int, torch.Generator]:
    """A cell's own seed (from the run's and the cell's label: any cell can be rerun alone)
    and a generator on ``device`` seeded with it."""
    cell_seed = seed * 1_000_003 + zlib.crc32(label.encode()) % 1_000_003
    return cell_seed, torch.Generator(device=device).manual_seed(cell_seed)


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
        kind = "bitwise" if name == "v" else "contract"
        record(report, name, check_rows(kind, out, ref, rows, spec.head_dim, numerics))
    return report


def check_rows(kind: str, out, want, rows, head_dim: int, numerics: str) -> dict:
    """One output's sampled ``rows`` against their float64 expectation under the tolerance
    ``kind`` (:data:`fqr.numerics.TOLERANCE_KINDS`), and every row of it finite."""
    nonfinite = int((~torch.isfinite(out.float())).sum())
    c = compare_kind(
        kind, out.index_select(0, rows), want, head_dim=head_dim, numerics=numerics
    ).to_dict()
    c["nonfinite_all_rows"] = nonfinite
    c["passed"] = bool(c["passed"] and nonfinite == 0)
    return c


def record(report: dict, name: str, check: dict) -> None:
    """Add one output's check to a report (the report passes while every output does)."""
    report[name] = check
    report["passed"] = report["passed"] and check["passed"]


def poison_free_memory(nbytes: int, device: torch.device) -> None:
    """Fill and free a block as large as the outputs, so that the caching allocator most likely
    hands NaN-filled memory to the next outputs: elements a kernel fails to write then show."""
    block = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)
    del block
