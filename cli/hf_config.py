"""``fqr hf-config``: whether fqr builds a verified preset from a transformers config.

``CONFIG`` is a ``config.json`` file, a checkpoint directory holding one, or a transformers
model type (its default config). Prints the preset ``Preset.from_hf_config`` builds (its
variant and the numerics mode in which fqr's op equals the model's transformers code bit for
bit, as ``tests/core/test_hf_zoo.py`` checks for every family), or the one line fqr refuses it
with. Exit 0 supported, 1 refused (a valid config fqr has no form for:
:class:`fqr.hf.UnsupportedConfig`), 2 bad input, one line naming the argument or the config key
(no such file, not a regular file or over 16 MiB, not JSON or nested too deeply, an unknown
model type, a value transformers or fqr finds invalid: a head count of 0, a theta beyond every
float, a key missing).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated

import typer

from fqr.text import printable

from .common import EXIT_FAILED, UsageError, app, example, out, schema
from .options import JsonOption

# A config.json is a few KB (the largest, with label maps, well under 1 MiB): a file over this
# is refused, not read (a link to /dev/zero read without bound before)
MAX_CONFIG_BYTES = 16 << 20
# Nesting a config never comes near (text_config -> rope_parameters -> a list): deeper is refused
# before transformers copies it recursively (200,000 levels: a RecursionError before)
MAX_CONFIG_DEPTH = 32
# The counts fqr reads, checked before transformers divides by them or builds a list per layer
# (0 heads: a ZeroDivisionError in LlamaConfig; "16" or NaN: a strict-dataclass traceback)
COUNT_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "q_lora_rank",
)
MAX_COUNT = {"num_hidden_layers": 1 << 16}  # transformers builds a list per layer
MAX_COUNT_DEFAULT = (1 << 31) - 1
# Keys whose value transformers takes only as a dict (or null)
DICT_KEYS = ("rope_scaling", "rope_parameters", "text_config")


def _read(path: Path, text: str) -> bytes:
    """The bytes of the config file ``path`` (named ``text``): a regular file (a FIFO would
    block forever, a device read without bound) of at most :data:`MAX_CONFIG_BYTES`."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"CONFIG {text}: not a regular file (a config.json is one)")
        if st.st_size > MAX_CONFIG_BYTES:
            raise UsageError(
                f"CONFIG {text}: {st.st_size} bytes, over the {MAX_CONFIG_BYTES} a config.json "
                f"may have"
            )
        # O_NONBLOCK: a file swapped for a FIFO after the check does not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UsageError(f"CONFIG {text}: not a regular file (a config.json is one)")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UsageError(f"CONFIG {text}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(f"CONFIG {text}: over the {MAX_CONFIG_BYTES} bytes a config.json may have")
    return data


def _depth_key(values: dict) -> str | None:
    """The top-level key under which ``values`` nests deeper than :data:`MAX_CONFIG_DEPTH`
    (iteratively: no recursion on hostile input), or None."""
    for key, value in values.items():
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if depth > MAX_CONFIG_DEPTH:
                return key
            if isinstance(item, dict):
                stack += [(v, depth + 1) for v in item.values()]
            elif isinstance(item, list):
                stack += [(v, depth + 1) for v in item]
    return None


def _check_values(values: dict, text: str, where: str = "config") -> None:
    """The keys fqr reads that transformers would fail on with a traceback (or a hang): each
    refused naming it (``config.num_attention_heads``; ``config.text_config.head_dim``)."""
    for key in COUNT_KEYS:
        value = values.get(key)
        if value is None:
            continue
        bound = MAX_COUNT.get(key, MAX_COUNT_DEFAULT)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            shown = value if not isinstance(value, int) or abs(value) < 10**30 else "a huge int"
            raise UsageError(
                f"CONFIG {text}: {where}.{key} must be an int in [1, {bound}], got {shown!r}"
            )
    for key in DICT_KEYS:
        value = values.get(key)
        if value is not None and not isinstance(value, dict):
            raise UsageError(
                f"CONFIG {text}: {where}.{key} must be a dict (or null), got "
                f"{type(value).__name__} {value!r}"[:300]
            )
    if isinstance(values.get("text_config"), dict):
        _check_values(values["text_config"], text, f"{where}.text_config")


def load_config(text: str):
    """The transformers config ``text`` names (module docstring); a UsageError naming it (or
    the key it stops at)."""
    import transformers

    shown = printable(text)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        data = _read(path, shown)
        try:
            values = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UsageError(f"CONFIG {shown}: not UTF-8 ({e.reason} at byte {e.start})") from None
        except RecursionError:
            raise UsageError(f"CONFIG {shown}: nested too deeply to be a config") from None
        except ValueError as e:
            raise UsageError(f"CONFIG {shown}: not JSON ({e})") from None
        if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
            raise UsageError(f"CONFIG {shown}: a transformers config.json has a model_type")
        deep = _depth_key(values)
        if deep is not None:
            raise UsageError(
                f"CONFIG {shown}: config.{printable(deep)} nests deeper than "
                f"{MAX_CONFIG_DEPTH} levels (a config never does)"
            )
        _check_values(values, shown)
        model_type = values.pop("model_type")
    else:
        model_type, values = text, {}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"CONFIG {shown}: transformers builds no config of it (model_type "
            f"{model_type!r} unknown to transformers {transformers.__version__})"
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # noqa: BLE001 - whatever a config class raises on what it was given
        line = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(
            f"CONFIG {shown}: transformers builds no config of it ({line[:400]})"
        ) from None


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
    from fqr.hf import HF_FAMILIES, UnsupportedConfig
    from fqr.presets import Preset

    hf = load_config(config)
    try:
        preset = Preset.from_hf_config(hf)
    except UnsupportedConfig as e:
        refusal = " ".join(str(e).split())
        if json_out:
            doc = {"schema": schema("hf-config"), "ok": False, "refused": refusal}
            out.print_json(json.dumps(doc))
        else:
            out.print(f"refused: {printable(refusal)}", markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED) from None
    except (ValueError, TypeError) as e:  # not a valid config: a value out of range, a key missing
        line = " ".join(str(e).split())
        raise UsageError(f"CONFIG {printable(config)}: {line}") from None
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
    # the summary holds the checkpoint's name as the config gives it (_name_or_path): escaped
    out.print(
        printable(
            f"supported: {preset.summary} (bit for bit with transformers under numerics "
            f"{family.numerics!r}; {family.note})"
        ),
        markup=False,
        highlight=False,
    )
