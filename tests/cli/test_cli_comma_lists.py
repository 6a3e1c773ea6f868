"""Options that take a comma list (``--dtype bf16,fp16``) complete each item in the shell
(:func:`fqr_cli.options.comma_list`): the items typed so far stay, the last one is completed
from the choices not given yet."""

from __future__ import annotations

import typing

import pytest
from fqr_cli.bench import bench
from fqr_cli.verify import verify

from fqr.backends import BACKENDS
from fqr.presets import PRESETS


def _completion(command, name: str):
    (option,) = typing.get_type_hints(command, include_extras=True)[name].__metadata__
    return option.autocompletion


@pytest.mark.parametrize(
    "command, name, typed, expected",
    [
        (bench, "dtype", "bf16,f", ["bf16,fp16", "bf16,fp32"]),
        (bench, "compare", "eager,no", ["eager,none"]),
        (
            bench,
            "preset",
            "qwen3-8b,deepseek-v3-q",
            ["qwen3-8b,deepseek-v3-q-rope", "qwen3-8b,deepseek-v3-q-rope-fp8"],
        ),
        (verify, "backend", "reference,inter", ["reference,interpret"]),
    ],
)
def test_each_item_of_a_comma_list_completes(command, name, typed, expected):
    assert _completion(command, name)(typed) == expected


def test_completion_offers_only_choices_not_given_yet():
    complete = _completion(verify, "backend")
    offered = complete("reference,")
    assert offered == [f"reference,{b}" for b in BACKENDS if b != "reference"]
    assert len(_completion(bench, "preset")("")) == len(PRESETS)


def test_token_counts_have_no_completion():
    assert _completion(bench, "tokens") is None
