"""``remat.estimate``: the memory of a training step, measured on fake tensors.

The model is built inside ``FakeTensorMode``: every tensor has a shape, dtype
and device but no data, so a 7B-parameter model costs nothing to build. The
step (forward, loss, backward, optimizer step) then runs under
`remat.memory.track` exactly as [`remat.profile`][remat.profile] runs it, and the
tracker's bytes are those a real run on the same device's kernels allocates.
A CPU build of torch cannot fake CUDA tensors: estimates made here reflect
CPU kernels (the report's ``device`` says so).

NOTE [Estimating a rank]
With ``world_size=N`` the step is what rank ``rank`` of an N-rank job runs:
a fake process group (torch's ``FakeProcessGroup``, as torchtitan's memory
estimation uses) stands for the job, so collectives return at once and move
nothing, and every tensor is fake. The model is built, marked, then handed to
``parallelize(model, mesh)`` with a 1-D ``DeviceMesh`` of N ranks (marks go on
before tensor parallelism and ``fully_shard``, as on a real rank); the tracker
then counts what this rank holds (NOTE [Memory per rank] in ``_tracker.py``).
Two things a real group does differently are made alike: ``wait_tensor``
returns the tensor it waits (a fake group's would be a new one), and DTensor's
sharding propagation is not counted. Gloo's buffers inside collectives count
by the tracker's rules (NOTE [Collective temporaries]), so an estimate is the
tracker's figure for a real gloo rank, checked against 2 real gloo processes
in ``tests/test_estimate_parallel.py``. The fake group is the process's
default group while the estimate runs and is destroyed after it, even on
error; an estimate cannot run where a real group is initialized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from remat._front.blocks import find_blocks
from remat._front.marks import apply
from remat._vocab.errors import check_bool
from remat.memory._compose import compose_report, identical_container
from remat.memory._report import ProfileReport
from remat.memory.profile import OptimizerLike, measure

Marks = None | str | type | Iterable[type] | Callable[[torch.nn.Module], Any]
Parallelize = Callable[[torch.nn.Module, Any], Any]
API = "remat.estimate"


def build_model(model: Any) -> torch.nn.Module:
    """Build ``model`` (a factory, a model class, or a Llama/GPT config) in the current mode."""
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        from remat.models.llama import Llama, LlamaConfig

        if isinstance(model, LlamaConfig):
            return Llama(model)
        try:
            from remat.models.gpt import GPT, GPTConfig
        except ImportError:  # pragma: no cover - the GPT model ships with remat.models
            GPT = GPTConfig = None
        if GPTConfig is not None and isinstance(model, GPTConfig):
            return GPT(model)
    if isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{API}: pass a factory that builds the model (a class, a function, or "
            f"functools.partial), not a built {type(model).__name__}; it is built on fake tensors"
        )
    if not callable(model):
        raise TypeError(f"{API}: model must be a factory or a LlamaConfig/GPTConfig, got {type(model).__name__}")
    built = model()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"{API}: the factory must return a torch.nn.Module, got {type(built).__name__}")
    return built


def apply_marks(model: torch.nn.Module, marks: Marks, api: str = API) -> None:
    """Mark ``model`` as ``marks`` says: ``"blocks"`` (the model's ``mark_blocks()`` if it
    has one, else [`remat.apply`][remat.apply]'s ``where="blocks"``), class names, globs or module
    types for [`remat.apply`][remat.apply], or a function ``marks(model)``."""
    if marks is None:
        return
    if marks == "blocks" and callable(getattr(model, "mark_blocks", None)):
        model.mark_blocks()
    elif isinstance(marks, (str, type)) or (
        isinstance(marks, (list, tuple)) and all(isinstance(t, (str, type)) for t in marks)
    ):
        try:
            apply(model, where=marks)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("remat.apply", api).replace("where=", "marks=")) from None
    elif callable(marks):
        marks(model)
    else:
        raise TypeError(f"{api}: marks must be None, 'blocks', class names, module types or a function, "
                        f"got {type(marks).__name__}")


def _build_in(model: Any, dtype: torch.dtype | None) -> torch.nn.Module:
    # Module.to(dtype) cannot swap fake parameters; build them in the dtype instead.
    if dtype is None:
        return build_model(model)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build_model(model)
    finally:
        torch.set_default_dtype(old)


def _fake_inputs(mode: FakeTensorMode, inputs: tuple, dtype: torch.dtype | None) -> tuple:
    if len(inputs) == 1 and callable(inputs[0]) and not isinstance(inputs[0], torch.Tensor):
        made = inputs[0]()
        return made if isinstance(made, tuple) else (made,)
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            out.append(mode.from_tensor(item))
        elif isinstance(item, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in item):
            out.append(torch.randn(*item, dtype=dtype))
        else:
            raise TypeError(f"{API}: each example input must be a tensor or a shape (tuple of ints), "
                            f"or pass one function that returns the inputs; got {type(item).__name__}")
    return tuple(out)


class Ranks:
    """One rank of a job on a fake process group: checks the arguments, then builds meshes
    and parallelizes models (NOTE [Estimating a rank]).

    Args:
        world_size: ranks in the job, or None (one process, no group).
        parallelize: ``parallelize(model, mesh)``, which shards the model in place or
            returns the sharded model.
        rank: the rank whose memory is measured.
        api: the public name errors start with.
    """

    def __init__(self, world_size: int | None, parallelize: Parallelize | None, rank: int | None,
                 api: str = API) -> None:
        self.world_size, self.parallelize, self.api = world_size, parallelize, api
        self.rank = rank if rank is not None else (0 if world_size is not None else None)
        self._meshes: dict[str, Any] = {}
        self._check()

    def _check(self) -> None:
        api, world, rank = self.api, self.world_size, self.rank
        if world is None:
            if self.parallelize is not None:
                raise ValueError(f"{api}: parallelize= needs world_size=N, the number of ranks it "
                                 f"shards the model over; pass world_size")
            if rank is not None:
                raise ValueError(f"{api}: rank={rank!r} needs world_size=N and parallelize=; "
                                 f"without them the estimate is of one process")
            return
        if isinstance(world, bool) or not isinstance(world, int):
            raise TypeError(f"{api}: world_size must be an int (the number of ranks), "
                            f"got {type(world).__name__}")
        if world < 1:
            raise ValueError(f"{api}: world_size must be at least 1, got {world}")
        if self.parallelize is None:
            raise ValueError(
                f"{api}: world_size={world} needs parallelize=fn(model, mesh) that shards the model "
                f"(parallelize_module, fully_shard); without it every rank holds the whole model: "
                f"leave world_size out for that")
        if not callable(self.parallelize):
            raise TypeError(f"{api}: parallelize must be a function (model, mesh) -> model or None, "
                            f"got {type(self.parallelize).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{api}: rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < world:
            raise ValueError(f"{api}: rank must be in [0, {world}) for world_size={world}, got {rank}")

    @property
    def active(self) -> bool:
        """Whether this is a rank of a job (``world_size`` given)."""
        return self.world_size is not None

    def describe(self) -> str:
        """``"rank r of N"``, or ``""`` for one process."""
        return f"rank {self.rank} of {self.world_size}" if self.active else ""

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The fake process group (nothing for one process); destroyed on exit, even on error."""
        if not self.active:
            yield
            return
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError(f"{self.api}: world_size= needs torch.distributed, which this build "
                               f"of torch lacks")
        if dist.is_initialized():
            raise RuntimeError(
                f"{self.api}: world_size= runs rank {self.rank} of {self.world_size} on a fake process "
                f"group, but a process group is already initialized here (backend "
                f"{dist.get_backend()!r}, {dist.get_world_size()} ranks); estimate in a process "
                f"without one (before dist.init_process_group, or after dist.destroy_process_group)")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        hook = sys.excepthook  # init_process_group prefixes uncaught errors with the rank
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        try:
            with _RealCollectives():
                yield
        finally:
            self._meshes.clear()
            if dist.is_initialized():
                dist.destroy_process_group()
            sys.excepthook = hook

    def apply(self, model: torch.nn.Module, device: str) -> torch.nn.Module:
        """Hand ``model`` (marked) to ``parallelize`` with a 1-D mesh of the ranks on ``device``."""
        if not self.active:
            return model
        if device not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            with unset_fake_temporarily():  # the mesh's rank table is real data
                self._meshes[device] = init_device_mesh(device, (self.world_size,))
        out = self.parallelize(model, self._meshes[device])
        if out is None:
            return model
        if not isinstance(out, torch.nn.Module):
            raise TypeError(f"{self.api}: parallelize must return the model (or None), "
                            f"got {type(out).__name__}")
        return out


class _RealCollectives(TorchDispatchMode):
    """Under a fake group, ``wait_tensor`` returns the tensor it waits, as a real group's does
    (NOTE [Estimating a rank]): the result of a collective is one storage, not two."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]
        return func(*args, **(kwargs or {}))


def device_of(inputs: Iterable[Any]) -> str:
    """The device type of the first tensor among ``inputs`` (``"cpu"`` when there is none)."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    return first.device.type if first is not None else "cpu"


def estimate(model: Any, *example_inputs: Any, batch: dict | None = None,
             loss_fn: Callable | None = None,
             optimizer: OptimizerLike = "adam", marks: Marks = None,
             dtype: torch.dtype | None = None, output_recompute: bool = False,
             label: str = "", world_size: int | None = None,
             parallelize: Parallelize | None = None, rank: int | None = None,
             compose: bool = False) -> ProfileReport:
    """Estimate the peak memory of one training step without allocating it.

    Args:
        model: a factory returning the model (class, function, ``functools.partial``),
            or a `LlamaConfig` / GPT config.
        *example_inputs: tensors (copied as fake tensors), shapes (random inputs in ``dtype``),
            or one function returning the inputs (called under the fake mode).
        batch: keyword inputs, ``model(*inputs, **batch)``: tensors or shapes, as above
            (a Hugging Face batch: ``{"input_ids": ..., "labels": ...}``).
        loss_fn: ``loss_fn(output) -> scalar``; default: sum of floating outputs.
        optimizer: ``"adam"`` (default), ``"adamw"``, ``"sgd"``, ``callable(params)``
            or None; its state (Adam: twice the parameters) exists before the step.
        marks: recompute marks to apply: ``"blocks"``, class names or globs (``"GPT2Block"``),
            module types, or ``marks(model)``.
        dtype: cast the model's floating parameters to this dtype (e.g. ``torch.bfloat16``).
        output_recompute: passed to the ``if_recomputed`` column of unmarked modules.
        label: the report's name.
        world_size: estimate one rank of a job of this many ranks, on a fake process group
            (NOTE [Estimating a rank]); needs ``parallelize``.
        parallelize: ``parallelize(model, mesh)``: shards the built and marked model over
            ``mesh``, a 1-D ``DeviceMesh`` of ``world_size`` ranks on the inputs' device type
            (``parallelize_module``, ``fully_shard``; it may build its own meshes over the same
            ranks, e.g. a 2-D one); returns the model, or None when it shards in place.
        rank: the rank estimated (default 0): ranks differ where a dimension does not divide.
        compose: for a model whose blocks are the identical children of one container (one
            class, one set of parameter shapes and marks, at least 6 of them), run the step
            with 3 and with 4 of them and compose the whole step's figures, exactly (NOTE
            [Composing an estimate]): a 32-block model costs 7 blocks' trace. The report then
            has no timeline and no bytes by module or phase at the peak (``report.composed``
            says how it was made); where the composition does not hold, or for a rank
            (``world_size``), the whole model is traced.

    Returns:
        A `ProfileReport` (``estimated=True``, no times):
        ``peak_bytes`` is the step's peak, parameters and optimizer state included;
        with ``world_size``, what rank ``rank`` holds (``report.rank``, ``report.world_size``).

    Raises:
        TypeError: ``model`` is a built module, or an input is neither tensor nor shape.
        ValueError: ``world_size`` without ``parallelize`` (or the reverse), ``world_size < 1``,
            ``rank`` outside ``[0, world_size)``.
        RuntimeError: ``world_size`` where a process group is already initialized.

    Examples:
        >>> import torch, remat
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
        >>> report = remat.estimate(make, (4096, 1024))
        >>> report.peak_bytes > 3 * report.param_bytes   # params, Adam state, grads
        True

        One rank of 4, the model's layer sharded column-wise (tensor parallelism):

        >>> from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        >>> shard = lambda model, mesh: parallelize_module(model, mesh, {"0": ColwiseParallel()})
        >>> rank = remat.estimate(make, (4096, 1024), world_size=4, parallelize=shard)
        >>> (rank.world_size, rank.param_bytes == report.param_bytes // 4)
        (4, True)

        A model of identical blocks, composed from 3 and 4 of them (the same figures, faster):

        >>> from remat.models.llama import LlamaConfig
        >>> config = LlamaConfig(layers=8, width=64, heads=4, hidden=128, vocab=300)
        >>> tokens = lambda: (torch.zeros(2, 32, dtype=torch.long),)
        >>> fast = remat.estimate(config, tokens, compose=True)
        >>> (fast.peak_bytes == remat.estimate(config, tokens).peak_bytes, fast.composed)
        (True, '8 identical blocks composed from runs with 3 and 4')
    """
    check_bool(API, "output_recompute", output_recompute)
    check_bool(API, "compose", compose)
    ranks = Ranks(world_size, parallelize, rank)
    if batch is not None and not isinstance(batch, dict):
        raise TypeError(f"{API}: batch must be a dict of keyword inputs, got {type(batch).__name__}")
    with ranks.group(), FakeTensorMode() as mode:
        net = _build_in(model, dtype)
        apply_marks(net, marks)
        inputs = _fake_inputs(mode, example_inputs, dtype)
        keywords = dict(zip(batch, _fake_inputs(mode, tuple(batch.values()), dtype))) if batch else {}
        device = device_of((*inputs, *keywords.values()))
        net = ranks.apply(net, device)
        net.train()
        where = f"{device} kernels (FakeTensorMode)"
        if ranks.active:
            where += f", {ranks.describe()} (fake process group)"
        def run(watch: Callable | None = None) -> ProfileReport:
            return measure(net, inputs, batch=keywords, loss_fn=loss_fn, optimizer=optimizer,
                           output_recompute=output_recompute, repeat=0, estimated=True,
                           label=label or type(net).__name__, device=where, api=API, watch=watch)

        report = None
        if compose and not ranks.active:  # NOTE [Composing an estimate]
            container = identical_container(net, find_blocks(net), marks=True)
            report = compose_report(net, container, run) if container is not None else None
        report = report or run()
    report.rank, report.world_size = ranks.rank, ranks.world_size
    return report
