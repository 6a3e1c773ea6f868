"""vLLM's own MLA calls with ``scale`` (issue 41.2). vLLM's MLA backends call, whatever the
cache dtype (``vllm/v1/attention/backends/mla/common.py``)::

    ops.concat_and_cache_mla(k_c_normed, k_pe.squeeze(1), kv_cache, slot_mapping,
                             kv_cache_dtype=self.kv_cache_dtype, scale=layer._k_scale)

and vLLM's kernel tests pass ``scale=torch.tensor(0.1)`` ('auto', 'fp8') and
``scale=torch.tensor(1.0)`` ('fp8_ds_mla'). vLLM reads the scale for the per-tensor FP8 names
and ignores it for 'auto' (a copy) and 'fp8_ds_mla' (each tile's scale is computed in the
kernel). fqr refused a scale there; now it takes the same argument lists and does what vLLM
does: the ignored scale changes no byte (its value is not read), a read one is the
per-tensor scale. A bad scale is refused naming it and every dtype that takes one."""

from __future__ import annotations

import pytest
import torch
from support.mla_widths import CACHE_DTYPES, FP8_NAMES, check_caches, insert_call, prologue_call

import fqr
from fqr.backends import BACKENDS

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])
IGNORED = ("auto", "fp8_ds_mla")


def _dtype(name):
    return torch.float16 if name == "fp8_ds_mla" else torch.bfloat16


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_vllms_backend_call_runs_for_every_dtype(gen, name, backend):
    """The MLA backend's keyword call with ``scale=layer._k_scale`` (a 0-dim float32 tensor)
    for every kv_cache_dtype: it runs and stores the float64 entry; where vLLM ignores the
    scale, the bytes are those of the call without one."""
    call = insert_call(gen, 512, 64, 16, name, dtype=_dtype(name), tokens=4, backend=backend,
                       scale="vllm")  # fmt: skip
    a = call.args
    kv_cache = a["kv_cache"].clone()
    layer_k_scale = a["scale"]
    assert layer_k_scale.dim() == 0 and layer_k_scale.dtype == torch.float32
    fqr.mla_cache_insert(a["kv_c"], a["k_pe"], kv_cache, a["slot_mapping"],
                         kv_cache_dtype=name, scale=layer_k_scale, backend=backend)  # fmt: skip
    check_caches(call, {"kv_cache": kv_cache})
    if name in IGNORED:
        _, without = call.run(scale=None)
        assert torch.equal(kv_cache, without["kv_cache"])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name,scale", [("auto", 0.1), ("fp8", 0.1), ("fp8_ds_mla", 1.0)])
def test_vllms_kernel_test_argument_lists(gen, name, scale, backend):
    """vLLM's ``test_concat_and_cache_mla`` / ``test_concat_and_cache_ds_mla``: positional
    ``(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)`` with ``torch.tensor(0.1)``
    ('auto', 'fp8'; an FP8 cache as uint8 bytes) and ``torch.tensor(1.0)`` ('fp8_ds_mla')."""
    call = insert_call(gen, 512, 64, 16, name, dtype=_dtype(name), tokens=4, backend=backend,
                       scale=None)  # fmt: skip
    a = call.args
    vllm_scale = torch.tensor(scale, dtype=torch.float32)
    kv_cache = a["kv_cache"].clone()
    fqr.mla_cache_insert(a["kv_c"], a["k_pe"], kv_cache, a["slot_mapping"], name, vllm_scale,
                         backend=backend)  # fmt: skip
    read = dict(call.args, scale=vllm_scale)
    check_caches(type(call)(call.op, read, call.width, call.rope, name), {"kv_cache": kv_cache})


@pytest.mark.parametrize("name", IGNORED)
def test_an_ignored_scale_is_never_read(gen, name):
    """Where vLLM ignores the scale its value is not read (0, NaN, another value: the same
    bytes as without one), on the first call and on the kept call's fast path."""
    call = insert_call(gen, 512, 64, 16, name, dtype=_dtype(name), tokens=4, scale=None)
    _, want = call.run()
    for value in (0.37, 0.0, float("nan"), float("inf")):
        for _ in range(2):  # the second call takes the kept call's entry
            _, got = call.run(scale=torch.tensor(value))
            assert torch.equal(got["kv_cache"], want["kv_cache"]), value


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", ["auto", "fp8_ds_mla", "fp8", "fp8_e5m2"])
def test_the_prologue_takes_k_scale_with_every_cache(gen, name, backend):
    """split_mla_rmsnorm_rope_cache takes ``k_scale`` with every cache too: read by an FP8
    cache, ignored by a model-dtype or fp8_ds_mla one (the same bytes as without it)."""
    call = prologue_call(gen, 512, 64, 16, name, dtype=_dtype(name), tokens=3, backend=backend)
    scale = torch.tensor(0.02)
    result, caches = call.run(k_scale=scale)
    if name in IGNORED:
        _, without = call.run(k_scale=None)
        assert torch.equal(caches["kv_cache"], without["kv_cache"])
    else:
        read = dict(call.args, k_scale=scale)
        check_caches(type(call)(call.op, read, call.width, call.rope, name), caches)


BAD_SCALES = [
    ("zero", torch.tensor(0.0), "finite and > 0"),
    ("negative", torch.tensor([-0.5]), "finite and > 0"),
    ("nan", torch.tensor(float("nan")), "finite and > 0"),
    ("inf", torch.tensor([float("inf")]), "finite and > 0"),
    ("two elements", torch.ones(2), "float32 tensor of shape"),
    ("float64", torch.ones((), dtype=torch.float64), "float32 tensor of shape"),
    ("not a tensor", 0.5, "must be a torch.Tensor"),
    ("meta", torch.ones((), device="meta"), "is on meta"),
]


@pytest.mark.parametrize("what,scale,says", BAD_SCALES, ids=[b[0] for b in BAD_SCALES])
@pytest.mark.parametrize("name", list(FP8_NAMES))
def test_a_bad_scale_is_refused_naming_every_dtype_that_takes_one(gen, name, what, scale, says):
    """A scale the call reads (an FP8 name) that is 0, negative, NaN, inf, of the wrong form,
    not a tensor or on another device: one line naming ``scale`` and every dtype that takes
    one, the cache byte for byte unchanged."""
    call = insert_call(gen, 96, 32, 16, name, tokens=3)
    cache = call.args["kv_cache"]
    before = cache.clone()
    with pytest.raises((ValueError, TypeError)) as info:
        fqr.mla_cache_insert(**dict(call.args, scale=scale))
    message = str(info.value)
    assert message.startswith("scale") and says in message and "\n" not in message, message
    if what != "meta":
        for dtype_name in FP8_NAMES:
            assert repr(dtype_name) in message, message
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_a_bad_k_scale_of_the_prologue_names_every_fp8_cache(gen):
    call = prologue_call(gen, 96, 32, 16, "fp8_e5m2", tokens=3)
    before = call.args["kv_cache"].clone()
    with pytest.raises(ValueError) as info:
        fqr.split_mla_rmsnorm_rope_cache(**dict(call.args, k_scale=torch.tensor(-1.0)))
    message = str(info.value)
    assert message.startswith("k_scale") and "float8_e5m2" in message, message
    assert all(repr(n) in message for n in FP8_NAMES), message
    assert torch.equal(call.args["kv_cache"].view(torch.uint8), before.view(torch.uint8))


def test_the_torch_op_takes_vllms_scale_with_auto(gen):
    """``torch.ops.fqr.mla_cache_insert`` (tensors first in its schema) with vLLM's scale."""
    call = insert_call(gen, 512, 64, 16, "auto", tokens=3, scale="vllm")
    a = call.args
    cache = a["kv_cache"].clone()
    torch.ops.fqr.mla_cache_insert(a["kv_c"], a["k_pe"], cache, a["slot_mapping"], a["scale"],
                                   kv_cache_dtype="auto")  # fmt: skip
    _, want = call.run(scale=None)
    assert torch.equal(cache, want["kv_cache"])
