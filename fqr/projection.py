"""The projection dispatch: the QKV projection and its prologue as ONE fused kernel or as the
pair (cuBLAS + fqr's prologue op), per bucket, whichever was measured faster.

Every prologue has a projected form ``fqr.<op>_proj(x, w_qkv, ..., qkv_bias=None)``
(:mod:`fqr.prologue.projected`): one kernel, the GEMM with the prologue as its epilogue, the
fused contract (one rounding). It is not faster everywhere: on the H200 it wins at T = 1 (at
TP 8 for every family measured, at TP 1 for all but Qwen3-32B) and at T = 2 at TP 8, and loses
at T = 16 and at prefill (docs/PERFORMANCE.md, issue 40). The projected op keeps its
meaning (always that one kernel); this module is the separate entry that chooses::

    q, k, v = fqr.proj_dispatch("split_qkv_rmsnorm_rope", x, w_qkv, positions, cos_sin_cache,
                                q_weight, k_weight, qkv_bias=None, num_heads=..., ...)

takes the projected form's arguments (its checks run first, naming the argument, before any
kernel), looks the call up in the table (:func:`choose`) and runs

* ``"fused"``: ``fqr.<op>_proj`` (one kernel; the fused contract of the float64 composition
  ``x @ w_qkv.T (+ qkv_bias)`` then the prologue, plus the fp32 accumulation floor);
* ``"pair"``: ``torch.nn.functional.linear(x, w_qkv, qkv_bias)`` (cuBLAS on CUDA), then
  ``fqr.<op>`` on that row. Its numerics are the pair's: qkv rounded once to x's dtype by the
  GEMM, then the prologue op's fused contract on that rounded row.

``torch.ops.fqr.<op>_proj_dispatch`` is the same entry as a ``torch.library`` op (schema and
fake those of ``torch.ops.fqr.<op>_proj``: the outputs do not depend on the choice), so that
Inductor can call it with a dynamic token count: the choice is then made at run time, per call.
The fusion pass (:mod:`fqr.fusion.patterns`, "projection") puts it into compiled vLLM-shaped
models; :class:`fqr.fusion.models.VllmStyleAttention` calls it with ``prologue="dispatch"``.

The table (``proj_dispatch.json`` beside this module, ``schema`` ``fqr.proj-dispatch/1``)::

    {"schema": "fqr.proj-dispatch/1", "source": "...", "buckets": [1, 2, 16, 1024, null],
     "entries": [{"device": "NVIDIA H200", "dtype": "bf16", "op": "split_qkv_rmsnorm_rope",
                  "n": 768, "k": 4096, "heads": [4, 1, 128], "norm": "head", "bias": false,
                  "model": "qwen3-8b TP8", "source": "...",
                  "choice": ["fused", "fused", "pair", "pair", "pair"],
                  "measured": [[1, 9.37, 6.66], [2, 9.47, 7.23], [16, 9.72, 13.84], ...]}, ...]}

An entry's key is the device's name (``torch.cuda.get_device_name``; ``"cpu"`` for CPU tensors),
the activation dtype, the prologue op, the projection's ``N`` (w_qkv's rows) and ``K`` (its
columns), the heads ``[num_heads, num_kv_heads, head_dim]`` and the ``norm`` argument of the
call (null for an op without them), and whether a ``qkv_bias`` is given. ``measured`` holds, per
token count the bench timed, ``[T, pair µs, fused µs]`` (device µs of CUDA-graph replays,
``fqr bench --projection``; fused null where its float64 check failed); ``choice`` has one
entry per token bucket (``T <= 1``, ``<= 2``, ``<= 16``, ``<= 1024``, any): ``"fused"`` where the
fused kernel was faster than the pair at every T measured in the bucket, else ``"pair"`` (a bucket
with no measurement keeps the pair). A table whose choices disagree with its own measurements
is refused. A call whose key has no entry (another device, dtype or shape; a bias the bench did
not time) runs the pair: today's behaviour, never slower than it.

``fqr bench --projection --write-dispatch PATH`` writes a new table from its measured cells
(:func:`fqr.bench.projection.dispatch_table`); the shipped one was written so from one H200
run at T = 1, 2, 16, 1024 and 16384, whose log and cells are
``docs/results/projection-h200-issue40-d.{log,json}``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .core import ACTIVATION_DTYPE_NAMES, dtype_name, dtype_of
from .lowering.tuning import table_text as table_text  # tuning.json's one-entry-a-line JSON
from .prologue import DECLARATIONS
from .prologue.declare import (
    DISPATCH_KEYS,
    LIBRARY,
    _as_schema_returns,
    _schema,
    _torch_fake,
    _torch_values,
)
from .prologue.projected import OWN, SUFFIX, ProjectedDeclaration
from .text import printable

SCHEMA = "fqr.proj-dispatch/1"
TABLE_FILE = Path(__file__).with_name("proj_dispatch.json")
TOKEN_BUCKETS = (1, 2, 16, 1024, None)  # the upper T of each bucket (None: any T)
CHOICES = ("fused", "pair")
OP_SUFFIX = "_dispatch"  # torch.ops.fqr.<op>_proj_dispatch
ENTRY_FIELDS = ("device", "dtype", "op", "n", "k", "heads", "norm", "bias", "model", "source",
                "choice", "measured", "note")  # fmt: skip


class DispatchTableError(ValueError):
    """A dispatch table that is not one (the file, the field, what was found)."""


@dataclass(frozen=True)
class Key:
    """What a table entry is for (module docstring)."""

    device: str
    dtype: torch.dtype
    op: str  # the prologue (its projected form is op + "_proj")
    n: int
    k: int
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_dim
    norm: str | None
    bias: bool


@dataclass(frozen=True)
class Entry:
    key: Key
    choices: tuple[str, ...]  # one per TOKEN_BUCKETS
    measured: tuple[tuple[int, float, float | None], ...]  # (T, pair µs, fused µs | None)
    doc: Mapping[str, Any]  # the entry as the file holds it


def bucket_of(tokens: int) -> int:
    """The index in :data:`TOKEN_BUCKETS` of the bucket holding ``tokens``."""
    for i, limit in enumerate(TOKEN_BUCKETS):
        if limit is None or tokens <= limit:
            return i
    raise AssertionError("the last bucket takes any T")


def choices_of(measured) -> tuple[str, ...]:
    """Per bucket: ``"fused"`` where it was faster than the pair at every T measured in the
    bucket (and measured at one at least), else ``"pair"``."""
    wins: list[list[bool]] = [[] for _ in TOKEN_BUCKETS]
    for tokens, pair_us, fused_us in measured:
        wins[bucket_of(tokens)].append(fused_us is not None and fused_us < pair_us)
    return tuple("fused" if w and all(w) else "pair" for w in wins)


# ------------------------------------------------------------------------------ the file


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _us(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _text(v: Any, where: str, *, optional: bool = False) -> None:
    if optional and v is None:
        return
    if not isinstance(v, str) or not v or len(v) > 1000:
        raise DispatchTableError(f"{where} must be a non-empty string")


def _entry(e: Any, where: str) -> Entry:
    if not isinstance(e, Mapping):
        raise DispatchTableError(f"{where} must be an object")
    unknown = [name for name in e if name not in ENTRY_FIELDS]
    if unknown:
        raise DispatchTableError(f"{where}: unknown field {printable(unknown[0])!r}")
    _text(e.get("device"), f"{where}.device")
    if e.get("dtype") not in ACTIVATION_DTYPE_NAMES:
        raise DispatchTableError(
            f"{where}.dtype must be one of {', '.join(ACTIVATION_DTYPE_NAMES)}"
        )
    op = e.get("op")
    if not isinstance(op, str) or not isinstance(
        DECLARATIONS.get(op + SUFFIX), ProjectedDeclaration
    ):
        raise DispatchTableError(f"{where}.op must name a prologue with a projected form")
    for name in ("n", "k"):
        if not (_int(e.get(name)) and e[name] > 0):
            raise DispatchTableError(f"{where}.{name} must be a positive int")
    heads = e.get("heads")
    if not (isinstance(heads, list) and len(heads) == 3 and all(_int(h) and h > 0 for h in heads)):
        raise DispatchTableError(f"{where}.heads must be [num_heads, num_kv_heads, head_dim]")
    _text(e.get("norm"), f"{where}.norm", optional=True)
    if not isinstance(e.get("bias"), bool):
        raise DispatchTableError(f"{where}.bias must be true or false")
    for name in ("model", "source", "note"):
        _text(e.get(name), f"{where}.{name}", optional=True)
    measured = e.get("measured")
    if not isinstance(measured, list) or not measured or len(measured) > 64:
        raise DispatchTableError(
            f"{where}.measured must be a list of 1 to 64 [T, pair us, fused us]"
        )
    rows = []
    for i, m in enumerate(measured):
        ok = isinstance(m, list) and len(m) == 3 and _int(m[0]) and m[0] > 0 and _us(m[1])
        if not (ok and (m[2] is None or _us(m[2]))):
            raise DispatchTableError(
                f"{where}.measured[{i}] must be [T >= 1, pair us > 0, fused us > 0 or null]"
            )
        rows.append((m[0], float(m[1]), None if m[2] is None else float(m[2])))
    if len({r[0] for r in rows}) != len(rows):
        raise DispatchTableError(f"{where}.measured: a token count is measured twice")
    choice = e.get("choice")
    if not (isinstance(choice, list) and len(choice) == len(TOKEN_BUCKETS)):
        raise DispatchTableError(
            f"{where}.choice must hold one choice per bucket ({len(TOKEN_BUCKETS)})"
        )
    if any(c not in CHOICES for c in choice):
        raise DispatchTableError(f"{where}.choice: each must be 'fused' or 'pair'")
    derived = choices_of(rows)
    if tuple(choice) != derived:
        raise DispatchTableError(
            f"{where}.choice {choice} disagrees with its measurements, which pick {list(derived)}"
        )
    key = Key(e["device"], dtype_of(e["dtype"]), op, e["n"], e["k"], tuple(heads),  # type: ignore[arg-type]
              e.get("norm"), e["bias"])  # fmt: skip
    return Entry(key, derived, tuple(rows), e)


def parse_table(doc: Any) -> dict[Key, Entry]:
    """``{key: entry}`` of a dispatch table document; :class:`DispatchTableError` naming the
    field where it is not one."""
    if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA:
        raise DispatchTableError(f"'schema' must be {SCHEMA!r}")
    if doc.get("buckets") != list(TOKEN_BUCKETS):
        raise DispatchTableError(f"'buckets' must be {json.dumps(list(TOKEN_BUCKETS))}")
    _text(doc.get("source"), "'source'")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise DispatchTableError("'entries' must be a list")
    table: dict[Key, Entry] = {}
    for i, e in enumerate(entries):
        entry = _entry(e, f"entries[{i}]")
        if entry.key in table:
            raise DispatchTableError(f"entries[{i}]: its key is in the table twice")
        table[entry.key] = entry
    return table


def load_table(path: Path | str = TABLE_FILE) -> dict[Key, Entry]:
    """:func:`parse_table` of the JSON file ``path``; every error one line naming the file."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        reason = printable(str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise DispatchTableError(
            f"{printable(path)}: not a readable JSON document ({reason})"
        ) from None
    try:
        return parse_table(doc)
    except DispatchTableError as e:
        raise DispatchTableError(f"{printable(path)}: {e}") from None


def entry_doc(key: Key, measured, *, model: str | None = None, source: str | None = None) -> dict:
    """A table entry for ``key`` from ``measured`` (``[(T, pair µs, fused µs | None)]``), its
    choices derived (:func:`choices_of`)."""
    rows = sorted((int(t), round(float(p), 2), None if f is None else round(float(f), 2))
                  for t, p, f in measured)  # fmt: skip
    doc: dict[str, Any] = {
        "device": key.device, "dtype": dtype_name(key.dtype), "op": key.op, "n": key.n,
        "k": key.k, "heads": list(key.heads), "norm": key.norm, "bias": key.bias,
    }  # fmt: skip
    if model is not None:
        doc["model"] = model
    if source is not None:
        doc["source"] = source
    doc["choice"] = list(choices_of(rows))
    doc["measured"] = [list(r) for r in rows]
    return doc


def table_doc(entries: list[Mapping[str, Any]], *, source: str) -> dict[str, Any]:
    """A table document holding ``entries`` (checked by :func:`parse_table`)."""
    doc = {"schema": SCHEMA, "source": source, "buckets": list(TOKEN_BUCKETS),
           "entries": [dict(e) for e in entries]}  # fmt: skip
    parse_table(doc)
    return doc


# ---------------------------------------------------------------------------- the lookup

_TABLE: list[dict[Key, Entry] | None] = [None]  # the table in use; None: the shipped one, unread


def current_table() -> dict[Key, Entry]:
    """The table the dispatch reads (the shipped ``proj_dispatch.json`` unless
    :func:`use_table` set another)."""
    table = _TABLE[0]
    if table is None:
        table = _TABLE[0] = load_table(TABLE_FILE)
    return table


def table_digest() -> str:
    """A digest of the table in use (the fusion pass's uuid holds it: a compiled graph's
    projection rewrites follow the table)."""
    import hashlib

    entries = sorted(json.dumps(e.doc, sort_keys=True) for e in current_table().values())
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


@contextlib.contextmanager
def use_table(table: Path | str | Mapping[str, Any] | None) -> Iterator[dict[Key, Entry]]:
    """Dispatch by ``table`` (a file, a document, or None: the shipped one) inside the block:
    to try a freshly written table before it replaces the shipped one, and in tests. The table
    is read and checked first (:class:`DispatchTableError` naming the file)."""
    if table is None:
        parsed = load_table(TABLE_FILE)
    elif isinstance(table, Mapping):
        parsed = parse_table(table)
    else:
        parsed = load_table(table)
    before = _TABLE[0]
    _TABLE[0] = parsed
    try:
        yield parsed
    finally:
        _TABLE[0] = before


@lru_cache(maxsize=64)
def device_name(device: torch.device) -> str:
    """The device's name as a table keys it: ``torch.cuda.get_device_name`` for a CUDA device
    (``"NVIDIA H200"``), else the device type (``"cpu"``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def key_of(proj: ProjectedDeclaration, call) -> Key:
    """The table key of a bound projected call (``proj.bound(values)``)."""
    x, w = call.x, call.w_qkv
    heads = tuple(int(getattr(call, n, 0) or 0) for n in ("num_heads", "num_kv_heads", "head_dim"))
    norm = getattr(call, "norm", None)
    return Key(device_name(x.device), x.dtype, proj.base.name, int(w.shape[0]), int(w.shape[1]),
               heads, norm if isinstance(norm, str) else None, call.qkv_bias is not None)  # type: ignore[arg-type]  # fmt: skip


def choose(key: Key, tokens: int | None) -> str:
    """``"fused"`` or ``"pair"`` for ``key`` at ``tokens`` tokens (``None``: not known yet, a
    dynamic T: ``"fused"`` when any bucket of the key picks it). No entry: ``"pair"``."""
    entry = current_table().get(key)
    if entry is None:
        return "pair"
    if tokens is None:
        return "fused" if "fused" in entry.choices else "pair"
    return entry.choices[bucket_of(tokens)]


# -------------------------------------------------------------------------- the dispatch


def projected_declaration(op: str) -> ProjectedDeclaration:
    """``op``'s projected form's declaration (``ValueError`` naming ``op`` if it has none)."""
    proj = DECLARATIONS.get(op + SUFFIX) if isinstance(op, str) else None
    if not isinstance(proj, ProjectedDeclaration):
        with_form = sorted(d.base.name for d in DECLARATIONS.values()
                           if isinstance(d, ProjectedDeclaration))  # fmt: skip
        raise ValueError(
            f"op must name a prologue with a projected form ({', '.join(with_form)}), got "
            f"{printable(op)!r}"
        )
    return proj


def run(proj: ProjectedDeclaration, values: list):
    """Run one projected call (``values`` in ``proj``'s parameter order) as the table says:
    the projected op, or ``F.linear`` then the prologue op. The projected form's checks run
    first, so bad input is refused before any kernel on either path."""
    call = proj.bound(values)
    proj.validate(call)
    if choose(key_of(proj, call), call.x.shape[0]) == "fused":
        return proj.call(values)
    qkv = torch.nn.functional.linear(call.x, call.w_qkv, call.qkv_bias)
    rest = {name: values[i] for name, i in proj.index.items() if name not in OWN}
    return proj.base.function(qkv, **rest)


def proj_dispatch(op: str, *args, **kwargs):
    """``fqr.<op>_proj``'s call, run as the dispatch table picks for its device, dtype, shape
    and token count: the fused kernel (one rounding) or ``torch.nn.functional.linear`` then
    ``fqr.<op>`` (the pair's numerics: qkv rounded once to x's dtype by the GEMM, then the
    prologue op's fused contract on it). See :mod:`fqr.projection`.

    Example::

        >>> import torch, fqr
        >>> x, w = torch.randn(3, 64), torch.randn(4 * 16, 64) / 8
        >>> table = fqr.rope_cos_sin_cache(16, 32, 1e6)
        >>> q, k, v = fqr.proj_dispatch("split_qkv_rmsnorm_rope", x, w, torch.arange(3), table,
        ...                             None, None, num_heads=2, num_kv_heads=1, head_dim=16,
        ...                             norm="none")
        >>> q.shape, v.shape
        (torch.Size([3, 32]), torch.Size([3, 16]))
    """
    proj = projected_declaration(op)
    return run(proj, proj.bind(args, kwargs))


def choice_for(op: str, *args, **kwargs) -> str:
    """What :func:`proj_dispatch` would run for this call: ``"fused"`` or ``"pair"`` (the
    call's metadata checked first)."""
    proj = projected_declaration(op)
    call = proj.bound(proj.bind(args, kwargs))
    proj.validate(call, values_too=False)
    return choose(key_of(proj, call), call.x.shape[0])


def _register(proj: ProjectedDeclaration) -> None:
    """``torch.ops.fqr.<op>_proj_dispatch``: ``<op>_proj``'s schema and fake, :func:`run` as
    the implementation."""
    name = proj.name + OP_SUFFIX
    values_of = _torch_values(proj)

    def impl(*args):
        values = values_of(args)
        return _as_schema_returns(proj, proj.bound(values), run(proj, values))

    LIBRARY.define(name + _schema(proj))
    for key in DISPATCH_KEYS:
        LIBRARY.impl(name, impl, key)
    LIBRARY._register_fake(name, _torch_fake(proj))


for _decl in list(DECLARATIONS.values()):
    if isinstance(_decl, ProjectedDeclaration):
        _register(_decl)
del _decl
