"""GEMM sites of a graph for the precision pass: what they are, what may not go fp8, and
what each precision would cost on the target GPU.

A *site* is one GEMM node of the forward graph; it stands for three GEMMs of a training
step -- ``fwd``, ``dgrad`` (input gradient) and ``wgrad`` (weight gradient) -- with the
problems the cost model uses (:func:`gemc.cost_model.kernels.gemm_backward_problems`).
For a GEMM over jagged values M is the sum of lengths: the graph's node already has it.

Structural exclusions (never fp8, whatever the numbers say) are decided here, from the
graph alone, so they hold even when nothing could be measured:

* only an ``nn.Linear`` runs fp8 (the runner swaps the module); einsum, bmm and matmul
  sites stay in bf16 or fp32 -- among them every activation x activation product
  (attention scores and probabilities, factorization-machine interactions);
* a GEMM whose result reaches a softmax or whose operand comes from one (attention scores
  and probabilities written out by hand), one that feeds the loss directly (the logits),
  and one whose weight is an embedding table (tied weights);
* every dim of all three GEMMs divisible by 16 (``_scaled_mm``'s K and N; M too, since
  the weight-gradient GEMM contracts over it);
* a GPU without fp8 tensor cores.

Norms, softmax, the loss, embedding lookups, optimizer state and residual adds are not
GEMM sites at all: the pass never assigns them a precision, and under the plan's bf16
autocast baseline they run as autocast runs them (norms, softmax and the loss in fp32).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from gemc.cost_model import kernels
from gemc.cost_model.op_cost import gemm_time, memory_time
from gemc.passes.classify_ops import op_name
from torch import fx

from gemc import fp8_recipe, ir
from gemc.ir import OpKind, innermost_scope, module_path

GEMMS = fp8_recipe.GEMMS
SiteKey = tuple[str, str, int]
_PASS_THROUGH = (OpKind.VIEW, OpKind.POINTWISE)
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_HOPS = 4  # views / pointwise ops between a GEMM and the softmax or loss it feeds


@dataclass
class Site:
    """One GEMM node and the facts the decision needs."""

    node: fx.Node
    op: str
    module: str  # innermost module path: the runner's target for this site
    module_type: str  # class name from the graph's module stack
    region: str
    key: SiteKey  # (module, op, index of that op in that module): the probe's key
    problem: dict[str, int]  # batch, m, n, k of the forward GEMM
    weight_fqn: str | None

    def problems(self) -> dict[str, tuple[int, int, int, int]]:
        """(batch, M, N, K) of the forward, input-gradient and weight-gradient GEMMs."""
        b, m, n, k = (int(self.problem[x]) for x in ("batch", "m", "n", "k"))
        dgrad, wgrad = kernels.gemm_backward_problems(b, m, n, k)
        return {"fwd": (b, m, n, k), "dgrad": dgrad, "wgrad": wgrad}


def _module_type(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    t = list(stack.values())[-1][1]
    name = t if isinstance(t, str) else getattr(t, "__qualname__", str(t))
    return name.rsplit(".", 1)[-1]


def collect_sites(gm: fx.GraphModule) -> list[Site]:
    """Every GEMM node with a known problem shape, in graph order."""
    sites = []
    counts: Counter[tuple[str, str]] = Counter()
    for node in gm.graph.nodes:
        if ir.kind_of(node) is not OpKind.GEMM or not node.meta.get(ir.GEMM):
            continue
        op = op_name(node)
        path = module_path(node)
        index = counts[(path, op)]
        counts[(path, op)] += 1
        weight = node.args[1] if op == "linear" and len(node.args) > 1 else None
        fqn = weight.meta.get(ir.PARAM) if isinstance(weight, fx.Node) else None
        sites.append(Site(node, op, path, _module_type(node), node.meta.get(ir.REGION, ""),
                          (path, op, index), dict(node.meta[ir.GEMM]), fqn))
    return sites


# ----------------------------------------------------------------------------- exclusions


def _reaches(node: fx.Node, want: set[str], kinds: set[OpKind], forward: bool) -> bool:
    """Whether a node of op name in ``want`` or kind in ``kinds`` is within ``_HOPS`` views
    or pointwise ops of ``node`` (downstream if ``forward``, else upstream)."""
    frontier, seen = [node], {node}
    for _ in range(_HOPS):
        nxt = []
        for n in frontier:
            for m in (n.users if forward else n.all_input_nodes):
                if m in seen:
                    continue
                seen.add(m)
                if m.op == "call_function" and (op_name(m) in want or ir.kind_of(m) in kinds):
                    return True
                if ir.kind_of(m) in _PASS_THROUGH:
                    nxt.append(m)
        frontier = nxt
    return False


def structural_reason(site: Site, table_fqns: set[str], is_linear: bool | None) -> str | None:
    """Why this site may never run fp8 (None: it may, if it pays and is accurate)."""
    node = site.node
    operands = node.all_input_nodes
    has_weight = any(ir.kind_of(a) is OpKind.PARAM for a in operands)
    if _reaches(node, _SOFTMAX, set(), True) or any(
        _reaches(a, _SOFTMAX, set(), False) or op_name(a) in _SOFTMAX
        for a in operands if a.op == "call_function"
    ):
        return "attention scores/probabilities (feeds or reads a softmax)"
    if not has_weight and site.op != "linear":
        return f"activation x activation {site.op} (interactions, attention): bf16 at most"
    if site.op != "linear":
        return f"{site.op} site: only nn.Linear layers run fp8"
    if is_linear is False or (is_linear is None and site.module_type != "Linear"):
        return f"module {site.module or '(root)'} is a {site.module_type or 'function'}, " \
               "not an nn.Linear"
    if site.weight_fqn in table_fqns:
        return "its weight is an embedding table"
    if _reaches(node, set(), {OpKind.LOSS}, True):
        return "feeds the loss directly (logits)"
    bad = {g: p for g, p in site.problems().items() if any(d % fp8_recipe.ALIGN for d in p[1:])}
    if bad:
        g, (_, m, n, k) = next(iter(bad.items()))
        return f"dims not divisible by {fp8_recipe.ALIGN} ({g} M={m} N={n} K={k})"
    return None


# ----------------------------------------------------------------------------- prices


@dataclass(frozen=True)
class Prices:
    """Predicted seconds of one GEMM in each precision; fp8 includes its quantization."""

    fp32: float
    bf16: float
    fp8: float
    fp8_quant: float  # the part of fp8 spent quantizing the two operands
    source: str

    def of(self, dtype: str) -> float:
        return {"fp32": self.fp32, "bf16": self.bf16, "fp8": self.fp8}[dtype]


def activation_bytes(site: Site) -> int:
    """Element bytes of the GEMM's input under bf16 autocast: 4 when it comes (through
    views) from a norm, which autocast runs and returns in fp32; else 2 (a bf16 GEMM or
    pointwise output)."""
    node = site.node.args[0] if site.node.args else None
    while isinstance(node, fx.Node) and ir.kind_of(node) is OpKind.VIEW and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return 4 if isinstance(node, fx.Node) and ir.kind_of(node) is OpKind.NORM else 2


def _operands(gemm: str, x_elt: int) -> tuple[tuple[int, bool], tuple[int, bool]]:
    """(element bytes, needs a layout copy) of a GEMM's two operands as the runner holds
    them: x as :func:`activation_bytes` says, dy in bf16, the master weight in fp32. The
    column-major right operand of dgrad and both operands of wgrad pay a copy of their fp8
    bytes into ``_scaled_mm``'s layout."""
    return {
        "fwd": ((x_elt, False), (4, False)),  # x row-major; W^T column-major as stored
        "dgrad": ((2, False), (4, True)),  # dy row-major; W must become column-major
        "wgrad": ((2, True), (x_elt, True)),  # dy^T and x both change layout
    }[gemm]


def _quant_time(numel: int, rows: int, elt: int, relayout: bool, gpu: Any, calibration: Any,
                quantisation: str) -> float:
    """Quantizing one operand the way the runner does: eager, kernel by kernel as the fp8
    module launches them; compiled, one pass (or less, fused into its producer)."""
    launch = calibration.kernel_s if calibration is not None else 2.5e-6
    if quantisation == fp8_recipe.COMPILED_QUANT:
        moved = float(fp8_recipe.compiled_quantize_bytes(numel, rows, elt))
        return memory_time(moved, gpu, calibration, "copy")[0] + launch
    t = sum(memory_time(float(b), gpu, calibration, "copy")[0]
            for b in fp8_recipe.quantize_kernels(numel, elt, relayout))
    return t + fp8_recipe.SCALE_KERNELS * launch


def price(site: Site, gpu: Any, calibration: Any,
          quantisation: str = fp8_recipe.EAGER_QUANT) -> dict[str, Prices]:
    """Prices of the site's three GEMMs at its real (batch, M, N, K), the fp8 one with its
    operands' quantisation as ``quantisation`` (:data:`gemc.fp8_recipe.QUANT_PATHS`) runs."""
    out = {}
    x_elt = activation_bytes(site)
    for gemm, (b, m, n, k) in site.problems().items():
        t32, src = gemm_time(b, m, n, k, "fp32", gpu, calibration)
        t16, _ = gemm_time(b, m, n, k, "bf16", gpu, calibration)
        t8, src8 = gemm_time(b, m, n, k, "fp8", gpu, calibration)
        if gemm == "fwd" and site.op == "linear":
            # bf16 autocast casts the fp32 weight once per forward (read 4 B, write 2 B);
            # fp8 quantizes from the fp32 weight instead (priced below)
            t16 += memory_time(6.0 * n * k, gpu, calibration, "copy")[0]
        (ea, ra), (eb, rb) = _operands(gemm, x_elt)
        # one quantization kernel sequence over the whole (batched) operand
        quant = (_quant_time(b * m * k, b * m, ea, ra, gpu, calibration, quantisation)
                 + _quant_time(b * k * n, b * n, eb, rb, gpu, calibration, quantisation))
        source = src if src == src8 else "roofline"
        out[gemm] = Prices(t32, t16, t8 + quant, quant, source)
    return out


# ---- module scopes: where each choice runs, and which kernels a scope displaces ---------------


def module_dtype(records: list[dict[str, Any]]) -> str:
    """A module's one precision from its GEMM sites' records: fp8 if any GEMM is, else fp32
    if any is (autocast scopes a whole module), else bf16."""
    dtypes = {r["gemms"][g]["dtype"] for r in records for g in GEMMS}
    return "fp8" if "fp8" in dtypes else "fp32" if "fp32" in dtypes else "bf16"


@dataclass(frozen=True)
class Scopes:
    """The choose-precision annotations as the runner applies them (``plan["precision"]``):
    ``modules`` each module's site records (node name first), ``dtype`` each module's one
    precision, ``applied`` the modules that get an entry of their own (their dtype differs
    from the scope they sit in), ``owner`` per module the entry whose scope it runs in
    (``"*"``: the baseline)."""

    baseline: str
    modules: dict[str, list[dict[str, Any]]]
    dtype: dict[str, str]
    applied: frozenset[str]
    owner: dict[str, str]


def module_scopes(gm: fx.GraphModule) -> Scopes | None:
    """The graph's :class:`Scopes`, or None where choose-precision has not run."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    facts = out_node.meta.get(ir.PRECISION)
    if not isinstance(facts, dict):
        return None
    baseline = facts["baseline"]
    modules: dict[str, list[dict[str, Any]]] = {}
    for node in gm.graph.nodes:
        record = node.meta.get(ir.PRECISION) if node.op == "call_function" else None
        if isinstance(record, dict) and "gemms" in record:
            modules.setdefault(record["module"], []).append({"node": node.name, **record})
    dtype = {name: module_dtype(records) for name, records in modules.items()}
    applied: set[str] = set()
    owner: dict[str, str] = {}
    for name in sorted(modules, key=lambda n: n.count(".")):  # parents before children
        scopes = [a for a in applied if name.startswith(a + ".") and dtype[a] != "fp8"]
        scope = max(scopes, key=len) if scopes else "*"
        if name and dtype[name] != (dtype[scope] if scopes else baseline):
            applied.add(name)  # e.g. an fp8 layer, or a bf16 layer inside an fp32 module
            scope = name
        owner[name] = scope
    return Scopes(baseline, modules, dtype, frozenset(applied), owner)


def scoped_nodes(gm: fx.GraphModule, scopes: Scopes) -> dict[str, str]:
    """By node name, the applied scope each node runs in, by the runner's rules: an autocast
    scope (fp32 / bf16) takes every op inside its module
    (``backends/torch/graph_precision.scope_module_precision``), an fp8 site its module's
    linear (``graph_fp8.apply_fp8_sites``)."""
    autocast = [s for s in scopes.applied if scopes.dtype[s] != "fp8"]
    fp8 = {s for s in scopes.applied if scopes.dtype[s] == "fp8"}
    taken: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = module_path(node)
        if path in fp8 and op_name(node) == "linear":
            taken[node.name] = path
            continue
        scope = innermost_scope(path, autocast)
        if scope is not None:
            taken[node.name] = scope
    return taken


def drop_displaced_kernels(gm: fx.GraphModule, taken: dict[str, str]) -> list[str]:
    """Take out of the graph every kernel group with a node in ``taken`` (its group and
    kernel annotations), and return them as ``"<kind> <id> (<scopes>)"``.

    Why: the runner cannot run such a kernel (it would compute a scoped op at the whole
    model's precision, or replace an fp8 site's linear) and leaves it out with a warning
    (``graph_precision.kernels_outside``); a plan that kept it priced a program that never
    runs (DLRM's top MLP: two fp32 modules' GEMM epilogues, 8 kernels run of 10 planned)."""
    members: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        gid = node.meta.get(ir.GROUP)
        if gid is not None:
            members.setdefault(gid, []).append(node)
    dropped = []
    for gid, nodes in members.items():
        hit = sorted({taken[n.name] for n in nodes if n.name in taken})
        if not hit:
            continue
        facts = next((n.meta[ir.KERNEL] for n in nodes if ir.KERNEL in n.meta), {})
        for n in nodes:
            n.meta.pop(ir.GROUP, None)
            n.meta.pop(ir.KERNEL, None)
        dropped.append(f"{facts.get('kind', 'kernel')} {gid} ({'/'.join(hit)})")
    return dropped
