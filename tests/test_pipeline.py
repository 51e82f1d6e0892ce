"""Marks on pipeline stages (``torch.distributed.pipelining``): 2 and 4 gloo ranks on loopback.

A GPT-style model (embedding, pre-norm blocks with dropout, head; its norms layer or
batch norms, whose statistics each micro-batch updates once) is split into stages
by hand, each rank builds its own stage modules from the same seed, marks them with remat
(or not), and runs a schedule over 4 micro-batches. Every stage's gradients and the last
rank's micro-batch losses and the stages' buffers must be bitwise equal to the same pipeline
unmarked: the marks survive the split, each micro-batch's region replays its own dropout
draws, and no statistic is updated twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import remat
from tests._harness import assert_bitwise_equal, assert_every_rank_succeeded, spawn_two_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WIDTH, VOCAB, SEQ, BATCH, MICRO = 16, 32, 6, 8, 4
DEADLINE_S = 240  # the whole test; each collective times out after 60 s
#: the zero-bubble schedule splits each backward into an input and a weight backward
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
MARKS = {
    "blocks": {},
    "blocks, fresh dropout in the re-run": {"preserve_rng_state": False},  # must differ
    "blocks reentrant": {"use_reentrant": True},
    "blocks output_recompute": {"output_recompute": True},
    "blocks policy": {"policy": remat.save_compute_intensive},
}


class Block(torch.nn.Module):
    reruns = 0  # forwards run again in backward, in this process

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.batch_norm = batch_norm  # statistics written once per micro-batch, in forward only
        self.norm = torch.nn.BatchNorm1d(WIDTH) if batch_norm else torch.nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        Block.reruns += remat.is_recomputing()
        h = self.norm(x.transpose(1, 2)).transpose(1, 2) if self.batch_norm else self.norm(x)
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(h))))


class Stage(torch.nn.Module):
    """Blocks, with the embedding before them on the first stage and the head after them
    on the last."""

    def __init__(self, blocks: int, first: bool, last: bool, batch_norm: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH) if first else None
        self.blocks = torch.nn.ModuleList(Block(batch_norm) for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, VOCAB) if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def _stages(n_stages: int, indices: list[int], batch_norm: bool) -> list[Stage]:
    """The stages ``indices`` of an ``n_stages`` split of ``max(4, n_stages)`` blocks, built
    from one seed in order, so every rank (and every configuration) holds the same weights."""
    torch.manual_seed(0)
    per = max(4, n_stages) // n_stages
    built = [Stage(per, i == 0, i == n_stages - 1, batch_norm) for i in range(n_stages)]
    return [built[i] for i in indices]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def rank_stages(rank: int, world: int, schedule_name: str, batch_norm: bool) -> tuple[list, list[int], int]:
    """``(stage modules, their indices, number of stages)`` of ``rank``: one stage per rank,
    two (``rank`` and ``rank + world``) under the interleaved schedule."""
    two = schedule_name.startswith("Interleaved")
    n_stages = 2 * world if two else world
    indices = [rank, rank + world] if two else [rank]
    return _stages(n_stages, indices, batch_norm), indices, n_stages


def schedule_of(schedule_name: str, modules: list, indices: list[int], n_stages: int) -> object:
    """The schedule ``schedule_name`` over ``PipelineStage``s of ``modules``, MICRO micro-batches."""
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(modules, indices, strict=True)]
    cls = schedule_class(schedule_name)
    return cls(stages if len(stages) > 1 else stages[0], MICRO, loss_fn=_loss)


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class named ``name`` without its prefix."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, f"Schedule{name}")


def step_once(schedule: object, rank: int, world: int, ids: torch.Tensor, target: torch.Tensor) -> list:
    """One ``schedule.step`` as ``rank`` runs it; the micro-batch losses on the last rank."""
    losses: list = []
    if rank == 0:
        schedule.step(ids)
    elif rank == world - 1:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    return losses


def _run(rank: int, world: int, schedule_name: str, marks: dict | None, batch_norm: bool) -> dict:
    modules, indices, n_stages = rank_stages(rank, world, schedule_name, batch_norm)
    if marks is not None:
        for module in modules:
            remat.apply(module, where=Block, **marks)
    schedule = schedule_of(schedule_name, modules, indices, n_stages)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    losses: list = []
    for _ in range(2):
        # the first step infers the stages' shapes: torch runs each stage on uninitialized
        # tensors then, which batch norm's statistics take in (unmarked too); the second step
        # starts from zero gradients and fresh statistics
        for module in modules:
            module.zero_grad(set_to_none=True)
            for m in module.modules():
                if isinstance(m, torch.nn.BatchNorm1d):
                    m.reset_running_stats()
        torch.manual_seed(10 + rank)  # the dropout draws: the same per rank in every configuration
        Block.reruns = 0
        losses = step_once(schedule, rank, world, ids, target)
    return {"grads": [p.grad for m in modules for p in m.parameters()] + [b for m in modules for b in m.buffers()],
            "losses": [loss.detach() for loss in losses], "reruns": Block.reruns}


def _all_runs(rank: int, world: int) -> dict:
    """One rank: every schedule with layer or batch norm, unmarked and under each marking;
    ``{(schedule and norm, marks): result}``."""
    out = {}
    for norm in ("layer norm", "batch norm"):
        for schedule in SCHEDULES:
            key = f"{schedule}, {norm}"
            out[(key, "unmarked")] = _run(rank, world, schedule, None, norm == "batch norm")
            for name, marks in MARKS.items():
                out[(key, name)] = _run(rank, world, schedule, marks, norm == "batch norm")
    return out


def two_ranks(rank: int) -> dict:
    return _all_runs(rank, 2)


def four_ranks(rank: int) -> dict:
    return _all_runs(rank, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_marked_pipeline_stages_train_bitwise_as_the_unmarked_pipeline(world):
    body = two_ranks if world == 2 else four_ranks
    out, codes = spawn_two_ranks(body, deadline=DEADLINE_S, pg_timeout=60, world=world)
    assert_every_rank_succeeded(out, codes)
    for rank, results in out.items():
        for (schedule, name), got in results.items():
            want = results[(schedule, "unmarked")]
            blocks_here = 2 if world == 2 else (2 if schedule.startswith("Interleaved") else 1)
            assert want["reruns"] == 0
            if name == "unmarked":
                continue
            # every marked block ran again in backward, for every micro-batch (more with
            # output_recompute, whose chained blocks run once more to hand their outputs on)
            assert got["reruns"] >= blocks_here * MICRO, (rank, schedule, name, got["reruns"])
            if "fresh dropout" in name:  # the control: the comparison can fail
                assert not all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"], strict=True))
                continue
            assert_bitwise_equal(got["grads"], want["grads"], f"rank {rank} {schedule} {name} grad")
            assert_bitwise_equal(got["losses"], want["losses"], f"rank {rank} {schedule} {name} loss")
    assert all(len(r["losses"]) == MICRO for r in out[world - 1].values())  # the last stage's rank
