"""The planner's cost model: what each block keeps and costs under each option (layer 4).

Memory comes from the tracker (`remat.memory.profile.measure`, on real or
fake tensors): one step with no marks and one step per option with every block
marked alike give each block's kept bytes under each option. Time per block is
its measured forward time, or on fake tensors a roofline estimate (FLOPs over
``throughput`` plus bytes moved over ``bandwidth``); the selective option costs
the share of a block's operators that ``save_compute_intensive`` does not keep
(by measured operator times on CPU tensors, by the roofline otherwise).
See NOTE [Plan cost model] in ``_solve/_problem.py`` for how these make a peak.

The work is split by job: `remat.planner._trace.trace` runs the step once with the blocks
hooked, `remat.planner._measure.measure_options` runs and times it once per option (the
options inside blocks from ``_options.py``), `remat.planner._times.block_times` makes the
blocks' re-run times of them, and here `assemble` makes `BlockCosts` of their figures, from
which `BlockCosts.problem` builds the solver's problem.

NOTE [Plans timing noise cannot flip]
On real tensors the times are measured: each block's forward, each child's, each
operator's on CPU, and each option's whole step (the calibration of its family). Two
plans whose times differ by less than the timer's noise then swap places run after run,
though each is measured as fast as the other (on the README's GPT: three plans in five
runs). So the options are ranked by times that do not move: the same model's operators
costed by FLOPs and bytes (the roofline the fake-tensor planner uses, from the warm-up
trace, which the timed trace needed anyway), plus the engine's share of each call, which
FLOPs and bytes miss and which dominates small tensors (`RERUN_CALL_S` per call
re-run, `POLICY_CALL_S` per call under a per-call policy: without it, ``selective``
looked cheap and the README's GPT got a plan whose predictions missed by up to half),
under the rules every time follows here (an ``output`` block or an operator mark re-runs
twice). The solver chooses on those
(``BlockCosts.problem(ranking=True)``); the measured, calibrated times then predict the
chosen plan's extra time (``Plan.predicted_extra_s``). Memory is measured either way,
and bytes do not jitter: the same model, inputs and budget give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from remat.memory.internal import local_nbytes, signature, truncated
from remat.planner._measure import Runs, measure_options
from remat.planner._settings import Settings
from remat.planner._solve import (
    BLOCK_OPTIONS,
    CALL_FAMILIES,
    OUTPUT,
    RECOMPUTE,
    STAGED,
    Choice,
    Problem,
    evaluate,
)
from remat.planner._times import BlockTimes, block_times
from remat.planner._trace import Trace, _named, trace


@dataclass(frozen=True)
class StepMemory:
    """What the whole step holds, measured once per option (marking every block alike)."""

    #: bytes alive before the step (parameters, inputs, the optimizer's state)
    baseline_bytes: int
    #: the gradients of the parameters outside blocks
    other_grad_bytes: int
    #: per option, the step's peak and the phase it is reached in
    peaks: dict[str, int] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    #: per option, the highest footprint reached in each phase (``ProfileReport.phase_peaks``)
    phase_peaks: dict[str, dict] = field(default_factory=dict)
    #: the unmarked step's peak in the optimizer's step (None: no optimizer)
    optimizer_peak: int | None = None


@dataclass(frozen=True)
class StepTime:
    """The unmarked step's seconds, how they were found, and each option's timed step."""

    #: forward, backward and the optimizer's step (None: not timed)
    seconds: float | None = None
    #: how ``seconds`` was found (measured or a roofline; `Plan.timing`)
    timing: str = "measured"
    #: per option, the seconds of its uniform run's step (the calibration of its family)
    per_option: dict = field(default_factory=dict)


@dataclass
class BlockCosts:
    """Measured costs of a model's blocks, in forward order (one entry per block).

    `problem` and the figures it is made of (`time_scale`, `transient_bytes`) read the fields
    and write none: asked twice, or after another problem, a cost model gives the same one."""

    names: list[str]
    types: list[str]
    kept: list[list[float | None]]
    times: BlockTimes
    output_bytes: list[int]
    grad_bytes: list[int]
    chain: list[bool]
    memory: StepMemory
    step: StepTime = field(default_factory=StepTime)
    #: the columns of ``kept``: `BLOCK_OPTIONS`, then options inside blocks
    options: list = field(default_factory=lambda: list(BLOCK_OPTIONS))
    #: forwards of each block per step: above 1 (gradient accumulation), every gradient
    #: exists while the later micro-batches run, and the model counts them all
    calls: int = 1
    #: on real tensors, the times that rank the options (None: ``times`` do)
    ranking: BlockTimes | None = None

    def problem(self, *, ranking: bool = False) -> Problem:
        """The solver's problem (NOTE [Plan cost model]), calibrated on the measured peaks
        (`transient_bytes`) and timed steps (`time_scale`); with ``ranking``, its times are
        `ranking`'s, not calibrated (NOTE [Plans timing noise cannot flip])."""
        n = len(self.names)
        fixed = self._fixed()
        keep_kept = [k[0] for k in self.kept]
        memory = self.memory
        end = memory.peaks["keep"] - sum(keep_kept)
        base = max((p for o, p in memory.peaks.items() if memory.phases.get(o) == "optimizer"), default=0)
        ranked = ranking and self.ranking is not None
        times = self.ranking if ranked else self.times
        model = [(1.0, 0.0)] * len(self.options) if ranked else self.time_model
        # Times on a binary grid (2**-30 s): sums of them are exact in any order, so plans of
        # equal cost are exact ties, broken the same way run after run (identical blocks)
        time_of = [[_grid(t * model[o][0] + u * model[o][1]) for o, (t, u) in enumerate(zip(row, units))]
                   for row, units in zip(self._raw_times(times), self._regions())]
        # What follows the last block (a head, a loss) runs backward with the gradients of
        # the parameters outside blocks and the blocks' kept bytes; a final chain is rebuilt there.
        tail = fixed[-1] + self.output_bytes[-1] if n else end
        gaps = self.transient_bytes
        return Problem(kept=self.kept, time=time_of,
                       rebuilt=[[k + g for g in gaps] for k in keep_kept],
                       fixed=fixed, output=self.output_bytes, end=end, chain_time=[0.0] * n,
                       base=base, last_held=keep_kept, tail=tail, options=self.options)

    @property
    def time_scale(self) -> list[float]:
        """Per column of ``options``, the factor `problem` scales its measured forward times by
        (all 1.0 without the options' timed steps, ``step.per_option``): `time_model`'s first term."""
        return [a for a, _ in self.time_model]

    @property
    def time_model(self) -> list[tuple[float, float]]:
        """Per column of ``options``, ``(scale, per_region_s)``: an option costs ``scale`` times
        the forward seconds it re-runs, plus ``per_region_s`` for each region it makes.

        NOTE [Calibrated re-run times]
        Each option's uniform run was timed too; its measured extra time over the unmarked
        step calibrates its family (a re-run costs more than its forward: the engine's hooks,
        the policy's dispatch mode, the gradients' temporaries). One model per family, fitted
        to all its options at once (least squares): whole blocks (``recompute``, the largest
        and steadiest of the timed differences), re-runs of children, per-call policies
        (``ops:``), ``selective`` and ``output`` (`_family`). A timer's noise on one option
        moves its family's model a little, and every option of the family with it, so it
        cannot make one option look cheaper than another of its kind: the plan is the same run
        after run. Children are a family apart from whole blocks: their marks cost more per
        second of forward (more hooks, operator marks), and pooled with them they made every
        block re-run look dearer than it is.

        A region also costs the engine's work per call, whatever it re-runs: a region
        around one small activation costs about as much as one around a whole attention on
        small tensors. Scaling forward seconds alone predicted such a child at half its
        measured cost and a per-call policy at a quarter (on a 4-block GPT of width 64, 4 x 64
        tokens: ``children:gelu`` 0.83 ms predicted, 1.93 measured; ``ops:`` options 4.1 ms
        against 8.0). So where a family's options tell the two apart (two or more timed, not
        proportional in forward seconds and regions), the fit has two terms, a scale and a
        price per region (not negative; the scale within [0.5, 4]); otherwise the price is 0
        and the scale alone is fitted, as a single timed option defines it exactly."""
        n, columns = len(self.names), len(self.options)
        raw_times, units = self._raw_times(self.times), self._regions()
        keep_s = self.step.per_option.get("keep")
        fitted: dict[str, list[tuple[float, float, float]]] = {}
        for o in range(1, columns):
            step_s = self.step.per_option.get(self.options[o])
            if keep_s is None or step_s is None:
                continue
            choice = [o if self.kept[i][o] is not None else 0 for i in range(n)]
            raw = sum(raw_times[i][c] for i, c in enumerate(choice))
            if raw > 0:
                regions = sum(units[i][c] for i, c in enumerate(choice))
                fitted.setdefault(_family(self.options[o]), []).append((raw, regions, step_s - keep_s))
        model = {family: _fit_family(rows) for family, rows in fitted.items()}
        out = [(1.0, 0.0)] + [model.get(_family(self.options[o]), (1.0, 0.0)) for o in range(1, columns)]
        # A child's re-run pays the engine's hooks as a block's does, per second of forward
        # at least: an option inside blocks is not scaled below ``recompute`` (its price per
        # region refitted at that scale).
        # A family fitted with a price per region needs no floor: its fixed cost is the price.
        floor = out[RECOMPUTE][0]
        for o in range(len(BLOCK_OPTIONS), columns):
            if out[o][0] < floor and not out[o][1]:
                out[o] = (floor, 0.0)
        return out

    @property
    def transient_bytes(self) -> list[float]:
        """Per column of ``options``, what its uniform run's backward held beyond the bytes kept
        (gradient temporaries, the rebuilt output of a cell mark): its measured peak less the
        rough model's (block moments only), added to that option's bytes in `problem`."""
        n, columns = len(self.names), len(self.options)
        keep_kept = [k[0] for k in self.kept]
        # times do not move a peak: the rough model is untimed
        rough = Problem(kept=self.kept, time=[[0.0] * columns for _ in range(n)], rebuilt=keep_kept,
                        fixed=self._fixed(), output=self.output_bytes, end=-float("inf"),
                        chain_time=[0.0] * n, last_held=keep_kept, tail=-float("inf"),
                        options=self.options)
        gaps = [0.0] * columns
        for o in range(columns):
            if self.options[o] in self.memory.peaks:
                choice = [o if self.kept[i][o] is not None else 0 for i in range(n)]
                gaps[o] = max(0.0, self.memory.peaks[self.options[o]] - evaluate(rough, choice)[0])
        return gaps

    def _fixed(self) -> list[float]:
        """Per block, the bytes alive in its backward that no choice changes: the baseline, the
        gradients of parameters outside blocks and of the blocks after it (all of them with
        several micro-batches, whose gradients exist while the later ones run)."""
        n = len(self.names)
        later = [sum(self.grad_bytes[i + 1 if self.calls == 1 else 0:]) for i in range(n)]
        return [self.memory.baseline_bytes + self.memory.other_grad_bytes + g for g in later]

    def _regions(self) -> list[list[int]]:
        """Per block and column, the regions the option makes: one for a block option or a
        per-call policy, one per child marked (NOTE [Calibrated re-run times])."""
        per_option = [0, *[1] * (len(BLOCK_OPTIONS) - 1)] + [
            len(Choice.parse(o).children) or 1 for o in self.options[len(BLOCK_OPTIONS):]]
        return [per_option] * len(self.names)

    def _raw_times(self, times: BlockTimes) -> list[list[float]]:
        """Per block and column, the extra seconds of ``times`` (this cost model's `times` or
        its `ranking`) before calibration."""
        columns = len(self.options)
        inner = times.child_s or [[]] * len(self.names)
        # An ``output`` block runs twice in backward, chained or not: once to hand its output
        # to whoever saved it, once to rebuild what it saved itself (NOTE [Output pass]); timed
        # on the README's GPT, a lone output block costs what one in a chain does (2x a re-run)
        # (so a chain adds nothing: ``chain_time`` is zero)
        return [[0.0, f, s, 2 * f, *c] + [0.0] * (columns - 4 - len(c))
                for f, s, c in zip(times.forward_s, times.selective_s, inner)]


def _fit_family(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(scale, per_region_s)`` fitted to a family's ``(forward s, regions, extra s)`` rows
    (NOTE [Calibrated re-run times]): two terms where the rows tell them apart, else one."""
    sxx = sum(r * r for r, _, _ in rows)
    one = min(4.0, max(0.5, sum(r * d for r, _, d in rows) / sxx))
    suu = sum(u * u for _, u, _ in rows)
    sxu = sum(r * u for r, u, _ in rows)
    det = sxx * suu - sxu * sxu
    if len(rows) < 2 or det <= 1e-9 * sxx * suu:  # proportional rows: the price is not seen
        return one, 0.0
    sxd = sum(r * d for r, _, d in rows)
    sud = sum(u * d for _, u, d in rows)
    scale = min(4.0, max(0.5, (sxd * suu - sud * sxu) / det))
    price = _price(rows, scale)
    return (scale, price) if price > 0 else (one, 0.0)


def _price(rows: list[tuple[float, float, float]], scale: float) -> float:
    """The per-region price that best fits ``rows`` at ``scale`` (least squares, not negative)."""
    suu = sum(u * u for _, u, _ in rows)
    return max(0.0, sum(u * (d - scale * r) for r, u, d in rows) / suu) if suu else 0.0


def _grid(seconds: float) -> float:
    """``seconds`` rounded to a multiple of 2**-30 s (about a nanosecond), a binary fraction."""
    return round(seconds * 2**30) / 2**30


def _family(option: str) -> str:
    """The options whose re-runs cost alike (NOTE [Calibrated re-run times]): ``"blocks"``
    (whole blocks re-run by the hooks), ``"children"`` (children re-run by cell and operator
    marks), ``"policies"`` (``selective`` and the per-call policies ``ops:``: a block re-run
    under a dispatch mode that decides per call, whose price per block the ``ops:`` options
    show and ``selective`` alone could not), ``"output"`` of its own (a chain of blocks
    re-run twice, measured at 2x a block re-run), and ``"staged"`` of its own (a block's
    Python run once more per stage: priced with the per-call policies, every staged plan
    came out cheaper than it ran, NOTE [Options re-run in stages])."""
    if option == "output":
        return option  # each block re-run twice in backward (NOTE [Output pass])
    if option == "recompute":
        return "blocks"
    if option == "selective":
        return "policies"
    family = Choice.parse(option).family
    return "staged" if family == STAGED else "policies" if family in CALL_FAMILIES else "children"



def assemble(traced: Trace, runs: Runs, settings: Settings, roofline: Trace | None = None) -> BlockCosts:
    """The cost model of the blocks from the trace and the runs (per forward of a block);
    ``roofline``: on real tensors, a trace costed by FLOPs and bytes, whose times rank the
    options (NOTE [Plans timing noise cannot flip])."""
    names, blocks, calls = traced.names, traced.blocks, traced.calls
    keep = {r.name: r for r in runs.reports["keep"].rows}
    every, kept = _kept_bytes(traced, runs)
    # Identical blocks (one class, one set of parameter shapes, the same bytes kept under every
    # option) cost the same: their times are averaged, so the timer cannot make one
    # of them look cheaper to recompute than its twin (a plan that is stable run after run)
    groups: dict[tuple, list[int]] = {}
    for k, (_, module) in enumerate(blocks):
        groups.setdefault((signature(module), tuple(kept[k])), []).append(k)
    times = block_times(traced, runs, settings.machine.fake, groups)
    ranking = None
    if not settings.machine.fake:
        ranking = block_times(roofline or traced, runs, True, groups, per_call=True)
    grads = [sum(local_nbytes(p) for p in m.parameters() if p.requires_grad) for _, m in blocks]
    return BlockCosts(
        names=names, types=[type(m).__name__ for _, m in traced.blocks],
        kept=kept, times=times,
        output_bytes=[keep[name].output_bytes // calls for name in names], grad_bytes=grads,
        chain=traced.chain, memory=_step_memory(runs, sum(grads)),
        step=_step_time(traced, runs, settings), options=every, calls=calls, ranking=ranking,
    )


def _kept_bytes(traced: Trace, runs: Runs) -> tuple[list[str], list[list[float | None]]]:
    """The columns (`BLOCK_OPTIONS`, then ``runs.columns``) and, per block and column, the bytes
    the block keeps under that option (None: not an option of the block)."""
    rows = {o: {r.name: r for r in rep.rows} for o, rep in runs.reports.items()}
    every = [*BLOCK_OPTIONS, *runs.columns]
    kept = [[float(rows[o][name].kept) if o in rows and (o in BLOCK_OPTIONS or o in runs.inner[name])
             else None for o in every] for name in traced.names]
    for k, row in enumerate(kept):
        if not traced.chain[k] and row[OUTPUT] is not None:
            row[OUTPUT] = None
    return every, kept


def _step_memory(runs: Runs, block_grads: int) -> StepMemory:
    """What the whole step holds under each option (``block_grads``: the blocks' gradients)."""
    report = runs.reports["keep"]
    all_grads = sum(local_nbytes(p) for p in runs.measured.parameters() if p.requires_grad)
    return StepMemory(
        baseline_bytes=report.baseline_bytes, other_grad_bytes=all_grads - block_grads,
        peaks={o: r.peak_bytes for o, r in runs.reports.items()},
        phases={o: r.peak_phase for o, r in runs.reports.items()},
        phase_peaks={o: dict(r.phase_peaks) for o, r in runs.reports.items()},
        optimizer_peak=report.phase_peaks.get("optimizer"))


def _step_time(traced: Trace, runs: Runs, settings: Settings) -> StepTime:
    """The unmarked step's seconds (on fake tensors, the roofline's) and how they were found."""
    if settings.machine.fake:
        step = 3 * traced.calls * sum(traced.ops.totals.total.values())
        timed = f"roofline ({settings.machine.device})"
    else:
        # the step users run: forward, backward and the optimizer's step
        step = (runs.steps["keep"] + runs.steps.get("optimizer", 0.0) if runs.steps
                else (runs.reports["keep"].step_ms or 0.0) / 1e3)
        timed = "measured, each family of options calibrated by its timed runs"
    return StepTime(seconds=step, timing=timed, per_option=runs.steps)


def measure_costs(model: torch.nn.Module, blocks: list, settings: Settings) -> BlockCosts:
    """Measure every block under every option: `trace`, `measure_options`,
    `assemble`; see the module docstring.

    With ``settings.build`` (a rank's plan, NOTE [Planning a rank]) each run is of a fresh
    model from it; ``model`` only names the blocks."""
    settings.say("tracing blocks")
    state = None if settings.machine.fake else {k: v.detach().clone() for k, v in model.state_dict().items()}
    # on CPU tensors the selective share comes from operator times (a warm-up step first)
    timed = not settings.machine.fake and settings.machine.device == "cpu"
    roofline = None
    try:
        if timed:  # (also the warm-up of the timed trace) NOTE [Plans timing noise cannot flip]
            roofline = trace(model, blocks, settings)
        traced_model = model if settings.build is None else settings.build({})
        traced = trace(traced_model, _named(traced_model, blocks), settings, timed=timed)
        traced.blocks = _named(model, traced.blocks)  # the model's classes, not the sharded ones
        if state is not None:
            model.load_state_dict(state)
        runs = measure_options(model, traced, settings, state)
    finally:
        if state is not None:
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)
    return assemble(traced, runs, settings, roofline)



def composed_costs(model: torch.nn.Module, blocks: list, container: torch.nn.Module,
                   settings: Settings) -> BlockCosts | None:
    """Measure the model with 2 and with 3 of its ``n`` identical blocks and compose the costs of
    all ``n``: per block, the first, a middle one repeated, the last; every step-wide figure
    (baseline, peaks, step time) grows linearly with the number of blocks. None when the model
    does not run a shorter container as a shorter model, or is no longer than the runs.

    A rank's plan (``build``) composes from 3 and 4 blocks: FSDP2 gathers a unit's neighbours
    ahead of it in forward and in backward, so a step grows linearly only once some block has
    blocks on both sides (NOTE [Planning a rank])."""
    n = len(blocks)
    measured = {}
    build = settings.build
    small, large = (2, 3) if build is None else (3, 4)
    if n <= large:
        return None
    where = next(name for name, m in model.named_modules() if m is container)
    for count in (small, large):
        with truncated(container, count):
            try:
                cut = None if build is None else build.cut(where, count)
                measured[count] = measure_costs(model, blocks[:count], settings.replace(build=cut))
            except (TypeError, IndexError):  # the forward does not iterate over the container
                return None
    two, three = measured[small], measured[large]
    if two.options != three.options:  # the short models' blocks differ: measure the whole one
        return None

    def grow(a: float, b: float) -> float:
        return b + (n - large) * (b - a)

    def spread(values: list) -> list:
        return [values[0], *[values[1]] * (n - 2), values[-1]]

    times = three.times
    return BlockCosts(
        names=[name for name, _ in blocks], types=spread(three.types), kept=spread(three.kept),
        times=BlockTimes(spread(times.forward_s), spread(times.selective_s), spread(times.child_s)),
        output_bytes=spread(three.output_bytes), grad_bytes=spread(three.grad_bytes),
        chain=spread(three.chain), memory=_composed_memory(two.memory, three.memory, grow),
        step=StepTime(
            seconds=grow(two.step.seconds, three.step.seconds) if two.step.seconds is not None else None,
            timing=f"{three.step.timing}; {n} identical blocks composed from runs with {small} and {large}"),
        options=three.options, calls=three.calls,
    )


def _composed_memory(two: StepMemory, three: StepMemory,
                     grow: Callable[[float, float], float]) -> StepMemory:
    """The memory of the whole step from that of the short models' (`composed_costs`), each
    figure grown by ``grow`` but the gradients outside blocks, which do not grow."""
    # Each phase's peak grows linearly, at its own rate: the step's peak is the largest grown
    # one, which may be in another phase than the short models' (a rank's backward outgrows
    # its optimizer step, whose peak is mostly replicated parameters and their state).
    grown = {o: {phase: grow(two.phase_peaks[o][phase], peak)
                 for phase, peak in three.phase_peaks.get(o, {}).items()
                 if phase in two.phase_peaks.get(o, {})} for o in three.peaks}
    return StepMemory(
        baseline_bytes=int(grow(two.baseline_bytes, three.baseline_bytes)),
        other_grad_bytes=three.other_grad_bytes,
        peaks={o: int(max(g.values())) if g else int(grow(two.peaks[o], three.peaks[o]))
               for o, g in grown.items()},
        phases={o: max(g, key=g.get) if g else three.phases[o] for o, g in grown.items()},
        phase_peaks={o: {ph: int(v) for ph, v in g.items()} for o, g in grown.items()},
        optimizer_peak=(None if three.optimizer_peak is None
                        else int(grow(two.optimizer_peak, three.optimizer_peak))))
