"""The fusion pass for Inductor, and a ``torch.compile`` backend that runs it.

:class:`FusionPass` is an Inductor ``CustomGraphPass``: put it in
``torch._inductor.config.post_grad_custom_post_pass`` (or let :func:`backend` do it). It applies
the replacement patterns of :mod:`fqr.fusion.patterns` to each post-grad graph and records, per
graph, how many prologue sites it fused and which unfused norm/RoPE ops are left::

    fusion = fqr.fusion.backend()
    compiled = torch.compile(model, backend=fusion)
    compiled(positions, hidden)
    fusion.stats.sites                  # fused prologues, summed over compiled graphs

or, with Inductor's own entry point::

    fusion_pass = FusionPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=fusion_pass):
        torch.compile(model)(positions, hidden)

Before matching, the pass points every use of a symbolic size at one node
(:func:`unify_symbolic_sizes`) and merges the separate splits and slices that cut one tensor
into consecutive pieces into one ``split_with_sizes`` (:func:`fqr.fusion.coalesce.coalesce_splits`,
as vLLM's ``SplitCoalescingPass`` does before its QK-norm-RoPE fusion); after replacing, it
re-sorts the graph topologically and drops dead nodes.

Supported: torch 2.11 and newer (the patterns read every size and eps from the matched graph,
see :mod:`fqr.fusion.patterns`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import PatternMatcherPass, stable_topological_sort

from .. import prologue  # noqa: F401  (registers torch.ops.fqr.*)
from .coalesce import coalesce_splits

log = logging.getLogger(__name__)

FUSED_OPS = (
    torch.ops.fqr.split_qkv_rmsnorm_rope.default,
    torch.ops.fqr.qk_rmsnorm_rope.default,
    torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch.default,  # fqr.projection's entry
)

# What the unfused prologue leaves in an aten graph: RMSNorm's statistic and RoPE's gather.
# None of these should survive in a graph whose prologues were all fused.
UNFUSED_OPS = (
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.mean.dim,
    torch.ops.aten.pow.Tensor_Scalar,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_select.default,
)

_SOURCES = tuple(
    os.path.join(os.path.dirname(__file__), f)
    for f in (
        "patterns.py",
        "unfused.py",
        "fusion_pass.py",
        "coalesce.py",
        "../prologue/declare.py",  # torch.ops.fqr.* and their fakes
        "../prologue/split_qkv.py",
        "../prologue/qk.py",
        "../prologue/projected.py",
        "../projection.py",  # torch.ops.fqr.*_proj_dispatch
    )
)


# The oldest Inductor the pass was run on (its pattern-matcher API changes between releases);
# older ones are refused with a clear message rather than failing inside Inductor.
MIN_TORCH = (2, 11)


def check_torch_version() -> None:
    have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if have < MIN_TORCH:
        raise RuntimeError(
            f"fqr.fusion supports torch >= {'.'.join(map(str, MIN_TORCH))} (the versions its "
            f"pattern matcher was run on); found {torch.__version__}"
        )


@lru_cache(maxsize=1)
def fusion_patterns() -> PatternMatcherPass:
    """All replacement patterns, traced once per process (about 10 s of CPU)."""
    from .patterns import register_patterns

    check_torch_version()
    patterns = PatternMatcherPass(pass_name="fqr_qk_norm_rope_fusion")
    register_patterns(patterns)
    return patterns


@lru_cache(maxsize=1)
def projection_patterns() -> PatternMatcherPass:
    """The QKV projection patterns (:mod:`fqr.fusion.patterns`, "QKV projection"), applied
    after :func:`fusion_patterns` to the fused ops they left."""
    from .patterns import register_projection_patterns

    check_torch_version()
    patterns = PatternMatcherPass(pass_name="fqr_qkv_projection_fusion")
    register_projection_patterns(patterns)
    return patterns


@dataclass
class GraphRecord:
    sites: int
    coalesced_splits: int  # splits/slices merged into one split_with_sizes before matching
    fused_ops: int  # fqr ops in the graph after the pass
    unfused_ops: dict  # aten op name -> count of UNFUSED_OPS left after the pass
    ops: dict  # every call_function target name -> count, after the pass
    projected: int = 0  # of the sites, those whose qkv_proj GEMM went into the dispatching op


@dataclass
class FusionStats:
    graphs: list[GraphRecord] = field(default_factory=list)

    @property
    def sites(self) -> int:
        return sum(g.sites for g in self.graphs)

    @property
    def projected(self) -> int:
        """Sites whose ``qkv_proj`` GEMM went into ``*_proj_dispatch`` (fqr.projection)."""
        return sum(g.projected for g in self.graphs)

    @property
    def unfused_left(self) -> int:
        return sum(sum(g.unfused_ops.values()) for g in self.graphs)


def unify_symbolic_sizes(graph: torch.fx.Graph) -> int:
    """Make every use of one symbolic size go through one node.

    With ``mark_dynamic`` on several inputs (hidden states and positions, as vLLM does), the
    token count reaches the graph as one placeholder per input, all holding the same symbol.
    Inductor re-checks a match with one argument per symbol, so uses must agree on the node:
    point them all at the first node that holds the symbol. Returns the nodes redirected.
    """
    first: dict = {}
    redirected = 0
    for node in graph.nodes:
        if node.op != "placeholder" and node.target is not torch.ops.aten.sym_size.int:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt) or not val.node.expr.is_Symbol:
            continue
        canonical = first.setdefault(val.node.expr, node)
        if canonical is not node and node.users:
            node.replace_all_uses_with(canonical)
            redirected += 1
    return redirected


def op_counts(graph: torch.fx.Graph) -> Counter:
    return Counter(n.target for n in graph.nodes if n.op == "call_function")


class FusionPass(CustomGraphPass):
    """Replace every unfused attention prologue of a post-grad graph by one fqr op."""

    def __init__(self):
        self.patterns = fusion_patterns()
        self.projection = projection_patterns()
        self.stats = FusionStats()

    def __call__(self, graph: torch.fx.Graph) -> None:
        unify_symbolic_sizes(graph)
        coalesced = coalesce_splits(graph)
        sites = self.patterns.apply(graph)
        # the fused ops' qkv_proj GEMMs, where the dispatch table can pick the fused kernel
        projected = self.projection.apply(graph) if sites else 0
        if sites or coalesced:
            # A replacement lands before the first matched output (v, early in the graph);
            # an input computed later (a Gemma (1 + w) in fp32, say) must move up.
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
        ops = op_counts(graph)
        log.info(
            "fqr fusion: fused %d attention prologue site(s) (%d with their qkv_proj) in a "
            "graph of %d nodes",
            sites,
            projected,
            len(graph.nodes),
        )
        self.stats.graphs.append(
            GraphRecord(
                sites=sites,
                coalesced_splits=coalesced,
                fused_ops=sum(ops[o] for o in FUSED_OPS),
                unfused_ops={str(o): ops[o] for o in UNFUSED_OPS if ops[o]},
                ops={str(o): n for o, n in ops.items()},
                projected=projected,
            )
        )

    def uuid(self):
        # the projection rewrites follow the dispatch table in use (fqr.projection)
        from ..projection import table_digest

        return get_hash_for_files(_SOURCES, extra=table_digest())


class FusionBackend:
    """A ``torch.compile`` backend: Inductor with :class:`FusionPass` as its post-grad pass.

    Inductor's FX-graph and AOTAutograd caches are off by default (``cache=False``): a graph
    loaded from the cache skips every pass, so its sites would go uncounted. With
    ``cache=True`` repeated compiles are faster and ``stats`` covers only graphs compiled here.
    """

    def __init__(
        self,
        fusion_pass: FusionPass | None = None,
        *,
        cache: bool = False,
        config_patches: dict | None = None,
    ):
        self.fusion_pass = fusion_pass or FusionPass()
        self.cache = cache
        self.config_patches = dict(config_patches or {})

    @property
    def stats(self) -> FusionStats:
        return self.fusion_pass.stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        patches = {
            "post_grad_custom_post_pass": self.fusion_pass,
            "fx_graph_cache": self.cache,
            **self.config_patches,
        }
        with torch._functorch.config.patch(enable_autograd_cache=self.cache):
            return compile_fx(gm, example_inputs, config_patches=patches)


def backend(*, cache: bool = False, config_patches: dict | None = None) -> FusionBackend:
    """``torch.compile(model, backend=fqr.fusion.backend())``; see :class:`FusionBackend`."""
    return FusionBackend(cache=cache, config_patches=config_patches)
