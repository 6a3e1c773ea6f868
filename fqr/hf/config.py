"""A :class:`fqr.presets.Preset` from a Hugging Face transformers config: the config readers
(heads, head_dim, eps, the RoPE settings of transformers 5 ``rope_parameters`` or 4.x
``rope_theta`` / ``rope_scaling``, mRoPE sections, MLA dims), each key read the way the family's
own modeling code reads it, and :func:`preset_from_hf_config`, which puts them together with the
family's facts (:mod:`fqr.hf.families`).
"""

from __future__ import annotations

import numbers

from ..presets import Preset, PrologueSpec
from ..rope_cache import (
    SCALING_REQUIRED,
    YARN_DEFAULTS,
    check_rope,
    fraction,
    positive_count,
    positive_number,
)
from ..validate import check_finite_scalar, check_mrope_section
from .families import HF_FAMILIES, HF_NEEDS, HF_VARIANT_FAMILIES, MROPE_VARIANTS, HFFamily

# RoPE scalings fqr.rope_cache builds from a config, with the config keys each requires.
HF_ROPE_SCALINGS: dict[str, tuple[str, ...]] = {"default": ()} | {
    t: SCALING_REQUIRED[t] for t in ("linear", "llama3", "yarn")
}
# Keys a scaling may leave out, with the value vLLM uses then (yarn: the defaults of vLLM's
# DeepseekScalingRotaryEmbedding, fqr.rope_cache.YARN_DEFAULTS); the preset records them.
HF_ROPE_DEFAULTS: dict[str, tuple[tuple[str, float], ...]] = {
    "yarn": tuple(
        (k, YARN_DEFAULTS[k]) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    ),
}
# Keys a scaling carries only when the config has them (vLLM passes them through).
HF_ROPE_EXTRAS: dict[str, tuple[str, ...]] = {
    "yarn": ("attn_factor", "extrapolation_factor", "truncate")
}
# Config settings with which Hugging Face builds another yarn table than vLLM's DeepSeek path
# (which ignores them): refused rather than guessed; the value each may harmlessly have.
_YARN_REFUSED = {"attention_factor": None, "truncate": True}


class UnsupportedConfig(ValueError):
    """A valid config that fqr builds no preset for: a model type, RoPE scaling or setting its
    ops have no form for (``fqr hf-config``: "refused", exit 1). A plain ValueError / TypeError
    is a config that is not valid (a count of 0, a theta beyond every float, a key missing:
    exit 2)."""


def _required(text, key: str, model_type: str):
    """``text.<key>``; missing (or None): a ValueError naming it."""
    value = getattr(text, key, None)
    if value is None:
        raise ValueError(
            f"config.{key} is missing (a {model_type} config needs it to build a preset)"
        )
    return value


def _rope_parameters(config, layer_type: str = "full_attention") -> tuple[dict, dict[str, str]]:
    """The RoPE settings of the layers the prologue runs in: transformers 5's
    ``rope_parameters`` (per layer type for Gemma 3: the ``layer_type`` ones), else
    4.x's ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` attributes; and where
    each was read (``config.rope_parameters['factor']``, ``config.rope_theta``, ...), the
    name an error about it gives."""
    params = getattr(config, "rope_parameters", None)
    where = "config.rope_parameters"
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params, where = params[layer_type], f"{where}[{layer_type!r}]"
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"{where} must be a dict, got {type(params).__name__}")
    params = dict(params or {})
    origin = {key: f"{where}[{key!r}]" for key in params}
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"], origin["rope_theta"] = config.rope_theta, "config.rope_theta"
    scaling = getattr(config, "rope_scaling", None)
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"config.rope_scaling must be a dict, got {type(scaling).__name__}")
    if scaling and "rope_type" not in params:
        params |= scaling
        origin |= {key: f"config.rope_scaling[{key!r}]" for key in scaling}
    if getattr(config, "partial_rotary_factor", None) is not None:
        if "partial_rotary_factor" not in params:
            origin["partial_rotary_factor"] = "config.partial_rotary_factor"
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params, origin


def _scaling(
    rope: dict, origin: dict[str, str], rope_type: str, model_type: str, family: HFFamily
) -> tuple:
    """The preset's ``rope_scaling`` pairs: the type, its required keys, the optional ones
    (vLLM's default where the config has none), then the extras the config has; each value
    checked (:func:`fqr.rope_cache.check_rope`, errors naming the config key) and held as the
    Python number it is."""
    if rope_type == "default":
        return ()
    if rope_type == "yarn":
        refused = [
            k
            for k, ok in _YARN_REFUSED.items()
            if rope.get(k, ok) != ok and not (k == "truncate" and family.yarn_truncate)
        ]
        # HF multiplies by g(s, m) / g(s, m_all) only when both are set (non-zero), else by
        # g(s, 1); vLLM's DeepSeek path always by the former, with its defaults 1 and 0
        if bool(rope.get("mscale")) != bool(rope.get("mscale_all_dim")):
            refused.append("only one of mscale and mscale_all_dim")
        if refused:
            raise UnsupportedConfig(
                f"config: RoPE yarn ({model_type}) sets {', '.join(refused)}: with it Hugging "
                f"Face builds another table than vLLM's DeepSeek yarn (the one fqr builds)"
            )
    pairs = [(k, rope[k]) for k in HF_ROPE_SCALINGS[rope_type]]
    pairs += [
        (k, rope[k] if rope.get(k) is not None else v)
        for k, v in HF_ROPE_DEFAULTS.get(rope_type, ())
    ]
    pairs += [(k, rope[k]) for k in HF_ROPE_EXTRAS.get(rope_type, ()) if rope.get(k) is not None]
    checked = check_rope(
        rope["rope_theta"],
        {"rope_type": rope_type, **dict(pairs)},
        theta_name=origin.get("rope_theta", "config.rope_theta"),
        key_name=lambda key: origin.get(key, f"config RoPE {key}"),
    )
    return (("rope_type", rope_type), *((k, checked[k]) for k, _ in pairs))


def _ntk_alpha_theta(text, rope: dict, origin: dict[str, str], theta: float, model_type: str):
    """The base of Hunyuan's NTK-alpha table, as its rotary embedding reads a ``dynamic``
    scaling with an ``alpha`` (``compute_ntk_alpha_rope_parameters``): ``rope_theta * alpha **
    (head_dim / (head_dim - 2))``, ``head_dim`` the config's; a ``dynamic`` scaling without
    an ``alpha`` is transformers' dynamic NTK (its table changes with the sequence length),
    refused."""
    if rope.get("alpha") is None:
        raise ValueError(
            f"config: RoPE 'dynamic' ({model_type}) without an alpha is dynamic NTK (the table "
            "follows the sequence length), which fqr builds no preset for"
        )
    alpha = positive_number(origin.get("alpha", "config RoPE alpha"), rope["alpha"])
    d = positive_count("config.head_dim", _required(text, "head_dim", model_type))
    return theta * alpha ** (d / (d - 2))


def _mla_variant_params(text, model_type: str, family: HFFamily) -> tuple:
    """The ``mla-kv`` fields of a DeepSeek-style config (see :func:`preset_from_hf_config`)."""
    dims = {k: getattr(text, k, None) for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise ValueError(f"config: {model_type} (MLA) has no {', '.join(missing)}")
    q_lora_rank = getattr(text, "q_lora_rank", None)
    return (
        ("q_lora_rank", positive_count("config.q_lora_rank", q_lora_rank) if q_lora_rank else 0),
        *((k, positive_count(f"config.{k}", v)) for k, v in dims.items()),
        ("block_size", 64),
        ("cache_dtype", family.cache_dtype),
    )


def _norm_kind(text, model_type: str, family: HFFamily) -> str:
    """The QK-norm kind: the family's, or the one its :attr:`HFFamily.norm_key` value picks
    (a value the family's code does not take is refused, naming the key)."""
    key = family.norm_key
    if key is None or not hasattr(text, key):
        return family.norm
    value = getattr(text, key)
    kinds = dict(family.norm_kinds)
    if isinstance(value, (bool, str)) and value in kinds:
        return kinds[value]
    raise UnsupportedConfig(
        f"config.{key} {value!r} ({model_type}): fqr builds "
        + ", ".join(f"{v!r} ({kind} norm)" for v, kind in family.norm_kinds)
    )


def _eps(text, model_type: str, family: HFFamily, norm: str) -> float:
    """The QK norms' eps, ``config.<family.eps_key>``: required where a norm reads it (any
    norm kind but "none", and MLA's q_a / kv_a norms); without a norm a missing one is the
    spec's default, which nothing reads. A family whose code builds its norms with a fixed eps
    (:attr:`HFFamily.fixed_eps`: transformers' MLA q_a / kv_a norms) reads no key: that eps."""
    if family.fixed_eps is not None:
        return family.fixed_eps
    key = family.eps_key
    if key is None:  # the family's code reads no eps (or fixes it)
        return PrologueSpec.eps if family.fixed_eps is None else family.fixed_eps
    if norm == "none" and family.variant == "split-qkv" and getattr(text, key, None) is None:
        return PrologueSpec.eps
    where = f"config.{key}"
    eps = positive_number(where, _required(text, key, model_type))
    check_finite_scalar(where, eps, positive=True)  # and within float32 (the compute dtype)
    return eps


def _is_neox(text, family: HFFamily) -> bool:
    """The RoPE pairing the family's code takes from the config: ``family.interleave_key``
    read as that code reads it (a truth test: True / missing default True -> GPT-J pairs,
    False or None -> NeoX halves); a value of another type is refused, naming its key."""
    key = family.interleave_key
    if key is None or not hasattr(text, key):
        return family.is_neox
    value = getattr(text, key)
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"config.{key} must be a bool, got {type(value).__name__} {value!r}")
    return not value


def _layer_config(text, model_type: str, family: HFFamily):
    """The config the family's attention reads its sizes from for the layers the preset
    describes (:attr:`HFFamily.layer_type`): where the config is per layer
    (``per_layer_config``, transformers' heterogeneous configs: Gemma 4's head_dim and kv heads
    differ by layer type) that of the first layer of that type, else the config itself."""
    if family.layer_type is None:
        return text
    types = list(getattr(text, "layer_types", None) or ())
    if family.layer_type not in types:
        raise UnsupportedConfig(
            f"config.layer_types ({model_type}) has no {family.layer_type!r} layer: its preset "
            f"is of those layers"
        )
    per_layer = getattr(text, "per_layer_config", None)
    return text if per_layer is None else per_layer[types.index(family.layer_type)]


def _hidden_size(text) -> int:
    """``config.hidden_size`` (a positive count), or 0 where the config has none."""
    hidden = getattr(text, "hidden_size", None)
    return 0 if hidden is None else positive_count("config.hidden_size", hidden)


def _head_counts(text, model_type: str, family: HFFamily) -> tuple[int, int, int, str]:
    """``(num_attention_heads, num_key_value_heads, head_dim, where head_dim comes from)`` of
    a config of grouped-query attention: only a missing (or None) ``num_key_value_heads``
    means one kv head per q head (:attr:`HFFamily.kv_heads_key` None: one kv head),
    and only a missing ``head_dim`` means ``hidden_size / num_attention_heads`` (as Hugging
    Face reads them; a 0 is refused, not read as missing)."""
    heads = positive_count(
        "config.num_attention_heads", _required(text, "num_attention_heads", model_type)
    )
    key = family.kv_heads_key
    kv = 1 if key is None else getattr(text, key, None)
    where = f"config.{key or 'num_key_value_heads'}"
    kv_heads = heads if kv is None else positive_count(where, kv)
    if heads % kv_heads:
        raise ValueError(
            f"config.num_attention_heads ({heads}) must be a multiple of {where} ({kv_heads})"
        )
    head_dim = getattr(text, "head_dim", None)
    if head_dim is not None:
        return heads, kv_heads, positive_count("config.head_dim", head_dim), "config.head_dim"
    hidden = positive_count("config.hidden_size", _required(text, "hidden_size", model_type))
    if hidden % heads:
        raise ValueError(
            f"config.hidden_size ({hidden}) is not a multiple of config.num_attention_heads "
            f"({heads}) and config.head_dim is missing"
        )
    return heads, kv_heads, hidden // heads, "config.hidden_size / config.num_attention_heads"


def _rotary_fraction(text, key: str, head_dim: int) -> float:
    """``config.<key> / head_dim``: the fraction of each head a family rotating its first
    ``rotary_dim`` features rotates (GPT-J, CodeGen: ``q[..., :rotary_dim]``, the table
    ``rotary_dim`` wide); None (the code then rotates whole heads by a table ``hidden_size``
    wide) is refused, a width beyond the head (the code's table then does not fit) an error."""
    model_type = getattr(text, "model_type", "")
    value = getattr(text, key, None)
    if value is None:
        raise UnsupportedConfig(
            f"config.{key} None ({model_type}): the model's attention then rotates whole heads "
            f"by a table hidden_size wide, which fqr builds no preset for"
        )
    rotary = positive_count(f"config.{key}", value)
    if rotary > head_dim or rotary % 2:
        raise ValueError(
            f"config.{key} ({rotary}) must be even and at most the head_dim ({head_dim}): "
            f"RoPE rotates pairs of the head's first {key} features"
        )
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary:  # the preset's rotated width is int(D * factor)
        raise ValueError(f"config.{key} ({rotary}) is no float fraction of head_dim {head_dim}")
    return factor


def _mrope_params(
    rope: dict, origin: dict[str, str], model_type: str, rotary_dim: int, family: HFFamily
) -> tuple:
    """``mrope_section`` (three ints summing to ``rotary_dim / 2``; missing: the family code's
    default, else refused) and ``mrope_interleaved`` (a bool; where the family's code always
    interleaves, :attr:`HFFamily.mrope_interleaved`, True whatever the config says, and an
    explicit False is refused: the model would rotate otherwise than the config says; else
    the config's, missing False) of an mRoPE family's RoPE settings."""
    if family.mrope_one_plane:
        return (("mrope_section", (rotary_dim // 2, 0, 0)), ("mrope_interleaved", False))
    section = rope.get("mrope_section")
    where = origin.get("mrope_section", f"{model_type}'s default mrope_section")
    if section is None:
        if family.mrope_section is None:
            raise ValueError(f"config: {model_type} runs mRoPE but has no mrope_section")
        section = family.mrope_section
    interleaved = rope.get("mrope_interleaved")
    if interleaved is not None and not isinstance(interleaved, bool):
        raise TypeError(
            f"{origin.get('mrope_interleaved')} must be a bool, got "
            f"{type(interleaved).__name__} {interleaved!r}"
        )
    if family.mrope_interleaved is not None:
        if interleaved is not None and interleaved != family.mrope_interleaved:
            raise UnsupportedConfig(
                f"{origin['mrope_interleaved']} is {interleaved} but {model_type}'s code "
                f"ignores it and {'interleaves' if family.mrope_interleaved else 'does not'}"
                f": refused rather than guessed"
            )
        interleaved = family.mrope_interleaved
    elif interleaved is None:
        interleaved = False
    if isinstance(section, (list, tuple)):  # numpy ints as ints; anything else is refused
        section = [int(n) if isinstance(n, numbers.Integral) else n for n in section]
    try:
        check_mrope_section(section, interleaved, rotary_dim, config=True)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    return (("mrope_section", tuple(section)), ("mrope_interleaved", interleaved))


def _q_scale(text, family: HFFamily) -> float:
    """``config.<family.q_scale_key>``: required, a finite real number (as fp32: the
    product's compute dtype)."""
    key = family.q_scale_key
    where = f"config.{key}"
    value = _required(text, key, getattr(text, "model_type", ""))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {type(value).__name__} {value!r}")
    check_finite_scalar(where, float(value))
    return float(value)


def _index_params(text, model_type: str, kv_heads: int, rotary_dim: int) -> tuple:
    """The ``index-heads`` fields of a MiniMax-M3 config with indexer layers:
    ``index_head_dim`` (``config.index_head_dim``), no FP8 outputs (transformers' model
    computes in its own dtype). fqr's variant has as many indexer q heads as kv heads
    (``config.index_n_heads`` otherwise refused), and rotates them over ``min(rotary_dim,
    index_head_dim)`` features: the model slices its table ``cos[..., :index_head_dim]``,
    which for an index head narrower than the table is no rotation fqr has (refused)."""
    heads = positive_count("config.index_n_heads", _required(text, "index_n_heads", model_type))
    head_dim = positive_count(
        "config.index_head_dim", _required(text, "index_head_dim", model_type)
    )
    if heads != kv_heads:
        raise UnsupportedConfig(
            f"config.index_n_heads {heads} ({model_type}): fqr's index-heads variant has as "
            f"many indexer q heads as kv heads ({kv_heads})"
        )
    if head_dim < rotary_dim or head_dim % 2:
        raise UnsupportedConfig(
            f"config.index_head_dim {head_dim} ({model_type}): the indexer then rotates by "
            f"the first {head_dim} columns of a {rotary_dim}-wide cos / sin (no rotation fqr "
            f"has; an even index_head_dim >= the rotary width is)"
        )
    return (("index_head_dim", head_dim), ("attn_fp8", False), ("index_fp8", False))


def norm_weights(config, preset: Preset, q_weight=None, k_weight=None) -> tuple:
    """The ``(q_weight, k_weight)`` fqr's op takes for the model of ``config`` (of a family
    in :data:`HF_FAMILIES`; ``preset`` built from it), given the model's own QK-norm weights
    (its ``q_norm.weight`` / ``k_norm.weight``; None where its norm has none): those weights,
    or for a family whose norm has no weight (:attr:`HFFamily.weightless_norm`) ones of
    ``preset.head_dim``, in fp32; where the family multiplies q after its norm by a config
    value (:attr:`HFFamily.q_scale_key`: Muse's ``qk_scale_factor``), q's are that value in
    fp32. Under ``unfused`` the norm rounds to the model dtype, then the product with the fp32
    weight is rounded once: the model's ``qk_norm(q) * qk_scale_factor`` bit for bit."""
    import torch

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = HF_FAMILIES[text.model_type]
    if not family.weightless_norm:
        return q_weight, k_weight
    if q_weight is not None or k_weight is not None:
        raise ValueError(f"{text.model_type}: its QK norm has no weight, got one")
    ones = torch.ones(preset.head_dim, dtype=torch.float32)
    scale = 1.0 if family.q_scale_key is None else _q_scale(text, family)
    return ones * scale, ones


def preset_from_hf_config(config, *, name: str | None = None) -> Preset:
    """A :class:`Preset` from a Hugging Face ``PretrainedConfig`` of a family in
    :data:`HF_FAMILIES` (a multimodal config gives its text config's).

    Every key is read as the family's transformers code reads it, and every family is held to
    that code bit for bit by ``tests/core/test_hf_zoo.py`` (under :attr:`HFFamily.numerics`).
    Read from the config: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
    (else ``hidden_size / num_attention_heads``), the norm eps (:attr:`HFFamily.eps_key`,
    ``rms_norm_eps``; optional without a QK norm, where nothing reads it),
    ``max_position_embeddings`` and the RoPE settings (transformers 5 ``rope_parameters``, or
    4.x ``rope_theta`` / ``rope_scaling``): theta, ``partial_rotary_factor``, and the scaling,
    which must be one fqr builds for the family (:attr:`HFFamily.scalings`, keys in
    :data:`HF_ROPE_SCALINGS`; another is a ValueError naming its type); for an mRoPE family
    (:data:`MROPE_VARIANTS`: Qwen3-VL ``mrope``, Qwen3.5 ``mrope-gate``, Qwen2-VL kin
    ``qk-mrope``) its ``mrope_section`` (missing: the code's default) and
    ``mrope_interleaved`` (where the code ignores it, what the code does; a config saying
    otherwise is refused). A family whose QK norm has no weight takes the weights
    :func:`norm_weights` gives (Muse: ones, q's ``qk_scale_factor``). From the family: the norm
    kind (or the one
    :attr:`HFFamily.norm_key` picks), its weight offset, the RoPE pairing and the variant; a
    setting the family's code applies that fqr has no form for (:attr:`HFFamily.refused_keys`)
    is refused naming it. Families whose prologue is another variant
    (:data:`HF_VARIANT_FAMILIES`) are refused, and any other model type with what it needs
    (:data:`HF_NEEDS`).

    Multi-head Latent Attention (``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``,
    ``kimi_k2``: the ``mla-kv`` variant, as vLLM's ``deepseek_v2.py`` runs them): ``num_heads``
    is ``num_attention_heads``, ``num_kv_heads`` 1 (the one latent / k_pe head, whatever
    ``num_key_value_heads`` says), ``head_dim`` = rotary_dim = ``qk_rope_head_dim``, GPT-J
    pairs (``deepseek_v3`` / ``kimi_k2``: NeoX halves where ``rope_interleave`` is false, as
    transformers' DeepseekV3Attention reads it; V2 and V3.2 rotate GPT-J pairs whatever it
    says), eps 1e-6 (transformers' q_a / kv_a norms use 1e-6 and read no key for it; vLLM's
    read ``rms_norm_eps``), and the variant's
    ``q_lora_rank`` (None: 0, a model with one ``q_proj``; required by ``deepseek_v32``),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``v_head_dim`` from the config, with
    ``block_size`` 64 and ``cache_dtype`` ``"auto"`` (``deepseek_v32``: ``"fp8_ds_mla"``, the
    cache vLLM runs V3.2 with), what vLLM runs these models with by default (its FlashMLA
    backend forces blocks of 64; ``kv_cache_dtype`` defaults to the model dtype). Their RoPE is
    ``default`` or ``yarn`` (vLLM turns any other type into DeepSeek's yarn too: refused here).
    A yarn scaling records ``factor``, ``original_max_position_embeddings`` (both required),
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim`` (missing: vLLM's
    ``DeepseekScalingRotaryEmbedding`` defaults 32, 1, 1, 0) and ``attn_factor`` /
    ``extrapolation_factor`` where the config has them; ``attention_factor`` and
    only one of ``mscale`` / ``mscale_all_dim`` (Hugging Face's multiplier is then g(s, 1),
    vLLM's DeepSeek path's g(s, m) / g(s, m_all)) are refused, and ``truncate: false`` but
    where the family's yarn reads it (:attr:`HFFamily.yarn_truncate`: gpt-oss), recorded then
    (:mod:`fqr.rope_cache` says how the two differ).

    ``name`` defaults to the config's checkpoint name, lower case (``Qwen/Qwen3-8B`` ->
    ``qwen3-8b``), else its model type.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if isinstance(model_type, str) and model_type in HF_VARIANT_FAMILIES:
        raise UnsupportedConfig(
            f"config: {model_type}: {HF_VARIANT_FAMILIES[model_type]}; presets of the "
            f"prologue's variants are not built from a config yet"
        )
    if not isinstance(model_type, str):
        raise ValueError(f"config: model_type {model_type!r} is not a model type (a str)")
    if family is None:
        needs = HF_NEEDS.get(model_type)
        raise UnsupportedConfig(
            f"config: model_type {model_type!r} is not a family fqr builds presets for: "
            + (
                f"it needs {needs}"
                if needs
                else "its attention is not checked against fqr's ops (tests/core/test_hf_zoo.py)"
            )
        )
    rope, origin = _rope_parameters(text, family.layer_type or "full_attention")
    if family.fixed_theta is not None:  # the code's own table: no RoPE setting read
        rope = {"rope_theta": family.fixed_theta}
        origin = {"rope_theta": f"{model_type}'s fixed RoPE base"}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str):
        raise TypeError(f"config: RoPE type must be a str, got {rope_type!r}")
    if rope_type not in family.scalings:
        raise UnsupportedConfig(
            f"config: RoPE scaling {rope_type!r} ({model_type}) is not one fqr builds; "
            f"supported: {', '.join(family.scalings)}"
        )
    if family.ntk_alpha and rope_type == "dynamic":
        if rope.get("rope_theta") is None:
            raise ValueError("config: RoPE (dynamic) has no rope_theta")
        theta = positive_number(origin["rope_theta"], rope["rope_theta"])
        rope = dict(rope, rope_theta=_ntk_alpha_theta(text, rope, origin, theta, model_type))
        rope_type = "default"
    missing = [k for k in ("rope_theta", *HF_ROPE_SCALINGS[rope_type]) if rope.get(k) is None]
    if missing:
        raise ValueError(f"config: RoPE ({rope_type}) of {model_type} has no {', '.join(missing)}")
    theta = positive_number(origin["rope_theta"], rope["rope_theta"])
    scaling = _scaling(rope, origin, rope_type, model_type, family)
    if family.negated_angle:  # only from "default" (its scalings): the negated positions' table
        scaling = (("rope_type", "negated"),)
    variant_params: tuple = family.variant_params
    if family.variant == "mla-kv":
        heads = positive_count(
            "config.num_attention_heads", _required(text, "num_attention_heads", model_type)
        )
        head_dim = getattr(text, "qk_rope_head_dim", None)
        if head_dim is None:
            raise ValueError(f"config: {model_type} (MLA) has no qk_rope_head_dim")
        kv_heads, head_dim = 1, positive_count("config.qk_rope_head_dim", head_dim)
        head_key, partial_rotary_factor, factor_key = "config.qk_rope_head_dim", 1.0, None
        variant_params = _mla_variant_params(text, model_type, family)
    else:
        layer = _layer_config(text, model_type, family)
        heads, kv_heads, head_dim, head_key = _head_counts(layer, model_type, family)
        partial_rotary_factor, factor_key = 1.0, None
        if family.rotary_dim_key is not None:
            factor_key = f"config.{family.rotary_dim_key}"
            partial_rotary_factor = _rotary_fraction(text, family.rotary_dim_key, head_dim)
        elif rope.get("partial_rotary_factor") is not None:
            factor_key = origin["partial_rotary_factor"]
            partial_rotary_factor = fraction(factor_key, rope["partial_rotary_factor"])
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:  # RoPE rotates pairs
        raise ValueError(
            f"{factor_key} {partial_rotary_factor!r} rotates {rotary_dim} of head_dim "
            f"{head_dim} features: the rotated part must be even and >= 2"
            if factor_key
            else f"{head_key} ({head_dim}) must be even: RoPE rotates the head in pairs"
        )
    if family.variant in MROPE_VARIANTS:
        variant_params = _mrope_params(rope, origin, model_type, rotary_dim, family)
    for key in family.required:
        _required(text, key, model_type)
    if family.q_scale_key is not None:
        _q_scale(text, family)
    variant = family.variant
    if family.indexer_layer_type in (getattr(text, "layer_types", None) or ()):
        variant = "index-heads"
        variant_params = _index_params(text, model_type, kv_heads, rotary_dim)
    for key, harmless, what in family.refused_keys:
        value = getattr(text, key, harmless)
        if value != harmless:
            raise UnsupportedConfig(
                f"config.{key} {value!r} ({model_type}): the model's attention then has {what}, "
                f"which fqr builds no preset for"
            )
    norm = _norm_kind(text, model_type, family)
    eps = _eps(text, model_type, family, norm)
    max_position = positive_count(
        "config.max_position_embeddings",
        _required(text, "max_position_embeddings", model_type),
    )
    checkpoint = str(getattr(config, "name_or_path", "") or "")
    return Preset(
        name=name or (checkpoint.rstrip("/").rsplit("/", 1)[-1].lower() or model_type),
        hf_id=checkpoint,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        max_position=max_position,
        norm=norm,
        eps=eps,
        weight_offset=family.weight_offset,
        partial_rotary_factor=partial_rotary_factor,
        is_neox=_is_neox(text, family),
        rope_scaling=scaling,
        variant=variant,
        variant_params=variant_params,
        hidden_size=_hidden_size(text),
    )
