"""Every preset of a variant other than split-qkv on the CUDA GPU (skipped without one), through
the variant registry: the variant draws the inputs on the CPU, states the float64 expectation,
and runs its public op with the triton backend at realistic token counts (decode, a prefill
chunk, a long prefill), twice (the second call takes the bound launcher of the per-call
path). Inputs that the op updates in place (paged caches) hold random values, so a row written
where no slot names it shows."""

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare_kind
from fqr.variants import variant_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not BACKENDS["triton"].available, reason=BACKENDS["triton"].unavailable_reason() or ""
    ),
]

VARIANT_PRESETS = [n for n, p in fqr.PRESETS.items() if p.variant != "split-qkv"]
MAX_POSITION = 1 << 17


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("tokens", [1, 257, 4099])
@pytest.mark.parametrize("name", VARIANT_PRESETS)
def test_variant_presets_against_float64(name, tokens, tp):
    try:
        preset = fqr.get_preset(name, tp)
    except ValueError:
        pytest.skip(f"{name} has no tp={tp} view")
    variant = variant_of(preset)
    gen = torch.Generator().manual_seed(tokens * 131 + tp)
    max_position = min(preset.max_position, MAX_POSITION)
    inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=max_position)
    table = preset.cos_sin_cache(max_position)
    expected = variant.expected(preset, inputs, table)
    on_gpu = {k: x.cuda() for k, x in inputs.items()}
    for attempt in range(2):
        outs = variant.run(preset, on_gpu, table.cuda(), backend="triton")
        torch.cuda.synchronize()
        for out_name, out in zip(variant.outputs, outs):
            c = compare_kind(
                variant.tolerance(out_name),
                out,
                expected[out_name],
                head_dim=variant.head_dim(preset, out_name),
            )
            assert c.passed, f"{preset.label} T={tokens} call {attempt} {out_name}: {c}"
