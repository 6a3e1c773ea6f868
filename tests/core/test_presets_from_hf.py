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
from dataclasses import fields, replace
from types import SimpleNamespace

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
        hidden_size=preset.hidden_size,
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


@pytest.mark.parametrize(
    "cls_name,section", [("Qwen3VLTextConfig", (24, 20, 20)), ("Qwen3_5TextConfig", (11, 11, 10))]
)
def test_mrope_is_read_as_the_models_code_reads_it(cls_name, section):
    """Qwen3-VL / Qwen3.5's rotary embedding defaults the sections and always interleaves
    (``mrope_interleaved`` is never read: a config without it was read as False, issue 33;
    ``tests/core/test_hf_zoo.py`` compares both with the model's own attention)."""
    config = getattr(transformers, cls_name)()
    assert "mrope_interleaved" not in config.rope_parameters
    preset = Preset.from_hf_config(config)
    assert preset.params == {"mrope_section": section, "mrope_interleaved": True}


def test_an_mrope_interleaving_the_model_ignores_is_refused():
    config = rope("qwen3-vl-8b", mrope_interleaved=False)
    with pytest.raises(
        ValueError,
        match=r"^config\.rope_parameters\['mrope_interleaved'\] is False but qwen3_vl_text's code "
        r"ignores it and interleaves",
    ):
        Preset.from_hf_config(config)


def test_mrope_family_without_default_sections_needs_them(monkeypatch):
    from fqr.hf import HF_FAMILIES

    family = replace(HF_FAMILIES["qwen3_vl_text"], mrope_section=None)
    monkeypatch.setitem(HF_FAMILIES, "qwen3_vl_text", family)
    with pytest.raises(ValueError, match="qwen3_vl_text runs mRoPE but has no mrope_section"):
        Preset.from_hf_config(transformers.Qwen3VLTextConfig())


def test_variant_family_is_refused(monkeypatch):
    """A family listed in HF_VARIANT_FAMILIES (none now) is refused with its line."""
    from fqr.hf import HF_VARIANT_FAMILIES

    monkeypatch.setitem(HF_VARIANT_FAMILIES, "gemma4_text", "a line naming what it lacks")
    config = transformers.AutoConfig.for_model("gemma4")
    with pytest.raises(ValueError, match="gemma4_text: a line naming what it lacks; presets of"):
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
    # transformers' own config class of V3.2 (the V3 dims and rope; vLLM runs fp8_ds_mla)
    "deepseek-v3.2": ("DeepseekV32Config", DEEPSEEK_V3_CONFIG, "deepseek_v32"),
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


# ----------------------------------------- rope_interleave, deepseek_v32 (issue 32, item 1)


class _RecordingCache:
    """A transformers cache that records what the attention layer stores (kv_c, k_pe)."""

    def update(self, kv_nope, k_rot, layer_idx, **kwargs):
        self.kv_c, self.k_pe = kv_nope, k_rot
        return kv_nope, k_rot


def _tiny_deepseek(model_type: str, **more):
    cls = {"deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config"}[model_type]
    return getattr(transformers, cls)(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        **more,
    )


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
def test_the_preset_rotates_k_pe_as_the_models_attention_does(gen, model_type, interleave):
    """transformers' own DeepseekV3 / V32 attention run on random weights and inputs: the k_pe
    and kv_c it stores are what fqr's MLA op, given the preset built from the same config,
    returns (float32, the reference backend). DeepseekV3 reads ``rope_interleave`` (False:
    NeoX halves); DeepseekV32 rotates interleaved whatever it says."""
    import importlib

    import fqr

    config = _tiny_deepseek(model_type, rope_interleave=interleave)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = {"deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32"}[model_type]
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    attention = getattr(modeling, f"{prefix}Attention")(config, layer_idx=0).eval()
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    tokens = 5
    hidden = torch.randn(1, tokens, 64, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cache = _RecordingCache()
    with torch.no_grad():
        for norm in (attention.q_a_layernorm, attention.kv_a_layernorm):
            norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape, generator=gen))
        cos_sin = rotary(hidden, positions[None])
        mask = torch.zeros(1, 1, tokens, tokens)
        try:
            attention(hidden, cos_sin, mask, cache=cache, position_ids=positions[None])
        except Exception:  # noqa: BLE001 - only what was stored before attention matters
            pass
        kv_a = torch.cat([attention.q_a_proj(hidden), attention.kv_a_proj_with_mqa(hidden)], -1)
    preset = Preset.from_hf_config(config, name="tiny")
    assert preset.is_neox == (model_type == "deepseek_v3" and not interleave)
    spec = preset.spec
    cache_entry = torch.zeros(1, 64, 32 + 16, dtype=torch.float32)
    _, kv_c, k_pe = fqr.split_mla_rmsnorm_rope_cache(
        kv_a[0], positions, preset.cos_sin_cache(), attention.q_a_layernorm.weight.detach(),
        attention.kv_a_layernorm.weight.detach(), cache_entry, torch.arange(tokens),
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=spec.head_dim, eps=preset.eps,
        is_neox=preset.is_neox, backend="reference",
    )  # fmt: skip
    torch.testing.assert_close(kv_c, cache.kv_c[0, 0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(as_hf_stores(k_pe, preset), cache.k_pe[0, 0], rtol=2e-5, atol=2e-5)
    # the other pairing rotates other features: the comparison above can fail
    _, _, other = fqr.split_mla_rmsnorm_rope_cache(
        kv_a[0], positions, preset.cos_sin_cache(), attention.q_a_layernorm.weight.detach(),
        attention.kv_a_layernorm.weight.detach(), cache_entry.clone(), torch.arange(tokens),
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=spec.head_dim, eps=preset.eps,
        is_neox=not preset.is_neox, backend="reference",
    )  # fmt: skip
    assert (as_hf_stores(other, preset) - cache.k_pe[0, 0]).abs().max() > 1e-2


def as_hf_stores(k_pe, preset):
    """k_pe as transformers stores it: its interleaved rotation
    (``apply_rotary_pos_emb_interleave``) rotates the pairs (2i, 2i+1) and writes the results
    de-interleaved, ``cat(x[0::2], x[1::2])`` (its q likewise: the scores do not change); vLLM
    and fqr keep GPT-J pairs where they are."""
    return k_pe if preset.is_neox else torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)


def test_a_rope_interleave_that_is_not_a_bool_is_refused():
    config = untyped(checkpoint_config("deepseek-v3"), rope_interleave="no")
    with pytest.raises(TypeError, match=r"^config\.rope_interleave must be a bool, got str"):
        Preset.from_hf_config(config)


def test_deepseek_v32_needs_q_lora_rank():
    config = untyped(checkpoint_config("deepseek-v3.2"), q_lora_rank=None)
    with pytest.raises(ValueError, match=r"^config\.q_lora_rank is missing \(a deepseek_v32"):
        Preset.from_hf_config(config)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "deepseek-v3.2", "kimi-k2"])
@pytest.mark.parametrize("eps", [1e-5, "missing"])
def test_an_mla_norm_eps_is_what_the_models_code_uses(name, eps):
    """Transformers builds the q_a / kv_a norms of every MLA family with its own 1e-6 and never
    reads ``rms_norm_eps`` for them (issue 39: GLM-4.7-Flash's and GLM-5's 1e-5 were refused):
    the preset's eps is 1e-6 whatever the config says, or without the key."""
    config = untyped(checkpoint_config(name), rms_norm_eps=MISSING if eps == "missing" else eps)
    assert Preset.from_hf_config(config).eps == 1e-6


# ------------------------------------------------------- hostile configs (issue 23, finding 7)
# Every field is checked where it is read: one ValueError/TypeError naming the config key. A
# transformers 5 config type-checks its fields on assignment but not their values (a NaN theta,
# a factor of 0, -5 positions pass, at most with a warning); a 4.x config (or any object with
# the attributes) checks nothing: ``untyped`` below.

MISSING = object()


def untyped(config, **overrides):
    """``config`` as an object holding its attributes with no checks (what transformers 4.x's
    ``PretrainedConfig`` is), with ``overrides`` (``MISSING``: the attribute removed)."""
    values = config.to_dict() | {"name_or_path": config.name_or_path}
    for key, value in overrides.items():
        if value is MISSING:
            values.pop(key, None)
        else:
            values[key] = value
    return SimpleNamespace(**values)


def rope(name: str, **values):
    """Preset ``name``'s config with ``values`` merged into its ``rope_parameters``."""
    config = config_of(PRESETS[name])
    config.rope_parameters = config.rope_parameters | values
    return config


def gemma3(**values):
    """Gemma 3 27B's config with ``values`` merged into its full-attention RoPE settings."""
    config = config_of(PRESETS["gemma3-27b"])
    config.rope_parameters["full_attention"] |= values
    return config


def qwen3(**values):
    return rope("qwen3-8b", **values)


def llama3(**values):
    return rope("llama3-8b", **values)


def plain(**overrides):
    """Qwen3-8B's config, untyped, with ``overrides``."""
    return untyped(qwen3(), **overrides)


NAN, INF = float("nan"), float("inf")
RP = r"config\.rope_parameters\['{}'\]"
POSITIVE = " must be a finite number > 0, got "
FRACTION = r" must be a finite number in \(0, 1\], got "
COUNT = " must be an int >= 1, got "
VL = "qwen3-vl-8b"
# (id, the config, error, message)
BAD_CONFIGS = [
    (
        "theta 0",
        lambda: qwen3(rope_theta=0.0),
        ValueError,
        RP.format("rope_theta") + POSITIVE + "0",
    ),
    ("theta < 0", lambda: qwen3(rope_theta=-1e6), ValueError, POSITIVE + "-1000000"),
    ("theta nan", lambda: qwen3(rope_theta=NAN), ValueError, RP.format("rope_theta") + POSITIVE),
    ("theta str", lambda: untyped(qwen3(rope_theta="1e6")), TypeError, POSITIVE + "str '1e6'"),
    # unhashable: a TypeError naming nothing before
    (
        "model_type a list",
        lambda: plain(model_type=["qwen3"]),
        ValueError,
        r"model_type \['qwen3'\]",
    ),
    (
        "gemma3 full-attention theta nan",
        lambda: gemma3(rope_theta=NAN),
        ValueError,
        r"^config\.rope_parameters\['full_attention'\]\['rope_theta'\]" + POSITIVE + "nan$",
    ),
    (
        "4.x theta nan",
        lambda: plain(rope_parameters=MISSING, rope_theta=NAN),
        ValueError,
        r"^config\.rope_theta must be a finite number > 0, got nan$",
    ),
    (
        "linear factor 0",
        lambda: qwen3(rope_type="linear", factor=0.0),
        ValueError,
        RP.format("factor") + POSITIVE + "0",
    ),
    (
        "linear factor nan",
        lambda: qwen3(rope_type="linear", factor=NAN),
        ValueError,
        POSITIVE + "nan",
    ),
    (
        "linear factor -2",
        lambda: qwen3(rope_type="linear", factor=-2.0),
        ValueError,
        POSITIVE + "-2",
    ),
    ("llama3 factor 0", lambda: llama3(factor=0.0), ValueError, RP.format("factor") + POSITIVE),
    # ZeroDivisionError before
    (
        "llama3 low_freq_factor 0",
        lambda: llama3(low_freq_factor=0.0),
        ValueError,
        RP.format("low_freq_factor") + POSITIVE,
    ),
    (
        "llama3 high_freq_factor inf",
        lambda: llama3(high_freq_factor=INF),
        ValueError,
        RP.format("high_freq_factor") + POSITIVE + "inf",
    ),
    (
        "llama3 original positions 0",
        lambda: llama3(original_max_position_embeddings=0),
        ValueError,
        RP.format("original_max_position_embeddings") + COUNT + "0",
    ),
    (
        "positions -5",
        lambda: plain(max_position_embeddings=-5),
        ValueError,
        r"^config\.max_position_embeddings must be an int >= 1, got -5$",
    ),
    ("positions 0", lambda: plain(max_position_embeddings=0), ValueError, COUNT + "0"),
    (
        "positions str",
        lambda: plain(max_position_embeddings="40960"),
        TypeError,
        r"^config\.max_position_embeddings" + COUNT + "str '40960'$",
    ),
    ("positions bool", lambda: plain(max_position_embeddings=True), TypeError, "max_position_emb"),
    (
        "positions 4096.5",
        lambda: plain(max_position_embeddings=4096.5),
        TypeError,
        "max_position_emb",
    ),
    # OverflowError before
    (
        "partial rotary inf",
        lambda: qwen3(partial_rotary_factor=INF),
        ValueError,
        RP.format("partial_rotary_factor") + FRACTION + "inf",
    ),
    ("partial rotary nan", lambda: qwen3(partial_rotary_factor=NAN), ValueError, FRACTION + "nan"),
    ("partial rotary 0", lambda: qwen3(partial_rotary_factor=0.0), ValueError, FRACTION + "0"),
    ("partial rotary 1.5", lambda: qwen3(partial_rotary_factor=1.5), ValueError, FRACTION + "1.5"),
    (
        "partial rotary leaving no pair",
        lambda: qwen3(partial_rotary_factor=0.001),
        ValueError,
        RP.format("partial_rotary_factor") + r" 0\.001 rotates 0 of head_dim 128",
    ),
    # multi-head attention before
    (
        "kv heads 0",
        lambda: plain(num_key_value_heads=0),
        ValueError,
        r"^config\.num_key_value_heads" + COUNT + "0$",
    ),
    (
        "kv heads -1",
        lambda: plain(num_key_value_heads=-1),
        ValueError,
        "config.num_key_value_heads",
    ),
    (
        "kv heads str",
        lambda: plain(num_key_value_heads="8"),
        TypeError,
        "config.num_key_value_heads",
    ),
    (
        "kv heads do not divide the heads",
        lambda: plain(num_key_value_heads=3),
        ValueError,
        r"^config\.num_attention_heads \(32\) must be a multiple of "
        r"config\.num_key_value_heads \(3\)",
    ),
    (
        "heads 0",
        lambda: plain(num_attention_heads=0),
        ValueError,
        r"^config\.num_attention_heads" + COUNT + "0$",
    ),
    ("heads str", lambda: plain(num_attention_heads="32"), TypeError, "config.num_attention_heads"),
    # hidden_size // heads before
    ("head_dim 0", lambda: plain(head_dim=0), ValueError, r"^config\.head_dim" + COUNT + "0$"),
    ("head_dim str", lambda: plain(head_dim="128"), TypeError, "config.head_dim"),
    (
        "head_dim odd",
        lambda: plain(head_dim=127),
        ValueError,
        r"^config\.head_dim \(127\) must be even",
    ),
    (
        "hidden_size not a multiple of the heads",
        lambda: plain(head_dim=None, hidden_size=4100),
        ValueError,
        r"config\.hidden_size \(4100\) is not a multiple of config\.num_attention_heads \(32\)",
    ),
    ("eps nan", lambda: plain(rms_norm_eps=NAN), ValueError, r"^config\.rms_norm_eps" + POSITIVE),
    ("eps 0", lambda: plain(rms_norm_eps=0.0), ValueError, r"^config\.rms_norm_eps" + POSITIVE),
    ("eps below float32", lambda: plain(rms_norm_eps=1e-50), ValueError, r"^config\.rms_norm_eps"),
    ("eps str", lambda: plain(rms_norm_eps="1e-6"), TypeError, r"^config\.rms_norm_eps"),
    (
        "rope_parameters a list",
        lambda: plain(rope_parameters=[1e6]),
        TypeError,
        r"^config\.rope_parameters must be a dict, got list",
    ),
    (
        "4.x rope_scaling a str",
        lambda: plain(rope_parameters=MISSING, rope_theta=1e6, rope_scaling="linear"),
        TypeError,
        r"^config\.rope_scaling must be a dict, got str",
    ),
    (
        "4.x rope_scaling factor 0",
        lambda: plain(
            rope_parameters=MISSING,
            rope_theta=1e6,
            rope_scaling={"rope_type": "linear", "factor": 0},
        ),
        ValueError,
        r"^config\.rope_scaling\['factor'\] must be a finite number > 0, got 0$",
    ),
    # bool("false") is True before
    (
        "mrope_interleaved a str",
        lambda: untyped(rope(VL, mrope_interleaved="false")),
        TypeError,
        RP.format("mrope_interleaved") + " must be a bool, got str",
    ),
    # int("24") before
    (
        "mrope_section of strs",
        lambda: untyped(rope(VL, mrope_section=["24", "20", "20"])),
        ValueError,
        RP.format("mrope_section"),
    ),
    (
        "mrope_section sum",
        lambda: rope(VL, mrope_section=[24, 20, 19]),
        ValueError,
        RP.format("mrope_section") + ".*must sum to rotary_dim/2 = 64",
    ),
    # issue 41: an int beyond every float was an OverflowError naming nothing
    (
        "theta 401 digits",
        lambda: plain(rope_parameters={"rope_type": "default", "rope_theta": 10**400}),
        ValueError,
        RP.format("rope_theta") + POSITIVE + "an integer of 401 digits$",
    ),
    (
        "linear factor 401 digits",
        lambda: plain(
            rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 10**400}
        ),
        ValueError,
        RP.format("factor") + POSITIVE + "an integer of 401 digits$",
    ),
    (
        "partial_rotary_factor 401 digits",
        lambda: plain(partial_rotary_factor=10**400),
        ValueError,
        r"^config\.partial_rotary_factor" + FRACTION + "an integer of 401 digits$",
    ),
    (
        "heads 0",
        lambda: plain(num_attention_heads=0),
        ValueError,
        r"^config\.num_attention_heads" + COUNT + "0",
    ),
    (
        "heads str",
        lambda: plain(num_attention_heads="16"),
        TypeError,
        r"^config\.num_attention_heads",
    ),
    (
        "heads nan",
        lambda: plain(num_attention_heads=NAN),
        TypeError,
        r"^config\.num_attention_heads",
    ),
    (
        "4.x rope_scaling a list",
        lambda: plain(rope_parameters=MISSING, rope_theta=1e6, rope_scaling=[1, 2]),
        TypeError,
        r"^config\.rope_scaling must be a dict, got list",
    ),
]


@pytest.mark.parametrize(
    "make,error,message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_a_bad_config_value_is_refused_naming_its_key(make, error, message):
    """Not valid: a plain ValueError / TypeError, never :class:`fqr.hf.UnsupportedConfig`
    (``fqr hf-config`` exits 2 on it, 1 on a valid config fqr has no form for)."""
    from fqr.hf import UnsupportedConfig

    config = make()
    with pytest.raises(error, match=message) as e:
        Preset.from_hf_config(config)
    assert not isinstance(e.value, UnsupportedConfig)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: transformers.JetMoeConfig(), "jetmoe' is not a family fqr builds presets for"),
        (
            lambda: rope(VL, mrope_interleaved=False),
            r"mrope_interleaved'\] is False but qwen3_vl_text's code ignores it",
        ),
        (
            lambda: plain(
                rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
            ),
            "RoPE scaling 'dynamic'",
        ),
    ],
    ids=["no form", "contradicts the code", "a scaling fqr builds not"],
)
def test_a_valid_config_fqr_has_no_form_for_is_unsupported(make, message):
    from fqr.hf import UnsupportedConfig

    with pytest.raises(UnsupportedConfig, match=message):
        Preset.from_hf_config(make())


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: rope_cos_sin_cache(64, 64, 10**400), "^theta must be a finite number > 0"),
        (lambda: Preset("x", "x", 4, 2, 64, 10**400, 64), "^rope_theta must be"),
        (lambda: Preset("x", "x", 4, 2, 64, 1e4, 64, eps=10**400), "^eps must be"),
        (lambda: Preset("x", "x", 4, 2, 64, 1e4, 64, weight_offset=10**400), "^weight_offset"),
    ],
    ids=["table theta", "preset theta", "eps", "weight_offset"],
)
def test_an_int_beyond_every_float_is_named(call, message):
    """Issue 41: an ``OverflowError`` naming nothing before."""
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "key", ["num_attention_heads", "max_position_embeddings", "rms_norm_eps", "hidden_size"]
)
def test_a_missing_key_is_named(key):
    """An AttributeError before; ``hidden_size`` is needed only without ``head_dim``."""
    config = plain(**{key: MISSING, "head_dim": MISSING})
    with pytest.raises(ValueError, match=rf"^config\.{key} is missing \(a qwen3 config needs it"):
        Preset.from_hf_config(config)


@pytest.mark.parametrize("kv", [None, MISSING])
def test_only_a_missing_kv_head_count_means_multi_head(kv):
    """As Hugging Face reads it (``num_key_value_heads=None``: one kv head per q head); a
    missing attribute was an AttributeError before."""
    preset = Preset.from_hf_config(plain(num_key_value_heads=kv))
    assert (preset.num_heads, preset.num_kv_heads) == (32, 32)


def test_a_4x_config_reads_theta_and_scaling_attributes():
    """The fields' other home (transformers 4.x: ``rope_theta`` / ``rope_scaling``), checked
    the same way and giving the same preset."""
    want = PRESETS["llama3-8b"]
    config = untyped(
        config_of(want),
        rope_parameters=MISSING,
        rope_theta=want.rope_theta,
        rope_scaling=dict(want.rope_scaling),
    )
    assert Preset.from_hf_config(config, name=want.name) == want


def test_numpy_numbers_in_a_config_are_read_as_numbers():
    """Counts and scalars held as numpy numbers (a config filled from an array) are read as
    the Python numbers they hold (a TypeError naming num_heads before)."""
    import numpy as np

    want = PRESETS["qwen3-8b"]
    config = plain(
        num_attention_heads=np.int64(32),
        num_key_value_heads=np.int32(8),
        head_dim=np.int64(128),
        max_position_embeddings=np.int64(40960),
        rms_norm_eps=np.float32(1e-6),
    )
    built = Preset.from_hf_config(config, name=want.name)
    assert built.spec == replace(want.spec, eps=float(np.float32(1e-6)))
    assert built.max_position == 40960
    assert type(built.num_heads) is int and type(built.max_position) is int


# DeepSeek's yarn (the MLA families): its own keys, and the MLA dims
def deepseek(**changes):
    """DeepSeek-V3's config, untyped, with ``changes`` to its RoPE settings (Hugging Face
    itself divides by some of them when building a typed config)."""
    config = checkpoint_config("deepseek-v3")
    return untyped(config, rope_parameters=config.rope_parameters | changes)


BAD_MLA = [
    ("yarn factor 0", dict(factor=0), ValueError, RP.format("factor") + POSITIVE + "0"),
    ("yarn factor nan", dict(factor=NAN), ValueError, RP.format("factor") + POSITIVE + "nan"),
    # ZeroDivisionError before
    ("yarn beta_fast 0", dict(beta_fast=0), ValueError, RP.format("beta_fast") + POSITIVE + "0"),
    ("yarn beta_slow -1", dict(beta_slow=-1), ValueError, RP.format("beta_slow") + POSITIVE),
    (
        "yarn mscale nan",
        dict(mscale=NAN),
        ValueError,
        RP.format("mscale") + " must be a finite number >= 0, got nan",
    ),
    (
        "yarn mscale_all_dim -1",
        dict(mscale_all_dim=-1.0),
        ValueError,
        RP.format("mscale_all_dim") + " must be a finite number >= 0",
    ),
    ("yarn attn_factor 0", dict(attn_factor=0.0), ValueError, RP.format("attn_factor") + POSITIVE),
    (
        "yarn original positions 0",
        dict(original_max_position_embeddings=0),
        ValueError,
        RP.format("original_max_position_embeddings") + COUNT + "0",
    ),
    (
        "yarn original positions str",
        dict(original_max_position_embeddings="4096"),
        TypeError,
        RP.format("original_max_position_embeddings") + COUNT + "str",
    ),
    # ZeroDivisionError before: the correction range divides by ln(theta)
    (
        "yarn theta 1",
        dict(rope_theta=1.0),
        ValueError,
        RP.format("rope_theta") + " must not be 1 with a yarn scaling",
    ),
]


@pytest.mark.parametrize(
    "changes,error,message", [c[1:] for c in BAD_MLA], ids=[c[0] for c in BAD_MLA]
)
def test_a_bad_yarn_scaling_is_refused_naming_its_key(changes, error, message):
    with pytest.raises(error, match=message):
        Preset.from_hf_config(deepseek(**changes))


def test_a_4x_yarn_scaling_is_named_where_it_was_read():
    scaling = DEEPSEEK_V3_CONFIG["rope_scaling"] | {"beta_fast": 0}
    config = untyped(
        checkpoint_config("deepseek-v3"),
        rope_parameters=MISSING,
        rope_theta=1e4,
        rope_scaling=scaling,
    )
    with pytest.raises(ValueError, match=r"^config\.rope_scaling\['beta_fast'\]" + POSITIVE):
        Preset.from_hf_config(config)


@pytest.mark.parametrize(
    "key,value,error",
    [
        ("kv_lora_rank", 0, ValueError),
        ("qk_nope_head_dim", -128, ValueError),
        ("v_head_dim", "128", TypeError),
        ("qk_rope_head_dim", 0, ValueError),
        ("qk_rope_head_dim", 63, ValueError),
        ("q_lora_rank", -1, ValueError),
    ],
)
def test_a_bad_mla_dim_is_refused_naming_its_key(key, value, error):
    config = untyped(checkpoint_config("deepseek-v3"), **{key: value})
    message = "must be even" if value == 63 else "must be an int >= 1"
    with pytest.raises(error, match=rf"^config\.{key} .*{message}"):
        Preset.from_hf_config(config)


# --------------------------------------------------- the same values in a preset built by hand

YARN, GEMMA4 = PRESETS["deepseek-v3"], PRESETS["gemma4-31b-full"]
Q, L3 = PRESETS["qwen3-8b"], PRESETS["llama3-8b"]
BAD_PRESETS = [
    ("theta nan", Q, dict(rope_theta=NAN), ValueError, r"^rope_theta" + POSITIVE + "nan$"),
    ("theta 0", Q, dict(rope_theta=0), ValueError, r"^rope_theta" + POSITIVE + "0$"),
    ("theta str", Q, dict(rope_theta="1e6"), TypeError, r"^rope_theta"),
    ("positions 0", Q, dict(max_position=0), ValueError, r"^max_position" + COUNT + "0$"),
    ("positions -5", Q, dict(max_position=-5), ValueError, r"^max_position" + COUNT),
    ("positions str", Q, dict(max_position="40960"), TypeError, r"^max_position" + COUNT + "str"),
    # OverflowError before
    (
        "partial rotary inf",
        Q,
        dict(partial_rotary_factor=INF),
        ValueError,
        r"^partial_rotary_factor" + FRACTION + "inf$",
    ),
    (
        "partial rotary nan",
        Q,
        dict(partial_rotary_factor=NAN),
        ValueError,
        r"^partial_rotary_factor" + FRACTION,
    ),
    (
        "linear factor 0",
        PRESETS["gemma3-27b"],
        dict(rope_scaling=(("rope_type", "linear"), ("factor", 0.0))),
        ValueError,
        r"^rope_scaling\['factor'\]" + POSITIVE + "0",
    ),
    (
        "llama3 low_freq_factor 0",
        L3,
        dict(rope_scaling=(*L3.rope_scaling[:2], ("low_freq_factor", 0.0), *L3.rope_scaling[3:])),
        ValueError,
        r"^rope_scaling\['low_freq_factor'\]" + POSITIVE,
    ),
    (
        "llama3 missing a key",
        L3,
        dict(rope_scaling=L3.rope_scaling[:-1]),
        ValueError,
        r"^rope_scaling\['original_max_position_embeddings'\] is missing",
    ),
    (
        "yarn beta_fast 0",
        YARN,
        dict(rope_scaling=(*YARN.rope_scaling[:3], ("beta_fast", 0.0), *YARN.rope_scaling[4:])),
        ValueError,
        r"^rope_scaling\['beta_fast'\]" + POSITIVE,
    ),
    (
        "yarn theta 1",
        YARN,
        dict(rope_theta=1.0),
        ValueError,
        r"^rope_theta must not be 1 with a yarn scaling",
    ),
    (
        "proportional 0",
        GEMMA4,
        dict(rope_scaling=(("rope_type", "proportional"), ("partial_rotary_factor", 0.0))),
        ValueError,
        r"^rope_scaling\['partial_rotary_factor'\]" + FRACTION + "0",
    ),
    (
        "unknown type",
        Q,
        dict(rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0))),
        ValueError,
        r"^rope_scaling\['rope_type'\] must be one of linear, llama3, proportional, negated, yarn, "
        "got 'dynamic'",
    ),
    (
        "unknown key",
        PRESETS["gemma3-27b"],
        dict(rope_scaling=(("rope_type", "linear"), ("factor", 2.0), ("beta", 1.0))),
        ValueError,
        r"^rope_scaling\['beta'\]: a linear scaling takes only factor",
    ),
    (
        "not pairs",
        Q,
        dict(rope_scaling=("linear", 2.0)),
        TypeError,
        r"^rope_scaling must be \(key, value\) pairs",
    ),
]


@pytest.mark.parametrize(
    "preset,changes,error,message", [c[1:] for c in BAD_PRESETS], ids=[c[0] for c in BAD_PRESETS]
)
def test_a_preset_built_by_hand_refuses_the_same_values(preset, changes, error, message):
    with pytest.raises(error, match=message):
        replace(preset, **changes)
