"""``Preset.from_hf_config`` (issue 13): every preset (split-qkv, and the mRoPE variants of
Qwen3-VL and Qwen3.5) whose config transformers can build offline is rebuilt from a config made
of the preset's own numbers with the family's config class (no network), and comes back field
for field; a RoPE scaling fqr cannot build, an unknown family and a family whose prologue is
another variant are refused by name. The table of a ``linear`` scaling (Gemma 3 27B) is checked
against its definition in float64.

Multi-head Latent Attention: ``DeepseekV3Config`` / ``DeepseekV2Config`` holding the real
checkpoints' config.json values (DeepSeek-V3, DeepSeek-V2-Lite, and Kimi-K2, whose config is a
DeepseekV3Config saying model_type ``kimi_k2``), written here as the config.json has them, give
the ``deepseek-v3`` / ``deepseek-v2-lite`` / ``kimi-k2`` presets field for field (but name and
hf_id), the same yarn table, and the inverse frequencies transformers derives from the config;
missing yarn keys take vLLM's defaults; what vLLM's DeepSeek yarn would not build is refused."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from fqr.presets import PRESETS, Preset
from fqr.rope_cache import cos_sin_scale, inverse_frequencies, rope_cos_sin_cache

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
    if preset.variant == "mla-kv":
        pytest.skip("mla-kv: checked against the checkpoints' own configs below")
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


# The checkpoints' config.json values (fqr/presets.py names where each was read), as keyword
# arguments of the family's transformers config: 4.x's rope_theta / rope_scaling with "type".
DEEPSEEK_V3_CONFIG = dict(
    hidden_size=7168,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rms_norm_eps=1e-06,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)
DEEPSEEK_V2_LITE_CONFIG = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rms_norm_eps=1e-06,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)
KIMI_K2_CONFIG = dict(
    hidden_size=7168,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-06,
    rope_theta=50000.0,
    rope_scaling={
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)
# preset -> (config class, config.json values, model_type the checkpoint's config says)
CHECKPOINT_CONFIGS = {
    "deepseek-v3": ("DeepseekV3Config", DEEPSEEK_V3_CONFIG, "deepseek_v3"),
    "deepseek-v2-lite": ("DeepseekV2Config", DEEPSEEK_V2_LITE_CONFIG, "deepseek_v2"),
    # Kimi-K2's remote-code config is DeepSeek-V3's with model_type "kimi_k2"
    "kimi-k2": ("DeepseekV3Config", KIMI_K2_CONFIG, "kimi_k2"),
}


def checkpoint_config(name: str, **rope_scaling):
    cls_name, values, model_type = CHECKPOINT_CONFIGS[name]
    if rope_scaling:
        values = values | {"rope_scaling": rope_scaling}
    config = getattr(transformers, cls_name)(**values)
    config.model_type = model_type
    return config


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_mla_preset_comes_back_from_the_checkpoint_config(name):
    config = checkpoint_config(name)
    built = Preset.from_hf_config(config, name="x")
    preset = PRESETS[name]
    for f in fields(Preset):
        if f.name not in ("name", "hf_id"):
            assert getattr(built, f.name) == getattr(preset, f.name), f.name
    # one latent / k_pe head whatever num_key_value_heads says; head_dim is the rotated part
    assert (built.num_kv_heads, built.head_dim) == (1, config.qk_rope_head_dim)
    assert built.params["q_lora_rank"] == (config.q_lora_rank or 0)

    # the config's yarn table is the preset's, and its frequencies are the ones transformers
    # derives from the config (in float32: to float32 precision), its cos/sin multiplier too
    rows = torch.tensor([1, 4095, 4096, 65537, preset.max_position - 1])
    r = preset.rotary_dim
    table = rope_cos_sin_cache(
        r, 0, built.rope_theta, dict(built.rope_scaling), dtype=torch.float64, rows=rows
    )
    want = rope_cos_sin_cache(
        r, 0, preset.rope_theta, dict(preset.rope_scaling), dtype=torch.float64, rows=rows
    )
    assert torch.equal(table, want)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = inverse_frequencies(r, built.rope_theta, dict(built.rope_scaling))
    torch.testing.assert_close(inv_freq.double(), ours, rtol=2e-7, atol=0)
    assert attention_scaling == pytest.approx(cos_sin_scale(dict(built.rope_scaling)), rel=1e-15)


def test_missing_yarn_keys_take_vllms_defaults():
    config = checkpoint_config(
        "deepseek-v3", type="yarn", factor=40, original_max_position_embeddings=4096
    )
    preset = Preset.from_hf_config(config)
    assert preset.rope_scaling == (
        ("rope_type", "yarn"),
        ("factor", 40.0),
        ("original_max_position_embeddings", 4096),
        ("beta_fast", 32.0),
        ("beta_slow", 1.0),
        ("mscale", 1.0),
        ("mscale_all_dim", 0.0),
    )
    # vLLM's multiplier without mscale_all_dim: g(40, 1) / 1
    assert cos_sin_scale(dict(preset.rope_scaling)) == pytest.approx(1 + 0.1 * math.log(40))


def test_vllm_yarn_extras_are_kept():
    config = checkpoint_config("deepseek-v3", **DEEPSEEK_V3_CONFIG["rope_scaling"], attn_factor=0.5)
    preset = Preset.from_hf_config(config)
    assert preset.rope_scaling[-1] == ("attn_factor", 0.5)
    assert cos_sin_scale(dict(preset.rope_scaling)) == 0.5


@pytest.mark.parametrize("extra", [{"attention_factor": 1.2}, {"truncate": False}])
def test_hf_only_yarn_settings_are_refused(extra):
    (key,) = extra
    config = checkpoint_config(
        "deepseek-v2-lite", **DEEPSEEK_V2_LITE_CONFIG["rope_scaling"], **extra
    )
    with pytest.raises(ValueError, match=f"RoPE yarn \\(deepseek_v2\\) sets {key}"):
        Preset.from_hf_config(config)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_mla_family_builds_only_deepseeks_yarn(rope_type):
    config = checkpoint_config("kimi-k2", type=rope_type, factor=4.0)
    with pytest.raises(
        ValueError, match=f"RoPE scaling '{rope_type}' \\(kimi_k2\\) .* supported: default, yarn"
    ):
        Preset.from_hf_config(config)


def test_mla_config_without_scaling_has_the_plain_table():
    config = transformers.DeepseekV3Config()  # rope_parameters default, 4096 positions
    preset = Preset.from_hf_config(config)
    assert (preset.rope_scaling, preset.max_position, preset.variant) == ((), 4096, "mla-kv")
    assert (preset.num_heads, preset.num_kv_heads, preset.head_dim, preset.is_neox) == (
        config.num_attention_heads,
        1,
        config.qk_rope_head_dim,
        False,
    )
