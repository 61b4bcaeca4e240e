"""Run a compiled graph with the plan's kernels in place, forward and backward.

Until the distributed runner substitutes kernels itself, this is how a test (or a person)
checks that the kernels a plan lists compute what the model computes: take the exported
``GraphModule`` the compiler annotated, real weights (e.g. from the ModelSpec built on
CPU), and the plan's kernel entries; :class:`GraphRunner` interprets the graph eagerly,
running

* each fused group as one call of its generated autograd function (from the entry's
  source, checked against its sha256, or regenerated from its structure),
* each ``jagged_attention`` entry as ``padded_to_jagged`` -> ``jagged_attention`` ->
  ``jagged_to_padded`` over the lengths the model's mask uses,
* each ``batched_embedding_bag`` entry as one :class:`BatchedEmbeddingBag` lookup whose
  backward updates the tables in place (the optimizer is fused: no table gradient exists),

and every other node as its ATen op. Groups are placed in a topological order of the
condensed graph, so a group whose nodes were interleaved with others in the capture still
sees all its inputs. The runner needs only the graph and the entries, nothing of the
compiler's state.

Under autocast (dtype D on the inputs' device), a fused group's output whose only uses are
as the input ``x`` of GEMMs (a ``gemm_epilogue`` group's linear, or a plain
``aten.linear``) is written directly in D: those GEMMs cast it to D anyway, so this is the
rounding eager autocast does, minus a pass over memory (e.g. a LayerNorm's fp32 output
under CUDA autocast, read back and written in bf16 by the cast). The gradient reaching the
group is then D, as eager's is before the cast's backward widens it; the group's inputs'
gradients still come back in their own dtypes. An output with any other use (a residual
operand, a view, the graph's output) keeps eager's dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .codegen import generated
from .codegen.host import make_runner
from .codegen.spec import sha256

__all__ = ["GraphRunner"]


def _gemm_operand_in_epilogue(structure: dict[str, Any]) -> bool:
    """Whether a GEMM group's epilogue reads one of its GEMM's own operands."""
    if structure["kind"] != "gemm_epilogue":
        return False
    operands = {ref[1] for ref in structure["ops"][0]["args"] if ref is not None}
    return any(slot["input"] in operands for slot in structure["slots"])


def _autocast_on(inputs: Sequence[Any]) -> bool:
    dev = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), None)
    return dev is not None and torch.is_autocast_enabled(dev)


_SKIP = {torch.ops.aten._assert_tensor_metadata.default}
_LINEAR = torch.ops.aten.linear.default


def _param_fqn(node: fx.Node) -> str | None:
    return node.meta.get("gemc.param")


class GraphRunner:
    """``runner(*inputs) -> loss`` of ``gm`` with ``entries`` substituted.

    ``params``: tensors by FQN for the graph's parameter and buffer placeholders (pass the
    model's own parameters to have gradients land on them). ``kinds``: restrict which
    entry kinds are substituted (the rest run as the ATen ops they replace).
    ``narrow``: under autocast, write outputs only GEMMs read in the autocast dtype (see
    the module doc); False keeps eager's dtypes everywhere. ``release``: drop each value
    from the environment after its last reader (False keeps all until the loss returns);
    ``peak_live`` records the most values held at once in the last call.
    """

    def __init__(self, gm: fx.GraphModule, entries: Sequence[dict[str, Any]],
                 params: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu",
                 kinds: Sequence[str] | None = None, narrow: bool = True,
                 release: bool = True) -> None:
        self.gm = gm
        self.release = release  # drop each value after its last reader (see _last_reads)
        self.device = torch.device(device)
        self.params = params
        self.nodes = list(gm.graph.nodes)
        self.entries = [e for e in entries if kinds is None or e["kind"] in kinds]
        sources = {e["sha256"]: e["code"] for e in entries if e.get("code") is not None}
        self.by_name = by_name = {n.name: n for n in self.nodes}
        self.unit_of: dict[fx.Node, int] = {}
        self.units: list[dict[str, Any]] = []
        self.tables: dict[str, Any] = {}  # entry name -> BatchedEmbeddingBag
        for entry in self.entries:
            index = len(self.units)
            unit = {"entry": entry, "nodes": [by_name[n] for n in entry["nodes"]]}
            if "structure" in entry:
                unit["run"] = make_runner(self._source(entry, sources), entry["binding"])
                unit["shared_operand"] = _gemm_operand_in_epilogue(entry["structure"])
            elif entry["kind"] == "batched_embedding_bag":
                self.tables[entry["name"]] = self._embedding_module(entry)
            self.units.append(unit)
            for n in unit["nodes"]:
                self.unit_of[n] = index
        for unit in self.units:  # needs every unit known: the uses may be later groups
            if "run" in unit:
                unit["narrow"] = [narrow and self._only_gemm_input(by_name[name])
                                  for name in unit["entry"]["binding"]["outputs"]]
        self.order = self._schedule()
        self.free_after = self._last_reads()

    # -- setup ------------------------------------------------------------------------------

    @staticmethod
    def _source(entry: dict[str, Any], sources: dict[str, str]) -> str:
        code = sources.get(entry["sha256"])
        if code is None:  # not embedded: regenerate it from the structure
            code, _ = generated(entry["structure"])
        if sha256(code) != entry["sha256"]:
            raise ValueError(f"kernel {entry['name']}: source does not match its sha256")
        return code

    def _embedding_module(self, entry: dict[str, Any]) -> Any:
        from .embedding_bag import BatchedEmbeddingBag

        opt = entry["optimizer"]
        module = BatchedEmbeddingBag(
            [(t["rows"], t["dim"]) for t in entry["tables"]], pooling="sum",
            optimizer=opt["optimizer"], lr=opt["lr"], eps=opt["eps"],
            weight_decay=opt["weight_decay"], device=self.device)
        with torch.no_grad():
            for dst, table in zip(module.split_weights(), entry["tables"]):
                dst.copy_(self.params[table["fqn"]].detach())
        return module

    def _only_gemm_input(self, node: fx.Node) -> bool:
        """Whether every use of ``node`` is as a GEMM's input ``x`` and nothing else there
        (not its weight or bias, not an epilogue operand of its group)."""
        if not node.users:
            return False
        for user in node.users:
            if user in self.unit_of:
                entry = self.units[self.unit_of[user]]["entry"]
                if entry["kind"] != "gemm_epilogue" or "structure" not in entry:
                    return False
                st = entry["structure"]
                linear = st["ops"][0]
                if linear["op"] != "linear":
                    return False
                ix = linear["args"][0][1]
                if [i for i, n in enumerate(entry["binding"]["inputs"]) if n == node.name] \
                        != [ix]:
                    return False
                refs = [ref for op in st["ops"] for ref in op["args"]
                        if ref is not None and list(ref) == ["i", ix]]
                if len(refs) != 1 or any(slot["input"] == ix for slot in st["slots"]):
                    return False
            elif user.op == "call_function" and user.target is _LINEAR:
                if user.args[0] is not node or node in (*user.args[1:], *user.kwargs.values()):
                    return False
            else:
                return False
        return True

    def _schedule(self) -> list[Any]:
        """Nodes and units in a topological order of the condensed graph (stable)."""
        position = {n: i for i, n in enumerate(self.nodes)}
        key_of = {n: ("u", self.unit_of[n]) if n in self.unit_of else ("n", n)
                  for n in self.nodes}
        members: dict[Any, list[fx.Node]] = {}
        for n in self.nodes:
            members.setdefault(key_of[n], []).append(n)
        deps: dict[Any, set[Any]] = {k: set() for k in members}
        for key, nodes in members.items():
            for n in nodes:
                for a in n.all_input_nodes:
                    if key_of[a] != key:
                        deps[key].add(key_of[a])
        done: set[Any] = set()
        order: list[Any] = []
        pending = sorted(members, key=lambda k: position[members[k][0]])
        while pending:
            for i, key in enumerate(pending):
                if deps[key] <= done:
                    order.append(key)
                    done.add(key)
                    del pending[i]
                    break
            else:
                raise ValueError("kernel groups form a cycle in the graph")
        return order

    def _reads(self, key: Any) -> set[fx.Node]:
        """Nodes whose values the step at ``key`` reads from the environment."""
        if key[0] == "n":
            return set(key[1].all_input_nodes)
        unit = self.units[key[1]]
        members = set(unit["nodes"])
        reads = {a for n in members for a in n.all_input_nodes if a not in members}
        entry = unit["entry"]
        names: list[str] = []
        if "structure" in entry:
            names = list(entry["binding"]["inputs"])
        elif entry["kind"] == "jagged_attention":
            names = [entry[x] for x in ("q", "k", "v", "offsets")]
        elif entry["kind"] == "batched_embedding_bag":
            names = [t[x] for t in entry["tables"] for x in ("ids", "offsets")]
        return reads | {self.by_name[name] for name in names}

    def _last_reads(self) -> list[list[fx.Node]]:
        """Per step, the nodes whose last reader it is: their values leave the environment
        after it. Why: the environment would otherwise hold every intermediate of the
        forward until the loss returns, on top of what autograd saves; values autograd
        needs stay alive through autograd's own references."""
        last: dict[fx.Node, int] = {}
        for i, key in enumerate(self.order):
            produced = [key[1]] if key[0] == "n" else self.units[key[1]]["nodes"]
            for n in produced:
                last.setdefault(n, i)
            for n in self._reads(key):
                last[n] = max(last.get(n, i), i)
        free: list[list[fx.Node]] = [[] for _ in self.order]
        for n, i in last.items():
            free[i].append(n)
        return free

    # -- execution --------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> Any:
        env: dict[fx.Node, Any] = {}
        # jagged layouts by (offsets, clamp, max_len): the attention layers of one forward
        # share one, so the host reads the total length (a sync) once, not once per layer
        self._layouts: dict[tuple[str, int, int], tuple[torch.Tensor, int]] = {}
        user = iter(inputs)
        self.peak_live = 0
        for i, key in enumerate(self.order):
            if i and self.release:
                for n in self.free_after[i - 1]:
                    env.pop(n, None)
            self.peak_live = max(self.peak_live, len(env))
            if key[0] == "u":
                self._run_unit(self.units[key[1]], env)
                continue
            node = key[1]
            if node.op == "placeholder":
                fqn = _param_fqn(node)
                env[node] = self.params[fqn] if fqn is not None else next(user)
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], env.__getitem__)
                return result[0] if isinstance(result, (list, tuple)) and len(result) == 1 \
                    else result
            elif node.op == "call_function":
                env[node] = None if node.target in _SKIP else self._call(node, env)
            else:
                raise ValueError(f"cannot run node {node.name} ({node.op})")
        raise ValueError("graph has no output")

    def _call(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if "device" in kwargs:  # captured on meta: run where the inputs are
            kwargs = {**kwargs, "device": self.device}
        return node.target(*args, **kwargs)

    def _run_unit(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        entry = unit["entry"]
        by_name = self.by_name
        if "structure" in entry:
            binding = entry["binding"]
            inputs = [env[by_name[n]] for n in binding["inputs"]]
            if unit.get("shared_operand") and _autocast_on(inputs):
                self._run_as_aten(unit, env)
                return
            dtypes = self._narrowed(unit["narrow"], inputs)
            outs = unit["run"](*inputs, out_dtypes=dtypes)
            for name, value in zip(binding["outputs"], outs):
                env[by_name[name]] = value
        elif entry["kind"] == "jagged_attention":
            node = unit["nodes"][0]
            env[node] = self._jagged_attention(entry, env, by_name)
        elif entry["kind"] == "batched_embedding_bag":
            self._embeddings(entry, env, by_name)
        else:
            raise ValueError(f"unknown kernel kind {entry['kind']!r}")

    def _run_as_aten(self, unit: dict[str, Any], env: dict[fx.Node, Any]) -> None:
        """The loud fallback of a GEMM group that reads its GEMM's operand in the epilogue
        too (``n + linear(n)``): under autocast the kernel's GEMM needs the operand cast to
        the autocast dtype, the epilogue needs it uncast (eager adds the fp32 value), and
        the kernel takes one tensor per input. The group's own ATen ops run instead."""
        name = unit["entry"].get("name", "gemm_epilogue")
        if not unit.get("warned"):
            unit["warned"] = True
            warnings.warn(
                f"gemc: kernel {name} runs as its ATen ops under autocast: its epilogue reads "
                "the GEMM's own operand, which the kernel would see rounded to the autocast "
                "dtype (eager reads it unrounded)", RuntimeWarning, stacklevel=3)
        for node in unit["nodes"]:
            env[node] = self._call(node, env)

    @staticmethod
    def _narrowed(narrow: list[bool], inputs: Sequence[Any]) -> list[torch.dtype | None] | None:
        """Per output, the autocast dtype where the output may be written in it, else None."""
        if not any(narrow):
            return None
        dev = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return None
        dt = torch.get_autocast_dtype(dev)
        return [dt if f else None for f in narrow]

    def _jagged_attention(self, entry: dict[str, Any], env: dict[fx.Node, Any],
                          by_name: dict[str, fx.Node]) -> torch.Tensor:
        from .jagged import jagged_to_padded, padded_to_jagged
        from .jagged_attention import jagged_attention

        q, k, v = (env[by_name[entry[x]]] for x in ("q", "k", "v"))
        offsets = env[by_name[entry["offsets"]]]
        length = int(entry["max_len"])
        key = (entry["offsets"], int(entry["clamp_min"]), length)
        if key not in self._layouts:
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=key[1], max=length)
            attn_offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
            self._layouts[key] = (attn_offsets, int(attn_offsets[-1]))
        attn_offsets, total = self._layouts[key]
        qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), attn_offsets, total)
                      for x in (q, k, v))
        scale = entry["scale"] if entry["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        out = jagged_attention(qj, kj, vj, attn_offsets, length, scale=scale)
        return jagged_to_padded(out, attn_offsets, length).transpose(1, 2)

    def _embeddings(self, entry: dict[str, Any], env: dict[fx.Node, Any],
                    by_name: dict[str, fx.Node]) -> None:
        module = self.tables[entry["name"]]
        ids, offsets, weights = [], [], []
        base = 0
        mean = any(t["pooling"] == "mean" for t in entry["tables"])
        for t in entry["tables"]:
            tid = env[by_name[t["ids"]]]
            off = env[by_name[t["offsets"]]].to(torch.int64)
            if not t["include_last_offset"]:
                off = torch.cat([off, off.new_full((1,), tid.numel())])
            ids.append(tid.to(torch.int64))
            offsets.append(off[:-1] + base)
            base += tid.numel()
            if mean:
                lengths = off[1:] - off[:-1]
                scale = (1.0 / lengths.clamp(min=1).to(torch.float32)) if t["pooling"] == "mean" \
                    else torch.ones_like(lengths, dtype=torch.float32)
                weights.append(torch.repeat_interleave(scale, lengths, output_size=tid.numel()))
        flat_offsets = torch.cat([*offsets, offsets[0].new_full((1,), base)])
        psw = torch.cat(weights) if mean else None
        out = module(torch.cat(ids), flat_offsets, psw)
        for t, part in zip(entry["tables"], module.split_output(out)):
            env[by_name[t["output"]]] = part

    def table_weights(self, fqn: str) -> torch.Tensor:
        """The current (optimizer-updated) weights of an embedding table the runner owns."""
        for entry in self.entries:
            if entry["kind"] != "batched_embedding_bag":
                continue
            for t, w in zip(entry["tables"], self.tables[entry["name"]].split_weights()):
                if t["fqn"] == fqn:
                    return w
        raise KeyError(fqn)
