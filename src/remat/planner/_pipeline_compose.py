"""Fake-tensor pipeline plans composed from one micro-batch per distinct stage (layer 4).

NOTE [A rank's peak composed]
Replaying a rank's whole loop (`remat.planner._pipeline._RankStep`) for every option of the
cost model runs each stage's forward and backward once per micro-batch per option: a 70B
model on 8 ranks with 32 micro-batches is minutes of fake tensors. But a micro-batch through
a stage does the same to the bytes alive whichever micro-batch it is; what differs is only
what the loop holds around it (NOTE [What a pipeline rank holds]). So for fake stages:

- a cost model of the blocks (bytes kept and re-run times per block and option, `BlockCosts`)
  is measured once, on one micro-batch's forward and backward, for all the stages whose blocks
  are observed equal (`observe_stage`: each block's class, parameters and inputs), on the one
  of them with the fewest parameters outside its blocks: one for every stage of a Llama;
- a plan's peak on a rank is composed exactly: each stage it holds is run once under the
  tracker with its part of the plan applied (`stage_profile`: its forward, its loss, its
  backward, NOTE [A later backward, from the first]); stages observed equal (`stage_key`:
  classes, parameters and buffers, input, whether the loss follows) share these runs, so a
  Llama's middle stages are one. `remat.planner._timeline.rank_peak` then walks the schedule's
  actions on byte counts as the replay walks them on tensors, what the loop and its sends hold
  included; the optimizer's step is measured once per rank of one kind (no mark changes it);
- the solver chooses on the cost model with each block's kept bytes times the micro-batches
  its stage holds at the unmarked peak (`remat.planner._pipeline_rank`), offset so that it
  predicts the rank's composed peak unmarked; every plan it chooses is composed, and while
  that is over the budget, solved again for the budget less the prediction's largest error
  seen (NOTE [Solve, measure, lower the target]); where the solver finds nothing, the fastest
  marking of every block alike whose composed peak fits is taken.

A plan's ``measured_peak_bytes`` is that composed peak: checked against the replay to within
1% in ``tests/test_pipeline_plan.py`` (and the replay, to the byte, against real pipelines).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from remat.memory.internal import Step
from remat.planner._cost import BlockCosts, composed_costs, measure_costs
from remat.planner._settings import Machine, Settings, Solving, mark_choices
from remat.planner._solve import OPTIONS
from remat.planner._timeline import StageProfile, rank_peak

API = "remat.plan_pipeline"


@dataclass(frozen=True)
class StageSpec:
    """What a fake stage is run on: its factory, input, output, and the loss after it.

    Attributes:
        make: builds the stage (in the fake mode).
        index: its index in the pipeline.
        last: the loss follows it.
        inputs: ``(input, output gradient or None, target or None)``, each a
            ``remat.planner._pipeline._Spec``.
        blocks: its blocks' names in the stage.
        key: `stage_key`: stages of one key share their measurements.
        blocks_key: ``(key, parameters outside the blocks)`` (`observe_stage`): stages of one
            key share the cost model of their blocks, measured on the one with the fewest.
    """

    make: Callable[[], torch.nn.Module]
    index: int
    last: bool
    inputs: tuple
    blocks: tuple[str, ...]
    key: tuple
    blocks_key: tuple


def observe_stages(stages: list, x: torch.Tensor, blocks: Any, dtype: torch.dtype | None) -> list[tuple]:
    """Each fake stage's ``(input, blocks' names, (key, blocks' key))`` (`observe_stage`), run in
    the fake mode on the previous one's output; a stage of a key seen already is built, not run
    (its output is that stage's)."""
    from remat.memory.internal import build_in

    out, seen = [], {}
    for i, make in enumerate(stages):
        built, ends = build_in(make, dtype), (i == 0, i == len(stages) - 1)
        key = stage_key(built, x, ends)
        if key not in seen:
            seen[key] = observe_stage(built, x, ends, blocks)
        y, names, key, blocks_key = seen[key]
        out.append((x, names, (key, blocks_key)))
        x = y
    return out


def observe_stage(stage: torch.nn.Module, x: torch.Tensor, ends: tuple[bool, bool], blocks: Any) -> tuple:
    """Run a fake stage on its input ``x`` (``ends``: whether it is the first, the last):
    ``(output, its blocks' names, its `stage_key`, its blocks' key)``. The blocks' key is what stages must share for one cost model of their blocks
    (each block's class, parameters and inputs, as the run shows them), with the parameters
    outside the blocks: the stage with the fewest is the one measured."""
    from remat._front.blocks import find_blocks
    from remat.memory.internal import signature
    from remat.planner._trace import find_blocks as select

    chosen = select(stage, blocks) if isinstance(blocks, (type, tuple)) else find_blocks(stage)
    chosen = chosen or [("", stage)]
    seen: dict[str, tuple] = {}
    hooks = [m.register_forward_pre_hook(functools.partial(_note_inputs, seen, n), with_kwargs=True)
             for n, m in chosen]
    try:
        y = stage(x)
    finally:
        for hook in hooks:
            hook.remove()
    inside = sum(p.numel() for _, m in chosen for p in m.parameters())
    outside = sum(p.numel() for p in stage.parameters()) - inside
    key = stage_key(stage, x, ends)
    return y, tuple(n for n, _ in chosen), key, (tuple((signature(m), seen.get(n)) for n, m in chosen), outside)


def _note_inputs(seen: dict, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    from torch.utils._pytree import tree_leaves

    seen[name] = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                       for t in tree_leaves((args, kwargs)))


def stage_key(stage: torch.nn.Module, spec: Any, ends: tuple[bool, bool]) -> tuple:
    """What two stages must share to be measured once (observed, not named): each module's
    class in order, every parameter's and buffer's shape and dtype, the input's, and ``ends``:
    whether it is the first stage (its input takes no gradient) and the last (the loss follows)."""
    classes = tuple(type(m) for m in stage.modules())
    tensors = tuple((tuple(t.shape), t.dtype) for t in (*stage.parameters(), *stage.buffers()))
    return classes, tensors, (tuple(spec.shape), spec.dtype), ends


class _OneMicrobatch:
    """A stage's loop for one micro-batch: its forward and backward, as the replay runs them
    (a fresh input, the output's gradient a buffer of ones, the loss after the last stage)."""

    def __init__(self, spec: StageSpec, loss_fn: Callable) -> None:
        self.spec, self.loss_fn = spec, loss_fn

    def tensors(self) -> tuple:
        x, grad, target = (None if s is None else torch.zeros(s.shape, dtype=s.dtype, device=s.device)
                           for s in self.spec.inputs)
        if self.spec.index > 0:
            x.requires_grad_(x.is_floating_point())
        return x, (None if grad is None else torch.ones_like(grad)), target

    def __call__(self, model: torch.nn.Module, batch: Any) -> None:
        x, grad, target = self.tensors()
        y = model(x)
        if self.spec.last:
            self.loss_fn(y, target).backward()
        else:
            y.backward(grad)


class _Segments:
    """The tracker's live bytes, the most of them since `start`; and in a backward, the most
    of them less the parameters' gradients made so far: the same backward's when those
    gradients exist already (NOTE [A later backward, from the first])."""

    def __init__(self, tracker: Any, parameters: list[torch.nn.Parameter]) -> None:
        self.tracker, self.top = tracker, 0
        self.made, self.top_later, self.seen = 0, 0, set()
        tracker.on_change = self.see
        self.hooks = [p.register_post_accumulate_grad_hook(self.accumulated) for p in parameters]

    def see(self, live: int, phase: str, module: str) -> None:
        self.top = max(self.top, live)
        self.top_later = max(self.top_later, live - self.made)

    def accumulated(self, p: torch.nn.Parameter) -> None:
        if id(p) not in self.seen:  # a parameter used twice adds its second gradient in place
            self.seen.add(id(p))
            self.made += p.grad.untyped_storage().nbytes()

    def start(self) -> int:
        self.top = self.top_later = self.tracker.live_bytes
        self.made = 0
        return self.top

    def since(self, start: int) -> tuple[int, int]:
        return self.top - start, self.tracker.live_bytes - start


def stage_profile(spec: StageSpec, choices: dict[str, str], loss_fn: Callable,
                  dtype: torch.dtype | None, split: bool = False) -> StageProfile:
    """Run one stage, ``choices`` marked, for one micro-batch under the tracker (NOTE [A rank's
    peak composed]).

    NOTE [A later backward, from the first]
    A stage's first backward in a step makes its parameters' gradients: each is the tensor
    its last operator made, kept (autograd steals it). A later one makes the same tensors and
    adds each into the gradient there, in place, and frees it at once. So the later backward's
    bytes alive are the first's less the gradients made so far, moment by moment: both
    profiles come from one run (half the cost; equal to the replay's peaks to the byte in
    ``tests/test_pipeline_plan.py``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory import track
    from remat.memory.internal import build_in

    one = _OneMicrobatch(spec, loss_fn)
    with FakeTensorMode():
        stage = build_in(spec.make, dtype)
        stage.train()
        mark_choices(dict(stage.named_modules()), choices)
        with track(stage) as tracker:
            seg = _Segments(tracker, [p for p in stage.parameters() if p.requires_grad])
            try:
                (forward, loss, first, later), freed = _profile_round(stage, one, seg)
                halves = _split_rounds(stage, one, seg) if split and spec.index > 0 else None
            finally:
                for hook in seg.hooks:
                    hook.remove()
    return StageProfile(forward=forward, loss=loss, backward=(first, later), output_bytes=freed[1],
                        input_grad_bytes=freed[0], split=halves)


def _split_rounds(stage: torch.nn.Module, one: _OneMicrobatch, seg: _Segments) -> tuple:
    """The input backward's ``(peak, net)`` and the weight backward's, the step's first and a
    later one (NOTE [A backward split in two] in ``_pipeline.py``): two micro-batches run as
    the replay runs them, the input's gradient let go after the input backward (it is sent),
    the output (the last stage's, attached, and its loss) held through the weight backward."""
    from remat.planner._split_backward import backward_input, backward_weight

    stage.zero_grad(set_to_none=True)
    halves: list = []
    for _ in range(2):
        x, grad, target = one.tensors()
        out = stage(x)
        y = one.loss_fn(out, target) if one.spec.last else out
        start = seg.start()
        groups = backward_input([y], None if one.spec.last else [grad], [x], stage.parameters())
        if one.spec.last and not out._is_view():
            out.detach_()
        halves.append(seg.since(start))
        x.grad = None
        start = seg.start()
        backward_weight(stage.parameters(), groups)
        halves.append(seg.since(start))
        del groups
    stage.zero_grad(set_to_none=True)
    return halves[0], halves[1], halves[3]


def _profile_round(stage: torch.nn.Module, one: _OneMicrobatch, seg: _Segments) -> tuple:
    """One micro-batch's forward, loss, first and later backward: their ``(peak, net)``, and the
    bytes freed by letting go of the input's gradient, then of the output (and loss)."""
    x, grad, target = one.tensors()
    start = seg.start()
    y = stage(x)
    forward = seg.since(start)
    loss, lossed = None, (0, 0)
    if one.spec.last:
        start = seg.start()
        loss = one.loss_fn(y, target)
        lossed = seg.since(start)
    start = seg.start()
    (loss if loss is not None else y).backward(None if loss is not None else grad)
    first = seg.since(start)
    later = (seg.top_later - start, first[1] - seg.made)
    before = seg.tracker.live_bytes
    if x.requires_grad:
        x.grad = None
    dropped = before - seg.tracker.live_bytes
    before, own = seg.tracker.live_bytes, y.untyped_storage().nbytes()
    del y, loss
    # the output's bytes: freed with it (the last stage's loss is freed with it, kept apart)
    return (forward, lossed, first, later), (dropped, own if one.spec.last else before - seg.tracker.live_bytes)


def _nbytes(spec: Any) -> int:
    if spec is None:
        return 0
    numel = 1
    for n in spec.shape:
        numel *= n
    return numel * spec.dtype.itemsize


class Composer:
    """The measurements of a fake-tensor pipeline plan, each made once and shared (NOTE [A
    rank's peak composed]): stage profiles per plan, cost models and optimizer phases per key.

    Args:
        specs: every stage's `StageSpec`, in pipeline order.
        n_microbatches: micro-batches per step.
        loss_fn: the schedule's loss function.
        latest: each send is let go at the next one (``Schedule1F1B``).
        split: the schedule splits backwards into input and weight backwards (zero-bubble).
        settings: the planner's settings for the stages' cost models (fake tensors).
        dtype: the stages' dtype.
    """

    def __init__(self, specs: list[StageSpec], n_microbatches: int, loss_fn: Callable, latest: bool,
                 settings: Settings, dtype: torch.dtype | None, split: bool = False) -> None:
        self.specs, self.n, self.loss_fn, self.latest, self.split = specs, n_microbatches, loss_fn, latest, split
        self.settings, self.dtype = settings, dtype
        self._profiles: dict[tuple, StageProfile] = {}
        self._costs: dict[tuple, BlockCosts] = {}
        self._bases: dict[tuple, tuple[int, int]] = {}

    def profile(self, stage: int, choices: dict[str, str]) -> StageProfile:
        spec = self.specs[stage]
        key = (spec.key, tuple(sorted((n, c) for n, c in choices.items() if c != "keep")))
        if key not in self._profiles:
            self._profiles[key] = stage_profile(spec, choices, self.loss_fn, self.dtype, self.split)
        return self._profiles[key]

    def costs(self, stage: int) -> BlockCosts:
        """The cost model of a stage's blocks for one micro-batch, shared by the stages whose
        blocks are equal and measured on the one of them with the fewest parameters outside
        its blocks (the solver's guide: each plan's peak is then composed, exactly)."""
        key = self.specs[stage].blocks_key[0]
        if key not in self._costs:
            group = [s for s in self.specs if s.blocks_key[0] == key]
            measured = min(group, key=lambda s: (s.blocks_key[1], s.index))
            self._costs[key] = _stage_costs(measured, self.loss_fn, self.settings, self.dtype)
        return self._costs[key]

    def kept(self, held: list[int], choices: dict[int, dict[str, str]]) -> int:
        """What one micro-batch's forward through the rank's stages leaves alive besides their
        outputs, ``choices`` marked (remat's random-state snapshots included)."""
        return sum(self.profile(s, choices[s]).forward[1] - self.profile(s, choices[s]).output_bytes for s in held)

    def peak(self, actions: list, held: list[int], choices: dict[int, dict[str, str]]) -> int:
        """A rank's peak with each stage it holds marked as ``choices[stage]`` says."""
        return max(self.loop_peak(actions, held, choices), self.base(held)[1])

    def loop_peak(self, actions: list, held: list[int], choices: dict[int, dict[str, str]],
                  at_peak: dict | None = None) -> int:
        """A rank's peak in its loop (forwards and backwards; not the optimizer's step); ``at_peak``
        as for `rank_peak`."""
        last = len(self.specs) - 1
        profiles = {s: self.profile(s, choices[s]) for s in held}
        buffers = self.n * sum(_nbytes(self.specs[s].inputs[0]) + _nbytes(self.specs[s].inputs[1])
                               + _nbytes(self.specs[s].inputs[2]) for s in held)
        handoff = {s: (_nbytes(self.specs[s + 1].inputs[0]), _nbytes(self.specs[s].inputs[1]))
                   for s in held if s + 1 in held}
        return self.base(held)[0] + rank_peak(actions, profiles, last, buffers, self.latest, at_peak, handoff)

    def base(self, held: list[int]) -> tuple[int, int]:
        """What a rank holds before its loop (parameters, the optimizer's state) and the peak of
        its optimizer's step, measured once per rank of one key (no mark changes them)."""
        key = tuple(self.specs[s].key for s in held)
        if key not in self._bases:
            self._bases[key] = _rank_base([self.specs[s].make for s in held], self.settings.optimizer,
                                          self.dtype)
        return self._bases[key]


def _rank_base(makers: list[Callable], optimizer: Any, dtype: torch.dtype | None) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.internal import Step, build_in
    from remat.memory.profile import measure

    def gradients(model: torch.nn.Module, batch: Any) -> None:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)

    with FakeTensorMode():
        model = torch.nn.ModuleList(build_in(make, dtype) for make in makers)
        report = measure(model, (), step=Step(custom=gradients, api=API), optimizer=optimizer,
                         estimated=True, api=API)
    return report.baseline_bytes, report.phase_peaks.get("optimizer", 0)


def _stage_costs(spec: StageSpec, loss_fn: Callable, settings: Settings,
                 dtype: torch.dtype | None) -> BlockCosts:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.internal import Step, build_in, identical_container
    from remat.planner._trace import find_blocks

    with FakeTensorMode():
        stage = build_in(spec.make, dtype)
        stage.train()
        mine = settings.replace(step=Step(custom=_OneMicrobatch(spec, loss_fn), api=API), optimizer=None,
                                blocks=list(spec.blocks))
        blocks = find_blocks(stage, mine.blocks)
        container = identical_container(stage, blocks) if mine.compose else None
        costs = composed_costs(stage, blocks, container, mine) if container is not None else None
        return costs if costs is not None else measure_costs(stage, blocks, mine)


def composer_for(stages: list, inputs: dict, n_microbatches: int, loss_fn: Callable, latest: bool,
                 plan_options: dict, split: bool = False) -> Composer:
    """The `Composer` of fake ``stages`` (factories) from `remat.planner._pipeline._stage_inputs`'s
    ``inputs`` and `plan_pipeline`'s options for `remat.plan`."""
    last = len(stages) - 1
    specs = [StageSpec(make, i, i == last, (inputs[i], None if i == last else inputs[i + 1],
                                            inputs["target"] if i == last else None),
                       tuple(inputs[("blocks", i)]), *inputs[("key", i)]) for i, make in enumerate(stages)]
    options = plan_options.get("options", OPTIONS)
    settings = Settings(step=Step(api=API), optimizer=plan_options.get("optimizer", "adam"),
                        blocks=plan_options.get("blocks"), options=tuple(dict.fromkeys(("keep", *options))),
                        machine=Machine(fake=True, device=plan_options.get("device") or inputs[0].device.type,
                                        throughput=plan_options.get("throughput")),
                        solving=Solving(solver=plan_options.get("solver", "auto")),
                        progress=plan_options.get("progress"), compose=plan_options.get("compose", True))
    return Composer(specs, n_microbatches, loss_fn, latest, settings, plan_options.get("dtype"), split)
