"""``fqr hf-config``: whether fqr builds a verified preset from a transformers config.

``CONFIG`` is a ``config.json`` file, a checkpoint directory holding one, or a transformers
model type (its default config). Prints the preset ``Preset.from_hf_config`` builds (its
variant and the numerics mode in which fqr's op equals the model's transformers code bit for
bit, as ``tests/core/test_hf_zoo.py`` checks for every family), or the one line fqr refuses it
with. Exit 0 supported, 1 refused, 2 bad usage (no such file, not a config, an unknown model
type).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import EXIT_FAILED, UsageError, app, example, out, schema
from .options import JsonOption


def load_config(text: str):
    """The transformers config ``text`` names (module docstring); a UsageError naming it."""
    import transformers

    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        try:
            values = json.loads(path.read_text())
        except OSError as e:
            raise UsageError(f"CONFIG {text}: {e.strerror or e}") from None
        except ValueError as e:
            raise UsageError(f"CONFIG {text}: not JSON ({e})") from None
        if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
            raise UsageError(f"CONFIG {text}: a transformers config.json has a model_type")
        model_type = values.pop("model_type")
    else:
        model_type, values = text, {}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"CONFIG {text}: transformers builds no config of it (model_type {model_type!r} "
            f"unknown to transformers {transformers.__version__})"
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, KeyError) as e:
        line = " ".join(str(e).split())
        raise UsageError(f"CONFIG {text}: transformers builds no config of it ({line})") from None


@app.command(
    name="hf-config",
    epilog=example("fqr hf-config path/to/config.json", "fqr hf-config mistral --json"),
)
def hf_config(
    config: Annotated[
        str, typer.Argument(help="config.json, a checkpoint directory, or a model type")
    ],
    json_out: JsonOption = False,
):
    """Whether fqr builds a verified preset from a transformers config, or why not."""
    from fqr.hf import HF_FAMILIES
    from fqr.presets import Preset

    hf = load_config(config)
    try:
        preset = Preset.from_hf_config(hf)
    except (ValueError, TypeError) as e:
        refusal = " ".join(str(e).split())
        if json_out:
            doc = {"schema": schema("hf-config"), "ok": False, "refused": refusal}
            out.print_json(json.dumps(doc))
        else:
            out.print(f"refused: {refusal}", markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED) from None
    family = HF_FAMILIES[hf.get_text_config().model_type]
    if json_out:
        doc = {
            "schema": schema("hf-config"),
            "ok": True,
            "model_type": hf.get_text_config().model_type,
            "variant": preset.variant,
            "numerics": family.numerics,
            "summary": preset.summary,
        }
        out.print_json(json.dumps(doc))
        return
    out.print(
        f"supported: {preset.summary} (bit for bit with transformers under numerics "
        f"{family.numerics!r}; {family.note})",
        markup=False,
        highlight=False,
    )
