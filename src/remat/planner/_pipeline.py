"""A plan per pipeline rank, from the schedule's own action order (``remat.plan_pipeline``).

NOTE [A plan per pipeline stage]
Under a pipeline schedule a rank runs the forwards of several micro-batches before their
backwards: under 1F1B the first of p ranks holds up to p micro-batches' activations at once,
the last one; interleaved and zero-bubble schedules change those counts again. One marking
for every rank either wastes time on the late ranks or does not fit the early ones.

So the counts are not typed in by hand: `schedule_actions` builds the schedule class itself
(``torch.distributed.pipelining``), with stand-ins for the stages that carry only their
layout (index, number of stages, ranks; no process group), and reads the order of actions it
computes for every rank (``pipeline_order``: forward, backward, or input and weight backward of
stage s for micro-batch m). A schedule that computes its order this way works without a change
here.

Each rank of real stages is then planned as one model, `remat.plan` over a ``ModuleList`` of
its stages, for the loop that rank runs: `_RankStep` replays its actions in the schedule's order
on real tensors (a stage's input, a fresh tensor per micro-batch as a receive buffer is, is kept until
that micro-batch's backward, as the stage keeps it), so the planner measures and holds the
rank's budget in that very loop (NOTE [The step users run]), with the micro-batches in flight
that the schedule gives it; a backward split into an input and a weight backward (zero-bubble)
is replayed as torch runs it (NOTE [A backward split in two]), and so are schedules that put two
adjacent stages on one rank (a V: ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, whose
overlapped forward and backward run one after the other). Stages given as factories (fake tensors) are not replayed whole: each distinct stage is measured on one
micro-batch and each rank's peak composed from the replay's rules on byte counts (NOTE [A rank's
peak composed] in ``_pipeline_compose.py``), equal to the replay's; ``compose=False`` replays.

NOTE [What a pipeline rank holds]
Besides each micro-batch's activations, a rank running torch 2.13's schedules holds, and the
replay holds as long (checked to the byte against the real pipeline on 2 and 4 gloo ranks under
GPipe, 1F1B, interleaved 1F1B and interleaved zero-bubble, on 2 under ZBV and DualPipeV,
``tests/test_pipeline_plan.py``):

- a receive buffer per micro-batch for each stage's input and, below the last stage, for its
  output's gradient, made in the first step and kept (the first stage's micro-batches and the
  last stage's targets are chunks of the user's batch, alive through the step);
- what it sends (a stage's output; a stage's input gradient, freed from the input itself) until
  torch lets the send go: under ``Schedule1F1B`` the latest send of each kind and, in its
  pending work, the next-to-last warm-up forward's output until the forwards are done, then the
  latest input gradient; under the other schedules every send until the step ends;
- the last stage's outputs (merged at the end) and its losses, until the step ends; an output
  that is a view keeps its autograd graph (torch detaches only outputs that are not views);
- in a V, between two adjacent stages on the rank, no send and no receive: the output (and,
  back, the input's gradient) is put in place of the next stage's input buffer (the previous
  stage's gradient buffer), which is freed, and held into the next step until replaced there.
  A tracker around ``schedule.step`` does not see those held from the last step (the step
  never reads them), so it measures less than the replay, which counts them from the step's
  start as the allocator does (``tests/test_pipeline_plan.py`` reads them first, then the
  real pipeline's peak is the replay's to the byte).

NOTE [A backward split in two]
Zero-bubble schedules (``ScheduleInterleavedZeroBubble``) run a stage's backward as an input
backward ``I`` and, later, a weight backward ``W``. Torch 2.13's stage (``stage_backward_input``
and ``stage_backward_weight`` in ``torch.distributed.pipelining._backward``) finds, in ``I``,
the graph's nodes where a path to a parameter leaves the paths to the stage's input, records
the gradients reaching them, computes the input's gradient with the graph retained, and
detaches the output (or loss); it keeps those nodes (alive with everything saved for backward
below them), the recorded gradients, the input and the output until ``W``, which computes the
parameters' gradients from the recorded ones. The first stage's ``I`` does nothing and its
``W`` is its whole backward. What ``W`` does not walk (a GELU between two linears, a dropout's
mask) stays saved until the graph dies: at ``W``, or at the step's end on the last stage when
its output is a view (its graph kept). `remat.planner._split_backward` does the same with
public autograd APIs (``Node.register_prehook``, ``GradientEdge``): the replay and the
composed peak (each stage's ``I`` and first and later ``W`` measured) equal the real
pipeline's to the byte on 2 and 4 gloo ranks (``tests/test_pipeline_plan.py``).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat.memory import format_bytes
from remat.planner._pipeline_compose import Composer, composer_for, observe_stages
from remat.planner._pipeline_rank import plan_rank
from remat.planner._pipeline_step import _RankStep, _Spec
from remat.planner._plan import Plan
from remat.planner._schedule import _matched, in_flight, in_flight_counts, schedule_actions
from remat.planner._solve import BudgetError

__all__ = ["PipelinePlan", "RankPlan", "in_flight", "in_flight_counts", "plan_pipeline", "schedule_actions"]

API = "remat.plan_pipeline"


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a [`PipelinePlan`][remat.PipelinePlan].

    Attributes:
        rank: the pipeline rank.
        stages: the stage indices it holds, in the order its ``ModuleList`` lists them.
        in_flight: the most micro-batches it holds at once under the schedule (a
            micro-batch on two of its stages counts twice).
        kept_bytes: what one micro-batch's forward through its stages keeps for backward
            with the plan applied (``remat.memory.saved_bytes``; with stage factories, what
            the tracker sees it leave alive besides the stages' outputs, which also counts
            remat's random-state snapshots).
        plan: the [`Plan`][remat.Plan] of ``ModuleList(its stages)`` for its loop.
    """

    rank: int
    stages: tuple[int, ...]
    in_flight: int
    kept_bytes: int
    plan: Plan


@dataclass(frozen=True)
class PipelinePlan:
    """What to recompute on each rank of a pipeline: made by [`remat.plan_pipeline`][remat.plan_pipeline].

    Attributes:
        schedule: the schedule class's name.
        n_microbatches: micro-batches per step.
        ranks: one [`RankPlan`][remat.planner.RankPlan] per rank.

    Examples:
        >>> import torch, remat
        >>> from torch.distributed.pipelining import Schedule1F1B
        >>> stages = [torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
        ...           torch.nn.Linear(128, 32)) for _ in range(2)]) for _ in range(2)]
        >>> p = remat.plan_pipeline(stages, torch.randn(64, 32), schedule=Schedule1F1B,
        ...                         n_microbatches=4, budget=0.9, repeat=1)
        >>> [r.in_flight for r in p.ranks]
        [2, 1]
        >>> remat.PipelinePlan.from_json(p.to_json()) == p
        True
        >>> names = p.apply(stages[0], rank=0)  # on rank 0, its stage modules
    """

    schedule: str
    n_microbatches: int
    ranks: tuple[RankPlan, ...]

    def apply(self, *modules: torch.nn.Module, rank: int) -> list[str]:
        """Mark ``rank``'s stage modules (in the order of ``RankPlan.stages``) as its plan says."""
        mine = self.ranks[rank]
        if len(modules) != len(mine.stages):
            raise ValueError(f"remat.PipelinePlan.apply: rank {rank} holds {len(mine.stages)} stage(s) "
                             f"{list(mine.stages)}, got {len(modules)} module(s); pass its stage modules in order")
        return mine.plan.apply(torch.nn.ModuleList(modules))

    def to_json(self) -> str:
        """The plan as JSON text (`from_json` reads it back)."""
        data = {"remat_pipeline_plan": 1, "schedule": self.schedule, "n_microbatches": self.n_microbatches,
                "ranks": [{"rank": r.rank, "stages": list(r.stages), "in_flight": r.in_flight,
                           "kept_bytes": r.kept_bytes, "plan": json.loads(r.plan.to_json())}
                          for r in self.ranks]}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        """Read a plan written by `to_json`."""
        data = json.loads(text)
        if data.get("remat_pipeline_plan") != 1:
            raise ValueError("remat.PipelinePlan.from_json: not a remat pipeline plan "
                             "(no 'remat_pipeline_plan': 1 field)")
        ranks = tuple(RankPlan(r["rank"], tuple(r["stages"]), r["in_flight"], r["kept_bytes"],
                               Plan.from_json(json.dumps(r["plan"]))) for r in data["ranks"])
        return cls(data["schedule"], data["n_microbatches"], ranks)

    def __str__(self) -> str:
        lines = [(f"remat.plan_pipeline: {self.schedule}, {self.n_microbatches} micro-batches, "
                  f"{len(self.ranks)} ranks"),
                 (f"{'rank':>4} {'stages':<8} {'in flight':>9} {'kept/mb':>11} {'budget':>11} "
                  f"{'predicted':>11} {'measured':>11} {'extra ms':>9}  choices")]
        for r in self.ranks:
            p = r.plan
            kept = r.kept_bytes
            measured = format_bytes(p.measured_peak_bytes) if p.measured_peak_bytes is not None else "-"
            choices = sorted(set(p.choices.values()))
            lines.append(f"{r.rank:>4} {','.join(map(str, r.stages)):<8} {r.in_flight:>9} "
                         f"{format_bytes(kept):>11} {format_bytes(p.budget_bytes):>11} "
                         f"{format_bytes(p.predicted_peak_bytes):>11} {measured:>11} "
                         f"{1e3 * p.predicted_extra_s:>9.2f}  {', '.join(choices)}")
        return "\n".join(lines)


def _stage_inputs(stages: Sequence[Any], example: Any, target: Any, dtype: torch.dtype | None,
                  fake: bool, blocks: Any = None) -> dict[Any, Any]:
    """What each stage receives for one micro-batch (the example, then each stage's output) and
    the last stage's ``"target"``: real tensors, or the shapes of fake ones run through the
    stages' factories."""
    if not fake:
        inputs, x = {"target": target}, example
        with torch.no_grad():
            for i, stage in enumerate(stages):
                inputs[i], x = x, stage(x)
                inputs[("blocks", i)] = _block_names(stage)
        return inputs
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.internal import fake_inputs

    with FakeTensorMode() as mode, torch.no_grad():
        x = fake_inputs(mode, (example,), dtype)[0]
        inputs = {"target": None if target is None else _Spec(fake_inputs(mode, (target,), dtype)[0])}
        for i, (given, names, keys) in enumerate(observe_stages(stages, x, blocks, dtype)):
            inputs[i], inputs[("blocks", i)], inputs[("key", i)] = _Spec(given), names, keys
    return inputs


def _block_names(stage: torch.nn.Module) -> list[str]:
    """The blocks ``remat.apply(stage, where="blocks")`` marks (none: the stage is one block)."""
    from remat._front.blocks import find_blocks

    return [name for name, _ in find_blocks(stage)] or [""]


def _rank_model(makers: Sequence[Callable[[], torch.nn.Module]]) -> torch.nn.ModuleList:
    """A rank's stages built from their factories (a fake-tensor plan builds it in its mode)."""
    return torch.nn.ModuleList(make() for make in makers)


def _sum_loss(output: Any, target: Any) -> torch.Tensor:
    return output.float().sum()


def plan_pipeline(stages: Sequence[Any], example: Any, *, schedule: type, n_microbatches: int,
                  budget: Any, target: Any = None, loss_fn: Callable | None = None,
                  world_size: int | None = None, dtype: torch.dtype | None = None,
                  **plan_options: Any) -> PipelinePlan:
    """Plan recompute for each rank of a pipeline, from the schedule's own action order.

    NOTE [A plan per pipeline stage]: the schedule class computes which micro-batches each
    rank holds at once; each rank's stages are planned as one model for the loop that rank
    runs, so its measured peak holds its budget there.

    Args:
        stages: every stage, in pipeline order (stage ``i`` is ``stages[i]``): modules
            (measured on real tensors, not changed), or functions that build them (planned on
            fake tensors, as [`remat.plan`][remat.plan] plans a factory: a model larger than
            this machine; e.g. `remat.models.llama.llama_stages`).
        example: one micro-batch's input to the first stage (a tensor; with factories also a
            shape, for a float input).
        schedule: a ``torch.distributed.pipelining`` schedule class (``Schedule1F1B``,
            ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
            ``ScheduleZBVZeroBubble``, ...).
        n_microbatches: micro-batches per step.
        budget: each rank's peak: one budget for all (as [`remat.plan`][remat.plan] reads
            it; a fraction is of that rank's own peak without recompute), or one per rank.
        target: one micro-batch's target, handed to ``loss_fn`` as the schedule hands it.
        loss_fn: ``loss_fn(output, target) -> scalar``, the function given to the schedule;
            default: the sum of the last stage's output.
        world_size: ranks in the pipeline; default: one per stage for a single-stage
            schedule, half the stages for a multi-stage one.
        dtype: build factories' stages in this dtype.
        **plan_options: passed to [`remat.plan`][remat.plan] for every rank (``options``,
            ``optimizer``, ``repeat``, ``blocks``, ``device``, ``throughput``, ...). With
            factories, each distinct stage is measured once on one micro-batch and each rank's
            peak composed (NOTE [A rank's peak composed]: a 70B model on 8 ranks with 32
            micro-batches in seconds); ``compose=False`` replays each rank's whole loop
            instead (the composition's reference; minutes at that size); ``blocks`` is then a
            module type, or None for each stage's own blocks.

    Returns:
        A [`PipelinePlan`][remat.PipelinePlan]: one [`Plan`][remat.Plan] per rank.

    Raises:
        ValueError: bad arguments (before any work), or the schedule refuses the layout.
        TypeError: ``schedule`` is not a class.
        remat.BudgetError: a rank's budget is below what any plan reaches there.

    Examples:
        >>> import torch, remat
        >>> from torch.distributed.pipelining import ScheduleGPipe
        >>> stages = [torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
        ...           torch.nn.Linear(128, 32)) for _ in range(2)]) for _ in range(2)]
        >>> p = remat.plan_pipeline(stages, torch.randn(64, 32), schedule=ScheduleGPipe,
        ...                         n_microbatches=4, budget=0.9, repeat=1)
        >>> [(r.rank, r.stages, r.in_flight) for r in p.ranks]
        [(0, (0,), 4), (1, (1,), 4)]
        >>> all(r.plan.measured_peak_bytes <= r.plan.budget_bytes for r in p.ranks)
        True

        A Llama split into 2 stages, planned on fake tensors from the stages' factories (the
        same call plans a model larger than this machine), a budget per rank:

        >>> from torch.distributed.pipelining import Schedule1F1B
        >>> from remat.models.llama import LlamaConfig, llama_stages, next_token_loss
        >>> config = LlamaConfig(layers=4, width=64, heads=4, hidden=128, vocab=256)
        >>> p = remat.plan_pipeline(llama_stages(config, 2), torch.zeros(2, 32, dtype=torch.long),
        ...                         schedule=Schedule1F1B, n_microbatches=4, budget=[0.8, 1.0],
        ...                         optimizer=None, loss_fn=lambda out, target: next_token_loss(out))
        >>> [r.in_flight for r in p.ranks]
        [2, 1]
    """
    from torch.distributed.pipelining import schedules

    stages = list(stages)
    fake = _check_pipeline(stages, schedule, n_microbatches, plan_options)
    single = issubclass(schedule, schedules.PipelineScheduleSingle)
    world = world_size or (len(stages) if single else max(1, len(stages) // 2))
    budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * world
    if len(budgets) != world:
        raise ValueError(f"{API}: {len(budgets)} budgets for {world} ranks; give one, or one per rank")
    if fake:
        plan_options["dtype"] = dtype
    order = schedule_actions(schedule, len(stages), world, n_microbatches)
    inputs = _stage_inputs(stages, example, target, dtype, fake, plan_options.get("blocks"))
    wait_next = issubclass(schedule, schedules.Schedule1F1B)
    if fake and plan_options.get("compose", True):  # NOTE [A rank's peak composed]
        split = any(kind == "I" for actions in order.values() for kind, _, _ in actions)
        composer = composer_for(stages, inputs, n_microbatches, loss_fn or _sum_loss, wait_next, plan_options,
                                split)
        ranks = [_plan_composed(rank, composer, order[rank], budgets[rank], schedule.__name__,
                                plan_options.get("solver", "auto")) for rank in sorted(order)]
        return PipelinePlan(schedule.__name__, n_microbatches, tuple(ranks))
    ranks = []
    for rank in sorted(order):
        held = sorted({s for _, s, _ in order[rank]})
        step = _RankStep(held, order[rank], inputs, len(stages), n_microbatches, loss_fn or _sum_loss,
                         sends_wait_next=wait_next)
        ranks.append(_plan_rank(rank, step, [stages[s] for s in held], budgets[rank], fake,
                                schedule.__name__, plan_options))
    return PipelinePlan(schedule.__name__, n_microbatches, tuple(ranks))


def _check_pipeline(stages: list, schedule: Any, n_microbatches: Any, plan_options: dict) -> bool:
    """`plan_pipeline`'s arguments, before any work; whether the stages are factories."""
    modules = all(isinstance(s, torch.nn.Module) for s in stages)
    factories = all(callable(s) and not isinstance(s, torch.nn.Module) for s in stages)
    if not stages or not (modules or factories):
        raise ValueError(f"{API}: stages must be a non-empty list of nn.Module stages in pipeline order, "
                         f"or of functions that build them (planned on fake tensors), not a mix")
    if not isinstance(schedule, type):
        raise TypeError(f"{API}: schedule must be a schedule class (Schedule1F1B, ...), got {schedule!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"{API}: n_microbatches must be a positive int, got {n_microbatches!r}")
    blocks = plan_options.get("blocks")
    if factories and plan_options.get("compose", True) and not (blocks is None or isinstance(blocks, (type, tuple))):
        raise ValueError(f"{API}: with stage factories, blocks= must be a module type (the blocks of "
                         f"that type in each stage) or None (each stage's own blocks), got "
                         f"{type(blocks).__name__}; names differ from stage to stage")
    for key in ("step", "batch"):
        if key in plan_options:
            raise ValueError(f"{API}: {key}= is set by the pipeline planner (each rank's loop); "
                             f"pass loss_fn= and target= for the last stage's loss")
    return factories


def _plan_rank(rank: int, step: _RankStep, stages: list, budget: Any, fake: bool, schedule: str,
               plan_options: dict) -> RankPlan:
    """``rank``'s plan: `remat.plan` of its stages for its loop."""
    from remat.planner._plan import plan

    held = sorted(step.position)
    model = functools.partial(_rank_model, stages) if fake else torch.nn.ModuleList(stages)
    options = {"blocks": step.blocks, **plan_options}
    try:
        chosen = plan(model, budget=budget, step=step, batch=(), **options)
    except BudgetError as err:
        raise BudgetError(f"{API}: rank {rank} (stages {held}, {in_flight(step.actions)} micro-batches "
                          f"in flight under {schedule}): {err}", budget_bytes=err.budget_bytes,
                          floor_bytes=err.floor_bytes) from err
    kept = _kept_per_microbatch(model, chosen, held, step.inputs, plan_options.get("dtype"))
    return RankPlan(rank, tuple(held), in_flight(step.actions), kept, chosen)


def _plan_composed(rank: int, composer: Composer, actions: list, budget: Any, schedule: str,
                   solver: str) -> RankPlan:
    """``rank``'s plan on fake tensors, its peak composed (NOTE [A rank's peak composed])."""
    actions = _matched(actions)
    held = sorted({s for _, s, _ in actions})
    try:
        chosen = plan_rank(composer, actions, held, budget, solver)
    except BudgetError as err:
        raise BudgetError(f"{API}: rank {rank} (stages {held}, {in_flight(actions)} micro-batches "
                          f"in flight under {schedule}): {err}", budget_bytes=err.budget_bytes,
                          floor_bytes=err.floor_bytes) from err
    kept = composer.kept(held, {s: {d.name.partition(".")[2]: d.choice for d in chosen.decisions
                                    if d.name.split(".")[0] == str(pos)} for pos, s in enumerate(held)})
    return RankPlan(rank, tuple(held), in_flight(actions), kept, chosen)


def _kept_per_microbatch(model: Any, chosen: Plan, held: list[int], inputs: dict[Any, Any],
                         dtype: torch.dtype | None) -> int:
    """What one micro-batch's forward through the rank's stages keeps, the plan applied (on a
    copy; fake tensors for a factory's)."""
    from remat.memory import saved_bytes

    if not isinstance(model, torch.nn.Module):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from remat.memory.internal import build_in

        with FakeTensorMode():
            return _kept(build_in(model, dtype), chosen, held, inputs, saved_bytes)
    return _kept(copy.deepcopy(model), chosen, held, inputs, saved_bytes)


def _kept(marked: torch.nn.ModuleList, chosen: Plan, held: list[int], inputs: dict[Any, Any],
          saved_bytes: Callable) -> int:
    chosen.apply(marked)

    def forwards() -> list:
        outs = []
        for stage, module in zip(held, marked):
            x = inputs[stage]
            x = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if isinstance(x, _Spec) else x
            if stage > 0:
                x = x.detach().clone().requires_grad_(x.is_floating_point())
            outs.append((x, module(x)))
        return outs

    return saved_bytes(forwards)
