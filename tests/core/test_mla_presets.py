"""The Multi-head Latent Attention presets (DeepSeek-V3 / V3.2, Kimi-K2, DeepSeek-V2-Lite):
the conventions the ``mla-kv`` / ``mla-q-rope`` declarations read them by, their tensor-parallel
views (q heads divided, the one latent / k_pe head on every rank) and how the DeepSeek-V3
family's presets differ. The numbers themselves are checked against the checkpoints' configs
in ``test_presets_from_hf.py`` (DeepSeek-V3, V2-Lite, Kimi-K2) and the yarn tables in
``test_rope_yarn.py``."""

from __future__ import annotations

from dataclasses import fields

import pytest

from fqr.presets import PRESETS, Preset, get_preset

MLA = ["deepseek-v3", "deepseek-v3-fp8", "deepseek-v3.2", "kimi-k2", "deepseek-v2-lite"]
PARAMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "block_size")


@pytest.mark.parametrize("name", MLA)
def test_mla_conventions(name):
    p = PRESETS[name]
    assert p.variant == "mla-kv"
    assert (p.num_kv_heads, p.head_dim, p.rotary_dim, p.partial_rotary_factor) == (1, 64, 64, 1.0)
    assert (p.is_neox, p.norm, p.weight_offset) == (False, "head", 0.0)
    assert [k for k, _ in p.variant_params] == [*PARAMS, "cache_dtype"]
    assert all(type(v) is int for k, v in p.variant_params if k in PARAMS)
    assert dict(p.rope_scaling)["rope_type"] == "yarn"
    # vLLM's table has original_max_position_embeddings * factor rows
    yarn = dict(p.rope_scaling)
    assert p.max_position == yarn["original_max_position_embeddings"] * yarn["factor"]
    assert "variant=mla-kv" in p.summary and f"cache_dtype={p.params['cache_dtype']}" in p.summary


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_tp_divides_q_heads_and_replicates_the_latent_head(name, tp):
    full = PRESETS[name]
    view = get_preset(name, tp)
    assert view.num_heads * tp == full.num_heads
    assert (view.num_kv_heads, view.total_heads, view.total_kv_heads) == (1, full.num_heads, 1)
    assert view.spec.q_size == full.num_heads // tp * 64 and view.spec.kv_size == 64
    assert {view.kv_head_owner(rank) for rank in range(tp)} == {0}
    assert view.rotary_dim == 64 and view.params == full.params
    if tp > 1:
        assert view.label == f"{name}@tp{tp}"


def test_deepseek_v3_family_differs_only_in_the_cache():
    v3 = PRESETS["deepseek-v3"]
    for name, hf_id, cache in (
        ("deepseek-v3-fp8", "deepseek-ai/DeepSeek-V3", "fp8"),
        ("deepseek-v3.2", "deepseek-ai/DeepSeek-V3.2-Exp", "fp8_ds_mla"),
    ):
        other = PRESETS[name]
        assert (other.hf_id, other.params["cache_dtype"]) == (hf_id, cache)
        for f in fields(Preset):
            if f.name not in ("name", "hf_id", "variant_params"):
                assert getattr(other, f.name) == getattr(v3, f.name), (name, f.name)
        assert {k: v for k, v in other.variant_params if k != "cache_dtype"} == {
            k: v for k, v in v3.variant_params if k != "cache_dtype"
        }
    assert v3.params["cache_dtype"] == "auto"
