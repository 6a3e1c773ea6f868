"""Cells of a preset whose prologue is another member of the family (:mod:`fqr.prologue`):
the same run loop, columns and document rows as the split-qkv presets, with every part taken
from the preset's :class:`~fqr.prologue.Variant`:

==============  ============================================================================
inputs          :meth:`Variant.draw` (fresh per cell, rotated like the split-qkv sets)
expectation     :meth:`Variant.expected` (float64) on the checked rows
fqr             :meth:`Variant.run_in_place`, the public op, under the run's numerics (a
                donated KV cache updated in place, as vLLM passes it: every call on a set
                stores the same rows); on triton its bare launcher is the variant program's
                kernel (:meth:`Variant.program_args`)
eager/compile   :meth:`Variant.eager`, the model's own unfused chain, and
                ``torch.compile(fullgraph=True)`` of it (token dimension dynamic), ``unfused``
check           each output under its tolerance kind (:meth:`Variant.tolerance`), finite on
                every row
traffic         bytes of every input read once (the table: one row per token; a donated
                cache is not read) plus every output written once
                (:meth:`Variant.bytes_written`: a cache only at its stored slots)
==============  ============================================================================

Liger is split-qkv's own (it has no kernel for these chains): a variant preset reports it as
skipped. The dispatch table (:func:`fqr.bench.run.dispatch_rows`) takes every preset's variant.
"""

from __future__ import annotations

from functools import partial

import torch

from ..core import TOKENS, HeadOp, Role, dtype_name
from ..numerics import compare_kind
from ..presets import Preset
from ..prologue import Variant, variant_of
from .cell import Cell, Implementation
from .checks import cell_generator, check_row_index, check_rows, record
from .config import BenchConfig
from .document import FQR
from .traffic import Traffic, rotation_sets

# The bench reads positions below this (the tables of Llama 4 and Gemma 4 are 5 and 0.5 GB at
# their configs' max_position_embeddings; a row gather costs the same at any position).
MAX_TABLE_ROWS = 1 << 18


def variant_table(preset: Preset) -> torch.Tensor:
    """The preset's real fp32 table, at most :data:`MAX_TABLE_ROWS` rows."""
    return preset.cos_sin_cache(min(preset.max_position, MAX_TABLE_ROWS))


def is_variant_preset(preset: Preset) -> bool:
    return preset.variant != "split-qkv"


def _token_rows(variant: Variant, inputs: dict, rows: torch.Tensor) -> dict:
    """The inputs at the checked rows: each token-indexed argument (its kind's token dim:
    rows, positions, planes, slots) cut to them, every other one (weights, caches) as it
    is. A slot mapping of the first N <= T tokens keeps the checked rows below N (``rows``
    ascend: the sample's first tokens keep their slots)."""
    token_dims = {
        p.name: p.kind.token_dim
        for p in variant.declaration.tensor_params
        if p.kind.token_dim is not None
    }
    sample = {}
    for name, x in inputs.items():
        dim = token_dims.get(name)
        if dim is not None and x.dim() > 1 and name == "positions":
            dim = x.dim() - 1  # [planes, T] positions
        sample[name] = x if dim is None else x.index_select(dim, rows[rows < x.shape[dim]])
    return sample


def variant_traffic(
    variant: Variant, preset: Preset, inputs: dict, cache: torch.Tensor, dtype: torch.dtype
) -> Traffic:
    """Bytes the call reads and writes, once each (module docstring): of a packed row the
    columns its sections hold (a head's padding, or q's nope part where only the rope part is
    rotated in place, is not read), of the table one row per token, of a donated cache
    nothing; every output written once (:meth:`Variant.bytes_written`: a cache only at its
    stored slots)."""
    positions = inputs.get("positions")  # an op without positions (a cache insert) has none
    options = {} if positions is None else {"positions_dtype": positions.dtype}
    program = variant.program(preset, dtype, **options)
    operands = variant.program_args(preset, inputs, cache)
    tokens = next(iter(inputs.values())).shape[0]
    read = {"rows": 0, "index": 0, "table": 0, "call": 0}
    facts = program.eqn_facts()
    for var, x in zip(program.inputs, operands):
        roles = {
            f.operands[i] if isinstance(f, HeadOp) else ("sections", f.sections)
            for e, f in facts
            for i, v in enumerate(e.inputs)
            if v is var and f is not None
        }
        if Role.CACHE in roles:
            continue  # stored into at its slots, never read
        sections = [r[1] for r in roles if isinstance(r, tuple)]
        if Role.TABLE in roles:
            read["table"] += tokens * x.shape[1] * x.element_size()
        elif sections:
            columns = sum(s.width for sec in sections for s in sec)
            read["rows"] += tokens * columns * x.element_size()
        elif Role.INDEX in roles or (
            x.dim() and x.shape[0] == tokens and not x.is_floating_point()
        ):
            read["index"] += x.nbytes
        elif x.dim() and x.shape[0] == tokens:
            read["rows"] += x.nbytes
        else:
            read["call"] += x.nbytes
    return Traffic(
        qkv_read=read["rows"],
        qkv_written=variant.bytes_written(program, inputs),
        positions=read["index"],
        cos_sin=read["table"],
        weights=read["call"],
    )


def per_call_outputs(variant: Variant, preset: Preset, dtype: torch.dtype) -> frozenset[str]:
    """The outputs that are not ``[T, ...]`` rows (a paged cache the op updates): checked
    whole, against the expectation of the whole call."""
    program = variant.program(preset, dtype)
    return frozenset(
        name
        for name, v in zip(variant.outputs_of(preset), program.outputs)
        if not v.aval.shape or v.aval.shape[0] != TOKENS
    )


def check_variant_outputs(
    variant: Variant,
    preset: Preset,
    outputs,
    exact: dict,
    rows: torch.Tensor,
    numerics: str,
    tokens: int,
    whole: frozenset[str] = frozenset(),
) -> dict:
    """Each output on the sampled rows under its tolerance kind, and finite on every row; an
    output in ``whole`` (:func:`per_call_outputs`) compared whole."""
    report = {"passed": True, "rows": int(rows.numel()), "numerics": numerics}
    names = variant.outputs_of(preset)
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(names):
        got = len(outputs) if isinstance(outputs, (tuple, list)) else type(outputs).__name__
        return report | {"passed": False, "error": f"{got} outputs, expected {names}"}
    for name, out in zip(names, outputs):
        want, kind = exact[name], variant.tolerance(name, preset)
        d = variant.head_dim(preset, name)
        if name in whole and isinstance(out, torch.Tensor):
            # the whole cache (its expectation may be another form: fp8_ds_mla's entries)
            try:
                c = compare_kind(kind, out, want, head_dim=d, numerics=numerics).to_dict()
            except (ValueError, AssertionError) as e:
                c = {"passed": False, "error": f"{list(out.shape)}: {e}"}
        elif not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != tokens:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            c = {"passed": False, "error": f"got {got}, expected [{tokens}, ...]"}
        else:
            c = check_rows(kind, out, want, rows, d, numerics)
        record(report, name, c)
    return report


def make_variant_cell(
    cfg: BenchConfig, preset: Preset, dtype: torch.dtype, tokens: int, cache: torch.Tensor,
    env: dict, ceiling_gbps: float, device: torch.device,
) -> Cell:  # fmt: skip
    """A :class:`fqr.bench.run.Cell` of a variant preset (seeded per cell, as split-qkv's)."""
    variant = variant_of(preset)
    label = f"{preset.name} {dtype_name(dtype)} T={tokens}"
    seed, generator = cell_generator(cfg.seed, label, device)

    def draw():
        return variant.draw(preset, tokens, dtype, generator, max_position=cache.shape[0])

    first = draw()
    traffic = variant_traffic(variant, preset, first, cache, dtype)
    n_sets = rotation_sets(traffic.total, env["l2_bytes"])
    sets = [first] + [draw() for _ in range(n_sets - 1)]
    rows = check_row_index(tokens, cfg.check_rows, torch.Generator().manual_seed(seed), "cpu")
    rows = rows.to(device)
    exact = variant.expected(preset, _token_rows(variant, first, rows), cache)
    whole = per_call_outputs(variant, preset, dtype)
    if whole:  # before any run updates them in place: the whole call's expectation
        full = variant.expected(preset, first, cache)
        exact.update((name, full[name]) for name in whole)
    check = partial(check_variant_outputs, variant, preset, tokens=tokens, whole=whole)
    # the updated inputs as drawn, put back before each implementation's check (an in-place
    # rotation compounds; a cache insert stores the same entries again, harmlessly)
    pristine = {n: first[n].clone() for n in variant.donated if n in first}

    def restore() -> None:
        for name, x in pristine.items():
            first[name].copy_(x)

    return Cell(
        preset,
        dtype,
        tokens,
        sets,
        rows,
        exact,
        traffic,
        ceiling_gbps,
        device,
        check,
        restore if pristine else None,
    )


def _compiled(chain):
    """``torch.compile(fullgraph=True)`` of an eager chain, the token dimension dynamic (as
    vLLM marks it; sizes 0 and 1 are always specialised): in each input the first dim of T
    rows (``[T, ...]`` rows, ``[3, T]`` mRoPE positions), never a later one that happens to
    equal T (Gemma 4's qkv row is 16,384 wide: marking it too is a constraint violation)."""
    compiled = torch.compile(chain, fullgraph=True)

    def run(inputs: dict):
        tokens = inputs["qkv"].shape[0]
        if tokens >= 2:
            for x in inputs.values():
                token_dim = next((d for d, size in enumerate(x.shape) if size == tokens), None)
                if token_dim is not None:
                    torch._dynamo.mark_dynamic(x, token_dim)
        return compiled(inputs)

    return run


def variant_implementations(
    cfg: BenchConfig, preset: Preset, dtype: torch.dtype, cache: torch.Tensor, skipped: dict
) -> list:
    """fqr (the variant's public op), then the peers the variant has (module docstring)."""
    variant = variant_of(preset)

    def ours(inputs: dict):  # a donated cache as a serving engine passes it: updated in place
        return variant.run_in_place(
            preset, inputs, cache, numerics=cfg.numerics, backend=cfg.backend
        )

    fqr = Implementation(FQR, ours, cfg.numerics)
    if cfg.backend == "triton":
        from ..lowering import lower_by_tokens

        program = variant.program(preset, dtype, numerics=cfg.numerics)
        kernels = lower_by_tokens(program, target="cuda")
        fqr.launcher = lambda x: kernels.launch(variant.program_args(preset, x, cache))
        if cfg.pdl:
            pdl = lower_by_tokens(program, target="cuda", pdl=True)
            fqr.pdl_launcher = lambda x: pdl.launch(variant.program_args(preset, x, cache))
    impls = [fqr]
    for peer in cfg.compare:
        if peer not in ("eager", "compile"):
            skipped[f"{peer}/{preset.name}"] = f"{peer} has no {variant.name} chain"
            continue
        chain = variant.eager(preset, cache, dtype)
        impls.append(
            Implementation(peer, chain if peer == "eager" else _compiled(chain), "unfused")
        )
    return impls
