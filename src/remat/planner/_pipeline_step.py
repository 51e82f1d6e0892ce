"""One pipeline rank's loop replayed in the schedule's order (NOTE [A plan per pipeline stage]
and NOTE [What a pipeline rank holds] in ``_pipeline.py``): what `remat.plan` measures and
plans each rank for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat.planner._schedule import _matched
from remat.planner._split_backward import backward_input, backward_weight


class _RankStep:
    """One rank's loop: its actions in the schedule's order, on real or fake tensors (NOTE [A
    plan per pipeline stage]). Called as ``step(model, batch)`` by `remat.plan`.

    What a ``PipelineStage`` holds besides activations is held here as long as torch holds it
    (NOTE [What a pipeline rank holds]): a receive buffer per micro-batch for each stage's input
    and, below the last stage, for its output's gradient, all from the step's start; a sent
    tensor (a stage's output, or its input's gradient) until its send is waited: the next send
    under 1F1B, the step's end under the other schedules; the last stage's outputs and losses
    until the step ends."""

    def __init__(self, stages: list[int], actions: list, inputs: dict[Any, Any], n_stages: int,
                 n_microbatches: int, loss_fn: Callable, sends_wait_next: bool) -> None:
        self.position = {s: i for i, s in enumerate(stages)}
        self.actions, self.inputs, self.n_stages, self.loss_fn = _matched(actions), inputs, n_stages, loss_fn
        self.n, self.sends_wait_next = n_microbatches, sends_wait_next
        self.fake = any(isinstance(x, _Spec) for x in inputs.values())
        #: the rank's blocks, by name in the ``ModuleList`` of its stages (`remat.plan`'s default)
        self.blocks = [f"{i}.{n}".rstrip(".") for i, s in enumerate(stages) for n in inputs[("blocks", s)]]
        self._kept = None
        self._kept = None if self.fake else self._buffers()  # before any step, as torch's first step

    def _buffers(self) -> tuple[dict, dict, list]:
        """A tensor per micro-batch for each stage's input (a receive buffer; the first stage's
        micro-batches), for each output's gradient below the last stage, and the last stage's
        targets. Real tensors: made once and kept across steps, as a ``PipelineStage`` keeps its
        buffers (copies of the example's values); fake: made in each step, in the running mode,
        from the shapes."""
        if self._kept is not None:
            return self._kept
        last = self.n_stages - 1

        def fresh(key: Any, ones: bool = False) -> list:
            x = self.inputs.get(key)
            if x is None:
                return [None] * self.n
            if isinstance(x, _Spec):
                return [(torch.ones if ones else torch.zeros)(x.shape, dtype=x.dtype, device=x.device)
                        for _ in range(self.n)]
            return [torch.ones_like(x) if ones else x.clone() for _ in range(self.n)]

        return ({s: fresh(s) for s in self.position},
                {s: fresh(s + 1, ones=True) for s in self.position if s < last},
                fresh("target") if last in self.position else [None] * self.n)

    def __call__(self, model: torch.nn.ModuleList, batch: Any) -> None:
        last = self.n_stages - 1
        received, grads, targets = self._buffers()
        for s in self.position:  # a V's buffers handed over from the last step: alive until replaced
            if s + 1 in self.position:
                _seen(*received[s + 1], *grads[s])
        kept, held = [], {}  # until the step ends; until the micro-batch's (weight) backward
        sent = _Sends(self.actions, self.sends_wait_next)
        for i, (kind, stage, mb) in enumerate(self.actions):
            if kind == "F":
                x = received[stage][mb % self.n]
                if stage > 0:
                    x = x.detach().requires_grad_(x.is_floating_point())
                y = out = model[self.position[stage]](x)
                if stage == last:  # the schedule computes the loss right after the forward
                    kept.append(out)  # merged at the end: detached after its backward unless a view
                    y = self.loss_fn(out, targets[mb % self.n])
                    kept.append(y)
                elif stage + 1 in self.position:  # handed on without a send (a V)
                    received[stage + 1][mb % self.n] = y.detach()
                    out = None
                else:
                    sent.add("F", y.detach(), i)
                    out = None
                held[(stage, mb)] = [x, y, out, None]
            else:  # the loop's ``y`` names the backward's output until the next action names another
                y = self._backward(model, kind, stage, mb, i, held, grads, sent)

    def _backward(self, model: torch.nn.ModuleList, kind: str, stage: int, mb: int, i: int, held: dict,
                  grads: dict, sent: _Sends) -> torch.Tensor:
        """A full (``B``), input (``I``) or weight (``W``) backward, as torch's stage runs it
        (NOTE [A backward split in two]): the first stage's input backward does nothing and its
        weight backward is a full one; another's input backward keeps its parameter groups, its
        input and output, until its weight backward. The last stage's output is detached after
        its (input) backward unless it is a view (torch's stage keeps a view's graph)."""
        last, module = self.n_stages - 1, model[self.position[stage]]
        given = None if stage == last else grads[stage][mb % self.n]
        x, y, out, groups = held[(stage, mb)] if kind == "I" else held.pop((stage, mb))
        if kind == "I" and stage > 0:
            held[(stage, mb)][3] = backward_input([y], None if given is None else [given], [x],
                                                  module.parameters())
        elif kind == "I":
            return y
        elif groups is not None:
            backward_weight(module.parameters(), groups)
            return y
        elif stage == last:
            y.backward()
        else:
            y.backward(given)
        if out is not None and not out._is_view():
            out.detach_()
        if stage > 0 and x.grad is not None:
            if stage - 1 in self.position:  # in place of the previous stage's gradient buffer
                grads[stage - 1][mb % self.n] = x.grad
            else:
                sent.add("B", x.grad, i)
            x.grad = None
        return y


def _seen(*tensors: torch.Tensor) -> None:
    """Read ``tensors`` (no reference kept), so that a tracker counts them from here, freed
    when they are replaced; unread, it would count neither."""
    for t in tensors:
        t.detach()


class _Sends:
    """The tensors a rank's sends hold (NOTE [What a pipeline rank holds]): every one until the
    step ends, or under 1F1B (``latest``) the latest of each kind and the one its pending work
    holds: a warm-up forward's output (not the last one's) until the backwards after the last
    forward begin, then the latest input gradient."""

    def __init__(self, actions: list, latest: bool) -> None:
        kinds = [a[0] for a in actions]
        self.first_b = next((i for i, k in enumerate(kinds) if k != "F"), len(kinds))
        self.last_f = max((i for i, k in enumerate(kinds) if k == "F"), default=-1)
        self.latest, self.held = latest, {"F": [], "B": [], "work": []}

    def add(self, kind: str, t: torch.Tensor, i: int) -> None:
        """Action ``i`` sends ``t`` (``kind`` ``"F"``: a stage's output; ``"B"``: an input's gradient)."""
        if not self.latest:
            self.held[kind].append(t)
            return
        self.held[kind] = [t]
        if (kind == "F" and i < self.first_b - 1) or (kind == "B" and i > self.last_f):
            self.held["work"] = [t]


class _Spec:
    """A stage input's shape, dtype and device (fake-tensor plans make the tensor in each run)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = tuple(t.shape), t.dtype, t.device


