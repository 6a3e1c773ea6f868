"""The transformers zoo: every decoder model type of the installed transformers whose attention
applies rotary embeddings, a tiny config of each, its own attention run on random weights with
its q and k captured after its norm and RoPE, and fqr's op through ``Preset.from_hf_config`` on
the same projection output (``tests/core/test_hf_zoo.py``).

Scope (:func:`zoo_model_types`): the model types of transformers' config mapping whose modeling
module names a rotary embedding (``RotaryEmbedding`` or ``apply_rotary``; a type with no
modeling module of its own, as ``exaone``, by the module of the model class transformers runs
it with) and that are decoders: in the causal-LM or image-text-to-text mapping, or a text
config (``*_text``) a multimodal model wraps; a composite config whose text config is itself in
scope is that text config (``gemma3`` is ``gemma3_text``), so it is counted once.

Capture (:func:`run_model`): the model with one layer, in bf16, its norm weights random; the
module-level rotary function of its modeling module (``apply_rotary_pos_emb`` and kin) is
wrapped so that its first call records its inputs and outputs and stops the forward; forward
hooks record each linear projection's output. The RoPE table fqr is given is the model's own
(its rotary embedding called in fp32 on positions ``0..P-1``), and the preset's table is
checked against it separately.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
from dataclasses import dataclass, field

import torch

ROTARY_FUNCTIONS = (
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_interleave",
    "apply_rotary_emb",
    "apply_multimodal_rotary_pos_emb",
)
POSITIONS = 64  # rows of the RoPE table; positions are drawn below it
TOKENS = 6

# The sizes every tiny config gets (where the config class has the key).
TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=POSITIONS,
    num_experts=2,
    num_local_experts=2,
    n_routed_experts=2,
    num_experts_per_tok=1,
    n_shared_experts=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    layer_types=None,
)


# Model types whose input ids carry, per position, a text token beside its audio codebooks
# (``[B, T, num_codebooks + 1]``): the zoo's ids as ``[1, T, 1]``, which their embedding
# broadcasts over the codebooks (Kyutai's speech-to-text)
IDS_WITH_CODEBOOKS = ("kyutai_speech_to_text",)


class Captured(Exception):
    """Raised by the wrapped rotary function once it has recorded its call."""


@dataclass
class Capture:
    """What one forward recorded: the rotary function's name, its inputs and outputs, and
    every linear layer's output by qualified name (first call only)."""

    function: str = ""
    inputs: tuple = ()
    outputs: tuple = ()
    linears: dict = field(default_factory=dict)
    norms: dict = field(default_factory=dict)
    # the outputs of the rotary calls after the first (``run_model(rotary_calls=...)``: MiniMax-M3's
    # indexer rotates its own q and k after the attention's)
    later: list = field(default_factory=list)


def transformers_root() -> pathlib.Path:
    import transformers

    return pathlib.Path(transformers.__file__).parent / "models"


def _modeling_source(model_type: str) -> str:
    """The source of the modeling module that runs ``model_type``: its own, else (a config-only
    type: ``exaone``, ``internlm3``, ... run Llama's code) the module of the base model class
    transformers' auto mapping names for it."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    files = sorted(
        (transformers_root() / model_type_to_module_name(model_type)).glob("modeling_*.py")
    )
    name = MODEL_MAPPING_NAMES.get(model_type)
    if not files and isinstance(name, str) and name in _model_classes():
        files = [_model_classes()[name]]
    return "".join(f.read_text() for f in files)


@functools.cache
def _model_classes() -> dict[str, pathlib.Path]:
    """Every model class transformers defines, by name, with its modeling file."""
    found = {}
    for path in transformers_root().glob("*/modeling_*.py"):
        found |= {m: path for m in re.findall(r"^class (\w+)\(", path.read_text(), re.M)}
    return found


def zoo_model_types() -> list[str]:
    """The model types in scope (module docstring), in the config mapping's order."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    rotary = re.compile(r"RotaryEmbedding|apply_rotary")
    decoders = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )
    found = [
        model_type
        for model_type in CONFIG_MAPPING_NAMES
        if (model_type in decoders or model_type.endswith("_text"))
        and rotary.search(_modeling_source(model_type))
    ]
    scope = []
    for model_type in found:
        try:
            text = AutoConfig.for_model(model_type).get_text_config()
        except Exception:  # noqa: BLE001 - a config transformers cannot build stays in scope
            text = None
        inner = getattr(text, "model_type", model_type)
        if inner != model_type and inner in found:
            continue
        scope.append(model_type)
    return scope


def tiny_config(model_type: str, **extra):
    """The model type's text config (eager attention) with :data:`TINY` sizes where it has
    those keys, and ``extra``."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type).get_text_config()
    keys = set(base.to_dict())
    kwargs = {k: v for k, v in TINY.items() if k in keys} | extra
    if "qk_rope_head_dim" in keys and "head_dim" in keys:  # MLA: head_dim is the rope part
        kwargs["head_dim"] = TINY["qk_rope_head_dim"]
    # token ids the tiny vocabulary holds
    kwargs |= {k: 0 for k in ("pad_token_id", "bos_token_id", "eos_token_id") if k in keys}
    # the text config's own class (a composite config would give its text config the
    # defaults, full size, and the sizes to itself)
    config = type(base)(**kwargs).get_text_config()
    config._attn_implementation = "eager"
    return config


def text_model_class(config):
    """The base model class of ``config``: transformers' AutoModel mapping, else the class
    of the config's modeling module whose ``config_class`` is the config's (a text model
    that only a multimodal model builds: Qwen2.5-Omni's, PaddleOCR-VL's)."""
    from transformers import AutoModel

    try:
        return AutoModel._model_mapping[type(config)]
    except KeyError:
        pass
    except ValueError:  # mapped to a class its package does not export (Voxtral Realtime's)
        pass
    package = type(config).__module__.rsplit(".", 1)[0]
    name = package.rsplit(".", 1)[1]
    module = importlib.import_module(f"{package}.modeling_{name}")
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and getattr(value, "config_class", None) is type(config)
            # T5Gemma 2's text encoder and decoder are its text models
            and value.__name__.endswith(("Model", "Encoder", "Decoder"))
            and value.forward is not torch.nn.Module.forward  # not the pretrained base class
        ):
            return value
    raise LookupError(f"no model class of {type(config).__name__}")


def _modeling_module(model):
    return importlib.import_module(type(model).__module__)


def run_model(
    config,
    positions: torch.Tensor,
    generator: torch.Generator,
    *,
    offset: float,
    rotary_calls: int | None = 1,
):
    """The model of ``config`` (one layer, bf16, random weights; norm weights ``offset + 0.3
    * N(0, 1)``) run on ``TOKENS`` random tokens at ``positions`` (``[T]``, or ``[3, T]``
    planes) until its first rotary call (its ``rotary_calls``-th: the later ones' outputs in
    ``capture.later``; None: the whole forward, Gemma 3n's v_norm runs after k's rotation):
    ``(model, capture)``."""

    torch.manual_seed(int(torch.randint(2**31, (1,), generator=generator, device=generator.device)))
    # built in bf16 as a checkpoint loads (the rotary inverse frequencies stay fp32)
    model = text_model_class(config)._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[0].split(".")[-1]
            # Chameleon's q_norm / k_norm: a weight and bias per head, [H, D]
            if "norm" in leaf and (p.dim() == 1 or leaf in ("q_norm", "k_norm")):
                p.copy_(
                    offset
                    + 0.3 * torch.randn(p.shape, generator=generator, device=generator.device)
                )
    capture = Capture()
    module = _modeling_module(model)
    originals = {n: getattr(module, n) for n in ROTARY_FUNCTIONS if hasattr(module, n)}

    calls: list[torch.Tensor] = []

    def wrap(name, fn):
        def recording(*args, **kwargs):
            out = returned = fn(*args, **kwargs)
            if torch.is_tensor(out):  # one tensor a call (GPT-J, CodeGen): q's and k's calls
                order = _q_and_k_order(module, name)
                if order is None:  # another rotation first (Qwen4-Exp's indexer): not q, k
                    return out
                calls.append(out)
                if len(calls) < 2:
                    return out
                out = calls[order.index("q")], calls[order.index("k")]
            if capture.function:
                capture.later.append(out)
            else:
                capture.function, capture.inputs, capture.outputs = name, args, out
            if rotary_calls is None or 1 + len(capture.later) < rotary_calls:
                return returned
            raise Captured

        return recording

    hooks = []
    for qual, sub in model.named_modules():
        leaf = qual.rsplit(".", 1)[-1]
        # a projection of its own module class (Moshi's MoshiLinear around its nn.Linear)
        projection = isinstance(sub, torch.nn.Linear) or leaf in ("q_proj", "k_proj", "v_proj")
        if projection or "norm" in leaf:
            store = capture.linears if projection else capture.norms

            def hook(mod, args, out, qual=qual, store=store):
                store.setdefault(qual, out)

            hooks.append(sub.register_forward_hook(hook))
    ids = torch.randint(
        0, config.vocab_size, (1, positions.shape[-1]), generator=generator, device=generator.device
    )
    if config.model_type in IDS_WITH_CODEBOOKS:
        ids = ids[..., None]
    try:
        for name, fn in originals.items():
            setattr(module, name, wrap(name, fn))
        inputs = dict(position_ids=positions[..., None, :], use_cache=False)
        with torch.no_grad():
            try:
                model(input_ids=ids, **inputs)
            except AttributeError as e:
                # Qwen3-Omni's talker embeds no ids (its forward asks for an embed_tokens it
                # does not have): its own input embeddings (codec_embedding) given instead
                if "embed_tokens" not in str(e):
                    raise
                model(inputs_embeds=model.get_input_embeddings()(ids), **inputs)
            except ValueError as e:
                # a decoder that runs only with an encoder's output (T5Gemma 2's): random
                # encoder states (its cross-attention comes after its self-attention's RoPE);
                # IDEFICS runs only with images: one of random image encoder states, every
                # token seeing it (its gated cross-attention rotates nothing)
                if "image_encoder_embeddings" in str(e):
                    width = config.vision_config.embed_dim
                    images = torch.randn(
                        (1, 4, width), generator=generator, device=generator.device
                    ).to(torch.bfloat16)
                    mask = torch.ones((1, ids.shape[-1], 1), dtype=torch.long)
                    model(
                        input_ids=ids, image_encoder_embeddings=images,
                        image_attention_mask=mask, **inputs,
                    )  # fmt: skip
                elif "encoder_hidden_states" in str(e):
                    states = torch.randn(
                        (1, ids.shape[-1], config.hidden_size), generator=generator,
                        device=generator.device,
                    ).to(torch.bfloat16)  # fmt: skip
                    model(input_ids=ids, encoder_hidden_states=states, **inputs)
                else:
                    raise
    except Captured:
        pass
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
        for h in hooks:
            h.remove()
    return model, capture


def _q_and_k_order(module, name: str) -> list[str] | None:
    """The order in which a modeling module rotates q and k with a rotary function that
    rotates one tensor a call (GPT-J, CodeGen: ``k_rot = apply_rotary_pos_emb(k_rot, ...)``
    then ``q_rot = ...``, in each branch alike), read from its code; None where its code has
    no such q and k calls (Qwen4-Exp's indexer rotates its own q and block keys so, the
    attention's q and k in one call)."""
    import inspect

    order = re.findall(rf"^\s*([qk])\w* = {name}\(", inspect.getsource(module), re.M)
    branches = {tuple(order[i : i + 2]) for i in range(0, len(order), 2)}
    if len(branches) != 1 or sorted(order[:2]) != ["k", "q"]:
        return None
    return order[:2]


def _rotary_embedding(model) -> torch.nn.Module:
    """The model's own rotary embedding: the outermost one (Evolla's text model also holds its
    protein encoder's, deeper down)."""
    found = [
        (qual.count("."), i, m)
        for i, (qual, m) in enumerate(model.named_modules())
        if type(m).__name__.endswith("RotaryEmbedding")
    ]
    return min(found, key=lambda x: x[:2])[2]


def _sin_cos_buffer(table: torch.Tensor) -> torch.Tensor:
    half = table.shape[-1] // 2
    return torch.cat([table[:POSITIONS, half:], table[:POSITIONS, :half]], -1).float()


def table_as_built_in_fp32(model, mrope: bool, layer_type: str = "full_attention") -> torch.Tensor:
    """The table the model's rotary embedding builds when built in fp32: GPT-J / CodeGen's
    ``create_sinusoidal_positions`` divides an int64 ``arange`` by the width, which gives
    torch's default dtype, the load dtype while a model is built (bf16 here: frequencies
    rounded to bf16, up to 6e-3 off the sinusoid at positions < 64; a preset's table is the
    exact one); every other rotary embedding computes its frequencies in fp32 whatever the
    load dtype: :func:`model_table`."""
    rotary = _rotary_embedding(model)
    if getattr(rotary, "embed_positions", None) is None:
        return model_table(model, mrope, layer_type)
    build = importlib.import_module(type(rotary).__module__).create_sinusoidal_positions
    assert torch.get_default_dtype() == torch.float32
    return _sin_cos_buffer(build(POSITIONS, rotary.pos_embd_dim))


def negated_angle(table: torch.Tensor) -> torch.Tensor:
    """The table ``[P, R]`` (cos | sin halves) of the negated angles: sin negated (exact)."""
    half = table.shape[-1] // 2
    return torch.cat([table[:, :half], -table[:, half:]], -1)


def model_table(model, mrope: bool, layer_type: str = "full_attention") -> torch.Tensor:
    """The model's own RoPE table in vLLM layout ``[POSITIONS, R]`` (cos | sin halves, fp32):
    its rotary embedding called in fp32 on positions ``0..POSITIONS-1`` (where its RoPE is per
    layer type, ``layer_type``'s)."""
    rotary = _rotary_embedding(model)
    table = getattr(rotary, "embed_positions", None)
    if table is not None:  # GPT-J / CodeGen's sinusoidal buffer: [sin | cos] halves
        return _sin_cos_buffer(table)
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.arange(POSITIONS)[None]
    if mrope:
        pos = pos.expand(3, 1, -1)
    import inspect

    if "layer_type" in inspect.signature(rotary.forward).parameters:  # RoPE per layer type
        out = rotary(x, pos, layer_type)
    else:
        try:
            out = rotary(x, pos)
        except TypeError:
            out = rotary(x, pos, layer_type)
    if torch.is_tensor(out) and out.is_complex():  # DeepSeek-V2's freqs_cis
        return torch.cat([out.real, out.imag], dim=-1)[0].float()
    cos, sin = (t[0].float() for t in out)
    half = cos.shape[-1] // 2
    if torch.equal(cos[:, :half], cos[:, half:]):
        return torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
    if torch.equal(cos[:, 0::2], cos[:, 1::2]):
        return torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=-1)  # repeat_interleave'd (GPT-J)
    return torch.cat([cos, sin], dim=-1)  # one column a frequency (gpt-oss)


# The names models give a fused [q | k | v] projection, and their q and k norms.
FUSED_QKV = ("qkv_proj", "Wqkv", "query_key_value", "c_attn", "qkv")
Q_NORMS = ("q_norm", "q_layernorm", "query_layernorm", "q_ln")
K_NORMS = ("k_norm", "k_layernorm", "key_layernorm", "k_ln")


def _heads(x: torch.Tensor) -> torch.Tensor:
    """A model's heads as fqr's rows ``[T, H * D]``: ``[1, H, T, D]`` (after the transpose,
    most models), or ``[1, T, H, D]`` (Llama 4 rotates before it), told apart by the token
    count (the zoo's :data:`TOKENS` is no head count it builds)."""
    if x.shape[2] == TOKENS:
        x = x.transpose(1, 2)
    return x[0].reshape(TOKENS, -1)


def _attention(model, capture: Capture, *names: str) -> tuple[str, torch.nn.Module]:
    """The qualified name prefix and module of the first attention that has a linear layer
    of one of ``names``."""
    for qual in capture.linears:
        prefix, _, leaf = qual.rpartition(".")
        # not a cross-attention (IDEFICS's gated ones run before its self-attention)
        if leaf in names and not getattr(model.get_submodule(prefix), "is_cross_attention", 0):
            return prefix, model.get_submodule(prefix)
    raise LookupError(f"no projection named {', '.join(names)} ran")


def _weight(module, *names):
    for name in names:
        sub = getattr(module, name, None)
        if sub is not None:
            weight = getattr(sub, "weight", None)  # a weightless norm: None
            return None if weight is None else weight.detach()
    return None


def _bias(module, *names):
    for name in names:
        sub = getattr(module, name, None)
        if sub is not None:
            bias = getattr(sub, "bias", None)
            return None if bias is None else bias.detach()
    return None


def compared_outputs(preset, numerics, model, capture, positions, table, backend="reference"):
    """``[(name, fqr's output, the model's)]``: fqr's op of ``preset``'s variant on the
    projection output the model computed, with the model's norm weights and RoPE table
    (``table``), under ``numerics``, on ``backend``."""
    import fqr
    from fqr.hf import norm_weights
    from fqr.prologue.params import index_head_kwargs

    rotated = tuple(capture.outputs[:2])
    if preset.variant == "mla-kv":
        return _mla_outputs(preset, numerics, model, capture, positions, table, rotated, backend)
    prefix, attention = _attention(model, capture, "q_proj", *FUSED_QKV)
    if f"{prefix}.q_proj" in capture.linears:
        names = ("q_proj", "k_proj", "v_proj")
        qkv = torch.cat([capture.linears[f"{prefix}.{n}"][0] for n in names], -1)
    else:
        qkv = next(
            capture.linears[f"{prefix}.{n}"][0]
            for n in FUSED_QKV
            if f"{prefix}.{n}" in capture.linears
        )
    weights = (_weight(attention, *Q_NORMS), _weight(attention, *K_NORMS))
    # a weightless norm (Muse's qk_norm): the weights fqr's mapping gives for the config
    weights = norm_weights(model.config, preset, *weights)
    names = ("q", "k", "index_q", "index_k")  # fqr's outputs compared, in order
    common = dict(numerics=numerics, backend=backend)
    if preset.variant == "qk-layernorm":
        # Persimmon's q_layernorm / k_layernorm (weight and bias), its row as stored
        biases = (_bias(attention, *Q_NORMS), _bias(attention, *K_NORMS))
        # Chameleon's are [H, D] (each head its own): fqr's per-head weights are [H * D]
        weights, biases = ([x.reshape(-1) for x in pair] for pair in (weights, biases))
        out = fqr.split_qkv_layernorm_rope(
            qkv, positions, table, *weights, *biases, num_heads=preset.num_heads,
            num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim, eps=preset.eps,
            is_neox=preset.is_neox, **preset.params, **common,
        )  # fmt: skip
    elif preset.variant == "rope-rmsnorm":
        # the rotary function runs before the norms: the model's own query_layernorm /
        # key_layernorm of its rotated q and k
        out = fqr.split_qkv_rope_rmsnorm(
            qkv, positions, table, *weights, num_heads=preset.num_heads,
            num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim, eps=preset.eps,
            is_neox=preset.is_neox, **common,
        )  # fmt: skip
        norms = [getattr(attention, n) for n in ("query_layernorm", "key_layernorm")]
        with torch.no_grad():
            rotated = tuple(norm(x) for norm, x in zip(norms, rotated))
    elif preset.variant == "rope-l2norm":
        # the model's own weightless norm of its rotated q and k (Llama 4's one qk_norm,
        # nanochat's q_norm / k_norm)
        out = fqr.split_qkv_rope_l2norm(
            qkv, positions, table, num_heads=preset.num_heads,
            num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim, eps=preset.eps,
            is_neox=preset.is_neox, **common,
        )  # fmt: skip
        norms = [getattr(attention, n, None) for n in ("qk_norm", "q_norm", "k_norm")]
        norms = norms[:1] * 2 if norms[0] is not None else norms[1:]
        with torch.no_grad():
            rotated = tuple(norm(x) for norm, x in zip(norms, rotated))
    elif preset.variant == "index-heads":
        # MiniMax-M3's sparse layer: its indexer's q_proj / k_proj after the attention's row,
        # their (1 + w) norms; the indexer's rotated q and k, the later rotary call
        indexer = attention.indexer
        qkv = torch.cat(
            [qkv, *(capture.linears[f"{prefix}.indexer.{n}"][0] for n in ("q_proj", "k_proj"))],
            -1,
        )
        out = fqr.split_qkv_index_rmsnorm_rope(
            qkv, positions, table, *weights, _weight(indexer, "q_norm"), _weight(indexer, "k_norm"),
            **index_head_kwargs(preset, attn_fp8=False, index_fp8=False), **common,
        )  # fmt: skip
        out = (out[0], out[1], out[3], out[4])
        rotated = (*rotated, *capture.later[0])
    elif preset.variant == "split-qkv-vnorm":
        # Gemma 3n / 4: v normalised too, the model's own v_norm output compared beside q, k
        out = fqr.split_qkv_rmsnorm_rope_vnorm(
            qkv, positions, table, *weights, **preset.spec.head_kwargs(**common)
        )
        rotated = (*rotated, capture.norms[f"{prefix}.v_norm"])
        names = ("q", "k", "v")
    elif preset.variant == "qk-mrope":
        q, k = (capture.linears[f"{prefix}.{n}"][0] for n in ("q_proj", "k_proj"))
        out = fqr.qk_mrope(
            q, k, positions, table, head_dim=preset.head_dim, is_neox=preset.is_neox,
            **preset.params, **common,
        )  # fmt: skip
    elif preset.variant in ("mrope", "mrope-gate"):
        out = fqr.split_qkv_rmsnorm_mrope(
            qkv, positions, table, *weights, **preset.spec.head_kwargs(**common),
            **preset.params, output_gate=preset.variant == "mrope-gate",
        )  # fmt: skip
    else:  # split-qkv, and split-qkv-layout's row as stored (its qkv_layout)
        out = fqr.split_qkv_rmsnorm_rope(
            qkv, positions, table, *weights, **preset.spec.kwargs(**common), **preset.params
        )
    # CodeGen rotates in fp32 and rounds q and k to the model dtype after its rotary function
    # (``query.transpose(1, 2).to(value.dtype)``): its rounded q and k
    rotated = tuple(x.to(out[0].dtype) for x in rotated)
    return [
        (name, _rotated_part(ours, theirs), _heads(theirs))
        for name, ours, theirs in zip(names, out, rotated)
    ]


def _rotated_part(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """fqr's ``[T, H * D]`` output cut to what the model's rotary function returned: models
    that split off the rotated part first (Phi, StableLM: ``q_rot, q_pass = q[..., :R],
    q[..., R:]``) rotate ``[1, H, T, R]`` and concatenate the rest after; compared are then
    the first R features of each head."""
    heads, width = theirs.shape[1 if theirs.shape[2] == TOKENS else 2], theirs.shape[-1]
    if ours.shape[1] == heads * width:
        return ours
    return ours.view(ours.shape[0], heads, -1)[..., :width].reshape(ours.shape[0], -1)


def _mla_outputs(preset, numerics, model, capture, positions, table, rotated, backend):
    import fqr

    prefix, attention = _attention(model, capture, "kv_a_proj_with_mqa")
    p = preset.params
    q_lora_rank, nope, rope = p["q_lora_rank"], p["qk_nope_head_dim"], preset.head_dim
    rows = [capture.linears[f"{prefix}.kv_a_proj_with_mqa"][0]]
    if q_lora_rank:
        rows.insert(0, capture.linears[f"{prefix}.q_a_proj"][0])
    cache = torch.zeros(1, TOKENS, p["kv_lora_rank"] + rope, dtype=torch.bfloat16)
    out = fqr.split_mla_rmsnorm_rope_cache(
        torch.cat(rows, -1), positions, table, _weight(attention, "q_a_layernorm"),
        _weight(attention, "kv_a_layernorm"), cache, torch.arange(TOKENS),
        q_lora_rank=q_lora_rank, kv_lora_rank=p["kv_lora_rank"], qk_rope_head_dim=rope,
        eps=preset.eps, is_neox=preset.is_neox, numerics=numerics, backend=backend,
    )  # fmt: skip
    q = capture.linears[f"{prefix}.q_b_proj" if q_lora_rank else f"{prefix}.q_proj"][0].clone()
    q = fqr.mla_q_rope(
        q, positions, table, num_heads=preset.num_heads, qk_nope_head_dim=nope,
        is_neox=preset.is_neox, numerics=numerics, backend=backend,
    ).view(TOKENS, preset.num_heads, nope + rope)[:, :, nope:]  # fmt: skip
    k_pe, q_pe = out[-1], q.reshape(TOKENS, -1)
    if capture.function == "apply_rotary_pos_emb_interleave":
        # it writes each head's rotated pairs de-interleaved: cat(x[0::2], x[1::2])
        k_pe = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], -1)
        q_pe = q.reshape(TOKENS, preset.num_heads, rope)
        q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], -1).reshape(TOKENS, -1)
    norms = {
        leaf.rpartition(".")[2]: v[0]
        for leaf, v in capture.norms.items()
        if leaf.startswith(prefix)
    }
    pairs = [("kv_c", out[-2], norms["kv_a_layernorm"])]
    if q_lora_rank:
        pairs.append(("q_c", out[0], norms["q_a_layernorm"]))
    return pairs + [("k_pe", k_pe, _heads(rotated[1])), ("q_pe", q_pe, _heads(rotated[0]))]
