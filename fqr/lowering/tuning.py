"""The cuda target's tuning table as data: which kernel variant (warps, tokens per tile, chunk
budget, chunk mode, programs per SM, and the schedule knobs: heads per program, register
budget, pipeline stages) runs each program shape in each token bucket, as the H200 sweeps
measured it. ``tuning.json`` beside this module is the table
:mod:`fqr.lowering.targets` reads; the sweep (:mod:`fqr.tools.tuning_sweep`, ``python -m
fqr.tools.tuning_sweep``) writes a new one with :func:`table_from_sweep`, so a re-tune is a
regenerated file to review, not a hand edit.

The document (``schema`` ``fqr.tuning/3``)::

    {"schema": "fqr.tuning/3", "source": "...", "options": [num_warps, block_t, tile_elems,
     chunk_mode, programs_per_sm, heads_per_program, maxnreg, pipeline_stages],
     "buckets": [256, 8192, null],
     "untuned": [[2, 1, 2048, "grid", 0, 0, 0, 0], ...],
     "entries": [{"model": "Qwen3-8B", "shape": [[32, 128, "neox128", false], ...],
                  "dtype": null | "bf16" | "fp16", "variants": [[...], [...], [...]],
                  "note": "..."}, ...]}

``programs_per_sm`` caps the grid at that many programs per multiprocessor of the device (the
persistent loop then walks the remaining token tiles, and weights loaded before the loop are
read once per program, not once per tile); 0 launches one program per token tile.

The schedule knobs (issue 38; 0 leaves each off, the kernel as before):

* ``heads_per_program`` (a power of two; with ``chunk_mode`` ``grid``): the decode schedule.
  Each chain's heads go in groups of that many, one program per group along grid axis 1, the
  group's first head computed from the program index (one body per chain in the source); a
  chain with a reduction over its whole row (OLMo2's full-width norm, MLA's latent norms)
  stays one program. A head's reduction is then never longer than one head, and a token's work
  is spread over as many programs as it has head groups.
* ``maxnreg``: the registers a thread may use (Triton's ``maxnreg``, ptx ``.maxnreg``): the
  register budget that sets how many warps an SM holds (64 on the H200: half occupancy).
* ``pipeline_stages``: the persistent token loop is ``tl.range(..., num_stages=n)``, so Triton
  issues the loads of the next ``n - 1`` token tiles while the current one computes (it
  pipelines the loop's loads, not only those feeding a dot); only a capped grid
  (``programs_per_sm``) loops.

A ``fqr.tuning/2`` document (five options) is still read: its option sets take the knobs off.

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

SCHEMA = "fqr.tuning/3"
SCHEMAS = {"fqr.tuning/2": 5, SCHEMA: 8}  # the schemas read, and the options each one sets
TUNING_FILE = Path(__file__).with_name("tuning.json")
# The options a variant sets, in the order of an entry's option sets.
TILING_OPTIONS = (
    "num_warps", "block_t", "tile_elems", "chunk_mode", "programs_per_sm",
    "heads_per_program", "maxnreg", "pipeline_stages",
)  # fmt: skip
# The value of each schedule knob that takes it off (a sweep row or a /2 document without it).
KNOB_DEFAULTS = {"heads_per_program": 0, "maxnreg": 0, "pipeline_stages": 0}
TOKEN_BUCKETS = (256, 8192, None)  # the upper T of each variant (None: any T)
CHUNK_MODES = ("loop", "unroll", "grid")  # the cuda target's chunk modes

Config = tuple[int, int, int, str, int, int, int, int]
Variants = tuple[Config, ...]
Key = tuple  # a shape, or (shape, dtype)


class TuningError(ValueError):
    """A tuning document that does not describe a table (named field, what was found)."""


def config_of(cfg: Mapping[str, Any]) -> Config:
    """A sweep row's option set (``{option: value}``) as a table's option set, the schedule
    knobs it does not name off (a row of a sweep made before them)."""
    return tuple(cfg.get(o, KNOB_DEFAULTS.get(o)) for o in TILING_OPTIONS)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _config(value: Any, where: str, width: int = len(TILING_OPTIONS)) -> Config:
    if not (isinstance(value, list) and len(value) == width):
        raise TuningError(f"{where} must be a list of {width}: {TILING_OPTIONS[:width]}")
    value = value + [KNOB_DEFAULTS[o] for o in TILING_OPTIONS[width:]]
    warps, block_t, elems, mode, per_sm, per_program, maxnreg, stages = value
    ints = (warps, block_t, elems)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
        raise TuningError(f"{where}: num_warps, block_t, tile_elems must be positive ints")
    if any(v & (v - 1) for v in ints):
        raise TuningError(f"{where}: num_warps, block_t, tile_elems must be powers of two")
    if mode not in CHUNK_MODES:
        raise TuningError(f"{where}: chunk_mode must be one of {', '.join(CHUNK_MODES)}")
    if not (isinstance(per_sm, int) and not isinstance(per_sm, bool) and per_sm >= 0):
        raise TuningError(f"{where}: programs_per_sm must be an int >= 0 (0: no cap)")
    if not (_int(per_program) and per_program >= 0 and not per_program & (per_program - 1)):
        raise TuningError(f"{where}: heads_per_program must be 0 or a power of two")
    if per_program and mode != "grid":
        raise TuningError(f"{where}: heads_per_program needs chunk_mode grid")
    if not (_int(maxnreg) and (maxnreg == 0 or 16 <= maxnreg <= 255)):
        raise TuningError(f"{where}: maxnreg must be 0 (no budget) or 16 .. 255")
    if not (_int(stages) and 0 <= stages <= 8):
        raise TuningError(f"{where}: pipeline_stages must be an int 0 .. 8 (0: a plain loop)")
    return (warps, block_t, elems, mode, per_sm, per_program, maxnreg, stages)


def _variants(value: Any, where: str, width: int = len(TILING_OPTIONS)) -> Variants:
    if not (isinstance(value, list) and len(value) == len(TOKEN_BUCKETS)):
        raise TuningError(f"{where} must hold one option set per bucket ({len(TOKEN_BUCKETS)})")
    return tuple(_config(v, f"{where}[{i}]", width) for i, v in enumerate(value))


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
    if not isinstance(doc, Mapping) or doc.get("schema") not in SCHEMAS:
        raise TuningError(f"'schema' must be {SCHEMA!r} (or 'fqr.tuning/2')")
    width = SCHEMAS[doc["schema"]]
    if list(doc.get("options", ())) != list(TILING_OPTIONS[:width]):
        raise TuningError(f"'options' must be {list(TILING_OPTIONS[:width])}")
    if list(doc.get("buckets", ())) != list(TOKEN_BUCKETS):
        raise TuningError(f"'buckets' must be {list(TOKEN_BUCKETS)}")
    untuned = _variants(doc.get("untuned"), "'untuned'", width)
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
        table[key] = _variants(e.get("variants"), f"{where}.variants", width)
    return untuned, table


def upgraded(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A tuning document in the current schema: a ``fqr.tuning/2`` one with every option set
    given the schedule knobs off (the same kernels), others as they are (checked by
    :func:`parse_table`)."""
    parse_table(doc)
    if doc["schema"] == SCHEMA:
        return dict(doc)
    pad = [KNOB_DEFAULTS[o] for o in TILING_OPTIONS[SCHEMAS[doc["schema"]] :]]
    return {
        **doc,
        "schema": SCHEMA,
        "options": list(TILING_OPTIONS),
        "untuned": [list(c) + pad for c in doc["untuned"]],
        "entries": [
            {**e, "variants": [list(c) + pad for c in e["variants"]]} for e in doc["entries"]
        ],
    }


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
    kept: Mapping[str, Variants] | None = None,
) -> dict[str, Any]:
    """A tuning document from a sweep's rows (``{"preset", "T", "cfg": {option: value},
    "us"}``, device µs per call; rows whose ``cfg`` is not an option set, e.g. a hand-written
    kernel, are passed over; a knob a row does not name is off, :func:`config_of`). For each
    preset (``shapes``: preset -> its plan's shape key) and bucket, the option set with the
    least summed ``us / best us at that T`` over the bucket's token counts (each T weighs
    alike), among those measured at every one of them. A bucket where the sweep measured no T
    keeps the preset's variant in ``kept`` (the table before), where it has one."""
    per: dict[str, dict[int, dict[Config, float]]] = {}
    for r in rows:
        cfg = r.get("cfg")
        if not isinstance(cfg, Mapping) or r.get("preset") not in shapes:
            continue
        key = config_of(cfg)
        per.setdefault(r["preset"], {}).setdefault(int(r["T"]), {})[key] = float(r["us"])
    entries = []
    for preset, by_t in per.items():
        chosen = []
        lower = 0
        for b, limit in enumerate(TOKEN_BUCKETS):
            ts = [t for t in by_t if t > lower and (limit is None or t <= limit)]
            lower = limit or 0
            if not ts and kept and preset in kept:
                chosen.append(list(kept[preset][b]))
                continue
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
    """A table document as ``tuning.json`` (and the projection dispatch's
    ``proj_dispatch.json``) holds it: one key per line, each entry's fields on lines of their
    own, and every list of scalars or option sets on one line (a regenerated table diffs by
    entry)."""

    def line(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    head = [f" {line(k)}: {line(v)}" for k, v in doc.items() if k != "entries"]
    entries = [
        "  {\n" + ",\n".join(f"   {line(k)}: {line(v)}" for k, v in e.items()) + "\n  }"
        for e in doc.get("entries", [])
    ]
    body = ",\n".join([*head, ' "entries": [\n' + ",\n".join(entries) + "\n ]"])
    return "{\n" + body + "\n}\n"
