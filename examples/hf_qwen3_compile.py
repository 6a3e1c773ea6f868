"""Hugging Face drop-in: compile a transformers Qwen3 with fqr's fusion pass.

``torch.compile(model, backend=fqr.fusion.backend())`` is Inductor with fqr's pass added: in
every decoder layer it finds Qwen3's unfused attention prologue (q/k/v projections, per-head
``q_norm`` / ``k_norm``, ``apply_rotary_pos_emb``) and replaces it by one fqr kernel. Nothing
in the model changes; the weights stay where they are.

This script builds a Qwen3 from a small config with random weights (no download; the same
code takes ``Qwen3ForCausalLM.from_pretrained("Qwen/Qwen3-8B")``), runs it eagerly and
compiled with the pass, and prints how many prologues were fused and how far the compiled
logits are from the eager ones (relative to their largest magnitude). It also shows the
preset fqr reads from the config (:meth:`fqr.Preset.from_hf_config`). Exit 0 when every
layer was fused and the logits agree within the tolerance of the dtype, 1 otherwise::

    python examples/hf_qwen3_compile.py                      # CPU, fp32, 2 layers
    python examples/hf_qwen3_compile.py --device cuda --dtype bf16 --layers 4 --tokens 512
"""

from __future__ import annotations

import argparse
import sys

import torch

import fqr

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# max |compiled - eager| / max |eager| of the logits: compile noise in each dtype
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0**-6, "fp16": 2.0**-8}


def tiny_qwen3_config(layers: int):
    """A Qwen3 config at test size: Qwen3-8B's structure (GQA 2:1, per-head QK norm, NeoX
    RoPE, theta 1e6), small widths."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


def run(layers: int = 2, tokens: int = 12, dtype: str = "fp32", device: str = "cpu", seed=0):
    """Build, run eager and compiled; the result as a dict (also printed)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = tiny_qwen3_config(layers)
    print(f"fqr preset from the config: {fqr.Preset.from_hf_config(config, name='tiny').summary}")
    model = Qwen3ForCausalLM(config).to(device=device, dtype=DTYPES[dtype]).eval()
    with torch.no_grad():  # HF sets the norm weights to 1, which would hide a wrong weight
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.2 * torch.randn_like(norm.weight))
    input_ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)

    fusion = fqr.fusion.backend()
    compiled = torch.compile(model, backend=fusion)
    with torch.no_grad():
        eager = model(input_ids).logits.float()
        fused = compiled(input_ids).logits.float()
    err = ((fused - eager).abs().max() / eager.abs().max()).item()
    result = {
        "layers": layers,
        "sites_fused": fusion.stats.sites,
        "logits_rel_err": err,
        "tolerance": TOLERANCE[dtype],
        "ok": fusion.stats.sites == layers and err <= TOLERANCE[dtype],
    }
    print(
        f"fused {result['sites_fused']}/{layers} attention prologues; compiled logits vs eager:"
        f" max err {err:.2g} x max |logit| (tolerance {TOLERANCE[dtype]:.2g}) -> "
        + ("ok" if result["ok"] else "FAILED")
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return 0 if run(args.layers, args.tokens, args.dtype, args.device, args.seed)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
