"""The per-call fast path of the declared ops: the kept calls (:class:`CheckedCall`), their
generated entries and the declaration's fast entry (:func:`_fast_entry`), and what every run
of a declared op does after its launch, whatever the backend: the autograd version counter of
every tensor it wrote in place is advanced (:func:`wrote_in_place`).

A declaration (:class:`fqr.prologue.declare.Declaration`) makes its fast entry here and keeps
a :class:`CheckedCall` per static arguments and tensor metadata that passed its checks; the
kinds of its tensor arguments (:class:`fqr.prologue.declare.TensorKind`) say which of their
hooks the generated source must call (``reads_values``, ``guards_itself``,
``passes_through``). This module imports nothing of the declaration machinery (only its
types, for annotations): :mod:`fqr.prologue.declare` stands on it.

**Autograd, one policy for every backend.** A kernel (interpreted or compiled) writes a
donated cache, ``q`` rotated in place, an ``out=`` buffer through its pointer, which torch
does not see; the reference backend writes through torch (``copy_``), which advances the
tensor's version counter. Every run of a kept call's entry (the first call and the fast
path, the host function's and the launcher's alike) ends with
``torch.autograd.graph.increment_version`` of each tensor the call wrote, so a backward that
saved one of them raises torch's "modified by an inplace operation" on every backend, instead
of running on overwritten values (an inference tensor has no counter: nothing to advance).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version

if TYPE_CHECKING:
    from ..core import Program
    from .declare import Call, Declaration

MAX_CHECKED_CALLS = 4096  # kept calls held across every op (a full table keeps no new key)
MAX_PER_KEY = 8  # kept calls per static arguments (the most recent first)
_KEPT = [0]  # kept calls held now, across every op


class _Miss:
    """What :func:`_fast_entry` returns when no kept call matches: the call's key (None: an
    argument is unhashable; the checks name it)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple | None):
        self.key = key


_NO_MATCH = object()  # what a kept call's entry returns for arguments it does not match


def _compiled(source: str, name: str, namespace: dict[str, Any], filename: str) -> Callable:
    """Function ``name`` of ``source`` (text fqr generated from its own declaration), compiled
    in memory into ``namespace``; never written to a file."""
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def _tuple_source(items: Sequence[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _fast_entry(decl: Declaration) -> Callable[[list], Any]:
    """The declaration's fast entry, generated as straight-line source: ``fast(values)`` (the
    arguments in parameter order) builds the call's key (every scalar argument, a list by its
    hashable stand-in, with its type; which tensors and unkeyed forms are given; the keys of
    arguments that are not plain tensors) and tries the kept calls of that key
    (:meth:`CheckedCall.enter`); the first that matches runs the call and its result is
    returned, else a :class:`_Miss` with the key."""
    namespace: dict[str, Any] = {"_CALLS": decl._calls, "_Miss": _Miss, "_NO_MATCH": _NO_MATCH}
    lines = ["def fast(v):", "    try:"]
    key_of = dict(decl._key_of)
    statics = []
    for j, i in enumerate(decl._keyed_at):
        if j in key_of:
            namespace[f"_KEY{j}"] = key_of[j]
            lines.append(f"        s{j} = _KEY{j}(v[{i}])")
        else:
            lines.append(f"        s{j} = v[{i}]")
        statics.append(f"s{j}")
    parts = [
        _tuple_source(statics),
        _tuple_source([f"type({s})" for s in statics]),
        _tuple_source([f"v[{i}] is None" for i in decl._presence_at]),
    ]
    for i, kind in decl._complex:
        namespace[f"_KIND{i}"] = kind
        parts.append(f"_KIND{i}.key(v[{i}])")
    lines += [
        f"        key = {_tuple_source(parts)}",
        "        kept = _CALLS.get(key)",
        "    except TypeError:  # an unhashable argument",
        "        return _Miss(None)",
        "    if kept:",
        "        for checked in kept:",
        "            result = checked.enter(v)",
        "            if result is not _NO_MATCH:",
        "                return result",
        "    return _Miss(key)",
    ]
    source = "\n".join(lines) + "\n"
    fast = _compiled(source, "fast", namespace, f"<fqr {decl.name} fast entry>")
    fast.source = source  # type: ignore[attr-defined]
    return fast


class CheckedCall:
    """What a call whose arguments passed the checks needs on every later call with the same
    static arguments and tensor metadata, as one generated function, :attr:`enter`
    (straight-line source, :meth:`_entry`): the guard of that metadata (torch's C++
    ``TensorGuards``: dispatch keys, dtype, device, sizes and strides, the token dimension
    free; an argument that was the same tensor as an earlier one must be again, and is guarded
    once), the token counts, the per-call checks where the key has them, the program's
    operands, the run and the return value. For kernel backends the run is the generated host
    function of this metadata (:mod:`fqr.lowering.host`; one for new outputs, one for caller
    buffers), made after the first launch and remade when a new kernel variant is bound."""

    __slots__ = (
        "program",
        "launch",
        "backend",
        "per_call",
        "host",
        "enter",
        "source",
        "_host_builds",
    )

    MAX_HOST_BUILDS = 8

    def __init__(self, decl: Declaration, program: Program, backend, call: Call):
        self.program = program
        self.launch = backend.bind(program)
        self.backend = backend if backend.has_kernels else None
        present = [
            (p, getattr(call, p.name))
            for p in decl.tensor_params
            if getattr(call, p.name) is not None
        ]
        on_host = any(t.device.type == "cpu" for p, x in present for t in p.kind.guard_tensors(x))
        reads_values = any(p.kind.reads_values() for p, _ in present)
        # the checks of values run every call where the values are on the host (CPU positions
        # and slots); the address and grad-mode checks (distinct caches, out= buffers) on every
        # call of the calls they apply to
        self.per_call = (
            (on_host and reads_values)
            or any(when(call) for when, _ in decl.value_checks)
            or bool(decl.written(call))
        )
        self.host: list = [None, None]
        self._host_builds = 0
        self.enter, self.source = self._entry(decl, call, present)

    def _entry(self, decl: Declaration, call: Call, present: list) -> tuple[Callable, str]:
        """Generate :attr:`enter`: ``enter(values, checked=False)`` returns the call's result,
        or ``_NO_MATCH`` where ``values`` do not match (``checked``: the full checks just ran
        on them; no guard, no per-call checks)."""
        from torch._C._dynamo.guards import TensorGuards

        ns: dict[str, Any] = {
            "_NO_MATCH": _NO_MATCH,
            "_DECL": decl,
            "_HOST": self.host,
            "_GENERAL": self.general,
        }
        lines = ["def enter(v, checked=False):", "    if not checked:"]
        body: list[str] = []
        # the guard tensors: each present argument's, named g0, g1, ...
        entries: list[tuple] = []
        names: list[str] = []
        owners: dict[str, list[str]] = {}  # each present argument's guard tensors' names
        for p, x in present:
            i = decl.index[p.name]
            found = p.kind.guard_entries(x)
            these = [f"g{len(names) + k}" for k in range(len(found))]
            if p.kind.guards_itself():
                body.append(f"{these[0]} = v[{i}]")
            else:
                ns[f"_KIND{i}"] = p.kind
                body.append(f"{', '.join(these)}, = _KIND{i}.guard_tensors(v[{i}])")
            entries += found
            names += these
            owners[p.name] = these
        # a tensor given twice (tied weights) is guarded once, and must be given twice again
        first_of: dict[int, str] = {}
        same: list[str] = []
        distinct: list[int] = []
        for k, entry in enumerate(entries):
            seen = first_of.get(id(entry[0]))
            if seen is None:
                first_of[id(entry[0])] = names[k]
                distinct.append(k)
            else:
                same.append(f"{names[k]} is {seen}")
        ns["_GUARD"] = TensorGuards(
            *(entries[k][0] for k in distinct),
            dynamic_dims_sizes=[entries[k][1] for k in distinct],
            dynamic_dims_strides=[entries[k][2] for k in distinct],
        )
        guard = f"_GUARD.check({', '.join(names[k] for k in distinct)})"
        body.append(f"if not ({' and '.join([*same, guard])}):")
        body.append("    return _NO_MATCH")
        lines += ["        try:"] + ["            " + b for b in body]
        lines += [
            "        except (TypeError, RuntimeError, ValueError):  # not tensors where they were",
            "            return _NO_MATCH",
        ]
        # the token counts: each token-indexed tensor's T the first one's, T in the class --
        # 0, 1, more -- the checks saw
        token_sizes = [
            f"{names[k]}.shape[{e[3]}]" for k, e in enumerate(entries) if e[3] is not None
        ]
        if token_sizes:
            lines.append(f"        T = {token_sizes[0]}")
            tokens_class = min(call._tokens, 2)
            first_test = f"T != {tokens_class}" if tokens_class < 2 else "T < 2"
            tests = [first_test] + [f"{size} != T" for size in token_sizes[1:]]
            lines.append(f"        if {' or '.join(tests)}:")
            lines.append("            return _NO_MATCH")
        anchor_at = decl.index[decl._anchor]
        if self.per_call:
            lines += [
                "        call = _DECL.bound(v)",
                f"        call._tokens = v[{anchor_at}].shape[0]",
            ]
            lines += [
                "        " + b
                for b in _per_call_source(decl, call, ns, dict(zip(names, entries)), owners)
            ]
            lines += ["    else:", "        call = None"]
        else:
            lines += ["    call = None"]
        # each program operand: the argument, viewed as the dtype the key and guard fix, then
        # expanded by its kind where it gives other tensors than itself
        operands = []
        for p in decl.tensor_params:
            if not decl.used(p, call):
                continue
            i = decl.index[p.name]
            x = f"v[{i}]"
            view = p.kind.viewed_as(getattr(call, p.name), call)
            if view is not None:
                ns[f"_VIEW{i}"] = view
                x = f"{x}.view(_VIEW{i})"
            if p.kind.passes_through():
                operands.append(x)
            else:
                ns[f"_KIND{i}"] = p.kind
                operands.append(f"*_KIND{i}.operands({x})")
        lines.append(f"    args = [{', '.join(operands)}]")
        if decl._out is not None or decl._returns is not None:
            lines.append("    if call is None:")
            lines.append("        call = _DECL.bound(v)")
        if decl._out is None:
            lines += [
                "    host = _HOST[0]",
                "    outs = None if host is None else host.fn(args)",
                "    if outs is None:",
                "        outs = _GENERAL(args, None)",
            ]
        else:
            ns["_OUT"] = decl._out
            lines += [
                "    out = _OUT(call)",
                "    host = _HOST[out is not None]",
                "    outs = None",
                "    if host is not None:",
                "        outs = host.fn(args) if out is None else host.fn(args, out)",
                "    if outs is None:",
                "        outs = _GENERAL(args, out)",
            ]
        lines += _written_source(decl, call, ns)
        donated = self.program.aliases()
        kept = [j for j in range(len(self.program.outputs)) if j not in donated]
        if donated:
            lines.append(f"    outs = {_tuple_source([f'outs[{j}]' for j in kept])}")
        if decl._returns is not None:
            ns["_RETURNS"] = decl._returns
            lines.append("    return _RETURNS(call, outs)")
        elif len(kept) == 1:
            lines.append("    return outs[0]")
        else:
            lines.append("    return outs")
        source = "\n".join(lines) + "\n"
        return _compiled(source, "enter", ns, f"<fqr {decl.name} kept call>"), source

    def keep(self, decl: Declaration, key: tuple) -> None:
        """Keep this call first among ``key``'s (at most ``MAX_PER_KEY``: the oldest goes).
        The budget counts the kept calls held: a new one is kept while fewer than
        ``MAX_CHECKED_CALLS`` are, one that replaces the oldest of a full key always."""
        with decl._lock:
            kept = decl._calls.get(key, [])
            if len(kept) < MAX_PER_KEY and _KEPT[0] >= MAX_CHECKED_CALLS:
                return
            held = [self, *kept][:MAX_PER_KEY]
            decl._calls[key] = held
            _KEPT[0] += len(held) - len(kept)

    def general(self, args: list, out: list | None = None) -> tuple:
        """Run on ``args`` (first: the token rows), into ``out`` when given, where the generated
        host function does not cover the call (or there is none yet): no tokens, empty outputs
        and no launch; else the backend's launch, after which the host function is made (and
        remade when a new kernel variant was bound)."""
        rows = args[0]
        if rows.shape[0] == 0:
            if out is not None:
                return tuple(out)
            aliases = self.program.aliases()
            return tuple(
                args[aliases[i]]
                if i in aliases
                else torch.empty(0, v.aval.shape[1], dtype=v.aval.dtype, device=rows.device)
                for i, v in enumerate(self.program.outputs)
            )
        with _on_device(rows.device):  # the host function returns None on another device
            outs = tuple(self.launch(args) if out is None else self.launch(args, out))
        if self.backend is not None and self._host_builds < self.MAX_HOST_BUILDS:
            bound = self.backend.bound_kernels(self.program)
            host = self.host[out is not None]
            if host is None or host.bound != bound:
                self._host_builds += 1
                self.host[out is not None] = self.backend.host_function(self.program, args, out)
        return outs


def _per_call_source(
    decl: Declaration, call: Call, ns: dict[str, Any], entries: dict[str, tuple], owners: dict
) -> list[str]:
    """The lines of a kept call's entry that run :meth:`Declaration.per_call`'s checks for the
    calls of ``call``'s key, straight-line: each kind's check of values, each value check,
    then the writes' check. Where only donated arguments are written and every tensor's span
    is a function of T (the guard fixes the other sizes and the strides), the spans (first to
    last byte) are compared inline, and only where a written tensor's span meets another's
    does :meth:`Declaration.check_writes` run (which decides, and names the pair); else it
    runs every call. ``entries``: each guard tensor's name in the source to its guard entry;
    ``owners``: each present argument's guard tensor names."""
    checks = decl.per_call_checks(call)
    lines = []
    for p in checks.kinds:
        i = decl.index[p.name]
        ns[f"_KIND{i}"] = p.kind  # the method is looked up each call (tests wrap it)
        lines.append(f"_KIND{i}.per_call({p.name!r}, v[{i}], call)")
    for k, check in enumerate(checks.value_checks):
        ns[f"_VALUE_CHECK{k}"] = check
        lines.append(f"_VALUE_CHECK{k}(call)")
    written = [p for p in decl.tensor_params if p.donated and getattr(call, p.name) is not None]
    if not written and decl._writes is None:
        return lines
    ns["_READ"] = checks.read
    full = ["_DECL.check_writes(call, _READ)"]
    spans = {
        name: _span_source(name, entry)
        for p in {*checks.read, *written}
        for name in owners[p.name]
        for entry in (entries[name],)
    }
    if decl._writes is not None or call._tokens == 0 or None in spans.values():
        return lines + full
    written_names = [(p.name, name) for p in written for name in owners[p.name]]
    others = [(p.name, name) for p in checks.read for name in owners[p.name]]
    pairs = list(
        dict.fromkeys(
            (w, u) if w < u else (u, w)  # each pair once (a written argument is read too)
            for k, (argument, w) in enumerate(written_names)
            for other, u in others + written_names[:k]
            if other != argument and spans[w] != "" and spans[u] != ""
        )
    )
    for name in dict.fromkeys(n for pair in pairs for n in pair):
        lines.append(f"s_{name} = {name}.data_ptr()")
        lines.append(f"e_{name} = s_{name} + {spans[name]}")
    if pairs:
        meets = " or ".join(f"(s_{u} <= e_{w} and s_{w} <= e_{u})" for w, u in pairs)
        lines += [f"if {meets}:", "    " + full[0]]
    return lines


def _span_source(name: str, entry: tuple) -> str | None:
    """The offset of guard tensor ``name``'s last byte from its first (:func:`byte_span`) as
    source: the sizes the guard fixes as numbers, T at the token dim, another free size read
    from the tensor; ``""`` for a tensor empty at every call, None where the guard leaves a
    stride free. (A free size of 0 gives a span that ends before it starts: at worst the
    exact check runs.)"""
    tensor, sizes, strides, token_dim = entry
    if None in strides:
        return None
    if 0 in sizes:
        return ""
    size = tensor.element_size()
    fixed = size - 1
    terms = []
    for d, (n, st) in enumerate(zip(sizes, strides)):
        if n is not None:
            fixed += size * (n - 1) * st
        elif st:
            fixed -= size * st
            terms.append(f"{size * st} * {'T' if d == token_dim else f'{name}.shape[{d}]'}")
    return " + ".join([str(fixed), *terms])


def _on_device(device: torch.device):
    """A context making ``device`` the current one of its type where it is not (a launch takes
    the current device's stream); nothing for CPU and meta tensors."""
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    module = torch.get_device_module(device)
    if module.current_device() == device.index:
        return contextlib.nullcontext()
    return module.device(device)


def wrote_in_place(tensors: Sequence[torch.Tensor]) -> None:
    """Advance the autograd version counter of each tensor a run wrote in place (module
    docstring): torch's own in-place ops do it; a kernel's stores through a pointer do not."""
    increment_version(list(tensors))


def _written_source(decl: Declaration, call: Call, ns: dict[str, Any]) -> list[str]:
    """The lines of a kept call's entry, after the run, that advance the version counter of
    every tensor the call wrote (:func:`wrote_in_place`): the donated arguments the key has
    (fixed by it), then the declaration's ``writes(call)`` (``out=`` buffers, qkv under
    ``inplace``), read each call."""
    donated = [
        f"v[{decl.index[p.name]}]"
        for p in decl.tensor_params
        if p.donated and getattr(call, p.name) is not None
    ]
    if not donated and decl._writes is None:
        return []
    ns["_WROTE"] = wrote_in_place
    lines = []
    if decl._writes is not None:
        ns["_WRITES"] = decl._writes
        lines += ["    if call is None:", "        call = _DECL.bound(v)"]
        donated.append("*[t for _, t in _WRITES(call)]")
    lines.append(f"    _WROTE([{', '.join(donated)}])")
    return lines
