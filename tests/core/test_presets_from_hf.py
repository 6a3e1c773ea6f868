"""``Preset.from_hf_config`` (issue 13): every preset (split-qkv, and the mRoPE variants of
Qwen3-VL and Qwen3.5) whose config transformers can build offline is rebuilt from a config made
of the preset's own numbers with the family's config class (no network), and comes back field
for field; a RoPE scaling fqr cannot build, an unknown family and a family whose prologue is
another variant are refused by name. The table of a ``linear`` scaling (Gemma 3 27B) is checked
against its definition in float64."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from fqr.presets import PRESETS, Preset
from fqr.rope_cache import rope_cos_sin_cache

transformers = pytest.importorskip("transformers")

# fqr preset name prefix -> the transformers config class of its family
CONFIG_CLASS = {
    "qwen3-30b-a3b": "Qwen3MoeConfig",
    "qwen3-235b-a22b": "Qwen3MoeConfig",
    "qwen3.5-": "Qwen3_5TextConfig",
    "qwen3-vl-": "Qwen3VLTextConfig",
    "qwen3-": "Qwen3Config",
    "gemma3-": "Gemma3TextConfig",
    "olmo2-": "Olmo2Config",
    "llama3-": "LlamaConfig",
    "glm4-": "GlmConfig",
}


def config_of(preset: Preset):
    """A config of the preset's family holding the preset's numbers, as a checkpoint's
    config.json would (transformers 5: ``rope_parameters``; Gemma 3 per layer type)."""
    cls_name = next(c for prefix, c in CONFIG_CLASS.items() if preset.name.startswith(prefix))
    rope = {"rope_type": "default", "rope_theta": preset.rope_theta} | dict(preset.rope_scaling)
    if preset.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = preset.partial_rotary_factor
    if preset.variant.startswith("mrope"):
        rope |= {k: list(v) if isinstance(v, tuple) else v for k, v in preset.variant_params}
    if cls_name == "Gemma3TextConfig":
        rope = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    config = getattr(transformers, cls_name)(
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        hidden_size=preset.num_heads * preset.head_dim,
        max_position_embeddings=preset.max_position,
        rms_norm_eps=preset.eps,
        rope_parameters=rope,
    )
    config.name_or_path = preset.hf_id
    return config


@pytest.mark.parametrize("preset", PRESETS.values(), ids=lambda p: p.name)
def test_preset_comes_back_from_its_config(preset):
    if preset.variant not in ("split-qkv", "mrope", "mrope-gate"):
        pytest.skip(f"{preset.variant}: presets of this variant are not built from a config yet")
    built = Preset.from_hf_config(config_of(preset), name=preset.name)
    for f in fields(Preset):
        assert getattr(built, f.name) == getattr(preset, f.name), f.name


def test_default_name_is_the_checkpoint_lower_case():
    preset = Preset.from_hf_config(config_of(PRESETS["qwen3-8b"]))
    assert (preset.name, preset.hf_id) == ("qwen3-8b", "Qwen/Qwen3-8B")


def test_multimodal_config_gives_its_text_config():
    text = config_of(PRESETS["gemma3-27b"])
    config = transformers.Gemma3Config(text_config=text.to_dict())
    assert Preset.from_hf_config(config, name="g").spec == PRESETS["gemma3-27b"].spec


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_rope_scaling_fqr_cannot_build_is_named(rope_type):
    config = config_of(PRESETS["qwen3-8b"])
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ValueError, match=f"RoPE scaling '{rope_type}' \\(qwen3\\) is not one"):
        Preset.from_hf_config(config)


def test_mrope_family_needs_its_sections():
    config = transformers.Qwen3VLTextConfig()
    with pytest.raises(ValueError, match="qwen3_vl_text runs mRoPE but has no mrope_section"):
        Preset.from_hf_config(config)


@pytest.mark.parametrize("model_type", ["gemma4", "llama4", "qwen3_next"])
def test_variant_family_is_refused(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match="variants are not built from a config yet"):
        Preset.from_hf_config(config)


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not a family"):
        Preset.from_hf_config(transformers.GPT2Config())


def test_linear_scaling_table_divides_positions():
    """Gemma 3 27B's global layers: ``{"rope_type": "linear", "factor": 8}``."""
    config = config_of(PRESETS["gemma3-27b"])
    config.rope_parameters["full_attention"] |= {"rope_type": "linear", "factor": 8.0}
    preset = Preset.from_hf_config(config)
    assert preset.rope_scaling == (("rope_type", "linear"), ("factor", 8.0))
    table = preset.cos_sin_cache(4096, dtype=torch.float64)
    r = preset.rotary_dim
    for p in (1, 777, 4095):
        for i in (0, 5, r // 2 - 1):
            angle = (p / 8.0) / preset.rope_theta ** (2 * i / r)
            assert table[p, i].item() == pytest.approx(math.cos(angle), abs=1e-15)
            assert table[p, r // 2 + i].item() == pytest.approx(math.sin(angle), abs=1e-15)
    assert not torch.equal(
        table, rope_cos_sin_cache(r, 4096, preset.rope_theta, dtype=torch.float64)
    )
