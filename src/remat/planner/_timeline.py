"""A pipeline rank's peak composed from one micro-batch per stage (NOTE [A rank's peak composed]
in ``_pipeline_compose.py``): the replay of `remat.planner._pipeline._RankStep` done on byte
counts, each stage's forward and backward taken from a `StageProfile` measured once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageProfile:
    """What one micro-batch through a stage does to the bytes alive, its plan applied: each
    figure measured by the tracker around that part of the loop (``peak``: the most above what
    was alive when it began; ``net``: what is alive after, less what was before).

    Attributes:
        forward: ``(peak, net)`` of the stage's forward; ``net`` counts its output.
        loss: ``(peak, net)`` of the loss after the last stage's forward (``(0, 0)`` elsewhere).
        backward: ``((peak, net), (peak, net))`` of the stage's first backward in a step (its
            parameters' gradients made) and of a later one (added to them); ``net`` counts
            the input's gradient.
        output_bytes: the output's bytes (freed when the loop and the sends let it go).
        input_grad_bytes: the input's gradient's bytes (sent; 0 for the first stage).
        split: under a schedule that splits backwards (NOTE [A backward split in two] in
            ``_pipeline.py``; not for the first stage, whose weight backward is its whole
            backward): ``(peak, net)`` of the input backward (``net`` counts the input's
            gradient), of the step's first weight backward and of a later one.
    """

    forward: tuple[int, int]
    loss: tuple[int, int]
    backward: tuple[tuple[int, int], tuple[int, int]]
    output_bytes: int
    input_grad_bytes: int
    split: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None


class _Live:
    """Bytes alive, and the tensors that may be freed by who holds them."""

    def __init__(self, start: int) -> None:
        self.bytes = self.peak = start
        self.size: dict[Any, int] = {}
        self.holders: dict[Any, set] = {}
        #: per stage, the micro-batches whose activations are held (the one running counted)
        self.activations: dict[int, int] = {}
        self.at_peak: dict[int, int] = {}

    def spike(self, extra: int) -> None:
        if self.bytes + extra > self.peak:
            self.peak, self.at_peak = self.bytes + extra, dict(self.activations)

    def grow(self, net: int) -> None:
        self.bytes += net
        self.spike(0)

    def made(self, tensor: Any, nbytes: int, holder: Any) -> None:
        """``tensor`` (counted already by a ``net``) is held by ``holder``."""
        self.size[tensor] = nbytes
        self.holders[tensor] = {holder}

    def hold(self, tensor: Any, holder: Any) -> None:
        if tensor in self.holders:
            self.holders[tensor].add(holder)

    def let_go(self, tensor: Any, holder: Any) -> None:
        held = self.holders.get(tensor)
        if held is None:
            return
        held.discard(holder)
        if not held:
            del self.holders[tensor]
            self.bytes -= self.size.pop(tensor)


class _SendHolds:
    """`remat.planner._pipeline._Sends` on byte counts: the tensors each send holds."""

    def __init__(self, actions: list, latest: bool, live: _Live, handoff: dict | None = None) -> None:
        kinds = [a[0] for a in actions]
        self.first_b = next((i for i, k in enumerate(kinds) if k != "F"), len(kinds))
        self.last_f = max((i for i, k in enumerate(kinds) if k == "F"), default=-1)
        self.latest, self.live, self.handoff = latest, live, handoff or {}
        self.held: dict[str, Any] = {}

    def add(self, kind: str, tensor: Any, i: int, stage: int = -1) -> None:
        """Action ``i`` of ``stage`` sends ``tensor``; or, to a stage on this rank (a V), puts it
        in place of that stage's buffer, which is freed (NOTE [What a pipeline rank holds])."""
        local = stage if kind == "F" else stage - 1
        if local in self.handoff:
            self.live.hold(tensor, "buffer")
            self.live.grow(-self.handoff[local][0 if kind == "F" else 1])
            return
        if not self.latest:
            self.live.hold(tensor, ("sent", i))
            return
        self._replace(kind, tensor)
        if (kind == "F" and i < self.first_b - 1) or (kind == "B" and i > self.last_f):
            self._replace("work", tensor)

    def _replace(self, slot: str, tensor: Any) -> None:
        self.live.hold(tensor, slot)
        old = self.held.get(slot)
        self.held[slot] = tensor
        if old is not None and old is not tensor:
            self.live.let_go(old, slot)


def rank_peak(actions: list, profiles: dict[int, StageProfile], last: int, buffer_bytes: int,
              latest: bool, at_peak: dict | None = None, handoff: dict | None = None) -> int:
    """The most bytes a rank's loop holds above what was alive before it (NOTE [A rank's peak
    composed]): ``actions`` its matched actions, ``profiles`` per stage it holds, ``last`` the
    last stage's index, ``buffer_bytes`` its receive buffers and targets (made first), ``latest``
    whether each send is let go at the next one (``Schedule1F1B``); ``at_peak`` (a dict) is
    filled with the micro-batches each stage holds activations of at the peak; ``handoff``, for
    each stage whose next is on this rank (a V), one micro-batch's bytes of that stage's input
    buffer and of its own output's gradient buffer."""
    live = _Live(buffer_bytes)
    sends = _SendHolds(actions, latest, live, handoff)
    local = None  # the tensor the loop's ``y`` names between actions
    seen: set[int] = set()
    for i, (kind, stage, mb) in enumerate(actions):
        p = profiles[stage]
        held = live.activations
        held[stage] = held.get(stage, 0) + 1 if kind == "F" else held.get(stage, 0)
        if kind == "F":
            live.spike(p.forward[0])
            live.grow(p.forward[1])
            out = None if stage == last else ("y", stage, mb)  # the last stage's outputs are kept
            if out is not None:
                live.made(out, p.output_bytes, "held")
            local = _rebind(live, local, out)
            if stage == last:
                live.spike(p.loss[0])
                live.grow(p.loss[1])
            else:
                sends.add("F", out, i, stage)
            continue
        out = None if stage == last else ("y", stage, mb)
        local = _rebind(live, local, out)
        _backward(live, sends, p, (kind, stage, mb, i), out, seen)
    if at_peak is not None:
        at_peak.update(live.at_peak)
    return live.peak


def _backward(live: _Live, sends: _SendHolds, p: StageProfile, action: tuple, out: Any, seen: set) -> None:
    """A full backward (``B``), or an input (``I``) or weight (``W``) one: the first stage's
    input backward does nothing, its weight backward is a full one (NOTE [A backward split in
    two]); its output is let go at the (weight) backward's end, its input's gradient sent."""
    kind, stage, mb, i = action
    if kind == "I" and p.split is None:
        return
    if kind != "I":
        live.let_go(out, "held")
        first = stage not in seen
        seen.add(stage)
    if p.split is not None and kind != "B":
        peak, net = p.split[0] if kind == "I" else p.split[1 if first else 2]
    else:
        peak, net = p.backward[0 if first else 1]
    live.spike(peak)
    live.grow(net)
    if kind != "I":
        live.activations[stage] -= 1
    if (kind != "W" or p.split is None) and stage > 0 and p.input_grad_bytes:
        grad = ("grad", stage, mb)
        live.made(grad, p.input_grad_bytes, "new")
        sends.add("B", grad, i, stage)
        live.let_go(grad, "new")


def _rebind(live: _Live, old: Any, new: Any) -> Any:
    """The loop's ``y`` now names ``new``: ``old`` is let go."""
    if new is not None:
        live.hold(new, "local")
    if old is not None and old != new:
        live.let_go(old, "local")
    return new
