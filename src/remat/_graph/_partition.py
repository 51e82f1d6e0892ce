"""The recompute pass on the joint forward/backward graph, and remat's partition function.

MindSpore's graph-mode recomputation, on an AOTAutograd joint graph:

1. the forward nodes a mark asks to recompute get the attributes
   ``recompute`` and ``need_cse_after_recompute`` (see ``_regions``);
2. each backward node that reads one of them reads a copy instead (attribute
   ``target_grad``). The copy (``duplicated``, ``need_cse_after_recompute``) is
   inserted right before the first backward node that needs it, together with
   the copies of the recomputed producers it needs, so recomputation does not
   raise memory early;
3. common subexpressions are eliminated in the backward part (``_cse``);
4. the graph is split by torch's min-cut partitioner, as ``torch.compile`` splits it
   (NOTE [Unmarked operators under the min-cut]
What no mark covers is partitioned as ``torch.compile``'s own ``aot_eager`` and
Inductor partition it: by ``min_cut_rematerialization_partition``, which saves the
fewest bytes from which backward rebuilds what it reads, recomputing cheap operators
(pointwise, views; never a product or a random draw at the default budget) where that
saves memory, and honours ``torch._functorch.config.activation_memory_budget``. The
joint graph gets torch's common-subexpression pass first, as in torch's min-cut.
Marks add to it: their copies are tagged ``must_be_in_backward`` (the min-cut computed
a copy in forward and saved its output, the very tensor the mark asked not to keep),
and the min-cut's own common-subexpression pass is off (it merged each copy back into
its original; step 3 ran on backward alone). One of torch's choices is overruled: a
node that reads an input the graph updates in place is saved, never recomputed (NOTE
[Inputs the graph mutates]: torch's min-cut recomputes it after the update, silently
wrong). So an unmarked model compiles to torch's own partition, and a marked one keeps
at most what its marks leave. On issue 27's Llama (4 layers, width 256, 4 x 256 tokens)
the unmarked compiled step saves 73.9 MB where the default partitioner, which saves
every forward value backward reads, saved 94.6 MB (its GPT: the same 73.6 MB both ways).
``GraphReport.partitioned`` names the unmarked nodes the min-cut rebuilt.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from remat._graph._cse import eliminate_common_subexpressions
from remat._graph._regions import is_view, module_path, op_name, plan_recompute

#: Key of remat's MindSpore-style attributes in ``node.meta``.
ATTRS = "remat.cnode_attrs"
RECOMPUTE_ATTRS = {"need_cse_after_recompute": True, "recompute": True}
DUPLICATED_ATTRS = {"need_cse_after_recompute": True, "duplicated": True}
BACKWARD_TAGS = ("is_backward", "must_be_in_backward")


@dataclass
class GraphReport:
    """What the recompute pass did to one compiled graph.

    Args:
        recomputed: ``(node, operator, module path)`` of the forward values not saved
            because a mark asks to recompute them.
        duplicated: ``(copy, operator, module path)`` of the copies put in backward.
        target_grad: names of the backward nodes that read a copy.
        cse_merged: backward nodes removed by common-subexpression elimination.
        saved_bytes: bytes of the activations the forward graph saves for backward
            (saved values that are not graph inputs such as parameters).
        saved: names of those saved activations.
        dumps: paths of the dump files written (empty without ``save_graphs``).
        copy_flops: floating-point operations of the copies (``torch.utils.flop_counter``'s
            formulas on the traced shapes): what recomputation computes.
        copy_bytes: bytes the copies read and write: what recomputation moves.
        partitioned: ``(node, operator, module path)`` of the unmarked forward nodes
            torch's min-cut recomputes in backward (NOTE [Unmarked operators under the
            min-cut]); views are left out.
    """

    recomputed: list[tuple[str, str, str]] = field(default_factory=list)
    duplicated: list[tuple[str, str, str]] = field(default_factory=list)
    target_grad: list[str] = field(default_factory=list)
    cse_merged: int = 0
    saved_bytes: int = 0
    saved: list[str] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)
    copy_flops: float = 0.0
    copy_bytes: int = 0
    partitioned: list[tuple[str, str, str]] = field(default_factory=list)


def split_joint(graph: fx.Graph) -> tuple[list[fx.Node], list[fx.Node]]:
    """Return the forward and backward ``call_function`` nodes of a joint graph, in order.

    AOTAutograd tags each node: backward nodes ``is_backward``; forward nodes
    ``is_forward``, or ``must_be_in_forward`` for the buffer updates (``copy_``)
    it appends after the backward nodes.
    """
    forward, backward = [], []
    for node in graph.nodes:
        if node.op == "call_function":
            is_backward = node.meta.get("partitioner_tag") in BACKWARD_TAGS
            (backward if is_backward else forward).append(node)
    return forward, backward


def drop_detaches(graph: fx.Graph) -> int:
    """Remove ``aten.detach`` nodes read only by other operators (no-ops in a traced graph)."""
    dropped = 0
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.detach.default and all(
            u.op == "call_function" for u in node.users
        ):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
    return dropped


def mutated_reads(forward: list[fx.Node]) -> set[fx.Node]:
    """The forward nodes that read an input the graph updates in place, or a view of one.

    NOTE [Inputs the graph mutates]
    A buffer a forward updates in place (a step counter, an EMA statistic, batch
    norm's running statistics) is an input of the joint graph that AOTAutograd writes
    back (``copy_``) when the forward ends. A copy of a node that read it, placed in
    backward, reads the updated value, not the one the forward read: the compiled
    re-run of an ``output_recompute`` block that multiplies by its counter used the
    next count (eager marks replay the state instead, NOTE [Observed writes]). Such
    nodes are kept, and torch's min-cut is told to keep them too (`keep_mutated_reads`);
    the recomputed nodes after them read what they kept. A view of such an input
    (``x.transpose(1, 2)``) shares its memory, so the nodes reading the view are kept too
    (a model input changed in place by a later block: the compiled re-run of the block
    before it read the changed input, shared fuzz case 5012).
    """
    mutated = {n.args[0] for n in forward
               if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
               and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"}
    if not mutated:
        return set()
    for n in forward:  # a view of such an input reads it too, wherever it is placed
        if n.op == "call_function" and n.args and n.args[0] in mutated and (
                n.target is operator.getitem or getattr(n.target, "is_view", False)):
            mutated.add(n)
    return mutated | {n for n in forward if any(a in mutated for a in n.all_input_nodes)}


def keep_mutated_reads(forward: list[fx.Node], recompute: set[fx.Node]) -> set[fx.Node]:
    """``recompute`` less the nodes that read an input the graph updates in place, each of them
    tagged ``MUST_SAVE`` (the tag torch's selective checkpoint sets) so that torch's min-cut
    keeps it too (NOTE [Inputs the graph mutates]). Left to itself, the min-cut recomputes such
    a read in backward, after the update: a block that updates and reads a step counter got
    gradients off by up to 0.46 under ``torch.compile``'s own ``aot_eager`` (torch 2.13)."""
    reads = mutated_reads(forward)
    for n in reads:
        if n.op == "call_function":
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return recompute - reads if reads else recompute


def copy_into_backward(
    graph: fx.Graph, backward: list[fx.Node], recompute: set[fx.Node]
) -> dict[fx.Node, fx.Node]:
    """Make backward read copies of the ``recompute`` values; return ``{original: copy}``.

    Each copy is placed right before the first backward node that reads it
    (directly or through another copy). Multi-output operators are copied
    whole when one of their recomputed outputs is needed.
    """
    producers = {n.args[0] for n in recompute if n.target is operator.getitem}
    copies: dict[fx.Node, fx.Node] = {}

    def materialize(node: Any, before: fx.Node) -> Any:
        if not isinstance(node, fx.Node) or (node not in recompute and node not in producers):
            return node
        if node not in copies:
            with graph.inserting_before(before):
                copy = graph.node_copy(node, lambda arg: materialize(arg, before))
            copy.name = graph._graph_namespace.create_name(f"{node.name}_recompute", None)
            copy.meta["partitioner_tag"] = "must_be_in_backward"
            copy.meta[ATTRS] = dict(DUPLICATED_ATTRS)
            copy.meta["remat.copy_of"] = node.name
            copies[node] = copy
        return copies[node]

    for node in backward:
        for arg in list(node.all_input_nodes):
            if arg in recompute:
                node.replace_input_with(arg, materialize(arg, node))
                node.meta[ATTRS] = {**node.meta.get(ATTRS, {}), "target_grad": True}
    for node in recompute:
        node.meta[ATTRS] = dict(RECOMPUTE_ATTRS)
    return copies


Dump = Callable[[str, fx.GraphModule], list[str] | None]


def recompute_partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    *,
    modules: dict[int, torch.nn.Module],
    report: GraphReport,
    root: torch.nn.Module | None = None,
    dump: Dump | None = None,
    **kwargs: Any,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition ``joint`` into forward and backward graphs, honouring remat's marks.

    Args:
        joint: AOTAutograd's joint forward/backward graph module (changed in place).
        joint_inputs: its example inputs (passed on to torch's min-cut partitioner).
        modules: ``id(module) -> module`` of the modules whose marks apply.
        root: the compiled module (its own mark covers the whole graph), or None.
        report: filled with what the pass did.
        dump: called as ``dump(stage, graph_module)`` after each stage, or None.
        **kwargs: the partitioner keywords AOTAutograd passes (``num_fwd_outputs``, ...).

    Returns:
        ``(forward module, backward module)``.
    """
    stage = dump or (lambda name, gm: None)
    stage("captured", joint)
    if functorch_config.cse:  # as torch's min-cut does first (NOTE [Unmarked operators under the min-cut])
        joint.graph = fx_graph_cse(joint.graph)
    graph = joint.graph
    drop_detaches(graph)
    forward, backward = split_joint(graph)
    _, recompute = plan_recompute(forward, modules, root)
    recompute = keep_mutated_reads(forward, recompute)
    copies = copy_into_backward(graph, backward, recompute)
    graph.lint()
    joint.recompile()
    stage("recompute", joint)
    _, backward = split_joint(graph)
    report.cse_merged = eliminate_common_subexpressions(graph, backward)
    joint.recompile()
    stage("cse", joint)
    with functorch_config.patch(cse=False):  # NOTE [Unmarked operators under the min-cut]
        fw_module, bw_module = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    stage("forward", fw_module)
    stage("backward", bw_module)
    _fill_report(report, forward, recompute, copies, graph, bw_module)
    return fw_module, bw_module


def _fill_report(
    report: GraphReport,
    forward: list[fx.Node],
    recompute: set[fx.Node],
    copies: dict[fx.Node, fx.Node],
    graph: fx.Graph,
    bw_module: fx.GraphModule,
) -> None:
    alive = set(graph.nodes)
    report.recomputed = [(n.name, _op(n), module_path(n)) for n in forward if n in recompute]
    report.duplicated = [(c.name, _op(c), module_path(c)) for c in copies.values() if c in alive]
    work = [_work(c) for c in copies.values() if c in alive]
    report.copy_flops = float(sum(f for f, _ in work))
    report.copy_bytes = int(sum(b for _, b in work))
    report.target_grad = [
        n.name for n in graph.nodes if n.meta.get(ATTRS, {}).get("target_grad")
    ]
    in_backward = {p.name for p in bw_module.graph.find_nodes(op="placeholder") if p.users}
    saved = [
        n
        for n in graph.nodes
        if n.name in in_backward and n.op == "call_function" and not _aliases_input(n)
    ]
    report.saved = [n.name for n in saved]
    rebuilt = {n.name for n in bw_module.graph.nodes if n.op == "call_function"}
    report.partitioned = [(n.name, _op(n), module_path(n)) for n in forward
                          if n.name in rebuilt and n not in recompute and not is_view(n)
                          and n.target is not operator.getitem]
    report.saved_bytes = sum(_nbytes(n.meta.get("val")) for n in saved)


def _work(node: fx.Node) -> tuple[float, int]:
    """``(FLOPs, bytes read and written)`` of one copied node, from its traced values."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or is_view(node):
        return 0.0, 0
    from torch.utils._pytree import tree_leaves, tree_map

    from remat._graph._flops import flop_formulas

    def value(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args, kwargs = tree_map(value, (node.args, node.kwargs))
    out = node.meta.get("val")
    moved = sum(_nbytes(t) for t in tree_leaves((args, kwargs, out)))
    packet = target._overloadpacket
    flops, formulas = 0.0, flop_formulas()  # NOTE [Attention's FLOPs on the CPU]
    if packet in formulas:
        try:
            flops = float(formulas[packet](*args, **kwargs, out_val=out))
        except (TypeError, ValueError, RuntimeError, NotImplementedError):  # bytes only, then
            flops = 0.0
    return flops, moved


def _op(node: fx.Node) -> str:
    return "getitem" if node.target is operator.getitem else op_name(node)


def _aliases_input(node: fx.Node) -> bool:
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "placeholder"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0
