"""``remat.plan``: choose what each block recomputes so a step fits a memory budget (layer 4).

The cost model (``_trace.py``, ``_measure.py``, ``_cost.py``) measures every block under
every option, the solver (``_solve.py``) picks the options of least extra time whose predicted
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
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from remat._front.marks import mark_of, marked_modules, recompute_module, unmark_module
from remat.memory import format_bytes
from remat.memory.internal import Step, StepFn, identical_container
from remat.memory.profile import OptimizerLike, check_trainable
from remat.planner._budget import parse_budget
from remat.planner._cost import BlockCosts, composed_costs, measure_costs
from remat.planner._loop import fit
from remat.planner._measure import interleaved_steps, measure_peak
from remat.planner._settings import Builder, Settings, mark_choices, marks_of
from remat.planner._solve import OPTIONS, BudgetError, Problem, Solution, evaluate, floor, solve
from remat.planner._trace import find_blocks
from remat.planner._verify import composed_peak

API = "remat.plan"


@dataclass(frozen=True)
class Decision:
    """One block's option in a `Plan`.

    Args:
        name: the block's qualified module name.
        type: its class name.
        choice: ``"keep"``, ``"recompute"``, ``"selective"``, ``"output"`` (``output_recompute``),
            or an option inside the block, ``"children:attn"`` / ``"children:fc+gelu"``: the
            children named are marked, not the block (NOTE [Options inside blocks]).
        kept_bytes: bytes the block keeps for backward under ``choice``.
        extra_s: predicted extra seconds per step.
    """

    name: str
    type: str
    choice: str
    kept_bytes: float
    extra_s: float


@dataclass(frozen=True)
class Plan:
    """What to recompute, block by block, with its predicted peak and overhead.

    Made by `plan`; frozen data that prints as a table and round-trips
    through `to_json` / `from_json`.

    Attributes:
        decisions: one [`Decision`][remat.planner.Decision] per block, in model order.
        budget_bytes: the peak asked for, in bytes (a fractional budget resolved against
            ``no_recompute_peak_bytes``).
        predicted_peak_bytes: the step's peak the solver predicts for this plan.
        predicted_extra_s: the solver's predicted extra seconds per step.
        step_s: the measured seconds of one step without recompute (None: not timed).
        no_recompute_peak_bytes: the step's peak with no mark.
        floor_bytes: the smallest peak the planner reaches: the cost model's floor, raised to
            what the plan at it measured where plans are measured (NOTE [A floor that plans
            reach]); a budget at it gets a plan.
        measured_peak_bytes: the peak measured with the plan applied (None: not verified).
        solver: which solver chose it (``"dp"``, ``"milp"``).
        solve_s: seconds the solver took.
        timing: how the options' times were found: ``"measured"`` (real tensors) or
            ``"roofline"`` (fake tensors: FLOPs and bytes moved).
        measured_extra_s: the plan's extra seconds per step, timed against the unmarked step
            in interleaved rounds (None: not timed).
        rank: the rank planned, for a rank's plan (``world_size=``); else None.
        world_size: the ranks in that job; every byte figure is the rank's (None: one process).

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                             torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> p = remat.plan(net, torch.randn(512, 64), budget=0.8)
        >>> p.predicted_peak_bytes <= p.budget_bytes
        True
        >>> remat.Plan.from_json(p.to_json()) == p
        True
        >>> names = p.apply(net)
    """

    decisions: tuple[Decision, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_extra_s: float
    step_s: float | None
    no_recompute_peak_bytes: int
    floor_bytes: int
    measured_peak_bytes: int | None = None
    solver: str = ""
    solve_s: float = 0.0
    timing: str = "measured"
    #: on real tensors: the plan's extra seconds per step, timed against the unmarked step in
    #: interleaved rounds (median of the rounds' ratios; None: not timed)
    measured_extra_s: float | None = None
    #: a rank's plan (``world_size=``): the rank planned and the ranks in the job; every
    #: byte figure, the budget's included, is this rank's (None: one process)
    rank: int | None = None
    world_size: int | None = None

    @property
    def choices(self) -> dict[str, str]:
        """``{block name: option}`` for every block."""
        return {d.name: d.choice for d in self.decisions}

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra time as a fraction of the step without recompute (0.1: 10% slower)."""
        return self.predicted_extra_s / self.step_s if self.step_s else 0.0

    @property
    def measured_overhead(self) -> float | None:
        """The timed extra time as a fraction of the step without recompute (None: not timed)."""
        if self.measured_extra_s is None or not self.step_s:
            return None
        return self.measured_extra_s / self.step_s

    def apply(self, model: torch.nn.Module) -> list[str]:
        """Mark ``model``'s blocks (or, for ``children:`` options, their children) as this
        plan says, through [`remat.recompute_module`][remat.recompute_module]; return the names marked.

        Args:
            model: a model with the planned block names (the planned one or a copy).

        Raises:
            ValueError: a block or a child is missing, or a module is already marked
                otherwise; nothing is marked then.
        """
        api = "remat.Plan.apply"
        named = dict(model.named_modules())
        missing = [d.name for d in self.decisions if d.name not in named]
        if missing:
            raise ValueError(f"{api}: {type(model).__name__} has no module {missing[0]!r} "
                             f"(and {len(missing) - 1} more missing); apply the plan to the model it was made for")
        chosen = [m for d in self.decisions for m in marks_of(d.name, named[d.name], d.choice, api)]
        for name, module, kwargs in chosen:
            old = mark_of(module)
            if old is not None and old != _spec_of(kwargs):
                raise ValueError(f"{api}: module {name!r} is already marked otherwise; "
                                 f"call remat.unmark(model) first")
        for _, module, kwargs in chosen:
            recompute_module(module, **kwargs)
        return [name for name, _, _ in chosen]

    def to_json(self) -> str:
        """The plan as JSON text (`from_json` reads it back)."""
        return json.dumps({"remat_plan": 1, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by `to_json`."""
        data = json.loads(text)
        if data.pop("remat_plan", None) != 1:
            raise ValueError("remat.Plan.from_json: not a remat plan (no 'remat_plan': 1 field)")
        data["decisions"] = tuple(Decision(**d) for d in data["decisions"])
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def __str__(self) -> str:
        rank = f" per rank (rank {self.rank} of {self.world_size})" if self.world_size is not None else ""
        head = (f"remat.plan: budget {format_bytes(self.budget_bytes)}{rank}, predicted peak "
                f"{format_bytes(self.predicted_peak_bytes)}"
                + (f", measured {format_bytes(self.measured_peak_bytes)}"
                   if self.measured_peak_bytes is not None else "")
                + f" (no recompute {format_bytes(self.no_recompute_peak_bytes)}, "
                f"floor {format_bytes(self.floor_bytes)})\n"
                f"predicted overhead +{100 * self.predicted_overhead:.1f}% "
                f"({1e3 * self.predicted_extra_s:,.2f} ms; times: {self.timing})"
                + (f", measured {100 * self.measured_overhead:+.1f}%" if self.measured_overhead is not None
                   else "")
                + f"; solved by {self.solver} in {1e3 * self.solve_s:.1f} ms")
        runs: list[list[Decision]] = []  # consecutive blocks with the same row print once
        for d in self.decisions:
            if runs and _same_row(runs[-1][-1], d):
                runs[-1].append(d)
            else:
                runs.append([d])
        names = [r[0].name if len(r) == 1 else f"{r[0].name}..{r[-1].name.rpartition('.')[2]} "
                 f"({len(r)})" for r in runs]
        width = max([len(n) for n in names] + [5])
        chosen = max([len(d.choice) for d in self.decisions] + [10])
        lines = [head, f"{'block':<{width}}  {'type':<16} {'choice':<{chosen}} {'kept':>12} {'extra ms':>9}"]
        for name, run in zip(names, runs):
            d = run[0]
            lines.append(f"{name:<{width}}  {d.type[:16]:<16} {d.choice:<{chosen}} "
                         f"{format_bytes(d.kept_bytes):>12} {1e3 * d.extra_s:>9.2f}")
        return "\n".join(lines)

    def report(self, measured: Any = None) -> str:
        """Predicted against measured peak (and step time when known), as a few lines.

        Args:
            measured: a `ProfileReport` (``remat.profile`` or
                ``remat.estimate`` of the marked model), a tracker, or peak bytes;
                default: the peak measured when the plan was made. An ``overhead``
                attribute (measured extra time over the unmarked step, 0.1 = 10%) is
                shown against the predicted overhead.
        """
        peak = getattr(measured, "peak_bytes", measured)
        peak = self.measured_peak_bytes if peak is None else int(peak)
        step_ms = getattr(measured, "step_ms", None)
        lines = [f"{'':<10} {'predicted':>12} {'measured':>12}",
                 f"{'peak':<10} {format_bytes(self.predicted_peak_bytes):>12} "
                 f"{format_bytes(peak) if peak is not None else '-':>12}"
                 + ("  (within budget)" if peak is not None and peak <= self.budget_bytes else
                    "  (OVER BUDGET)" if peak is not None else "")]
        overhead = getattr(measured, "overhead", None)
        if overhead is None and measured is None:
            overhead = self.measured_overhead
        if overhead is not None:
            lines.append(f"{'overhead':<10} {100 * self.predicted_overhead:>+11.1f}% {100 * overhead:>+11.1f}%")
        elif self.step_s:
            predicted = 1e3 * (self.step_s + self.predicted_extra_s)
            lines.append(f"{'step':<10} {predicted:>9.1f} ms "
                         + (f"{step_ms:>9.1f} ms" if step_ms else f"{'-':>12}"))
        return "\n".join(lines)


def _same_row(a: Decision, b: Decision) -> bool:
    return (a.type, a.choice, a.kept_bytes, round(a.extra_s, 12)) == (
        b.type, b.choice, b.kept_bytes, round(b.extra_s, 12))


def _spec_of(kwargs: dict) -> Any:
    probe = torch.nn.Identity()
    recompute_module(probe, **kwargs)
    return mark_of(probe)


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
    return sweep(model, *example_inputs, budgets=[budget], batch=batch, loss_fn=loss_fn, step=step,
                 optimizer=optimizer, blocks=blocks, options=options, device=device,
                 throughput=throughput, dtype=dtype, verify=verify, solver=solver, repeat=repeat,
                 progress=progress, compose=compose, world_size=world_size,
                 parallelize=parallelize, rank=rank)[0]


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
        list[remat.Plan]: one plan (or ``BudgetError``) per budget, in order: each the
        fastest of the plans the sweep measured within its budget, so a lower budget never
        gets a higher measured peak (NOTE [A sweep is monotone]).

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                             torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> plans = remat.planner.sweep(net, torch.randn(512, 64), budgets=["90%", "1B"], floors=True)
        >>> " then ".join(type(p).__name__ for p in plans)
        'Plan then BudgetError'
    """
    from remat.memory.estimate import Ranks

    ranks = Ranks(world_size, parallelize, rank, api=API)
    parsed = [parse_budget(b) for b in budgets]
    bad = [o for o in options if o not in OPTIONS]
    if bad:
        raise ValueError(f"{API}: unknown option(s) {bad}; choose from {OPTIONS}")
    _check_step(example_inputs, batch, loss_fn, step)
    _check_verify(verify)
    settings = Settings(step=Step(), optimizer=optimizer, blocks=blocks,
                        options=tuple(dict.fromkeys(("keep", *options))), throughput=throughput,
                        verify=verify, solver=solver, repeat=repeat, progress=progress,
                        compose=compose, floors=floors)
    if isinstance(model, torch.nn.Module):
        if ranks.active:
            raise ValueError(f"{API}: world_size= plans a rank from a factory that builds the model "
                             f"(marks go on before parallelize); pass the factory, not a built "
                             f"{type(model).__name__}")
        if marked_modules(model):
            raise ValueError(f"{API}: {type(model).__name__} already has recompute marks on "
                             f"{sorted(marked_modules(model))[:3]}; call remat.unmark(model) first")
        check_trainable(API, model, optimizer)
        if device is None:
            param = next(model.parameters(), None)
            device = param.device.type if param is not None else "cpu"
        made = _step(example_inputs, batch, loss_fn, step)
        with _optimizer_kept(optimizer):
            return _plans(model, parsed, settings.replace(step=made, device=device))
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.estimate import device_of
    from remat.memory.internal import build_in, fake_inputs

    with ranks.group(), FakeTensorMode() as mode:
        net = build_in(model, dtype)
        net.train()
        inputs = fake_inputs(mode, example_inputs, dtype) if example_inputs else ()
        keywords = _fake_batch(mode, batch, dtype)
        if device is None:
            first = next((t for t in tree_leaves((inputs, keywords)) if isinstance(t, torch.Tensor)), None)
            device = first.device.type if first is not None else "cpu"
        build = None
        if ranks.active:  # NOTE [Planning a rank]
            where = device_of(inputs)
            build = Builder(make=lambda: build_in(model, dtype), finish=lambda m: ranks.apply(m, where))
        made = _step(inputs, keywords, loss_fn, step)
        plans = _plans(net, parsed, settings.replace(step=made, device=device, fake=True, build=build))
    if not ranks.active:
        return plans
    return [dataclasses.replace(p, rank=ranks.rank, world_size=ranks.world_size)
            if isinstance(p, Plan) else p for p in plans]


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


def _plans(model: torch.nn.Module, budgets: list, settings: Settings) -> list:
    chosen = find_blocks(model, settings.blocks)
    container = identical_container(model, chosen) if settings.fake and settings.compose else None
    costs = composed_costs(model, chosen, container, settings) if container else None
    if costs is None:
        costs = measure_costs(model, chosen, settings)
    problem = costs.problem()
    ranking = costs.problem(ranking=True)  # NOTE [Plans timing noise cannot flip]
    least = _reachable_floor(model, costs, (ranking, problem), floor(problem), settings)
    out = []
    for value, fractional in budgets:
        budget = value * costs.peaks["keep"] if fractional else value
        try:
            out.append(_fit(model, costs, (ranking, problem), budget, least, settings))
        except BudgetError as err:
            if not settings.floors:
                raise
            out.append(err)
    return _shared(out, ranking) if len(out) > 1 else out


def _shared(found: list, ranking: Problem) -> list:
    """Each budget of a sweep gets the fastest plan the sweep found within it.

    NOTE [A sweep is monotone]
    Every plan of a sweep was measured; one found for a lower budget fits every higher one.
    Searching each budget alone, a cost model that errs (the U-Net's ``output`` options,
    predicted low) can end one budget on a fallback that a lower budget's search beat: the
    measured peak then rose as the budget fell (727,000 bytes at one budget, 734,232 at the
    next lower). So each budget takes, of all the sweep's plans measured within it, the
    fastest by the ranking times, the lower peak on a tie (a budget refused alone may get one
    too). That makes the measured peaks monotone: a plan chosen for a higher budget with a
    lower peak than a lower budget's would fit the lower budget, and be as fast, so the lower
    budget would have chosen it.
    """
    plans = [p for p in found if isinstance(p, Plan)]

    def key(p: Plan) -> tuple:
        rank = evaluate(ranking, [ranking.options.index(c) for c in p.choices.values()])[1]
        return rank, _peak(p)

    out = []
    for item in found:
        budget = item.budget_bytes
        fits = [p for p in plans if _peak(p) <= budget]
        best = min(fits, key=key, default=None)
        if best is None or (isinstance(item, Plan) and key(item) <= key(best)):
            out.append(item)
        else:
            out.append(dataclasses.replace(best, budget_bytes=int(budget)))
    return out


def _peak(plan: Plan) -> int:
    return plan.predicted_peak_bytes if plan.measured_peak_bytes is None else plan.measured_peak_bytes


def _reachable_floor(model: torch.nn.Module, costs: BlockCosts, problems: tuple[Problem, Problem],
                     least: float, settings: Settings) -> float:
    """The floor a plan is found at: the cost model's, raised to what its plan measures.

    NOTE [A floor that plans reach]
    The cost model's floor is the lowest peak it predicts. On some graphs it is optimistic:
    the U-Net's skip connections keep more than its blocks' moments add up to, and the plan at
    its floor measured 803,500 bytes for 770,080 predicted. Reported as it was, the floor
    named a budget no plan met (refused with "raise the budget"), and a sweep from it started
    with refusals. So where plans are measured (real tensors, ``verify``), the floor plan is
    measured once, and the floor is raised to the lowest peak a known plan measured: that plan,
    or a marking of every block alike (their runs were measured for the cost model), where one
    measured lower (the floor plan may measure worse than a uniform one where the model errs).
    """
    if settings.fake or not settings.verify:
        return least  # predictions only: composed or unmeasured
    ranking, problem = problems
    try:
        solution = solve(ranking, least, resolution=max(1.0, least / 8192), solver=settings.solver)
    except BudgetError:
        return least
    measured = _measure_choices(model, costs, solution.choices, settings)
    uniform = [costs.peaks[option] for o, option in enumerate(problem.options) if option in costs.peaks
               and all(problem.kept[i][o] is not None for i in range(problem.blocks))]
    return max(least, min([measured, *uniform]))


def _fit(model: torch.nn.Module, costs: BlockCosts, problems: tuple[Problem, Problem], budget: float,
         least: float, settings: Settings) -> Plan:
    """The plan for ``budget``: chosen on the first of ``problems`` (the ranking times), its
    extra time predicted by the second (the calibrated ones), its peak measured and re-solved
    for while it exceeds the budget (NOTE [Solve, measure, lower the target])."""
    ranking, problem = problems
    settings.say(f"solving for {format_bytes(budget)}")

    def solved(target: float, _rejected: Sequence[Solution]) -> Solution | None:
        try:
            return _predicted(problem, solve(ranking, target, resolution=max(1.0, target / 8192),
                                             solver=settings.solver))
        except BudgetError:
            return None

    def measured_peak(solution: Solution) -> int | None:
        if not settings.verify:
            return None
        settings.say(f"measuring the plan for {format_bytes(budget)}")
        return _measure_choices(model, costs, solution.choices, settings)

    # after a plan measured over the budget, the cost model erred near its floor: a measured uniform plan
    solution, measured, _ = fit(budget, solved, measured_peak,
                                lambda over: _uniform(costs, problems, budget) if over else None,
                                lambda over, exhausted: _budget_error(budget, least, costs, over, exhausted))
    # the marking of every block alike wins when it is faster and measured within the budget
    # (the model may have thought it over: its run was measured, not predicted)
    uniform = _uniform(costs, problems, budget)
    if uniform is not None and _ranked(ranking, uniform[0]) < _ranked(ranking, solution):
        solution, measured = uniform
    plan = _make(costs, problem, solution, budget, least, measured)
    if settings.fake or settings.build is not None or not settings.verify or not settings.repeat:
        return plan
    settings.say(f"timing the plan for {format_bytes(budget)}")
    return dataclasses.replace(plan, measured_extra_s=_timed_extra(model, costs, solution.choices, settings))


def _budget_error(budget: float, least: float, costs: BlockCosts, over: Sequence[int],
                  exhausted: bool) -> BudgetError:
    """Why no plan was found for ``budget``: every try measured over it (``exhausted``), the
    solver found none on a lowered target after the peaks ``over``, or none at all."""
    if exhausted:
        measured = over[-1]
        return BudgetError(
            f"{API}: no plan measured within a budget of {format_bytes(budget)} "
            f"({budget:,.0f} bytes); the last plan measured {format_bytes(measured)}; raise the budget",
            budget_bytes=budget, floor_bytes=measured)
    if over:
        return BudgetError(
            f"{API}: no plan measured within a budget of {format_bytes(budget)} ({budget:,.0f} "
            f"bytes): the cost model's floor is {format_bytes(least)}, but the plans near it "
            f"measured {format_bytes(min(over))} or more; raise the budget to {min(over):,.0f} bytes",
            budget_bytes=budget, floor_bytes=min(over))
    shown = max(least, budget + 1)
    no_recompute = costs.peaks["keep"]
    return BudgetError(
        f"{API}: no plan fits a budget of {format_bytes(budget)} ({budget:,.0f} bytes); the "
        f"smallest reachable peak is {format_bytes(shown)} ({shown:,.0f} bytes; no recompute: "
        f"{format_bytes(no_recompute)}); raise the budget or shrink the batch",
        budget_bytes=budget, floor_bytes=shown)


#: interleaved rounds, per unit of ``repeat``, that time a plan against the unmarked step
TIMED_ROUNDS = 4


def _timed_extra(model: torch.nn.Module, costs: BlockCosts, choices: Sequence[str],
                 settings: Settings) -> float:
    """The plan's extra seconds per step (forward and backward): the plan and the unmarked
    step timed in `TIMED_ROUNDS` x ``repeat`` interleaved rounds, the median of the
    rounds' ratios times the unmarked step's median; the model's state put back after."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    uniform = {"keep": {}, "plan": dict(zip(costs.names, choices))}
    try:
        steps = interleaved_steps(model, settings.step, dict(model.named_modules()), uniform,
                                   TIMED_ROUNDS * settings.repeat)
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
    return steps["plan"] - steps["keep"]


def _ranked(ranking: Problem, solution: Solution) -> float:
    """The extra time of ``solution`` by the ranking times."""
    return evaluate(ranking, [ranking.options.index(c) for c in solution.choices])[1]


def _predicted(problem: Problem, solution: Solution) -> Solution:
    """``solution`` (solved on the ranking times) with the extra time ``problem`` predicts."""
    choice = [problem.options.index(c) for c in solution.choices]
    return dataclasses.replace(solution, time=evaluate(problem, choice)[1])


def _uniform(costs: Any, problems: tuple[Problem, Problem], budget: float) -> tuple | None:
    """The fastest plan (by the ranking times) marking every block alike whose measured peak
    (from the cost model's runs) fits ``budget``, with that peak; None if none fits."""
    ranking, problem = problems
    best = None
    for o, option in enumerate(problem.options):
        measured = costs.peaks.get(option, float("inf"))
        if measured > budget or any(problem.kept[i][o] is None for i in range(problem.blocks)):
            continue  # (the run marked every block alike; a plan that cannot is another plan)
        rank = evaluate(ranking, [o] * problem.blocks)[1]
        if best is None or rank < best[0]:
            extra = evaluate(problem, [o] * problem.blocks)[1]
            best = (rank, Solution((option,) * problem.blocks, measured, extra, "uniform fallback"), measured)
    return None if best is None else best[1:]


def _measure_choices(model: torch.nn.Module, costs: BlockCosts, choices: Sequence[str],
                     settings: Settings) -> int:
    """The measured peak of the step with the blocks marked as ``choices`` say."""
    chosen = dict(zip(costs.names, choices))
    # (with micro-batches a block's moments recur after the gradients exist: traced whole)
    if settings.verify != "full" and settings.compose and settings.fake and costs.calls == 1:
        named = dict(model.named_modules())
        container = identical_container(model, [(name, named[name]) for name in costs.names])
        if container is not None:  # NOTE [Verifying by composition]
            peak = composed_peak(model, costs.names, choices, container, settings, costs.optimizer_peak)
            if peak is not None:
                return peak
    measure = {"optimizer": settings.optimizer, "fake": settings.fake, "optimizer_peak": costs.optimizer_peak}
    if settings.build is not None:  # NOTE [Planning a rank]: a fresh model, marked, then sharded
        return measure_peak(settings.build(chosen), settings.step, **measure)
    marked = mark_choices(dict(model.named_modules()), chosen)
    try:
        return measure_peak(model, settings.step, **measure)
    finally:
        for module in marked:
            unmark_module(module)


def _make(costs: Any, problem: Problem, solution: Any, budget: float, least: float,
          measured: int | None) -> Plan:
    decisions = []
    for i, (name, kind, choice) in enumerate(zip(costs.names, costs.types, solution.choices)):
        o = problem.options.index(choice)
        extra = problem.time[i][o]
        if choice == "output" and i + 1 < len(solution.choices) and solution.choices[i + 1] == "output":
            extra += problem.extra_time(i)
        decisions.append(Decision(name, kind, choice, float(problem.kept[i][o]), extra))
    return Plan(decisions=tuple(decisions), budget_bytes=int(budget),
                predicted_peak_bytes=int(solution.peak), predicted_extra_s=solution.time,
                step_s=costs.step_s, no_recompute_peak_bytes=int(costs.peaks["keep"]),
                floor_bytes=int(least), measured_peak_bytes=measured, solver=solution.solver,
                solve_s=solution.seconds, timing=costs.timed)
