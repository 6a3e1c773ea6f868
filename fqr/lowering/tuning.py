"""The cuda target's tuning table as data: which kernel variant (warps, tokens per tile, chunk
budget, chunk mode, programs per SM) runs each program shape in each token bucket, as the H200
sweeps measured it. ``tuning.json`` beside this module is the table
:mod:`fqr.lowering.targets` reads; the sweep (:mod:`fqr.tools.tuning_sweep`, ``python -m
fqr.tools.tuning_sweep``) writes a new one with :func:`table_from_sweep`, so a re-tune is a
regenerated file to review, not a hand edit.

The document (``schema`` ``fqr.tuning/2``)::

    {"schema": "fqr.tuning/2", "source": "...", "options": [num_warps, block_t, tile_elems,
     chunk_mode, programs_per_sm], "buckets": [256, 8192, null],
     "untuned": [[2, 1, 2048, "grid", 0], ...],
     "entries": [{"model": "Qwen3-8B", "shape": [[32, 128, "neox128", false], ...],
                  "dtype": null | "bf16" | "fp16", "variants": [[...], [...], [...]],
                  "note": "..."}, ...]}

``programs_per_sm`` caps the grid at that many programs per multiprocessor of the device (the
persistent loop then walks the remaining token tiles, and weights loaded before the loop are
read once per program, not once per tile); 0 launches one program per token tile.

``shape`` is :func:`fqr.lowering.targets.shape_key` of the plan (per chain: heads, head_dim,
register layout tag, whether it is a copy); ``dtype`` narrows an entry to the outputs' dtype
(measured apart); ``variants`` has one option set per bucket, in ``options`` order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core import dtype_name, dtype_of

SCHEMA = "fqr.tuning/2"
TUNING_FILE = Path(__file__).with_name("tuning.json")
# The options a variant sets, in the order of an entry's option sets.
TILING_OPTIONS = ("num_warps", "block_t", "tile_elems", "chunk_mode", "programs_per_sm")
TOKEN_BUCKETS = (256, 8192, None)  # the upper T of each variant (None: any T)
CHUNK_MODES = ("loop", "unroll", "grid")  # the cuda target's chunk modes

Config = tuple[int, int, int, str, int]
Variants = tuple[Config, ...]
Key = tuple  # a shape, or (shape, dtype)


class TuningError(ValueError):
    """A tuning document that does not describe a table (named field, what was found)."""


def _config(value: Any, where: str) -> Config:
    if not (isinstance(value, list) and len(value) == len(TILING_OPTIONS)):
        raise TuningError(f"{where} must be a list of {len(TILING_OPTIONS)}: {TILING_OPTIONS}")
    warps, block_t, elems, mode, per_sm = value
    ints = (warps, block_t, elems)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
        raise TuningError(f"{where}: num_warps, block_t, tile_elems must be positive ints")
    if any(v & (v - 1) for v in ints):
        raise TuningError(f"{where}: num_warps, block_t, tile_elems must be powers of two")
    if mode not in CHUNK_MODES:
        raise TuningError(f"{where}: chunk_mode must be one of {', '.join(CHUNK_MODES)}")
    if not (isinstance(per_sm, int) and not isinstance(per_sm, bool) and per_sm >= 0):
        raise TuningError(f"{where}: programs_per_sm must be an int >= 0 (0: no cap)")
    return (warps, block_t, elems, mode, per_sm)


def _variants(value: Any, where: str) -> Variants:
    if not (isinstance(value, list) and len(value) == len(TOKEN_BUCKETS)):
        raise TuningError(f"{where} must hold one option set per bucket ({len(TOKEN_BUCKETS)})")
    return tuple(_config(v, f"{where}[{i}]") for i, v in enumerate(value))


def _shape(value: Any, where: str) -> tuple:
    def chain(c: Any) -> tuple:
        ok = isinstance(c, list) and len(c) == 4
        if not ok or not (isinstance(c[0], int) and isinstance(c[1], int)):
            raise TuningError(f"{where}: a chain is [heads, head_dim, layout tag, is a copy]")
        if not isinstance(c[2], str) or not isinstance(c[3], bool):
            raise TuningError(f"{where}: a chain is [heads, head_dim, layout tag, is a copy]")
        return tuple(c)

    if not isinstance(value, list) or not value:
        raise TuningError(f"{where} must be a non-empty list of chains")
    return tuple(chain(c) for c in value)


def parse_table(doc: Mapping[str, Any]) -> tuple[Variants, dict[Key, Variants]]:
    """``(untuned variants, {shape or (shape, dtype): variants})`` of a tuning document;
    :class:`TuningError` naming the field where it is not one."""
    if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA:
        raise TuningError(f"'schema' must be {SCHEMA!r}")
    if list(doc.get("options", ())) != list(TILING_OPTIONS):
        raise TuningError(f"'options' must be {list(TILING_OPTIONS)}")
    if list(doc.get("buckets", ())) != list(TOKEN_BUCKETS):
        raise TuningError(f"'buckets' must be {list(TOKEN_BUCKETS)}")
    untuned = _variants(doc.get("untuned"), "'untuned'")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise TuningError("'entries' must be a list")
    table: dict[Key, Variants] = {}
    for i, e in enumerate(entries):
        where = f"entries[{i}]"
        if not isinstance(e, Mapping):
            raise TuningError(f"{where} must be an object")
        shape = _shape(e.get("shape"), f"{where}.shape")
        key: Key = shape
        if e.get("dtype") is not None:
            try:
                key = (shape, dtype_of(e["dtype"]))
            except ValueError:
                raise TuningError(
                    f"{where}.dtype must be a dtype name, got {e['dtype']!r}"
                ) from None
        if key in table:
            raise TuningError(f"{where}: its shape and dtype are tuned twice")
        table[key] = _variants(e.get("variants"), f"{where}.variants")
    return untuned, table


def load_table(path: Path = TUNING_FILE) -> tuple[Variants, dict[Key, Variants]]:
    """:func:`parse_table` of the JSON file ``path`` (default: the shipped table)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TuningError(f"{path}: not a readable JSON document ({e})") from None
    try:
        return parse_table(doc)
    except TuningError as e:
        raise TuningError(f"{path}: {e}") from None


def table_from_sweep(
    rows: Iterable[Mapping[str, Any]],
    shapes: Mapping[str, tuple],
    untuned: Variants,
    *,
    source: str,
    models: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """A tuning document from a sweep's rows (``{"preset", "T", "cfg": {option: value},
    "us"}``, device µs per call; rows whose ``cfg`` is not an option set, e.g. a hand-written
    kernel, are passed over). For each preset (``shapes``: preset -> its plan's shape key) and
    bucket, the option set with the least summed ``us / best us at that T`` over the bucket's
    token counts (each T weighs alike), among those measured at every one of them."""
    per: dict[str, dict[int, dict[Config, float]]] = {}
    for r in rows:
        cfg = r.get("cfg")
        if not isinstance(cfg, Mapping) or r.get("preset") not in shapes:
            continue
        key: Config = tuple(cfg.get(o) for o in TILING_OPTIONS)  # type: ignore[assignment]
        per.setdefault(r["preset"], {}).setdefault(int(r["T"]), {})[key] = float(r["us"])
    entries = []
    for preset, by_t in per.items():
        chosen = []
        lower = 0
        for limit in TOKEN_BUCKETS:
            ts = [t for t in by_t if t > lower and (limit is None or t <= limit)]
            lower = limit or 0
            common: set[Config] = set(by_t[ts[0]]) if ts else set()
            for t in ts[1:]:
                common &= set(by_t[t])
            if not common:
                raise TuningError(f"{preset}: no option set measured at every T of a bucket")
            best = {t: min(by_t[t].values()) for t in ts}
            score = {c: sum(by_t[t][c] / best[t] for t in ts) for c in common}
            winner = min(sorted(common), key=score.__getitem__)  # ties: the first in order
            chosen.append(list(winner))
        entries.append(
            {
                "model": (models or {}).get(preset, preset),
                "shape": [list(c) for c in shapes[preset]],
                "dtype": None if dtype is None else dtype_name(dtype),
                "variants": chosen,
            }
        )
    return {
        "schema": SCHEMA,
        "source": source,
        "options": list(TILING_OPTIONS),
        "buckets": list(TOKEN_BUCKETS),
        "untuned": [list(c) for c in untuned],
        "entries": entries,
    }


def table_text(doc: Mapping[str, Any]) -> str:
    """A tuning document as ``tuning.json`` holds it: one key per line, each entry's fields on
    lines of their own, and every list of scalars or option sets on one line (a regenerated
    table diffs by entry)."""

    def line(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    head = [f" {line(k)}: {line(v)}" for k, v in doc.items() if k != "entries"]
    entries = [
        "  {\n" + ",\n".join(f"   {line(k)}: {line(v)}" for k, v in e.items()) + "\n  }"
        for e in doc.get("entries", [])
    ]
    body = ",\n".join([*head, ' "entries": [\n' + ",\n".join(entries) + "\n ]"])
    return "{\n" + body + "\n}\n"
