"""The schedule's own order of actions per rank, read off the schedule class (NOTE [A plan per
pipeline stage] in ``_pipeline.py``): which micro-batches each rank holds at once.
"""

from __future__ import annotations

from typing import Any

import torch

API = "remat.plan_pipeline"


class _StageLayout:
    """What a schedule reads of a stage to compute its order: no module, no process group."""

    def __init__(self, index: int, n_stages: int, world: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, world, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = torch.nn.Identity()


def _rank0_stages(n_stages: int, world: int, style: str) -> list[int]:
    if style == "loop":
        return list(range(0, n_stages, world))
    return [0, n_stages - 1]  # "v": a rank holds stages i and 2p - 1 - i


def schedule_actions(schedule: type, n_stages: int, world: int, n_microbatches: int
                     ) -> dict[int, list[tuple[str, int, int]]]:
    """``{rank: [(kind, stage, micro-batch), ...]}`` in the order ``schedule`` runs them.

    ``kind`` is ``"F"`` (forward), ``"B"`` (full backward), ``"I"`` / ``"W"`` (input and
    weight backward). NOTE [A plan per pipeline stage].

    Raises:
        ValueError: the schedule refuses this layout (its own message), or computes no order.
    """
    from torch.distributed.pipelining import schedules

    single = issubclass(schedule, schedules.PipelineScheduleSingle)
    errors = []
    for style in (("loop",) if single else ("loop", "v")):
        try:
            if single:
                built = schedule(_StageLayout(0, n_stages, world, 0), n_microbatches, loss_fn=_no_loss)
            else:
                stages = [_StageLayout(i, n_stages, world, 0) for i in _rank0_stages(n_stages, world, style)]
                built = schedule(stages, n_microbatches, loss_fn=_no_loss)
        except (ValueError, AssertionError, RuntimeError, AttributeError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
            continue
        order = getattr(built, "pipeline_order", None)
        if order:  # an overlapped forward and backward (DualPipeV) runs one, then the other
            flat = {rank: [sub for a in actions if a is not None for sub in (getattr(a, "sub_actions", None) or (a,))]
                    for rank, actions in order.items()}
            return {rank: [_action(a) for a in actions if _action(a) is not None] for rank, actions in flat.items()}
    raise ValueError(f"{API}: {schedule.__name__} computes no action order for {n_stages} stages on "
                     f"{world} ranks with {n_microbatches} micro-batches"
                     + (f" ({errors[-1]})" if errors else ""))


def _no_loss(output: Any, target: Any) -> Any:
    return output


def _action(a: Any) -> tuple[str, int, int] | None:
    kind = str(getattr(a.computation_type, "value", a.computation_type))
    if kind not in ("F", "B", "I", "W") or a.microbatch_index is None:
        return None  # communication and gradient reduction: no activations
    return kind, a.stage_index, a.microbatch_index


def _matched(actions: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The actions with each backward naming a micro-batch its stage ran forward and holds:
    torch 2.13's 1F1B order numbers the last rank's forwards from 1 and its backwards from 0,
    so a backward whose micro-batch is not held takes its stage's oldest one."""
    held: dict[int, list[int]] = {}
    out = []
    for kind, stage, mb in actions:
        mine = held.setdefault(stage, [])
        if kind == "F":
            mine.append(mb)
        elif kind in ("B", "W"):
            if mb not in mine:
                if not mine:
                    continue  # nothing held: no activation to free
                mb = mine[0]
            mine.remove(mb)
        out.append((kind, stage, mb))
    return out


def in_flight(actions: list[tuple[str, int, int]]) -> int:
    """The most micro-batches a rank holds at once (each stage's counted apart): forwards
    run whose backward has not."""
    held, most = set(), 0
    for kind, stage, mb in _matched(actions):
        if kind == "F":
            held.add((stage, mb))
            most = max(most, len(held))
        elif kind in ("B", "W"):
            held.discard((stage, mb))
    return most


def in_flight_counts(schedule: type, n_stages: int, world: int, n_microbatches: int) -> list[int]:
    """The most micro-batches each rank holds at once under ``schedule`` (NOTE [A plan per
    pipeline stage]): read off the schedule's own action order.

    Examples:
        >>> from torch.distributed.pipelining import Schedule1F1B
        >>> from remat.planner import in_flight_counts
        >>> in_flight_counts(Schedule1F1B, n_stages=4, world=4, n_microbatches=8)
        [4, 3, 2, 1]
    """
    order = schedule_actions(schedule, n_stages, world, n_microbatches)
    return [in_flight(order[rank]) for rank in sorted(order)]
