"""fqr's public functions and the test-support builders on ``meta`` tensors: a device mix-up found
on the CPU, without a GPU (issue 30 item 4).

A CPU tensor mixed with a tensor of the caller's device is a mistake the CPU suite cannot see
(there the caller's device is the CPU) and a GPU run finds at the cost of a GPU visit: issue 30
found two (``rope_angles`` built ``inv_freq`` on the CPU; ``peer_table`` indexed a CPU table by
CUDA positions) that failed all 232 cases of ``tests/gpu/test_gpu_peers_mrope.py``. ``meta``
tensors are another device than the CPU that every machine has, free at any size: torch raises
"... is not on the expected device meta!" where CUDA raises "Expected all tensors to be on the
same device", and :class:`support.devices.CudaDeviceRules` (on for every test here) makes it
raise too where CUDA does and ``meta`` would not (a CPU tensor indexed by meta ones).

What runs, derived from fqr's registries so that a new op is covered without an edit here:
every preset's variant (:data:`fqr.prologue.VARIANTS`) through its public op (the ``auto``
backend, which is ``reference`` on ``meta``), ``torch.ops.fqr`` and its float64 reference;
the RoPE tables; and the builders the GPU files call (each port's ``check_case``, the mRoPE
and MiniMax runners, the peers' references) with ``device="meta"`` on the ``reference``
backend. :func:`test_every_public_name_is_run_on_meta` holds ``fqr.__all__`` to this list.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
from support import peers_mrope
from support import vllm_ascend_minimax as minimax
from support.devices import CudaDeviceRules
from support.mla import FLAVOURS, Q_LORA, draw, mla_program
from support.peer_caches import vllm_fused_qk_norm_rope
from support.peer_ports import PORTS, load_port, peer_norm_rope, peer_positions, peer_table
from support.vllm_native import vllm_native_case

import fqr
import fqr.ops
from fqr.backends import BACKENDS
from fqr.core import Primitive
from fqr.prologue import DECLARATIONS, VARIANTS, variant_of
from fqr.prologue.declare import NUMERICS, Slots
from fqr.rope_cache import SCALING_KEYS, rope_cos_sin_cache

META = torch.device("meta")
TOKENS, ROWS = 5, 64


@pytest.fixture(autouse=True)
def cuda_device_rules():
    with CudaDeviceRules():
        yield


def on_meta(inputs: dict) -> dict:
    """A call's inputs (tensors, :class:`fqr.NormStats`) on meta."""

    def moved(x):
        if isinstance(x, fqr.NormStats):
            return replace(x, q_sum_sq=x.q_sum_sq.to(META), k_sum_sq=x.k_sum_sq.to(META))
        return x.to(META)

    return {name: moved(x) for name, x in inputs.items()}


def outputs(result) -> list[torch.Tensor]:
    items = result.values() if isinstance(result, dict) else result
    items = items if isinstance(items, (tuple, list)) else [items]
    return [t for t in items if isinstance(t, torch.Tensor)]


def assert_like(meta: list[torch.Tensor], cpu: list[torch.Tensor]) -> None:
    """The meta run's outputs: on meta, with the CPU run's shapes and dtypes."""
    assert [t.device for t in meta] == [META] * len(meta)
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in cpu]


# ------------------------------------------------------------------------ the RoPE tables

# One scaling of each kind fqr.rope_cache builds (test_the_samples_cover_every_scaling).
SAMPLE_SCALINGS = {
    "none": {},
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    "negated": {"rope_type": "negated"},
    "yarn": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
}


def test_the_samples_cover_every_scaling():
    assert set(SAMPLE_SCALINGS) == {"none", *SCALING_KEYS}


@pytest.mark.parametrize("kind", sorted(SAMPLE_SCALINGS))
def test_a_table_is_built_on_the_rows_device(kind):
    rows = torch.arange(ROWS, device=META)
    table = rope_cos_sin_cache(64, 4096, 1e4, SAMPLE_SCALINGS[kind] or None, rows=rows)
    assert table.device == META and table.shape == (ROWS, 64)


def test_peer_table_is_built_on_the_positions_device(gen):
    positions = peer_positions(TOKENS, 4096, gen)
    table = peer_table(64, positions.to(META), torch.bfloat16, max_position=4096)
    assert table.device == META and table.shape == (4096, 64) and table.dtype == torch.bfloat16
    asked = peer_table(64, positions, torch.bfloat16, max_position=4096, device=META)
    assert asked.device == META  # device= builds it there from the CPU positions


# ---------------------------------------------------------------------- the public ops

# Every preset, so every variant and every option its presets take (FP8 caches, byte layouts).
PRESETS = sorted(fqr.PRESETS)


def preset_call(name: str, gen: torch.Generator):
    """The preset's variant, one call's inputs and its table (CPU); a full-width norm is
    sharded (TP 2) and takes its all-reduced statistics (:class:`fqr.NormStats`)."""
    preset = fqr.PRESETS[name]
    variant = variant_of(preset)
    if variant.sharded_stats is not None and preset.spec.norm == "full":
        preset = fqr.get_preset(name, 2)
    table = preset.cos_sin_cache(ROWS)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=ROWS)
    if variant.sharded_stats is not None:
        inputs = variant.sharded_stats(preset, inputs)
    return preset, variant, inputs, table


def numerics_modes(variant, preset) -> list[str]:
    """The numerics modes the preset's op takes (those its declaration's checks let pass)."""
    modes = []
    for mode in NUMERICS:
        try:
            variant.program(preset, numerics=mode)
        except ValueError:
            continue
        modes.append(mode)
    return modes


@pytest.mark.parametrize("name", PRESETS)
def test_public_op_on_meta_as_on_the_cpu(name, gen):
    """The preset's public op on meta tensors (``auto``: the reference backend there) in every
    numerics mode: outputs on meta, shaped as the same call's on the CPU."""
    preset, variant, inputs, table = preset_call(name, gen)
    for numerics in numerics_modes(variant, preset):
        cpu = variant.run(preset, inputs, table, numerics=numerics)
        meta = variant.run(preset, on_meta(inputs), table.to(META), numerics=numerics)
        assert_like(outputs(meta), outputs(cpu))


@pytest.mark.parametrize("name", PRESETS)
def test_torch_op_on_meta(name, gen):
    preset, variant, inputs, table = preset_call(name, gen)
    op, args = variant.torch_op(preset, on_meta(inputs), table.to(META))
    cpu_op, cpu_args = variant.torch_op(preset, inputs, table)
    assert_like(outputs(op(*args)), outputs(cpu_op(*cpu_args)))


def reads_slot_values(variant) -> bool:
    """A float64 reference that places rows by the slot mapping's values (meta has none)."""
    return any(isinstance(p.kind, Slots) for p in variant.declaration.tensor_params)


@pytest.mark.parametrize(
    "name", [n for n in PRESETS if not reads_slot_values(variant_of(fqr.PRESETS[n]))]
)
def test_float64_reference_on_meta(name, gen):
    preset, variant, inputs, table = preset_call(name, gen)
    meta = variant.expected(preset, on_meta(inputs), table.to(META))
    assert_like(outputs(meta), outputs(variant.expected(preset, inputs, table)))


def test_qk_rmsnorm_rope_on_meta(gen):
    """The declared op no preset variant runs (Hugging Face's separate q and k)."""
    q = torch.randn(TOKENS, 4 * 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(TOKENS, 2 * 64, generator=gen).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    positions = torch.randint(0, ROWS, (TOKENS,), generator=gen)
    args = (q, k, positions, rope_cos_sin_cache(64, ROWS, 1e4), w, w)
    for numerics in ("fused", "unfused"):
        cpu = fqr.qk_rmsnorm_rope(*args, head_dim=64, numerics=numerics)
        meta = fqr.qk_rmsnorm_rope(*(a.to(META) for a in args), head_dim=64, numerics=numerics)
        assert_like(list(meta), list(cpu))
        alone = fqr.qk_rmsnorm_rope(
            q.to(META), None, positions.to(META), args[3].to(META), w.to(META), None, head_dim=64
        )
        assert alone[0].device == META and alone[1] is None


def projected_calls(gen) -> dict:
    """One call of each projected form (``fqr.prologue.projected``) for the first preset of
    its prologue's variants: ``name -> (args, kwargs)``, CPU tensors, the variant's draw with
    its qkv replaced by hidden states, a packed weight and its bias."""
    calls: dict = {}
    for preset in fqr.PRESETS.values():
        variant = variant_of(preset)
        name = variant.declaration.name + "_proj"
        if name not in DECLARATIONS or name in calls:
            continue
        decl = DECLARATIONS[name]
        inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=ROWS)
        width, hidden = inputs["qkv"].shape[1], 96
        values = variant.arguments(preset, inputs, preset.cos_sin_cache(ROWS))
        values = {k: v for k, v in values.items() if k in decl.index and k != "qkv"}
        values.update(
            x=torch.randn(TOKENS, hidden, generator=gen).to(torch.bfloat16),
            w_qkv=torch.randn(width, hidden, generator=gen).to(torch.bfloat16),
            qkv_bias=torch.randn(width, generator=gen).to(torch.bfloat16),
        )
        calls[name] = ((), values)
    return calls


def test_projected_forms_on_meta(gen):
    """The projected forms (no preset variant runs them yet): the public op and its float64
    reference on meta tensors, like the CPU run; every projected form is run."""
    calls = projected_calls(gen)
    assert set(calls) == {n for n in DECLARATIONS if n.endswith("_proj")}
    for name, (args, kwargs) in calls.items():
        decl = DECLARATIONS[name]
        cpu = decl.function(*args, **kwargs)
        meta_args = tuple(a.to(META) for a in args)
        meta_kwargs = {k: v.to(META) if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}  # fmt: skip
        assert_like(list(decl.function(*meta_args, **meta_kwargs)), list(cpu))
        names = [p.name for p in decl.params]
        given = dict(zip(names, meta_args), **meta_kwargs)
        expected = decl.reference(**decl.reference_kwargs(given))
        assert [t.device for t in expected] == [META] * len(expected)


# Declared ops no preset variant runs, each with its own test above.
WITHOUT_A_VARIANT = {
    "qk_rmsnorm_rope": test_qk_rmsnorm_rope_on_meta,
    **{n: test_projected_forms_on_meta for n in DECLARATIONS if n.endswith("_proj")},
}


def test_every_declared_op_runs_on_meta():
    by_presets = {variant_of(p).declaration.name for p in fqr.PRESETS.values()}
    missing = set(DECLARATIONS) - by_presets - set(WITHOUT_A_VARIANT)
    assert not missing, f"no preset runs {sorted(missing)} here: give it a test of its own"
    assert set(VARIANTS) == {p.variant for p in fqr.PRESETS.values()}


def test_every_primitive_impl_runs_on_meta():
    """The programs run above (every preset, every numerics mode, the projected forms) hold
    every primitive of ``fqr.ops``: each one's ``impl`` rule ran on meta tensors."""
    ran = set()
    for name in PRESETS:
        preset = fqr.PRESETS[name]
        variant = variant_of(preset)
        for numerics in numerics_modes(variant, preset):
            ran |= {e.prim.name for e in variant.program(preset, numerics=numerics).eqns}
    for name, (args, kwargs) in projected_calls(torch.Generator()).items():  # no preset yet
        ran |= {e.prim.name for e in DECLARATIONS[name].program_for(*args, **kwargs).eqns}
    defined = {
        p.name
        for module in vars(fqr.ops).values()
        if inspect.ismodule(module) and module.__name__.startswith("fqr.ops.")
        for p in vars(module).values()
        if isinstance(p, Primitive)
    }
    assert defined and defined <= ran, sorted(defined - ran)


# fqr.__all__ beyond the declared ops: where each one that takes or makes tensors runs on meta
# here, and those that take none.
RUN_ON_META = {
    "attention_prologue": "split_qkv's composition, in every split-qkv preset's program",
    "eval_program": "the reference backend's interpreter: every public op run above",
    "ops": "test_every_primitive_impl_runs_on_meta",
    "NormStats": "preset_call: the full-width-norm presets under TP",
    "minimax_qknorm_rope_cache": "test_vllm_ascend_minimax_runners_on_meta",
    "rope_cos_sin_cache": "test_a_table_is_built_on_the_rows_device",
    "proj_dispatch": "tests/backends/test_proj_dispatch.py::test_runs_on_meta (the pair)",
    # the compiled kernels take meta tensors in the kernel-bundle build (tests/gpu on meta)
    "lower": "the kernel-bundle build",
    "jit": "the kernel-bundle build",
}
NO_TENSORS = {
    "__version__", "presets", "PRESETS", "Preset", "get_preset", "trace", "spec", "Aval",
    "Program", "TraceError", "BACKENDS", "BackendUnavailable", "available_backends",
    "use_kernel_bundle", "KernelBundleError",
}  # fmt: skip


def test_every_public_name_is_run_on_meta():
    unlisted = set(fqr.__all__) - set(DECLARATIONS) - set(RUN_ON_META) - NO_TENSORS
    assert not unlisted, f"say where {sorted(unlisted)} runs on meta tensors in this file"


# ------------------------------------------------------- the builders the GPU files call

REFERENCE_ON_META = dict(backend="reference", device="meta")
PORT_NAMES = sorted(p.stem for p in PORTS.glob("test_*.py") if "def check_case(" in p.read_text())


def test_the_ports_are_found():
    assert len(PORT_NAMES) >= 8, PORT_NAMES


@pytest.mark.parametrize("port", PORT_NAMES)
def test_port_check_case_on_meta(port, gen):
    """Each port's ``check_case`` (what the GPU files run, there with ``device=GPU_DEVICE``)
    on the first case of its CPU grid: inputs, tables and the peer's reference built on meta,
    fqr's op run there, no value compared."""
    module = load_port(port)
    module.check_case(module.CPU_GRID[0], "reference", gen, device="meta")


# The mRoPE runners of tests/gpu/test_gpu_peers_mrope.py, each with its grid's first case.
MROPE_RUNNERS = {
    "vllm_mrope_case": peers_mrope.VLLM_MROPE_GRID,
    "vllm_mrope_compiled_case": peers_mrope.VLLM_MROPE_GRID,
    "vllm_fused_qk_norm_mrope_case": peers_mrope.VLLM_FUSED_GRID,
    "ascend_triton_mrope_case": peers_mrope.ASCEND_TRITON_MROPE_GRID,
    "ascend_split_mrope_case": peers_mrope.ASCEND_SPLIT_MROPE_GRID,
}


def test_every_mrope_runner_is_here():
    runners = {n for n in vars(peers_mrope) if n.endswith("_case") and not n.startswith("_")}
    assert runners == set(MROPE_RUNNERS)


@pytest.mark.parametrize("runner", sorted(MROPE_RUNNERS))
def test_mrope_runner_on_meta(runner, gen):
    case = MROPE_RUNNERS[runner][0]
    if runner == "vllm_mrope_compiled_case":  # torch.compile, as the CPU port runs it
        peers_mrope.vllm_mrope_compiled_case(
            *case, compile_backend="aot_eager", device="meta", gen=gen
        )
    else:
        getattr(peers_mrope, runner)(*case, gen=gen, **REFERENCE_ON_META)


def test_vllm_ascend_minimax_runners_on_meta(gen):
    """``fqr.minimax_qknorm_rope_cache`` as tests/gpu/test_gpu_peers_minimax.py calls it."""
    minimax.run_cache_case(
        minimax.CACHE_TOKENS[0], minimax.CACHE_HEADS[0], 64, "reference", gen, "meta"
    )
    minimax.run_empty_case("reference", "meta")
    minimax.run_dynamic_capacity_case(*minimax.DYNAMIC_CASES[0], "reference", gen, "meta")
    for fp8 in (False, True):
        minimax.run_replay_case(fp8, 8, "reference", gen, "meta")


def test_peers_references_on_meta(gen):
    """The peers' own formulas (re-written in tests/support) on meta inputs."""
    tokens, heads, kv_heads, d = TOKENS, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=META, dtype=torch.bfloat16)
    positions = torch.randint(0, ROWS, (tokens,), device=META)
    table = rope_cos_sin_cache(d, ROWS, 1e4, rows=torch.arange(ROWS, device=META))
    w = torch.ones(d, device=META, dtype=torch.bfloat16)
    q, k, v = vllm_fused_qk_norm_rope(qkv, heads, kv_heads, d, 1e-6, w, w, table, True, positions)
    assert {t.device for t in (q, k, v)} == {META}
    rows = table[positions]
    normed = peer_norm_rope(qkv[:, : heads * d], w, rows, head_dim=d, rotary_dim=d, eps=1e-6)
    assert normed.device == META and normed.shape == (tokens, heads * d)
    case = vllm_native_case(gen, torch.bfloat16, d, d, is_neox=True, device="meta")
    assert {t.device for t in case.vllm()} == {META}
    out = fqr.split_qkv_rmsnorm_rope(*case.args, **case.fqr_kwargs(backend="reference"))
    assert {t.device for t in out} == {META}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_mla_builders_on_meta(flavour, gen):
    """The MLA program and its inputs (tests/support/mla.py) on meta, the reference backend."""
    program = mla_program(flavour)
    args = [a for a in draw(gen, flavour, torch.bfloat16, Q_LORA) if a is not None]
    outs = BACKENDS["reference"].launch(program, [a.to(META) for a in args])
    assert {t.device for t in outs} == {META}
