"""``remat.profile``: what each module keeps for backward and what recomputing it costs.

One training step (forward, loss, backward, optionally an optimizer step) runs
under `remat.memory.track`. When backward starts, every storage still
alive that the step allocated is what autograd keeps; it is charged to the
module whose operators allocated it. Separate untracked runs time each
module's forward, the price of recomputing it. [`remat.estimate`][remat.estimate] runs the
same measurement on fake tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from remat._engine.state import is_recomputing
from remat._front.marks import mark_of
from remat._vocab.errors import check_bool
from remat.memory._report import ModuleRow, ProfileReport, downsample
from remat.memory._step import AtBackward, Step, default_loss
from remat.memory._storages import local_nbytes, local_storages
from remat.memory._tracker import track

OptimizerLike = None | str | torch.optim.Optimizer | Callable[..., torch.optim.Optimizer]
OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def make_optimizer(optimizer: OptimizerLike, model: torch.nn.Module, api: str) -> torch.optim.Optimizer | None:
    """Build the optimizer named or made by ``optimizer`` over ``model``'s parameters."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"{api}: optimizer must be one of {sorted(OPTIMIZERS)}, an optimizer "
                             f"or a callable(params) -> optimizer, got {optimizer!r}")
        kind = OPTIMIZERS[optimizer.lower()]
        return kind(params, lr=1e-3, momentum=0.9) if kind is torch.optim.SGD else kind(params, lr=1e-3)
    if callable(optimizer):
        return optimizer(params)
    raise TypeError(f"{api}: optimizer must be None, a name, an optimizer or a callable, "
                    f"got {type(optimizer).__name__}")


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (a step on zero gradients) so a measured step is a steady one."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Calls:
    """Per-module input/output bytes and forward times, from global forward hooks."""

    def __init__(self, model: torch.nn.Module, exclude: set) -> None:
        self.names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()}
        self.exclude = exclude
        self.io: dict[str, list[int]] = {}
        self.times: dict[str, float] = {}
        self._starts: list[float] = []

    def __enter__(self) -> Self:
        hooks = torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._pre),
                         hooks.register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _bytes(self, obj: Any) -> int:
        seen: dict[int, int] = {}
        for storage in local_storages(tree_leaves(obj)):  # a DTensor by its local shard
            if storage._cdata not in self.exclude:
                seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._starts.append(time.perf_counter())

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module), type(module).__name__)
        elapsed = time.perf_counter() - self._starts.pop() if self._starts else 0.0
        if is_recomputing():  # a re-run in backward is not a forward call
            return
        self.times[name] = self.times.get(name, 0.0) + elapsed
        entry = self.io.setdefault(name, [0, 0, 0])
        entry[0] += 1
        entry[1] += self._bytes(args)
        entry[2] += self._bytes(output)


def _time_step(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any], repeat: int) -> tuple:
    run(model)  # warm-up: first-call costs are not recompute costs
    model.zero_grad(set_to_none=True)
    best_step, best = float("inf"), {}
    for _ in range(repeat):
        with _Calls(model, set()) as calls:
            start = time.perf_counter()
            run(model)
            step = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        best_step = min(best_step, step)
        best = {k: min(v, best.get(k, v)) for k, v in calls.times.items()}
    return best_step * 1e3, {k: v * 1e3 for k, v in best.items()}


def measure(model: torch.nn.Module, inputs: tuple, *, batch: dict | None = None,
            loss_fn: Callable | None = None,
            optimizer: OptimizerLike = None, output_recompute: bool = False, repeat: int = 0,
            label: str = "", device: str = "", estimated: bool = False,
            api: str = "remat.profile", optimizer_step: bool = True,
            step: Step | None = None, watch: Callable[[int, str, str], None] | None = None) -> ProfileReport:
    """Run one training step of ``model`` on ``inputs`` under the tracker; return the report.

    Shared by `profile` (real tensors, ``repeat`` timed runs) and
    [`remat.estimate`][remat.estimate] (fake tensors, no timing). ``optimizer_step=False`` leaves
    out the optimizer's step (its state still counts): the planner, which knows that
    phase's peak, verifies a plan's forward and backward only. ``step`` runs that
    step instead of ``loss_fn(model(*inputs, **batch)).backward()``: what it returns stays
    alive until the step ends (NOTE [The step users run]). ``watch`` is the tracker's
    ``on_change``: called after every allocation and free with the live bytes, the phase
    and the module running.
    """
    start = time.perf_counter()
    batch = batch or {}
    loss_fn = loss_fn or default_loss
    opt = make_optimizer(optimizer, model, api)
    if opt is not None:
        prime_optimizer(opt)
    run = step.run if step is not None else (lambda m: loss_fn(m(*inputs, **batch)).backward())
    step_ms, times = _time_step(model, run, repeat) if repeat else (None, {})
    params = {s._cdata: s.nbytes() for s in local_storages([*model.parameters(), *model.buffers()])}
    given = None if step is None else (step.inputs, step.batch)
    with track(model, baseline=[inputs, batch, opt, given]) as tracker, _Calls(model, set(params)) as calls:
        tracker.on_change = watch
        if step is None:
            loss = loss_fn(model(*inputs, **batch))
            kept = tracker.live_by_module(exclude=[loss])
            loss.backward()
            held = loss = None
        else:
            with AtBackward(tracker.live_by_module) as at:
                held = step.run(model)
            kept = at.value if at.seen else tracker.live_by_module()
        if opt is not None and optimizer_step:
            with tracker.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        del held
    rows = _rows(model, kept, calls, times, output_recompute)
    peak = tracker.peak()
    param_bytes = sum(local_nbytes(p) for p in model.parameters())
    optimizer_bytes = sum(s.nbytes() for s in local_storages(_state_tensors(opt)))
    rank, world_size = _rank()
    return ProfileReport(
        label=label or type(model).__name__, device=device or _device_of(model), estimated=estimated,
        rows=rows, total_kept=sum(kept.values()),
        outside_kept=sum(kept.values()) - sum(r.kept_self for r in rows),
        peak_bytes=peak.total_bytes, peak_increase=peak.increase_bytes, peak_phase=peak.phase,
        baseline_bytes=peak.baseline_bytes, param_bytes=param_bytes,
        grad_bytes=sum(local_nbytes(p) for p in model.parameters() if p.requires_grad),
        optimizer_bytes=optimizer_bytes, peak_by_phase=peak.by_phase,
        peak_by_module=dict(list(peak.by_module.items())[:20]), step_ms=step_ms,
        seconds=time.perf_counter() - start, timeline=downsample(tracker.timeline),
        phase_peaks=_phase_peaks(tracker), rank=rank, world_size=world_size,
    )


def _rank() -> tuple[int | None, int | None]:
    """``(rank, world size)`` of the default process group, or ``(None, None)`` without one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None, None
    return dist.get_rank(), dist.get_world_size()


def _phase_peaks(tracker: Any) -> dict:
    highest: dict[str, int] = {}
    for live, phase in tracker.timeline:
        highest[phase] = max(highest.get(phase, live), live)
    return {phase: tracker.baseline_bytes + live for phase, live in highest.items()}


def _state_tensors(opt: torch.optim.Optimizer | None) -> list:
    if opt is None:
        return []
    return [t for s in opt.state.values() for t in tree_leaves(s) if isinstance(t, torch.Tensor)]


def _device_of(model: torch.nn.Module) -> str:
    param = next(model.parameters(), None)
    return "cpu" if param is None else str(param.device)


def _rows(model: torch.nn.Module, kept: dict, calls: _Calls, times: dict, output_recompute: bool) -> list:
    rows = []
    for qualified, module in model.named_modules():
        name = qualified or type(module).__name__
        count, ins, outs = calls.io.get(name, (0, 0, 0))
        spec = mark_of(module)
        drop_output = spec.output_recompute if spec is not None else output_recompute
        rows.append(ModuleRow(
            name=name, type=type(module).__name__,
            depth=0 if not qualified else qualified.count(".") + 1,
            calls=count, kept_self=kept.get(name, 0), input_bytes=ins, output_bytes=outs,
            if_recomputed=ins + (0 if drop_output else outs), forward_ms=times.get(name),
            param_bytes=sum(local_nbytes(p) for p in module.parameters()),
            marked=spec is not None,
        ))
    _add_subtrees(rows)
    return rows


def _add_subtrees(rows: list) -> None:
    by_name = {r.name: r for r in rows}
    root = rows[0].name if rows else ""
    for row in rows:
        row.kept += row.kept_self
        if row.depth == 0:
            continue
        parts = row.name.split(".")
        for i in range(1, len(parts)):
            parent = by_name.get(".".join(parts[:i]))
            if parent is not None:
                parent.kept += row.kept_self
        if root in by_name:
            by_name[root].kept += row.kept_self


def check_trainable(api: str, model: torch.nn.Module, optimizer: Any) -> None:
    """Refuse, before any work, an optimizer step over a model with nothing to train.

    Examples:
        >>> import torch
        >>> from remat.memory.profile import check_trainable
        >>> try:
        ...     check_trainable("remat.profile", torch.nn.ReLU(), "adam")
        ... except ValueError as err:
        ...     print(str(err).split(";")[0])
        remat.profile: ReLU has no parameter that requires grad
    """
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{api}: {type(model).__name__} has no parameter that requires grad; "
                         f"an optimizer step has nothing to train: pass optimizer=None to measure "
                         f"forward and backward only")


def profile(model: torch.nn.Module, *example_inputs: Any, batch: dict | None = None,
            loss_fn: Callable | None = None, optimizer: OptimizerLike = "adam",
            output_recompute: bool = False, repeat: int = 3, label: str = "") -> ProfileReport:
    """Profile one training step of ``model``: memory kept per module and forward times.

    Args:
        model: the model, with or without recompute marks.
        *example_inputs: the model's positional inputs.
        batch: the model's keyword inputs, ``model(*example_inputs, **batch)`` (a Hugging
            Face batch: ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``).
        loss_fn: ``loss_fn(output) -> scalar``; default: the output's ``loss`` if it has
            one, else the sum of the floating outputs.
        optimizer: ``"adam"`` (default, as [`remat.estimate`][remat.estimate]), ``"adamw"``, ``"sgd"``,
            None (no optimizer step), an optimizer over ``model``'s parameters, or
            ``callable(params) -> optimizer``. Its state is created first (one step on
            zero gradients) so the measured step is a steady one, and the step is tracked
            as phase ``optimizer``. An optimizer made here leaves the parameters as they were.
        output_recompute: for unmarked modules, whether ``if_recomputed`` leaves the
            output out (marked modules use their own option).
        repeat: timed runs after one warm-up run; each module's fastest forward is
            reported (0: no timing).
        label: the report's name, e.g. ``"before"``; default: the model's class name.

    Returns:
        A `ProfileReport`; ``print(report)`` shows the table.

    Raises:
        TypeError: the model returns no floating tensor and no ``loss_fn`` is given.

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        >>> report = remat.profile(net, torch.randn(8, 16), repeat=1)
        >>> report.row("1").kept_self == 8 * 16 * 4  # GELU output, kept by the last Linear
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"remat.profile: model must be a torch.nn.Module, got {type(model).__name__}")
    check_bool("remat.profile", "output_recompute", output_recompute)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise TypeError(f"remat.profile: 'repeat' must be an int >= 0 (0: no timing), got {repeat!r}")
    if batch is not None and not isinstance(batch, dict):
        raise TypeError(f"remat.profile: batch must be a dict of keyword inputs, got "
                        f"{type(batch).__name__}; pass positional inputs after the model")
    check_trainable("remat.profile", model, optimizer)
    was_training = model.training
    restore = None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        with torch.no_grad():  # the step is measured, not kept
            restore = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]
    model.train()
    try:
        return measure(model, example_inputs, batch=batch, loss_fn=loss_fn, optimizer=optimizer,
                       output_recompute=output_recompute, repeat=repeat, label=label)
    finally:
        model.train(was_training)
        with torch.no_grad():
            for p, value in restore or ():
                p.copy_(value)
