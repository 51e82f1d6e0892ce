"""``remat.compile``: ``torch.compile`` with remat's recompute pass (front end: graph mode).

Dynamo captures the model; AOTAutograd traces the joint forward/backward graph
and calls remat's partition function (``_partition.recompute_partition``),
which applies every mark on the joint graph, then hands the forward and backward
graphs to the chosen compiler (``aot_eager``: run as traced; ``inductor``:
generated kernels).
"""

from __future__ import annotations

import functools
import operator
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from remat._graph._dump import GraphDumper, input_label
from remat._graph._partition import GraphReport, recompute_partition

BACKENDS = ("aot_eager", "inductor")


class RematBackend:
    """A ``torch.compile`` backend that partitions with remat's recompute pass.

    Args:
        backend: ``"aot_eager"`` (run the graphs as traced) or ``"inductor"``.
        save_graphs: a directory for the dumps of every stage, or None.
        roots: objects holding the modules whose marks apply (modules, functions).

    Attributes:
        reports: one `GraphReport` per graph compiled.

    Examples:
        >>> import torch, remat
        >>> from remat._graph._backend import RematBackend
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> _ = remat.recompute_module(net[1], output_recompute=True)
        >>> backend = RematBackend("aot_eager", roots=[net])
        >>> torch.compile(net, backend=backend)(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> [op for _, op, _ in backend.reports[0].duplicated]
        ['aten::relu']
    """

    #: Read by the marks' compile check (``remat._front.compile_check``): this backend applies them.
    honours_remat_marks = True

    def __init__(
        self, backend: str = "aot_eager", *, save_graphs: str | None = None, roots: Iterable = ()
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"remat.compile: backend must be one of {BACKENDS}, got {backend!r}; "
                f"use 'aot_eager' on machines without a C++ compiler"
            )
        if _torch_version() < (2, 13):
            raise RuntimeError(
                f"remat.compile: needs torch 2.13 or later, found {torch.__version__}: under torch "
                f"2.11 the compiled step never reached remat's partition (no mark was applied, "
                f"the memory not saved); upgrade torch, or train with the eager marks"
            )
        self.backend = backend
        self.save_graphs = save_graphs
        self._roots = [_held(r) for r in roots]
        self.reports: list[GraphReport] = []

    @property
    def roots(self) -> list:
        """The roots still alive (NOTE [A compiled model held weakly])."""
        return [r for r in map(operator.call, self._roots) if r is not None]

    def note_inputs(self, args: tuple, kwargs: dict) -> None:
        """Remember modules passed to a compiled function, so their marks apply."""
        roots = self.roots
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.nn.Module) and all(value is not r for r in roots):
                self._roots.append(weakref.ref(value))
                roots.append(value)

    def modules(self) -> dict[int, torch.nn.Module]:
        """Return ``id(module) -> module`` for every module reachable from the roots."""
        found: dict[int, torch.nn.Module] = {}
        for root in _module_roots(self.roots):
            for module in root.modules():
                found[id(module)] = module
        return found

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        report = GraphReport()
        self.reports.append(report)
        partition = functools.partial(
            recompute_partition,
            modules=self.modules(),
            report=report,
            root=next((r for r in self.roots[:1] if isinstance(r, torch.nn.Module)), None),
            dump=self._dumper(gm, report),
        )
        if self.backend == "inductor":
            return _compile_inductor(gm, example_inputs, partition)
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        compiler = aot_autograd(
            fw_compiler=boxed_nop,  # boxed: each saved tensor is freed after its last use
            bw_compiler=boxed_nop,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )
        return compiler(gm, example_inputs)

    def _dumper(self, gm: torch.fx.GraphModule, report: GraphReport) -> Callable | None:
        if self.save_graphs is None:
            return None
        dumper = GraphDumper(self.save_graphs, len(self.reports) - 1, _input_names(gm))

        def dump(stage: str, module: torch.fx.GraphModule) -> None:
            report.dumps += dumper(stage, module)

        return dump


def _input_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Map AOTAutograd's ``primals_i`` to the Dynamo input it stands for (``fc1.weight``)."""
    names = {}
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder"), start=1):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None)
        label = input_label(source() if callable(source) else source) if source else node.name
        names[f"primals_{i}"] = label
    return names


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: list, partition: Callable) -> Callable:
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RematPartitioner(CustomPartitionerFn):
        def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            kwargs.pop("compiler", None)
            return partition(joint, joint_inputs, **kwargs)

        def uuid(self) -> None:
            return None  # marks change between runs: never reuse a cached compile

    # caches key on the partitioner; remat's holds the model's marks, so never cache
    with config.patch(custom_partitioner_fn=RematPartitioner(), force_disable_caches=True):
        return compile_fx(gm, example_inputs)


def _held(root: Any) -> Callable[[], Any]:
    """``root`` held weakly where it can be: NOTE [A compiled model held weakly].

    NOTE [A compiled model held weakly]
    ``torch.compile`` keeps every backend object it was given until ``torch.compiler.reset()``
    (its cache of backends), so a backend that held the model it compiles kept the model, its
    parameters and their memory for the process's life after the user dropped it (a model
    compiled for evaluation, a planner's trial copies); ``torch.compile`` with a named backend
    lets it go. The backend needs the model only to read its marks while Dynamo compiles
    it, which it does only while the model is called: so it holds its roots by weak
    reference (a bound method by `weakref.WeakMethod`), and an object that takes none
    (a builtin) strongly.
    """
    try:
        if isinstance(root, types.MethodType):
            return weakref.WeakMethod(root)
        return weakref.ref(root)
    except TypeError:
        return lambda: root


def _module_roots(roots: Iterable) -> list[torch.nn.Module]:
    """Find the modules a model or function refers to: itself, ``self``, closures, globals."""
    found: list[torch.nn.Module] = []
    for root in roots:
        for value in _referenced(root):
            if isinstance(value, torch.nn.Module) and all(value is not f for f in found):
                found.append(value)
    return found


def _referenced(obj: Any) -> list:
    if isinstance(obj, torch.nn.Module):
        return [obj]
    values = []
    bound = getattr(obj, "__self__", None)
    if bound is not None:
        values.append(bound)
    fn = getattr(obj, "__func__", obj)
    fn = getattr(fn, "__wrapped__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code = getattr(fn, "__code__", None)
    if code is not None:
        scope = getattr(fn, "__globals__", {})
        values += [scope[name] for name in _global_names(code) if name in scope]
    values += list(getattr(fn, "__defaults__", None) or ())
    flat = []
    for value in values:
        flat += list(value) if isinstance(value, (list, tuple)) else [value]
    return flat


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the torch in use."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
