"""MindSpore-style text dumps (and Graphviz files) of the graphs at each stage of the pass.

One node a line, as in MindSpore's ``save_graphs`` output (as its recompute tutorial shows it)::

    %12(relu_1) = aten.relu.default(%11) {instance name: relu2 (ReLU)} \
cnode_attrs: {need_cse_after_recompute: true, recompute: true} : (f32[2, 48]) -> (f32[2, 48])

Backward nodes have no module of their own; they show the module and the name
of the forward node they differentiate (``cnode_primal_attrs: {forward_node_name: ...}``),
found through AOTAutograd's ``seq_nr``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import fx

from remat._graph._regions import clean_path, is_view, module_path

ATTRS = "remat.cnode_attrs"
STAGES = ("captured", "recompute", "cse", "forward", "backward")

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def describe_value(value: Any) -> str:
    """Describe a node's value as ``f32[2, 48]``; tuples as ``(f32[2], f32[2])``."""
    if isinstance(value, torch.Tensor):
        dims = ", ".join(str(d) for d in value.shape)
        return f"{_DTYPES.get(value.dtype, str(value.dtype).replace('torch.', ''))}[{dims}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    if value is None:
        return "none"
    return type(value).__name__


def _show_arg(arg: Any, index: dict[fx.Node, int]) -> str:
    if isinstance(arg, fx.Node):
        return f"%{index.get(arg, '?')}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_show_arg(a, index) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, torch.dtype):
        return _DTYPES.get(arg, str(arg))
    return repr(arg)


def _show_attrs(attrs: dict) -> str:
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in attrs.items()) + "}"


def forward_origins(graph: fx.Graph) -> dict[int, tuple[str, str]]:
    """Map AOTAutograd's ``seq_nr`` to ``(forward node name, module path)`` of a joint graph."""
    found: dict[int, tuple[str, str, bool]] = {}
    for node in graph.nodes:
        seq = node.meta.get("seq_nr")
        if node.op != "call_function" or seq is None or "nn_module_stack" not in node.meta:
            continue
        if node.meta.get("partitioner_tag") == "is_backward":
            continue  # a copy made by the pass
        current = found.get(seq)
        if current is None or (current[2] and not is_view(node)):
            found[seq] = (node.name, module_path(node), is_view(node))
    return {seq: (name, path) for seq, (name, path, _) in found.items()}


def format_node(
    node: fx.Node,
    index: dict[fx.Node, int],
    origins: dict[int, tuple[str, str]],
    input_names: dict[str, str],
) -> str:
    """Return the one-line description of ``node`` used in dumps."""
    head = f"%{index[node]}({node.name})"
    out = describe_value(node.meta.get("val"))
    if node.op == "placeholder":
        label = input_names.get(node.name, "")
        path = module_path(node)  # a saved forward value, in a backward graph
        where = f" {{instance name: {path}}}" if path else ""
        return f"{head} = input{' ' + label if label else ''}{where} : () -> ({out})"
    if node.op == "output":
        return "return " + _show_arg(node.args[0], index)
    target = node.target
    op = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    args = [_show_arg(a, index) for a in node.args]
    args += [f"{k}={_show_arg(v, index)}" for k, v in node.kwargs.items()]
    line = f"{head} = {op}({', '.join(args)})"
    path = module_path(node)
    origin = origins.get(node.meta.get("seq_nr"))
    if not path and origin is not None:
        path = origin[1]
    if path:
        line += f" {{instance name: {path}}}"
    attrs = node.meta.get(ATTRS)
    if attrs:
        line += f" cnode_attrs: {_show_attrs(attrs)}"
    if "nn_module_stack" not in node.meta and origin is not None:
        line += f" cnode_primal_attrs: {{forward_node_name: {origin[0]}}}"
    ins = ", ".join(describe_value(a.meta.get("val")) for a in node.all_input_nodes)
    return f"{line} : ({ins}) -> ({out})"


def format_graph(
    graph: fx.Graph,
    *,
    title: str = "",
    origins: dict[int, tuple[str, str]] | None = None,
    input_names: dict[str, str] | None = None,
) -> str:
    """Return a MindSpore-style text dump of ``graph``, one node a line.

    Args:
        graph: the graph to show.
        title: first comment line.
        origins: ``seq_nr -> (forward node, module path)`` naming backward nodes'
            forward counterparts (see `forward_origins`); built from
            ``graph`` when omitted.
        input_names: ``placeholder name -> label`` (parameter names of primals).

    Returns:
        The dump text.

    Examples:
        >>> import torch, torch.fx as fx
        >>> gm = fx.symbolic_trace(lambda x: torch.relu(x))
        >>> print(format_graph(gm.graph).splitlines()[-1])
        return %1
    """
    origins = forward_origins(graph) if origins is None else origins
    index = {n: i for i, n in enumerate(graph.nodes)}
    lines = [f"# {title}"] if title else []
    lines.append(
        "# %index(name) = operator(inputs) {instance name: module} cnode_attrs: {...} "
        ": (input types) -> (output type)"
    )
    lines += [format_node(n, index, origins, input_names or {}) for n in graph.nodes]
    return "\n".join(lines) + "\n"


def format_dot(graph: fx.Graph, *, title: str = "") -> str:
    """Return a Graphviz ``digraph`` of ``graph``: recomputed nodes orange, copies red, consumers blue."""
    colors = {"duplicated": "tomato", "recompute": "orange", "target_grad": "lightblue"}
    lines = [f'digraph "{title or "graph"}" {{', "  node [shape=box, style=filled, fillcolor=white];"]
    for node in graph.nodes:
        attrs = node.meta.get(ATTRS) or {}
        color = next((c for k, c in colors.items() if attrs.get(k)), "white")
        label = f"{node.name}\\n{node.target if node.op == 'call_function' else node.op}"
        path = module_path(node)
        if path:
            label += f"\\n{path}"
        lines.append(f'  "{node.name}" [label="{_dot_escape(label)}", fillcolor={color}];')
        for arg in node.all_input_nodes:
            lines.append(f'  "{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_escape(text: str) -> str:
    return text.replace('"', '\\"')


class GraphDumper:
    """Write the dumps of one compiled graph: ``<dir>/graph<k>_<nn>_<stage>.ir`` and ``.dot``.

    Args:
        directory: where to write (created if missing).
        graph_index: the number of this graph among those the compiled object produced.
        input_names: ``primals_i -> parameter name`` labels for the joint graph's inputs.
    """

    def __init__(self, directory: str, graph_index: int, input_names: dict[str, str]) -> None:
        self.directory = directory
        self.graph_index = graph_index
        self.input_names = input_names
        self.origins: dict[int, tuple[str, str]] = {}
        self.paths: list[str] = []
        os.makedirs(directory, exist_ok=True)

    def __call__(self, stage: str, gm: fx.GraphModule) -> list[str]:
        """Dump ``gm`` as stage ``stage``; return the files written."""
        if stage == "captured":
            self.origins = forward_origins(gm.graph)
        number = STAGES.index(stage) if stage in STAGES else len(STAGES)
        stem = os.path.join(self.directory, f"graph{self.graph_index}_{number:02d}_{stage}")
        title = f"remat graph {self.graph_index}, stage {stage}"
        text = format_graph(gm.graph, title=title, origins=self.origins, input_names=self.input_names)
        written = []
        for path, content in ((stem + ".ir", text), (stem + ".dot", format_dot(gm.graph, title=title))):
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(content)
            written.append(path)
        self.paths += written
        return written


_PARAM_SOURCE = re.compile(r"\._(?:modules|parameters|buffers)\[(['\"])([^'\"\]]+)\1\]")


def input_label(source_name: str) -> str:
    """Turn a Dynamo input source (``L['self']._modules['fc1']._parameters['weight']``) into ``fc1.weight``."""
    return clean_path(_PARAM_SOURCE.sub(r".\2", source_name))
