"""Golden files: the bundled cases, their storage (``golden/manifest.json`` + one safetensors
file per case) and the check of a backend's outputs against them (what a case file holds and
its entry says: :mod:`fqr.golden_cases`).

Each case's expectations are the independent float64 formulation (:func:`fqr.reference.prologue`)
of its inputs; they are the same for ``numerics="fused"`` and ``"unfused"``, only the tolerance
differs (:func:`fqr.numerics.compare`).

**Storage.** Each case file holds its inputs in their own dtypes (``qkv``, ``positions``,
``q_weight``/``k_weight``, ``q_bias``/``k_bias``, ``q_sum_sq``/``k_sum_sq`` for a sharded
full-width norm), the rows of the RoPE table it uses (``cos_sin_rows``) with their indices
(``cos_sin_index``), and the expectations (``expected_q``/``expected_k`` float64, ``expected_v``
in the input dtype); a case of another variant, or of a projected form (``x``, ``w_qkv``,
``qkv_bias`` in place of ``qkv``), holds the variant's inputs by name and ``expected_<output>``,
each listed in its entry. :func:`load_case` rebuilds the full ``[max_position, R]`` table with
NaN in every row the case does not use, so a kernel that reads a wrong row fails loudly, and
(for cases with ``row_stride > width``) places qkv in a wider NaN-filled buffer. The manifest
records each case's parameters, tolerances and the sha256 of its file; a mismatch raises
:class:`GoldenCorrupt`. :func:`regen` rebuilds everything deterministically from each case's
seed (same bytes twice).
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .core import ACTIVATION_DTYPE_NAMES, DTYPE_NAMES, DTYPES, dtype_of
from .files import check_destination, write_file

# the cases' contents (PEER_FORMS, peer_kwargs and row_width re-exported: fqr.golden's API)
from .golden_cases import PEER_FORMS as PEER_FORMS
from .golden_cases import case_tensors, peer_kwargs, reads_positions, row_width, sparse_table
from .inputs import PrologueInputs
from .numerics import Comparison, compare, compare_kind
from .presets import PRESETS, PrologueSpec, get_preset
from .prologue import VARIANTS, CaseSpec, NormStats, get_variant, golden_cases
from .prologue.declare import NUMERICS
from .prologue.split_qkv import SPLIT_QKV
from .validate import NORM_KINDS, check_finite_scalar


def _bundled_golden_dir() -> Path:
    """Where the bundled goldens are: the repository's top-level ``golden/`` in a source
    checkout (or an editable install), else ``fqr/golden_data`` inside the installed package
    (the build maps ``golden/`` there: pyproject.toml ``[tool.setuptools.package-dir]``)."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "golden"
    if (checkout / MANIFEST).is_file():
        return checkout
    return package / "golden_data"


MANIFEST = "manifest.json"
GOLDEN_DIR = _bundled_golden_dir()
FORMAT = "fqr-golden/1"


class GoldenCorrupt(Exception):
    """A golden case cannot be used: its manifest entry is malformed, or its file is missing,
    not a regular file inside the golden directory, does not match the manifest's sha256, or
    does not hold the tensors the entry describes. The message names the file and the reason."""


class GoldenManifestError(ValueError):
    """The manifest as a whole cannot be read (missing, a symlink, not JSON, not this format)."""


# ----------------------------------------------------------------------------- the cases


# Each variant declares its golden cases (fqr.prologue, ``Variant.golden``); CASES is all of
# them, in the order the variants register.
CASES: tuple[CaseSpec, ...] = golden_cases()


def select_cases(pattern: str | None = None) -> list[CaseSpec]:
    """The case specs whose name matches the glob ``pattern`` (all when None)."""
    return [c for c in CASES if pattern is None or fnmatch.fnmatchcase(c.name, pattern)]


def _write_manifest(directory: Path, entries: list[dict]) -> None:
    doc = {"format": FORMAT, "cases": entries}
    write_file(directory / MANIFEST, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _read_regular_file(directory: Path, name: str) -> bytes:
    """The bytes of ``name`` inside ``directory``, opened without following a symlink (so
    nothing outside the directory is read). OSError (ELOOP for a symlink) otherwise."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_manifest(directory: Path | str = GOLDEN_DIR) -> list:
    """The manifest's case entries, as stored (check each with :func:`entry_problem`).

    Raises :class:`GoldenManifestError` naming the manifest when it cannot be read as a whole
    (FileNotFoundError when there is none)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no golden manifest at {path} (write one there with `fqr golden regen --dir "
            f"{Path(directory)}`, or leave --golden-dir out for the bundled goldens)"
        )
    try:
        data = _read_regular_file(Path(directory), MANIFEST)
    except OSError as e:
        why = "a symlink (refused: golden files are read only inside the golden directory)"
        raise GoldenManifestError(
            f"{path}: {why if e.errno == errno.ELOOP else e.strerror or e}"
        ) from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenManifestError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise GoldenManifestError(f"{path}: JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise GoldenManifestError(f"{path}: not a golden manifest (a JSON {type(doc).__name__})")
    if doc.get("format") != FORMAT:
        raise GoldenManifestError(
            f"{path}: unknown golden format {doc.get('format')!r} (want {FORMAT})"
        )
    if not isinstance(doc.get("cases"), list):
        raise GoldenManifestError(f"{path}: 'cases' must be a list of case entries")
    return doc["cases"]


# The largest RoPE table a case may ask for: load_case builds it whole, NaN in every row the
# case does not use, from the entry's max_position and the stored rows' width. At most the
# longest context of fqr's presets (Llama 4 Scout's 10M positions), and at most as many elements
# as that preset's table (a wider rotary_dim gets fewer rows): 5 GiB of fp32. A qkv row stride
# (the padded buffer load_case builds) is at most twice the row.
MAX_POSITION = max(p.max_position for p in PRESETS.values())
MAX_TABLE_ELEMENTS = max(p.max_position * p.rotary_dim for p in PRESETS.values())
MAX_ROW_STRIDE_FACTOR = 2

_STRING_FIELDS = ("name", "file", "sha256", "preset", "dtype", "numerics", "norm")
_POSITIVE_FIELDS = ("tp", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "row_stride")
_COUNT_FIELDS = ("tokens", "bytes", "max_position")
_BOOL_FIELDS = ("is_neox", "bias", "norm_stats")


def entry_problem(entry) -> str | None:
    """Why a manifest entry cannot be used, or None: every field :func:`load_case` and the CLI
    read, with its type and range, and a ``file`` that names a file inside the directory."""
    if not isinstance(entry, dict):
        return f"an entry must be a JSON object, got {type(entry).__name__} {entry!r:.40}"
    for group, ok, want in (
        (_STRING_FIELDS, lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        (_POSITIVE_FIELDS, lambda v: type(v) is int and v >= 1, "an integer >= 1"),
        (_COUNT_FIELDS, lambda v: type(v) is int and v >= 0, "an integer >= 0"),
        (_BOOL_FIELDS, lambda v: isinstance(v, bool), "true or false"),
    ):
        for key in group:
            if key not in entry:
                return f"missing {key!r}"
            if not ok(entry[key]):
                return f"{key!r} must be {want}, got {entry[key]!r:.40}"
    shown = _unprintable(entry)
    if shown is not None:
        return shown
    file = entry["file"]
    if file in (".", "..") or "/" in file or "\\" in file or os.path.isabs(file):
        return f"'file' must name a file inside the golden directory, got {file!r}"
    if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        return f"'sha256' must be 64 lowercase hex digits, got {entry['sha256']!r:.72}"
    for key, choices in (
        ("dtype", ACTIVATION_DTYPE_NAMES),
        ("numerics", NUMERICS),
        ("norm", NORM_KINDS),
        ("positions_dtype", ("int32", "int64")),
    ):
        if entry.get(key) not in choices:
            return f"{key!r} must be one of {', '.join(choices)}, got {entry.get(key)!r:.40}"
    try:
        check_finite_scalar("'eps'", entry.get("eps"), positive=True)
        check_finite_scalar("'weight_offset'", entry.get("weight_offset"))
    except (TypeError, ValueError) as e:
        return str(e)
    variant = entry.get("variant", SPLIT_QKV.name)
    if variant not in VARIANTS:
        return f"'variant' must be one of {', '.join(VARIANTS)}, got {variant!r:.40}"
    problem = _projected_problem(entry, variant)
    if problem is not None:
        return problem
    row_case = is_row_case(entry)
    outputs = ("q", "k", "v")
    if not row_case:
        try:
            outputs = VARIANTS[variant].outputs_of(get_preset(entry["preset"], entry["tp"]))
        except (KeyError, ValueError) as e:
            return f"'preset': {e}"
        if entry.get("outputs") != list(outputs):
            got = entry.get("outputs")
            return f"'outputs' must be {list(outputs)} (variant {variant}), got {got!r:.60}"
        kinds = entry.get("tolerance_kinds")
        if not (isinstance(kinds, dict) and all(isinstance(kinds.get(k), str) for k in outputs)):
            return f"'tolerance_kinds' must map {', '.join(outputs)} to a kind, got {kinds!r:.60}"
        tensors = entry.get("tensors")
        if not (
            isinstance(tensors, dict)
            and all(
                isinstance(v, list)
                and len(v) == 2
                and v[0] in DTYPES
                and isinstance(v[1], list)
                and all(type(n) is int and n >= 0 for n in v[1])
                for v in tensors.values()
            )
        ):
            return f"'tensors' must map names to [dtype, shape], got {tensors!r:.60}"
    tol = entry.get("tolerance")
    if not (isinstance(tol, dict) and all(isinstance(tol.get(k), str) for k in outputs)):
        return f"'tolerance' must map {', '.join(outputs)} to text, got {tol!r:.60}"
    problem = _peer_problem(entry)
    if problem is not None:
        return problem
    width = row_width(entry)
    if row_case and entry["row_stride"] < width:
        return f"'row_stride' {entry['row_stride']} is smaller than the qkv width {width}"
    if entry["rotary_dim"] % 2 or entry["rotary_dim"] > entry["head_dim"]:
        return f"'rotary_dim' {entry['rotary_dim']} must be even and at most 'head_dim'"
    if entry["max_position"] < 1:
        return "'max_position' must be >= 1"
    if entry["max_position"] > MAX_POSITION:
        return (
            f"'max_position' {entry['max_position']} is beyond {MAX_POSITION}, the longest "
            "context of fqr's presets (the case's RoPE table is built whole)"
        )
    if row_case and entry["row_stride"] > MAX_ROW_STRIDE_FACTOR * width:
        return (
            f"'row_stride' {entry['row_stride']} is more than {MAX_ROW_STRIDE_FACTOR}x the qkv "
            f"width {width}"
        )
    try:
        preset = get_preset(entry["preset"], entry["tp"])
    except (KeyError, ValueError) as e:
        return f"'preset': {e}"
    if variant != preset.variant:
        return f"'variant' {variant} is not the variant of preset {preset.name} ({preset.variant})"
    if variant != SPLIT_QKV.name:
        try:
            VARIANTS[variant].check(preset)
        except ValueError as e:
            return f"'variant': {e}"
    return None


def is_row_case(entry: dict) -> bool:
    """Whether an entry is a split-qkv case of the packed row (a :class:`GoldenCase`, stored
    as ``qkv`` and the norm's tensors); every other case (another variant, a projected form) is
    a :class:`VariantCase` whose entry records its tensors."""
    return entry.get("variant", SPLIT_QKV.name) == SPLIT_QKV.name and "projected" not in entry


def _projected_problem(entry: dict, variant: str) -> str | None:
    """Why an entry's optional "projected" field (a case of the variant's projected form:
    ``{"hidden": K, "qkv_bias": bool}``) is unusable, or None."""
    if "projected" not in entry:
        return None
    form = entry["projected"]
    if not (
        isinstance(form, dict)
        and set(form) == {"hidden", "qkv_bias"}
        and type(form["hidden"]) is int
        and form["hidden"] >= 1
        and isinstance(form["qkv_bias"], bool)
    ):
        return (
            "'projected' must map exactly 'hidden' to an integer >= 1 and 'qkv_bias' to true or "
            f"false, got {form!r:.60}"
        )
    if VARIANTS[variant].projected is None:
        decl = VARIANTS[variant].declaration.name
        return f"'projected': variant {variant}'s op {decl} has no projected form"
    if entry["numerics"] != "fused":
        return f"'numerics' of a projected case must be fused, got {entry['numerics']!r:.40}"
    if "peer" in entry:
        return "'peer' is a form of the packed-row op, not of a projected case"
    return None


def _unprintable(entry: dict) -> str | None:
    """The first text in an entry (names and keys included) with a control character (a
    terminal escape sequence would reach the terminal of whoever lists the cases), or None.
    Iterative: a deeply nested field is no deeper a recursion."""
    stack: list = [("", entry)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and not value.isprintable():
            return f"{where!r} holds a control character: {value!r:.60}"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isprintable():
                    place = where or "the entry"
                    return f"a key in {place!r} holds a control character: {key!r:.60}"
                stack.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    return None


def _peer_problem(entry: dict) -> str | None:
    """Why an entry's optional "peer" field is unusable, or None."""
    if "peer" not in entry:
        return None
    peer = entry["peer"]
    if not isinstance(peer, dict) or not isinstance(peer.get("rope"), bool):
        return f"'peer' must be an object with a boolean 'rope', got {peer!r:.60}"
    extra = set(peer) - {"rope", "num_v_heads", "v_head_dim", "head_stride", "inplace"}
    if extra:
        return f"'peer' has an unknown field {sorted(extra)[0]!r}"
    for key in ("num_v_heads", "v_head_dim", "head_stride"):
        if key in peer and not (type(peer[key]) is int and peer[key] >= 1):
            return f"'peer.{key}' must be an integer >= 1, got {peer[key]!r:.40}"
    if "inplace" in peer and peer["inplace"] is not True:
        return f"'peer.inplace' must be true when present, got {peer['inplace']!r:.40}"
    if "head_stride" in peer and peer["head_stride"] < max(
        entry["head_dim"], peer.get("v_head_dim", entry["head_dim"])
    ):
        return "'peer.head_stride' is smaller than a head"
    return None


def _label(entry, index: int) -> str:
    name = entry.get("name") if isinstance(entry, dict) else None
    if isinstance(name, str) and name and name.isprintable():
        return name
    return f"<manifest entry {index}>"


def is_source_checkout() -> bool:
    """True when fqr runs from a source checkout (or an editable install), whose top-level
    ``golden/`` is the bundled golden directory and the place to regenerate it."""
    return (Path(__file__).resolve().parent.parent / "golden" / MANIFEST).is_file()


def _inside_installed_package(directory: Path) -> bool:
    """True when ``directory`` lies inside an installed (site-packages) copy of fqr: nothing is
    ever written there (``pip uninstall`` would leave it behind)."""
    package = Path(__file__).resolve().parent
    if is_source_checkout():
        return False  # a source checkout: the repository's golden/ is the place to regenerate
    target = directory.resolve()
    return target == package or package in target.parents


def regen(
    directory: Path | str = GOLDEN_DIR, pattern: str | None = None, kernels: bool = True
) -> list[dict]:
    """(Re)write the case files matching the glob ``pattern`` (all when None) and the manifest.

    Deterministic: the same bytes every time. With a pattern, the manifest keeps the existing
    entries of the cases not rebuilt; without one, stale case files are removed and (with
    ``kernels``) the generated-kernel goldens are rebuilt too
    (:func:`fqr.tools.golden_kernels.regen`).
    Returns the entries written.
    """
    directory = Path(directory)
    if _inside_installed_package(directory):
        raise ValueError(
            f"--dir: {directory} is inside the installed fqr package; regenerate into a "
            "directory of your own (fqr golden regen --dir DIR, then fqr verify --golden-dir DIR)"
        )
    specs = select_cases(pattern)
    if not specs:
        raise ValueError(f"pattern {pattern!r} matches no golden case")
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (the golden directory to write)")
    # Every file this call writes, refused before anything is written when one is a symlink
    # (or a directory): write_file never writes through a link, and nothing is half-done.
    for path in [directory / f"{c.name}.safetensors" for c in specs] + [directory / MANIFEST]:
        check_destination(path)
    if pattern is None and kernels:
        from .tools.golden_kernels import check_destinations as check_kernel_destinations

        check_kernel_destinations(directory)
    directory.mkdir(parents=True, exist_ok=True)
    old = {}
    if pattern is not None and (directory / MANIFEST).is_file():
        old = {e["name"]: e for e in read_manifest(directory) if entry_problem(e) is None}
    written = {}
    for spec in specs:
        tensors, entry = case_tensors(spec)
        # One metadata key: safetensors writes a multi-key map in hash order (not reproducible).
        data = save_safetensors(tensors, metadata={FORMAT: spec.name})
        write_file(directory / entry["file"], data)
        entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
        written[spec.name] = entry
    entries = [written.get(c.name) or old.get(c.name) for c in CASES]
    _write_manifest(directory, [e for e in entries if e is not None])
    if pattern is None:
        keep = {e["file"] for e in written.values()}
        for stale in directory.glob("*.safetensors"):
            if stale.name not in keep:
                stale.unlink()
        if kernels:
            from .tools.golden_kernels import regen as regen_kernels  # imports the lowering

            regen_kernels(directory)
    return list(written.values())


def list_cases(directory: Path | str = GOLDEN_DIR, pattern: str | None = None) -> list[dict]:
    """Manifest entries whose name matches the glob ``pattern`` (all when None). A malformed
    entry comes back as ``{"name": ..., "corrupt": reason}`` (named ``<manifest entry i>`` when
    it has no usable name): :func:`load_case` raises :class:`GoldenCorrupt` for it."""
    cases = []
    for i, entry in enumerate(read_manifest(directory)):
        problem = entry_problem(entry)
        if problem is not None:
            entry = {"name": _label(entry, i), "corrupt": problem}
        if pattern is None or fnmatch.fnmatchcase(entry["name"], pattern):
            cases.append(entry)
    return cases


# ------------------------------------------------------------------------- loading, checking


@dataclass
class GoldenCase:
    """One loaded case: the inputs of :func:`fqr.split_qkv_rmsnorm_rope` and the expectations."""

    entry: dict
    qkv_buffer: torch.Tensor  # [T, row_stride]; qkv is its first `width` columns
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor | None  # [max_position, R], NaN in rows not used; None: no RoPE
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    q_sum_sq: torch.Tensor | None
    k_sum_sq: torch.Tensor | None
    expected_q: torch.Tensor  # float64
    expected_k: torch.Tensor  # float64
    expected_v: torch.Tensor  # input dtype (bit-exact copy)
    tolerance: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.entry["name"]

    @property
    def qkv(self) -> torch.Tensor:
        return self.qkv_buffer[:, : row_width(self.entry)]

    def to(self, device) -> GoldenCase:
        """The inputs on ``device`` (expectations stay on the CPU)."""
        move = {
            k: (None if getattr(self, k) is None else getattr(self, k).to(device))
            for k in (
                "qkv_buffer",
                "positions",
                "cos_sin_cache",
                "q_weight",
                "k_weight",
                "q_bias",
                "k_bias",
                "q_sum_sq",
                "k_sum_sq",
            )
        }
        return GoldenCase(
            self.entry,
            **move,
            expected_q=self.expected_q,
            expected_k=self.expected_k,
            expected_v=self.expected_v,
            tolerance=self.tolerance,
        )

    def norm_stats(self) -> NormStats | None:
        if self.q_sum_sq is None:
            return None
        e = self.entry
        total = get_preset(e["preset"], e["tp"])
        return NormStats(
            self.q_sum_sq,
            self.k_sum_sq,
            total.total_heads * e["head_dim"],
            total.total_kv_heads * e["head_dim"],
        )

    @property
    def spec(self) -> PrologueSpec:
        """The case's static parameters (from its manifest entry)."""
        return PrologueSpec.of(self.entry)

    def inputs(self) -> PrologueInputs:
        return PrologueInputs(
            self.spec,
            self.qkv,
            self.positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            self.q_bias,
            self.k_bias,
        )

    def args(self) -> tuple:
        return self.inputs().args()

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`fqr.split_qkv_rmsnorm_rope` (without backend)."""
        return self.inputs().kwargs(
            norm_stats=self.norm_stats(), numerics=self.entry["numerics"], **peer_kwargs(self.entry)
        )

    def run(self, backend: str = "reference"):
        """``fqr.split_qkv_rmsnorm_rope`` on this case's inputs (an in-place case writes into a
        copy of the row buffer and returns its views: :meth:`check` reads the copy through
        them)."""
        from .prologue import split_qkv_rmsnorm_rope

        args = self.args()
        if self.entry.get("peer", {}).get("inplace"):
            args = (self.qkv_buffer.clone()[:, : row_width(self.entry)], *args[1:])
        return split_qkv_rmsnorm_rope(*args, **self.kwargs(), backend=backend)

    def check(self, q, k, v) -> dict[str, Comparison]:
        """Compare outputs with the expectations under the case's numerics contract; for an
        in-place case whose outputs are views of the row buffer, also every byte of that
        buffer outside q and k against the case's input (``"qkv"``, bit for bit)."""
        e = self.entry
        d, numerics = e["head_dim"], e["numerics"]
        checks = {
            "q": compare(q, self.expected_q, head_dim=d, numerics=numerics),
            "k": compare(k, self.expected_k, head_dim=d, numerics=numerics),
            "v": compare(v, self.expected_v, head_dim=d, bitwise=True),
        }
        if e.get("peer", {}).get("inplace") and q._base is not None:
            checks["qkv"] = self._untouched(q._base, q.shape[1] + k.shape[1])
        return checks

    def _untouched(self, written: torch.Tensor, qk_width: int) -> Comparison:
        """Bytes of ``written`` (the row buffer after an in-place call) outside its first
        ``qk_width`` columns, against the input, bit for bit (NaN padding included)."""
        was = self.qkv_buffer
        if written.shape != was.shape:
            return Comparison(None, float("inf"), float("inf"), 1, 0, False, "bytes unchanged")
        ints = {2: torch.int16, 4: torch.int32}[was.element_size()]
        after = written.detach()[:, qk_width:].contiguous().view(ints)  # where the output is
        before = was.to(written.device)[:, qk_width:].contiguous().view(ints)
        bad = int((after != before).sum())
        return Comparison(
            None, 0.0 if bad == 0 else float("inf"), 0.0, bad, 0, bad == 0, "bytes unchanged"
        )


def _tensor_problem(entry: dict, t: dict) -> str | None:
    """Why the file's tensors do not match its entry (names, shapes, dtypes, table rows), or
    None."""
    e = entry
    tokens, d = e["tokens"], e["head_dim"]
    hq, hkv = e["num_heads"] * d, e["num_kv_heads"] * d
    peer = e.get("peer") or {}
    v_width = peer.get("num_v_heads", e["num_kv_heads"]) * peer.get("v_head_dim", d)
    dtype = dtype_of(e["dtype"])
    floats = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    w_len = (d, d) if e["norm"] == "head" else (hq, hkv)
    want: dict[str, tuple[tuple, tuple]] = {
        "qkv": ((tokens, row_width(e)), (dtype,)),
        "positions": ((tokens,), (dtype_of(e["positions_dtype"]),)),
        "expected_q": ((tokens, hq), (torch.float64,)),
        "expected_k": ((tokens, hkv), (torch.float64,)),
        "expected_v": ((tokens, v_width), (dtype,)),
    }
    if peer.get("rope", True):
        want.update(
            cos_sin_rows=((None, e["rotary_dim"]), floats),
            cos_sin_index=((None,), (torch.int64, torch.int32)),
        )
    if e["norm"] != "none":
        want.update(q_weight=((w_len[0],), floats), k_weight=((w_len[1],), floats))
        if e["bias"]:
            want.update(q_bias=((w_len[0],), floats), k_bias=((w_len[1],), floats))
    if e["norm_stats"]:
        want.update(q_sum_sq=((tokens,), (torch.float32,)), k_sum_sq=((tokens,), (torch.float32,)))
    for name, (shape, dtypes) in want.items():
        if name not in t:
            return f"no tensor {name!r}"
        x = t[name]
        if x.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, x.shape)):
            wanted = ", ".join("*" if s is None else str(s) for s in shape)
            return f"tensor {name!r} has shape {list(x.shape)}, the entry implies [{wanted}]"
        if x.dtype not in dtypes:
            return f"tensor {name!r} is {x.dtype}, the entry implies {dtypes[0]}"
    extra = sorted(set(t) - set(want))
    if extra:
        return f"unexpected tensor {extra[0]!r} (the entry does not describe it)"
    if "cos_sin_index" not in want:
        return None
    return _table_problem(e, t)


def _table_problem(entry: dict, t: dict) -> str | None:
    """Why the stored RoPE rows cannot make the case's table, or None: the rows named must lie
    in ``[0, max_position)``, cover the positions, and the whole table stay within
    :data:`MAX_TABLE_ELEMENTS`."""
    index, rows, n = t["cos_sin_index"], t["cos_sin_rows"], entry["max_position"]
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        got = f"{index.dtype} {list(index.shape)}"
        return f"tensor 'cos_sin_index' must be int64 or int32 [rows], got {got}"
    if rows.dim() != 2 or not rows.dtype.is_floating_point:
        got = f"{rows.dtype} {list(rows.shape)}"
        return f"tensor 'cos_sin_rows' must be floating [rows, rotary_dim], got {got}"
    if rows.shape[0] != index.shape[0]:
        return "tensors 'cos_sin_rows' and 'cos_sin_index' differ in length"
    if n * rows.shape[1] > MAX_TABLE_ELEMENTS:
        return (
            f"a RoPE table of max_position={n} rows of {rows.shape[1]} is more than "
            f"{MAX_TABLE_ELEMENTS} elements (the largest of fqr's presets)"
        )
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
        return f"tensor 'cos_sin_index' names rows outside [0, max_position={n})"
    if not torch.isin(t["positions"].long(), index.long()).all():
        return "tensor 'positions' names RoPE rows the file does not hold (cos_sin_index)"
    return None


def _variant_tensor_problem(entry: dict, t: dict) -> str | None:
    """Why the file's tensors do not match a variant entry's ``tensors`` record, or None."""
    want = entry["tensors"]
    for name, (dtype, shape) in want.items():
        if name not in t:
            return f"no tensor {name!r}"
        if list(t[name].shape) != shape or DTYPE_NAMES.get(t[name].dtype) != dtype:
            return (
                f"tensor {name!r} is {DTYPE_NAMES.get(t[name].dtype, t[name].dtype)} "
                f"{list(t[name].shape)}, the entry says {dtype} {shape}"
            )
    extra = sorted(set(t) - set(want))
    if extra:
        return f"unexpected tensor {extra[0]!r} (the entry does not describe it)"
    for name in entry["outputs"]:
        if f"expected_{name}" not in t:
            return f"no tensor 'expected_{name}'"
    decl = _case_variant(entry).declaration
    params = {p.name for p in decl.tensor_params}
    for name in sorted(t):
        if name not in params and not name.startswith("expected_") and name not in _TABLE:
            return f"tensor {name!r} is not an argument of {decl.name}"
    if "projected" in entry:
        problem = _projection_problem(entry, t)
        if problem is not None:
            return problem
    if not reads_positions(entry["variant"]):
        return None
    for name in ("positions", "cos_sin_index", "cos_sin_rows"):
        if name not in t:
            return f"no tensor {name!r}"
    return _table_problem(entry, t)


def _projection_problem(entry: dict, t: dict) -> str | None:
    """Why a projected case's ``x``, ``w_qkv`` and ``qkv_bias`` do not fit its entry's
    ``projected`` field, dtype, token count and packed row width (``row_stride``), or None."""
    form, n, dtype = entry["projected"], entry["row_stride"], dtype_of(entry["dtype"])
    want = {"x": [entry["tokens"], form["hidden"]], "w_qkv": [n, form["hidden"]]}
    if form["qkv_bias"]:
        want["qkv_bias"] = [n]
    elif "qkv_bias" in t:
        return "tensor 'qkv_bias' in a case whose 'projected' says qkv_bias false"
    for name, shape in want.items():
        if name not in t:
            return f"no tensor {name!r}"
        x = t[name]
        if list(x.shape) != shape or x.dtype != dtype:
            return (
                f"tensor {name!r} is {DTYPE_NAMES.get(x.dtype, x.dtype)} {list(x.shape)}, the "
                f"entry's 'projected' implies {entry['dtype']} {shape}"
            )
    return None


_TABLE = ("cos_sin_rows", "cos_sin_index")  # the stored RoPE rows (load_case builds the table)


def _case_variant(entry: dict):
    """The variant an entry runs: its ``variant``, or that variant's projected form (the
    entry's ``projected``)."""
    variant = get_variant(entry["variant"])
    form = entry.get("projected")
    return variant if form is None else variant.projected_form(**form)


@dataclass
class VariantCase:
    """One loaded case of a variant other than split-qkv: its named inputs, the RoPE table
    (NaN in every row the case does not use; None for an op without positions) and the
    expectation of each output."""

    entry: dict
    inputs: dict[str, torch.Tensor]
    cos_sin_cache: torch.Tensor | None
    expected: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.entry["name"]

    @property
    def preset(self):
        return get_preset(self.entry["preset"], self.entry["tp"])

    @property
    def variant(self):
        """The entry's variant, or its projected form (the entry's ``projected``)."""
        return _case_variant(self.entry)

    def to(self, device) -> VariantCase:
        """The inputs on ``device`` (expectations stay on the CPU)."""
        moved = {k: x.to(device) for k, x in self.inputs.items()}
        table = None if self.cos_sin_cache is None else self.cos_sin_cache.to(device)
        return VariantCase(self.entry, moved, table, self.expected)

    def run(self, backend: str = "reference") -> tuple[torch.Tensor, ...]:
        """The variant's public op on this case's inputs."""
        return self.variant.run(
            self.preset,
            self.inputs,
            self.cos_sin_cache,
            numerics=self.entry["numerics"],
            backend=backend,
        )

    def check(self, *outputs: torch.Tensor) -> dict[str, Comparison]:
        """Each output against its expectation under its tolerance kind."""
        names, variant, preset = self.entry["outputs"], self.variant, self.preset
        if len(outputs) != len(names):
            raise ValueError(f"{self.name}: {len(outputs)} outputs, the case has {len(names)}")
        return {
            name: compare_kind(
                self.entry["tolerance_kinds"][name],
                out,
                self.expected[name],
                head_dim=variant.head_dim(preset, name),
                numerics=self.entry["numerics"],
            )
            for name, out in zip(names, outputs)
        }


def load_case(
    name_or_entry: str | dict, directory: Path | str = GOLDEN_DIR
) -> GoldenCase | VariantCase:
    """Load a case (by name or manifest entry). Raises :class:`GoldenCorrupt` naming the file
    and the reason for anything that makes the case unusable (the checks of :func:`list_cases`,
    then the file: a regular file inside ``directory``, its sha256, its tensors)."""
    directory = Path(directory)
    if isinstance(name_or_entry, str):
        found = [e for e in list_cases(directory) if e["name"] == name_or_entry]
        if not found:
            raise ValueError(f"no golden case named {name_or_entry!r} in {directory}")
        entry = found[0]
    else:
        entry = name_or_entry
    manifest = directory / MANIFEST
    problem = entry.get("corrupt") if isinstance(entry, dict) else None
    problem = problem or entry_problem(entry)
    if problem is not None:
        raise GoldenCorrupt(f"{manifest}: case {_label(entry, -1)}: {problem}")
    path = directory / entry["file"]
    try:
        data = _read_regular_file(directory, entry["file"])
    except FileNotFoundError:
        raise GoldenCorrupt(f"{path}: missing (listed in the manifest)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise GoldenCorrupt(
                f"{path}: a symlink (not read: golden files must be regular files inside the "
                f"golden directory)"
            ) from None
        raise GoldenCorrupt(f"{path}: {e.strerror or e}") from None
    if len(data) != entry["bytes"]:
        raise GoldenCorrupt(f"{path}: {len(data)} bytes, the manifest says {entry['bytes']}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise GoldenCorrupt(
            f"{path}: sha256 {digest[:12]}... does not match the manifest's "
            f"{entry['sha256'][:12]}..."
        )
    try:
        t = load_safetensors(data)
    except SafetensorError as e:
        raise GoldenCorrupt(f"{path}: not a safetensors file ({e})") from None
    variant = entry.get("variant", SPLIT_QKV.name)
    check = _tensor_problem if is_row_case(entry) else _variant_tensor_problem
    problem = check(entry, t)
    if problem is not None:
        raise GoldenCorrupt(f"{path}: {problem}")
    if not is_row_case(entry):
        table = None
        if reads_positions(variant):
            table = sparse_table(t["cos_sin_rows"], t["cos_sin_index"], entry["max_position"])
        expected = {name: t[f"expected_{name}"] for name in entry["outputs"]}
        inputs = {k: x for k, x in t.items() if not k.startswith("expected_") and k not in _TABLE}
        return VariantCase(entry, inputs, table, expected)
    qkv = t["qkv"]
    buffer = torch.full((qkv.shape[0], entry["row_stride"]), float("nan"), dtype=qkv.dtype)
    buffer[:, : qkv.shape[1]] = qkv
    table = None
    if "cos_sin_rows" in t:
        table = sparse_table(t["cos_sin_rows"], t["cos_sin_index"], entry["max_position"])
    return GoldenCase(
        entry,
        buffer,
        t["positions"],
        table,
        t.get("q_weight"),
        t.get("k_weight"),
        t.get("q_bias"),
        t.get("k_bias"),
        t.get("q_sum_sq"),
        t.get("k_sum_sq"),
        t["expected_q"],
        t["expected_k"],
        t["expected_v"],
        entry["tolerance"],
    )
