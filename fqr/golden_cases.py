"""The golden cases' contents: each case's inputs drawn from its seed (:mod:`fqr.inputs`), its
float64 expectations, and the manifest entry that describes them. :mod:`fqr.golden` stores,
lists, loads and checks them (``fqr golden regen`` writes what :func:`case_tensors` returns).

A split-qkv case of the packed row records its call's fields (heads, norm, peer layout, row
stride); a case of any other variant, or of a projected form (``CaseSpec.hidden``: the op from
the hidden states, :mod:`fqr.prologue.projected`), records its variant, outputs, tolerance
kinds and every stored tensor's dtype and shape (and ``projected``: ``{"hidden", "qkv_bias"}``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import reference
from .core import DTYPE_NAMES, dtype_of
from .inputs import random_norm_params, random_positions, random_qkv
from .numerics import kind_text, tolerance_text
from .presets import PrologueSpec, get_preset
from .prologue import CaseSpec, NormStats, get_variant
from .prologue.split_qkv import SPLIT_QKV
from .rope_cache import rope_cos_sin_cache

# The peer layouts and forms of the split-qkv cases (CaseSpec.peer): the keyword arguments of
# fqr.split_qkv_rmsnorm_rope each adds, as stored in a manifest entry's "peer" (absent: none).
# "rope": False is a layer without RoPE (cos_sin_cache=None); v_heads/v_dim scale v's head count
# and head_dim against k's.
PEER_FORMS: dict[str, dict] = {
    "nope": {"rope": False},
    "vheads": {"v_heads": 0.5, "v_dim": 1.5},
    "padded": {"head_pad": 16},
    "inplace": {"inplace": True},
}


def peer_kwargs(entry: dict) -> dict:
    """The layout and form arguments of a manifest entry's call (none without "peer")."""
    peer = entry.get("peer") or {}
    return {
        k: peer[k] for k in ("num_v_heads", "v_head_dim", "head_stride", "inplace") if k in peer
    }


def row_width(entry: dict) -> int:
    """Width of the packed row an entry describes (its layout, padding of each head included)."""
    peer = entry.get("peer") or {}
    hq, hkv, d = entry["num_heads"], entry["num_kv_heads"], entry["head_dim"]
    hv, dv = peer.get("num_v_heads", hkv), peer.get("v_head_dim", d)
    if peer.get("head_stride"):
        return (hq + hkv + hv) * peer["head_stride"]
    return (hq + hkv) * d + hv * dv


def _peer_entry(case: CaseSpec, spec: PrologueSpec) -> dict | None:
    """The manifest's "peer" field of a case: its call arguments, concrete for its shapes."""
    if case.peer is None:
        return None
    form, d, hkv = PEER_FORMS[case.peer], spec.head_dim, spec.num_kv_heads
    peer: dict = {"rope": form.get("rope", True)}
    if "v_heads" in form:
        peer["num_v_heads"] = max(1, int(hkv * form["v_heads"]))
        peer["v_head_dim"] = int(d * form["v_dim"])
    if "head_pad" in form:
        peer["head_stride"] = d + form["head_pad"]
    if form.get("inplace"):
        peer["inplace"] = True
    return peer


def _peer_qkv(entry: dict, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A packed row of the entry's layout: fresh values where heads are, NaN in head padding."""
    e, t = entry, entry["tokens"]
    kw = peer_kwargs(e)
    sections = reference.qkv_sections(
        e["num_heads"],
        e["num_kv_heads"],
        e["head_dim"],
        num_v_heads=kw.get("num_v_heads"),
        v_head_dim=kw.get("v_head_dim"),
        head_stride=kw.get("head_stride"),
    )
    row = torch.full((t, row_width(e)), float("nan"), dtype=torch.float64)
    for sec in sections:
        scale = 0.5 + 2.5 * torch.rand(sec.heads, generator=gen, dtype=torch.float64)
        heads = torch.randn(t, sec.heads, sec.head_dim, generator=gen, dtype=torch.float64)
        for h, (start, end) in enumerate(sec.head_columns()):
            row[:, start:end] = heads[:, h] * scale[h]
    return row.to(dtype)


def _table_rows_used(preset, positions: torch.Tensor, max_position: int):
    """The distinct positions a case reads and their rows of the preset's RoPE table."""
    index = torch.unique(positions.long())
    rows = rope_cos_sin_cache(
        preset.rotary_dim,
        max_position,
        preset.rope_theta,
        scaling=dict(preset.rope_scaling),
        rows=index,
    )
    return index, rows


def case_tensors(case: CaseSpec) -> tuple[dict[str, torch.Tensor], dict]:
    """Draw one case's inputs from its seed (:mod:`fqr.inputs`) and compute its expectations."""
    if case.variant_name != SPLIT_QKV.name or case.hidden is not None:
        return _variant_case_tensors(case)
    preset = get_preset(case.preset, case.tp)
    is_neox = preset.is_neox if case.is_neox is None else case.is_neox
    spec = replace(preset.spec, is_neox=is_neox)
    dtype = dtype_of(case.dtype)
    gen = torch.Generator().manual_seed(case.seed)
    t, d = case.tokens, spec.head_dim
    max_position = case.max_position or preset.max_position

    peer = _peer_entry(case, spec)
    if peer is None:
        qkv = random_qkv(spec, t, dtype, gen)
    else:
        layout = {"num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads}
        qkv = _peer_qkv(dict(layout, head_dim=d, tokens=t, peer=peer), dtype, gen)
    positions = random_positions(
        t, max_position, gen, dtype=dtype_of(case.positions_dtype), cover_ends=True
    )
    norm = dict(
        zip(
            ("q_weight", "k_weight", "q_bias", "k_bias"),
            random_norm_params(spec, dtype, gen, bias=case.bias),
        )
    )
    tensors: dict[str, torch.Tensor] = {"qkv": qkv, "positions": positions}
    tensors.update((name, x) for name, x in norm.items() if x is not None)
    norm_stats = None
    if spec.norm == "full" and preset.tp > 1:
        # The other ranks' q/k features, drawn only for the all-reduced sums of squares.
        sums = []
        for local, total in (
            (spec.q_size, preset.total_heads * d),
            (spec.kv_size, preset.total_kv_heads * d),
        ):
            rest = torch.randn(t, total - local, generator=gen, dtype=torch.float64)
            rest = (rest * (0.5 + 2.5 * torch.rand(1, generator=gen, dtype=torch.float64))).to(
                dtype
            )
            sums.append(rest.to(torch.float64).square().sum(-1))
        q, k, _ = reference.split_row(
            qkv, reference.qkv_sections(spec.num_heads, spec.num_kv_heads, d)
        )
        tensors["q_sum_sq"] = (sums[0] + q.double().square().sum(-1)).to(torch.float32)
        tensors["k_sum_sq"] = (sums[1] + k.double().square().sum(-1)).to(torch.float32)
        norm_stats = NormStats(
            tensors["q_sum_sq"],
            tensors["k_sum_sq"],
            preset.total_heads * d,
            preset.total_kv_heads * d,
        )

    index, rows = _table_rows_used(preset, positions, max_position)
    table = None
    if peer is None or peer["rope"]:
        tensors["cos_sin_index"], tensors["cos_sin_rows"] = index, rows
        table = sparse_table(rows, index, max_position)
    layout = {} if peer is None else peer_kwargs({"peer": peer})
    layout.pop("inplace", None)
    q, k, v = reference.prologue(
        qkv,
        positions,
        table,
        norm["q_weight"],
        norm["k_weight"],
        **spec.kwargs(q_bias=norm["q_bias"], k_bias=norm["k_bias"], norm_stats=norm_stats),
        **layout,
    )
    tensors.update(expected_q=q, expected_k=k, expected_v=v)

    entry = {
        "name": case.name,
        "file": f"{case.name}.safetensors",
        "seed": case.seed,
        "preset": case.preset,
        "tp": case.tp,
        "dtype": case.dtype,
        "numerics": case.numerics,
        "tokens": t,
        "bias": case.bias,
        "is_neox": is_neox,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": d,
        "rotary_dim": spec.rotary_dim,
        "norm": spec.norm,
        "norm_stats": norm_stats is not None,
        "eps": spec.eps,
        "weight_offset": spec.weight_offset,
        "rope_theta": preset.rope_theta,
        "max_position": max_position,
        "positions_dtype": case.positions_dtype,
        "row_stride": qkv.shape[1] + case.row_pad,
        "variant": SPLIT_QKV.name,
        "tolerance": {
            "q": tolerance_text(case.numerics, dtype),
            "k": tolerance_text(case.numerics, dtype),
            "v": "bit-exact",
        },
    }
    if peer is not None:
        entry["peer"] = peer
    return tensors, entry


def _variant_case_tensors(case: CaseSpec) -> tuple[dict[str, torch.Tensor], dict]:
    """A case of any other variant, or of a projected form (``case.hidden``): its inputs drawn
    by the variant, the RoPE rows its positions use (none for an op without positions: a
    stand-alone cache insert), and the variant's float64 expectation of each output
    (``expected_<output>``)."""
    variant = get_variant(case.variant_name)
    preset = get_preset(case.preset, case.tp)
    variant.check(preset)
    projected = None
    if case.hidden is not None:
        projected = {"hidden": case.hidden, "qkv_bias": case.qkv_bias}
        variant = variant.projected_form(**projected)
    if case.row_pad:
        raise ValueError(f"case {case.name}: row_pad is a split-qkv case option")
    dtype = dtype_of(case.dtype)
    gen = torch.Generator().manual_seed(case.seed)
    max_position = case.max_position or preset.max_position
    inputs = variant.draw(
        preset,
        case.tokens,
        dtype,
        gen,
        max_position=max_position,
        positions_dtype=dtype_of(case.positions_dtype),
        bias=case.bias,
    )
    # a case file holds each input's values (a [T, H, D] view of a row is stored contiguous)
    tensors, table = {name: x.contiguous() for name, x in inputs.items()}, None
    if reads_positions(variant.name):
        index, rows = _table_rows_used(preset, inputs["positions"], max_position)
        tensors.update(cos_sin_index=index, cos_sin_rows=rows)
        table = sparse_table(rows, index, max_position)
    expected = variant.expected(preset, inputs, table)
    outputs = variant.outputs_of(preset)
    tensors.update((f"expected_{name}", expected[name]) for name in outputs)
    spec = preset.spec
    kinds = {name: variant.tolerance(name, preset) for name in outputs}
    program = variant.program(preset, dtype, numerics=case.numerics)
    out_dtypes = {name: v.aval.dtype for name, v in zip(outputs, program.outputs)}
    entry = {
        "name": case.name,
        "file": f"{case.name}.safetensors",
        "seed": case.seed,
        "preset": case.preset,
        "variant": variant.name,
        "variant_params": {k: _jsonable(v) for k, v in preset.variant_params},
        "tp": case.tp,
        "dtype": case.dtype,
        "numerics": case.numerics,
        "tokens": case.tokens,
        "bias": case.bias,
        "is_neox": spec.is_neox,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rotary_dim": spec.rotary_dim,
        "norm": spec.norm,
        "norm_stats": False,
        "eps": spec.eps,
        "weight_offset": spec.weight_offset,
        "rope_theta": preset.rope_theta,
        "max_position": max_position,
        "positions_dtype": case.positions_dtype,
        # the packed row's width: the op's first (token-indexed) argument, or the rows of a
        # projected form's weight (the row the product makes)
        "row_stride": int(
            inputs["w_qkv"].shape[0]
            if projected
            else inputs[variant.declaration.tensor_params[0].name].shape[1]
        ),
        "outputs": list(outputs),
        "tolerance_kinds": kinds,
        "tolerance": {
            name: kind_text(kind, case.numerics, out_dtypes[name]) for name, kind in kinds.items()
        },
        "tensors": {
            name: [DTYPE_NAMES.get(x.dtype, str(x.dtype)), list(x.shape)]
            for name, x in tensors.items()
        },
    }
    if projected:
        entry["projected"] = projected
    return tensors, entry


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def reads_positions(variant: str) -> bool:
    """Whether a variant's op takes positions (and its case files the RoPE rows they read)."""
    return "positions" in get_variant(variant).declaration.index


def sparse_table(rows: torch.Tensor, index: torch.Tensor, max_position: int) -> torch.Tensor:
    """``[max_position, R]`` with ``rows`` at ``index`` and NaN everywhere else."""
    table = torch.full((max_position, rows.shape[1]), float("nan"), dtype=rows.dtype)
    table[index] = rows
    return table
