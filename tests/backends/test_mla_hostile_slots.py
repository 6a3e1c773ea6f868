"""The MLA cache APIs on out-of-range, duplicated and aliased slots, caches and scales (issue
41.4): ``fqr.mla_cache_insert`` (one cache and FlashInfer's two) and
``fqr.split_mla_rmsnorm_rope_cache``, on the reference backend and the interpreted kernel, on a
first call and on the kept call's fast path (after a good call of the same key): every
refusal is one line naming the argument, raised before anything is written (the caches byte
for byte as they were). The checks are the ones every declared op shares (one home:
``fqr.validate.check_slots_in_range`` for the slots, ``Declaration.check_writes`` for the
memory, the ``Scale`` kind for scales); a slot named twice was stored in an order no backend
promises (the interpreter's last program, the reference's last token) and is now refused."""

from __future__ import annotations

import pytest
import torch
from support.mla_widths import insert_call, prologue_call

from fqr.backends import BACKENDS

BACKEND_NAMES = ["reference"] + (["interpret"] if BACKENDS["interpret"].available else [])


def _insert(gen, backend):
    return insert_call(gen, 96, 32, 4, "fp8", tokens=4, short=False, backend=backend)


def _two(gen, backend):
    return insert_call(gen, 96, 32, 4, "fp8_e5m2", tokens=4, short=False, two_caches=True,
                       backend=backend)  # fmt: skip


def _prologue(gen, backend):
    return prologue_call(gen, 96, 32, 4, "auto", tokens=4, backend=backend)


OPS = {"mla_cache_insert": _insert, "two caches": _two, "prologue": _prologue}


def _rows(call):
    return "kv_c" if "kv_c" in call.args else "kv_a"


def _slots_past(call):
    cache = call.args["kv_cache"]
    return {"slot_mapping": torch.tensor([0, cache.shape[0] * cache.shape[1], 1, -1])}


def _slots_far(call):
    return {"slot_mapping": torch.tensor([0, 10**12, 1, -1])}


def _slots_twice(call):
    return {"slot_mapping": torch.tensor([2, -1, 5, 2])}


def _rows_in_cache(call):
    """The token rows (kv_c / kv_a) a view of the cache's own memory."""
    name = _rows(call)
    rows = call.args[name]
    cache = call.args["kv_cache"]
    flat = cache.view(-1).view(torch.uint8).view(rows.dtype)
    return {name: flat[: rows.numel()].view(rows.shape)}


def _k_pe_in_cache(call):
    if "k_pe" not in call.args:
        return None
    k_pe, cache = call.args["k_pe"], call.args["kv_cache"]
    flat = cache.view(-1).view(torch.uint8).view(k_pe.dtype)
    return {"k_pe": flat[-k_pe.numel() :].view(k_pe.shape)}


def _kpe_cache_is_kv_cache(call):
    if call.args.get("kpe_cache") is None:
        return None
    kv = call.args["kv_cache"]
    kpe = call.args["kpe_cache"]
    return {"kpe_cache": kv.view(-1)[: kpe.numel()].view(kpe.shape)}


def _scale_in_cache(call):
    name = "k_scale" if "k_scale" in call.args else "scale"
    if call.args.get(name) is None:
        return None
    cache = call.args["kv_cache"]
    inside = cache.view(-1).view(torch.uint8)[:4].view(torch.float32)
    inside.copy_(torch.tensor([0.5]).view(torch.uint8).view(torch.float32))  # a good value
    return {name: inside.reshape(())}


CHANGES = {
    "slot past the cache": (_slots_past, ("slot_mapping",)),
    "slot 10**12": (_slots_far, ("slot_mapping",)),
    "slot named twice": (_slots_twice, ("slot_mapping",)),
    "token rows inside the cache": (_rows_in_cache, ("kv_cache",)),
    "k_pe inside the cache": (_k_pe_in_cache, ("kv_cache",)),
    "kpe_cache aliasing kv_cache": (_kpe_cache_is_kv_cache, ("kpe_cache", "kv_cache")),
    "scale inside the cache": (_scale_in_cache, ("kv_cache", "scale", "k_scale")),
}


@pytest.mark.parametrize("warm", [False, True], ids=["first call", "fast path"])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("op", OPS)
def test_a_hostile_slot_or_alias_is_refused_before_anything_is_written(
    gen, op, change, backend, warm
):
    call = OPS[op](gen, backend)
    make, names = CHANGES[change]
    if warm:
        call.run()  # a good call of the same key: the hostile one takes its entry
    hostile = make(call)
    if hostile is None:
        pytest.skip(f"{op} has no such argument")
    args = dict(call.args, **hostile)
    caches = {n: args[n] for n in ("kv_cache", "kpe_cache") if args.get(n) is not None}
    before = {n: c.view(torch.uint8).clone() for n, c in caches.items()}
    with pytest.raises((ValueError, TypeError)) as info:
        call.op(**args)
    message = str(info.value)
    assert "\n" not in message and any(message.startswith(n) for n in names), message
    for n, c in caches.items():
        assert torch.equal(c.view(torch.uint8), before[n]), f"{n} was written"
