"""`Plan` and `Decision`: what `remat.plan` returns, as frozen data (layer 4)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from remat._front.marks import mark_of, recompute_module
from remat.memory import format_bytes
from remat.planner._settings import marks_of
from remat.planner._solve import Choice

API = "remat.plan"


@dataclass(frozen=True)
class Decision:
    """One block's option in a `Plan`.

    Args:
        name: the block's qualified module name.
        type: its class name.
        choice: the option's text: ``"keep"``, ``"recompute"``, ``"selective"``, ``"output"``
            (``output_recompute``), or an option inside the block, ``"children:attn"`` /
            ``"children:fc+gelu"`` (the children named are marked, not the block: NOTE [Options
            inside blocks]) or ``"ops:aten::mm#0+aten::addmm#3"`` (the block marked, those
            calls' outputs kept: NOTE [Options per operator]); `option` is it as a value.
        kept_bytes: bytes the block keeps for backward under ``choice``.
        extra_s: predicted extra seconds per step.

    Examples:
        >>> from remat.planner import Decision
        >>> d = Decision("blocks.0", "Block", "children:attn+mlp", kept_bytes=1024, extra_s=0.002)
        >>> d.option.children, d.option.family
        (('attn', 'mlp'), 'children')
    """

    name: str
    type: str
    choice: str
    kept_bytes: float
    extra_s: float

    @property
    def option(self) -> Choice:
        """The typed option ``choice`` stands for (NOTE [Choices as values]); a ``ValueError``
        naming ``choice`` when it is no option."""
        return _checked(self.choice, self.name, "remat.planner.Decision.option")


@dataclass(frozen=True)
class Measured:
    """What was measured of a `Plan` with the plan applied.

    Args:
        peak_bytes: the step's peak (None: not verified).
        extra_s: the plan's extra seconds per step, timed against the unmarked step in
            interleaved rounds (median of the rounds' ratios; None: not timed).

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
        ...                             torch.nn.Linear(64, 16)) for _ in range(2)])
        >>> plan = remat.plan(net, torch.randn(32, 16), budget=1.0, repeat=0)
        >>> plan.measured.peak_bytes == plan.measured_peak_bytes, plan.measured.extra_s
        (True, None)
    """

    peak_bytes: int | None = None
    extra_s: float | None = None


@dataclass(frozen=True)
class JobRank:
    """The rank a `Plan` is for (``world_size=``): every byte figure, the budget's included, is
    this rank's.

    Args:
        rank: the rank planned.
        world_size: the ranks in the job.

    Examples:
        >>> from remat.planner import JobRank
        >>> JobRank(rank=1, world_size=8)
        JobRank(rank=1, world_size=8)
    """

    rank: int
    world_size: int


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
        measured: what was measured of the plan applied (``measured_peak_bytes``,
            ``measured_extra_s``).
        measured_peak_bytes: the peak measured with the plan applied (None: not verified).
        solver: which solver chose it (``"dp"``, ``"milp"``).
        solve_s: seconds the solver took.
        timing: how the options' times were found: ``"measured"`` (real tensors) or
            ``"roofline"`` (fake tensors: FLOPs and bytes moved).
        measured_extra_s: the plan's extra seconds per step, timed against the unmarked step
            in interleaved rounds (None: not timed).
        job: for a rank's plan (``world_size=``), the rank and the job's ranks; else None.
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
    measured: Measured = Measured()
    solver: str = ""
    solve_s: float = 0.0
    timing: str = "measured"
    #: a rank's plan (``world_size=``): the rank planned and the ranks in the job (None: one process)
    job: JobRank | None = None

    @property
    def measured_peak_bytes(self) -> int | None:
        """The peak measured with the plan applied (None: not verified)."""
        return self.measured.peak_bytes

    @property
    def measured_extra_s(self) -> float | None:
        """On real tensors: the plan's extra seconds per step, timed against the unmarked step
        in interleaved rounds (median of the rounds' ratios; None: not timed)."""
        return self.measured.extra_s

    @property
    def rank(self) -> int | None:
        """The rank planned, for a rank's plan (``world_size=``); else None."""
        return None if self.job is None else self.job.rank

    @property
    def world_size(self) -> int | None:
        """The ranks in the job of a rank's plan; every byte figure, the budget's included, is
        this rank's (None: one process)."""
        return None if self.job is None else self.job.world_size

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
        data = {name: getattr(self, name) for name in JSON_FIELDS}
        data["decisions"] = [asdict(d) for d in self.decisions]
        return json.dumps({"remat_plan": 1, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by `to_json`.

        Raises:
            ValueError: the text is no remat plan, or a decision's option is no option
                (`Choice.parse`: the message names it and the forms an option takes).
        """
        api = "remat.Plan.from_json"
        data = json.loads(text)
        if data.pop("remat_plan", None) != 1:
            raise ValueError(f"{api}: not a remat plan (no 'remat_plan': 1 field)")
        for d in data["decisions"]:  # the message names this API, the block and the option
            _checked(d.get("choice"), d.get("name"), api)
        data["decisions"] = tuple(Decision(**d) for d in data["decisions"])
        data["measured"] = Measured(data.get("measured_peak_bytes"), data.get("measured_extra_s"))
        if data.get("world_size") is not None:
            data["job"] = JobRank(data.get("rank"), data["world_size"])
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


#: a plan's JSON, in order: its fields with `Plan.measured` and `Plan.job` written out, as
#: before they were grouped (a plan written then reads now)
JSON_FIELDS = ("decisions", "budget_bytes", "predicted_peak_bytes", "predicted_extra_s", "step_s",
               "no_recompute_peak_bytes", "floor_bytes", "measured_peak_bytes", "solver", "solve_s",
               "timing", "measured_extra_s", "rank", "world_size")


def _checked(choice: str, block: str, api: str) -> Choice:
    """The option ``choice`` of ``block`` stands for; a ``ValueError`` naming ``api`` if none."""
    option = Choice.parse(choice, api=api, block=block)
    if option.module:
        raise ValueError(f"{api}: option {choice!r} of block {block!r} names a module of its "
                         f"own; a block's option is {str(option.without_module())!r}")
    return option


def _same_row(a: Decision, b: Decision) -> bool:
    return (a.type, a.choice, a.kept_bytes, round(a.extra_s, 12)) == (
        b.type, b.choice, b.kept_bytes, round(b.extra_s, 12))


def _spec_of(kwargs: dict) -> Any:
    probe = torch.nn.Identity()
    recompute_module(probe, **kwargs)
    return mark_of(probe)
