"""``remat.plan``: choose what each block recomputes so a step fits a memory budget (layer 4).

The cost model (``_trace.py``, ``_measure.py``, ``_cost.py``) measures every block under
every option, the solver (``_solve/``) picks the options of least extra time whose predicted
peak fits, and the plan is then measured: when the tracker's peak exceeds the
budget, the solver runs again on a budget lowered by the excess (NOTE [Solve, measure,
lower the target] in ``_loop.py``). A
`Plan` is data; `Plan.apply` sets the marks through
[`remat.recompute_module`][remat.recompute_module].
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from remat._front.marks import marked_modules
from remat.memory.estimate import Ranks
from remat.memory.internal import Step, StepFn
from remat.memory.profile import OptimizerLike, check_trainable
from remat.planner._budget import parse_budget
from remat.planner._fitting import _plans
from remat.planner._loop import let_go
from remat.planner._result import Decision, JobRank, Measured, Plan
from remat.planner._settings import Builder, Machine, Settings, Solving
from remat.planner._solve import FAMILIES, OPTIONS, BudgetError

API = "remat.plan"

__all__ = ["Decision", "JobRank", "Measured", "Plan", "plan", "sweep"]


def plan(model: Any, *example_inputs: Any, budget: float | str, batch: Any = None,
         loss_fn: Callable | None = None, step: StepFn | None = None, optimizer: OptimizerLike = "adam",
         blocks: Any = None, options: Sequence[str] = OPTIONS, device: str | None = None,
         throughput: float | None = None, dtype: torch.dtype | None = None,
         verify: bool | str = True, solver: str = "auto", repeat: int = 3,
         progress: Callable[[str], None] | None = None, compose: bool = True,
         world_size: int | None = None, parallelize: Callable | None = None,
         rank: int | None = None) -> Plan:
    """Choose, per block, keep / recompute / selective / output_recompute, or marks on some of
    the block's children, for a memory budget.

    The plan has the least predicted extra time among those whose predicted step
    peak (parameters, gradients, optimizer state, activations, temporaries, as
    `remat.memory.track` counts them) fits ``budget``; with ``verify`` the
    plan is then run once under the tracker and re-solved until the measured
    peak fits too.

    The step measured is the one a training loop runs (NOTE [The step users run]):
    ``out = model(*example_inputs, **batch); loss_fn(out).backward()`` with ``out`` (a
    tensor, tuple, dict or Hugging Face ``ModelOutput``) alive until the step ends, the
    optimizer's step included; or ``step(model, batch)``, the loop's own body. The
    no-recompute peak a fractional budget scales is that step's.

    Args:
        model: a ``torch.nn.Module`` (profiled on real tensors, not changed), or a
            factory / ``LlamaConfig`` / ``GPTConfig`` (planned on fake tensors, as
            [`remat.estimate`][remat.estimate] runs it; times from FLOPs and bytes moved).
        *example_inputs: the model's inputs (tensors; shapes or a function for factories).
        budget: peak bytes (int), a fraction in (0, 1] of the no-recompute peak (float),
            or a string: ``"60%"`` or ``"0.6"`` (a fraction), ``"6GiB"``, ``"512MB"`` (bytes),
            read as ``remat plan --budget`` reads it (`remat.planner.parse_budget`).
        batch: the model's keyword inputs, ``model(*example_inputs, **batch)`` (a Hugging
            Face batch: ``{"input_ids": ..., "labels": ...}``), as for [`remat.profile`][remat.profile];
            with ``step``, whatever ``step`` takes as its batch.
        loss_fn: ``loss_fn(output) -> scalar``; default: the output's ``loss`` if it has
            one, else the sum of the floating outputs.
        step: ``step(model, batch) -> loss``, one step of the loop to plan for (gradient
            accumulation, several losses, an output freed early), used for the costs and the
            verification alike. It runs the forward and calls ``loss.backward()`` (or returns
            the loss and the planner calls it). ``batch`` is ``batch=``, or the one example
            input, or the example inputs as a tuple. Not with ``loss_fn``.
        optimizer: as for [`remat.profile`][remat.profile] (default ``"adam"``; its state counts).
        blocks: the modules to plan: names, or a module type; default: the blocks that
            ``remat.apply(model, where="blocks")`` marks (Hugging Face decoder layers, the
            repeated children of a ``ModuleList`` / ``Sequential``).
        options: the option families allowed, a subset of ``remat.planner.OPTIONS`` (``"keep"``
            always): ``"keep"``, ``"recompute"``, ``"selective"``, ``"output"`` mark whole
            blocks; ``"children"`` marks some children of a block (``"children:attn"``:
            its attention recomputed, the rest kept; NOTE [Options inside blocks]).
            ``options=remat.planner.BLOCK_OPTIONS`` (``"keep"``, ``"recompute"``,
            ``"selective"``, ``"output"``) restricts the plan to whole blocks.
        device: device whose roofline times fake-tensor plans (``"cuda"``; default: the inputs').
        throughput: FLOP/s of that device for fake-tensor plans.
        dtype: build a factory's model in this dtype (fake-tensor plans).
        verify: measure the plan's peak and re-solve while it exceeds the budget: ``True``
            (default) measures it on short models and composes the whole model's peak, exactly,
            where ``compose`` composes the costs and the plan's runs of choices allow it (NOTE
            [Verifying by composition] in ``remat/planner/_verify.py``), else on the whole model;
            ``"full"`` always runs the whole model; ``False`` does not measure the plan.
        solver: ``"auto"`` (dynamic program on chains, MILP otherwise), ``"dp"``, ``"milp"``.
        repeat: timed rounds of every option's step for real-tensor plans (medians kept);
            the chosen plan is then timed against the unmarked step in 4x as many
            (``Plan.measured_extra_s``; 0: neither).
        progress: called with a short message at each stage (the CLI's progress bar).
        compose: on fake tensors, measure a model of identical blocks with 2 and 3 of them
            and compose the costs of all (and with ``verify=True`` the plan's peak; ``False``:
            measure every block, verify on the whole model).
        world_size: plan one rank of a job of this many ranks (a factory only): the budget is
            that rank's, and every run is [`remat.estimate`][remat.estimate]'s for the rank (NOTE
            [Planning a rank]): the model is built, its blocks marked, then handed to ``parallelize``.
        parallelize: ``parallelize(model, mesh)``, as for [`remat.estimate`][remat.estimate].
        rank: the rank planned (default 0).

    Returns:
        remat.Plan: the plan; a rank's plan has ``rank`` and ``world_size`` set. Apply it to the
        model before sharding it, as marks always are.

    Raises:
        remat.BudgetError: the budget is below the smallest reachable peak (``floor_bytes``).
        TypeError: no blocks found, a block runs more than once per forward, a bad budget
            type, a ``batch`` that is not a dict without ``step``, a ``verify`` that is not a bool
            or a string.
        ValueError: a malformed budget, an unknown option, a ``verify`` string other than
            ``"full"``, a model already marked,
            ``world_size`` for a built model or without ``parallelize``, ``step`` with ``loss_fn``.
        RuntimeError: ``world_size`` where a process group is already initialized.

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                             torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> p = remat.plan(net, torch.randn(512, 64), budget="0.8")
        >>> p.measured_peak_bytes <= p.budget_bytes
        True

        A loop of two micro-batches (gradient accumulation), planned as it runs:

        >>> def step(model, batch):
        ...     for half in batch.chunk(2):
        ...         model(half).pow(2).mean().backward()
        >>> p = remat.plan(net, torch.randn(512, 64), budget="80%", step=step)

        One rank of 2, each block a unit of ``fully_shard`` (FSDP2), planned on fake tensors:

        >>> from torch.distributed.fsdp import fully_shard
        >>> def make():
        ...     return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256),
        ...         torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> def shard(model, mesh):
        ...     for block in model:
        ...         fully_shard(block, mesh=mesh)
        >>> p = remat.plan(make, (512, 64), budget=0.8, world_size=2, parallelize=shard)
        >>> (p.world_size, p.measured_peak_bytes <= p.budget_bytes)
        (2, True)
    """
    return _sweep(model, example_inputs, [budget], locals())[0]


def sweep(model: Any, *example_inputs: Any, budgets: Sequence[int | float | str], batch: Any = None,
          loss_fn: Callable | None = None, step: StepFn | None = None,
          optimizer: OptimizerLike = "adam", blocks: Any = None, options: Sequence[str] = OPTIONS,
          device: str | None = None, throughput: float | None = None,
          dtype: torch.dtype | None = None, verify: bool | str = True, solver: str = "auto",
          repeat: int = 3, progress: Callable[[str], None] | None = None, floors: bool = False,
          compose: bool = True, world_size: int | None = None,
          parallelize: Callable | None = None, rank: int | None = None) -> list[Plan | BudgetError]:
    """`remat.plan` for several budgets, measuring the blocks once.

    Args:
        budgets: the budgets, each as `remat.plan`'s ``budget``.
        floors: a budget below the floor gives its [`remat.BudgetError`][remat.BudgetError] in the list
            (else it is raised).
        model, example_inputs, others: as for `remat.plan`.

    Returns:
        list[remat.Plan]: one plan (or ``BudgetError``) per budget, in order: each the one
        predicted fastest of the plans the sweep measured within its budget, so a lower budget
        never gets a higher measured peak or a lower predicted overhead (NOTE [A sweep is
        monotone] in ``_fitting.py``).

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                             torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> plans = remat.planner.sweep(net, torch.randn(512, 64), budgets=["90%", "1B"], floors=True)
        >>> " then ".join(type(p).__name__ for p in plans)
        'Plan then BudgetError'
    """
    return _sweep(model, example_inputs, budgets, locals())


@dataclass(frozen=True)
class _Call:
    """What a call of `plan` or `sweep` asks beyond the model, its inputs and the budgets,
    checked: the `Settings` of its plans (the step and the device to come from the inputs)
    and what makes the step and the model.

    Args:
        settings: the settings of every plan of the call.
        batch, loss_fn, step, dtype: the arguments of `plan` of those names.
        device: the device asked for (None: the model's or the inputs').
        ranks: the rank planned (`remat.memory.estimate.Ranks`; inactive: one process).
    """

    settings: Settings
    batch: Any
    loss_fn: Callable | None
    step: StepFn | None
    dtype: torch.dtype | None
    device: str | None
    ranks: Ranks


def _sweep(model: Any, example_inputs: tuple, budgets: Sequence[int | float | str],
           given: Mapping[str, Any]) -> list[Plan | BudgetError]:
    """`sweep` on the arguments of a `plan` or `sweep` call by name (``given``: the call's
    ``locals()``, so that neither lists the keywords they share again); what the planning
    left in reference cycles is collected before the plans are returned (NOTE [What
    planning leaves behind])."""
    try:
        return _sweep_planned(model, example_inputs, budgets, given)
    finally:
        let_go()


def _sweep_planned(model: Any, example_inputs: tuple, budgets: Sequence[int | float | str],
                   given: Mapping[str, Any]) -> list[Plan | BudgetError]:
    ranks = Ranks(given["world_size"], given["parallelize"], given["rank"], api=API)
    parsed = [parse_budget(b) for b in budgets]
    call = _call(example_inputs, given, ranks)
    if isinstance(model, torch.nn.Module):
        return _sweep_built(model, example_inputs, parsed, call)
    plans = _sweep_fake(model, example_inputs, parsed, call)
    if not ranks.active:
        return plans
    job = JobRank(rank=ranks.rank, world_size=ranks.world_size)
    return [dataclasses.replace(p, job=job) if isinstance(p, Plan) else p for p in plans]


def _call(inputs: tuple, given: Mapping[str, Any], ranks: Ranks) -> _Call:
    """The keywords `plan` and `sweep` share (``given``, by name) as one checked value: the one
    place they become `Settings`."""
    options = given["options"]
    bad = [o for o in options if o not in FAMILIES]
    if bad:
        raise ValueError(f"{API}: unknown option(s) {bad}; choose from {FAMILIES}")
    _check_step(inputs, given["batch"], given["loss_fn"], given["step"])
    _check_verify(given["verify"])
    settings = Settings(step=Step(), optimizer=given["optimizer"], blocks=given["blocks"],
                        options=tuple(dict.fromkeys(("keep", *options))),
                        machine=Machine(throughput=given["throughput"]),
                        solving=Solving(solver=given["solver"], verify=given["verify"],
                                        floors=given.get("floors", False)),
                        repeat=given["repeat"], progress=given["progress"], compose=given["compose"])
    return _Call(settings=settings, batch=given["batch"], loss_fn=given["loss_fn"], step=given["step"],
                 dtype=given["dtype"], device=given["device"], ranks=ranks)


def _sweep_built(model: torch.nn.Module, example_inputs: tuple, budgets: list,
                 call: _Call) -> list[Plan | BudgetError]:
    """The plans of a built model, on real tensors."""
    if call.ranks.active:
        raise ValueError(f"{API}: world_size= plans a rank from a factory that builds the model "
                         f"(marks go on before parallelize); pass the factory, not a built "
                         f"{type(model).__name__}")
    if marked_modules(model):
        raise ValueError(f"{API}: {type(model).__name__} already has recompute marks on "
                         f"{sorted(marked_modules(model))[:3]}; call remat.unmark(model) first")
    settings = call.settings
    check_trainable(API, model, settings.optimizer)
    device = call.device
    if device is None:
        param = next(model.parameters(), None)
        device = param.device.type if param is not None else "cpu"
    made = _step(example_inputs, call.batch, call.loss_fn, call.step)
    machine = dataclasses.replace(settings.machine, device=device)
    with _optimizer_kept(settings.optimizer):
        return _plans(model, budgets, settings.replace(step=made, machine=machine))


def _sweep_fake(factory: Any, example_inputs: tuple, budgets: list, call: _Call) -> list[Plan | BudgetError]:
    """The plans of a model ``factory`` builds, on fake tensors (a rank's: NOTE [Planning a rank])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.estimate import device_of
    from remat.memory.internal import build_in, fake_inputs

    ranks, dtype = call.ranks, call.dtype
    with ranks.group(), FakeTensorMode() as mode:
        net = build_in(factory, dtype)
        net.train()
        inputs = fake_inputs(mode, example_inputs, dtype) if example_inputs else ()
        keywords = _fake_batch(mode, call.batch, dtype)
        device = call.device
        if device is None:
            first = next((t for t in tree_leaves((inputs, keywords)) if isinstance(t, torch.Tensor)), None)
            device = first.device.type if first is not None else "cpu"
        build = None
        if ranks.active:  # NOTE [Planning a rank]
            where = device_of(inputs)
            build = Builder(make=lambda: build_in(factory, dtype), finish=lambda m: ranks.apply(m, where))
        made = _step(inputs, keywords, call.loss_fn, call.step)
        machine = dataclasses.replace(call.settings.machine, fake=True, device=device)
        return _plans(net, budgets, call.settings.replace(step=made, machine=machine, build=build))


#: the values of ``verify=``: measure the plan (composed where exact), on the whole model, not at all
VERIFY = (True, "full", False)


def _check_verify(verify: Any) -> None:
    if not isinstance(verify, (bool, str)):
        raise TypeError(f"{API}: verify must be True, False or 'full', got {type(verify).__name__}")
    if isinstance(verify, str) and verify != "full":
        raise ValueError(f"{API}: verify must be True, False or 'full' (measure the plan on the whole "
                         f"model, every block traced), got {verify!r}")


def _check_step(inputs: tuple, batch: Any, loss_fn: Callable | None, step: StepFn | None) -> None:
    if step is None:
        if batch is not None and not isinstance(batch, dict):
            raise TypeError(f"{API}: batch must be a dict of keyword inputs, got {type(batch).__name__}; "
                            f"pass positional inputs after the model, or step=fn(model, batch) for "
                            f"a batch of another kind")
        return
    if not callable(step):
        raise TypeError(f"{API}: step must be a function step(model, batch) -> loss, "
                        f"got {type(step).__name__}")
    if loss_fn is not None:
        raise ValueError(f"{API}: give loss_fn= or step=, not both; the step computes its own loss")
    if inputs and batch is not None:
        raise ValueError(f"{API}: with step=, give the batch once: batch=... or the example inputs, "
                         f"not both")


def _step(inputs: tuple, batch: Any, loss_fn: Callable | None, step: StepFn | None) -> Step:
    """The step to measure (NOTE [The step users run]) from `plan`'s arguments."""
    if step is None:
        return Step(inputs=tuple(inputs), batch=batch, loss_fn=loss_fn, api=API)
    given = batch if batch is not None else inputs[0] if len(inputs) == 1 else tuple(inputs)
    return Step(batch=given, custom=step, api=API)


def _fake_batch(mode: Any, batch: Any, dtype: torch.dtype | None) -> Any:
    """``batch`` on fake tensors: a dict's values as example inputs are read, else each tensor."""
    from remat.memory.internal import fake_inputs

    if isinstance(batch, dict):
        return dict(zip(batch, fake_inputs(mode, tuple(batch.values()), dtype)))
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


@contextlib.contextmanager
def _optimizer_kept(optimizer: OptimizerLike) -> Iterator[None]:
    """A user's own optimizer leaves planning as it came: its state (Adam's moments and step
    count) is loaded back; planning runs its step to measure and time it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        yield
        return
    saved = copy.deepcopy(optimizer.state_dict())
    try:
        yield
    finally:
        optimizer.load_state_dict(saved)
