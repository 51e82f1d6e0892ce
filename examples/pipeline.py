"""A plan per pipeline rank, applied and trained under torch.distributed.pipelining.

    python examples/pipeline.py [--schedule 1F1B|GPipe|Interleaved1F1B] [--budget 0.8]

A GPT (``remat.models.GPTStage``) is split into stages (one per rank;
two per rank under the interleaved schedule). ``remat.plan_pipeline`` plans every rank here,
once, for the schedule's own order of forwards and backwards; two gloo ranks on loopback then
each apply their own part of the plan to their own stages and train one step. Each rank
prints its peak (``remat.memory.track`` around ``schedule.step``) against its budget, and
whether its stages' gradients are bitwise those of the same pipeline unmarked.

On a cluster, plan once (or on fake tensors: pass stage factories, e.g.
``remat.models.llama.llama_stages``), write ``plan.to_json()``, and on each rank read it
with ``remat.PipelinePlan.from_json`` and call ``plan.apply(*its_stages, rank=rank)``
before building its ``PipelineStage``s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.models import GPTConfig, GPTStage

CONFIG = GPTConfig(layers=8, width=64, heads=4, seq_len=64, vocab=256)
WORLD, MICRO, BATCH = 2, 4, 32


def stages(n_stages: int) -> list[GPTStage]:
    torch.manual_seed(0)  # every rank builds the same weights
    return [GPTStage(CONFIG, i, n_stages) for i in range(n_stages)]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), target.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.seq_len), generator=g),
            torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.seq_len), generator=g))


def schedule_class(name: str) -> type:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, f"Schedule{name}")


def train(rank: int, schedule: str, plan_json: str | None) -> tuple[list, list, int]:
    """One step on ``rank``; its stages' gradients, its losses and its peak."""
    from torch.distributed.pipelining import PipelineStage

    two = schedule.startswith("Interleaved")
    n_stages = 2 * WORLD if two else WORLD
    indices = [rank, rank + WORLD] if two else [rank]
    every = stages(n_stages)
    modules = [every[i] for i in indices]
    if plan_json is not None:
        remat.PipelinePlan.from_json(plan_json).apply(*modules, rank=rank)
    pipeline = [PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(modules, indices)]
    runner = schedule_class(schedule)(pipeline if two else pipeline[0], MICRO, loss_fn=loss_fn)
    ids, target = batch()
    losses: list = []
    for _ in range(2):  # the first step infers the shapes and makes the buffers
        for m in modules:
            m.zero_grad(set_to_none=True)
        losses = []
        with remat.memory.track() as tracker:
            if rank == 0:
                runner.step(ids)
            else:
                runner.step(target=target, losses=losses)
    return [p.grad for m in modules for p in m.parameters()], losses, tracker.peak_bytes


def rank_main(rank: int, port: int, schedule: str, plan_json: str, budgets: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    want, want_losses, unmarked_peak = train(rank, schedule, None)
    got, got_losses, peak = train(rank, schedule, plan_json)
    same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and all(
        torch.equal(a, b) for a, b in zip(got_losses, want_losses, strict=True))
    print(f"rank {rank}: peak {peak / 2**20:.2f} MiB (unmarked {unmarked_peak / 2**20:.2f} MiB), "
          f"budget {budgets[rank] / 2**20:.2f} MiB, within: {peak <= budgets[rank]}, "
          f"gradients bitwise equal to unmarked: {same}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B"])
    parser.add_argument("--budget", default="0.8", help="each rank's budget (remat.plan's budget)")
    args = parser.parse_args()
    n_stages = 2 * WORLD if args.schedule.startswith("Interleaved") else WORLD
    ids, target = batch()
    plan = remat.plan_pipeline(stages(n_stages), ids[: BATCH // MICRO], schedule=schedule_class(args.schedule),
                               n_microbatches=MICRO, budget=args.budget,
                               world_size=WORLD, target=target[: BATCH // MICRO], loss_fn=loss_fn,
                               optimizer=None, repeat=1)
    print(plan, flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budgets = [r.plan.budget_bytes for r in plan.ranks]
    mp.start_processes(rank_main, args=(port, args.schedule, plan.to_json(), budgets), nprocs=WORLD,
                       start_method="spawn")


if __name__ == "__main__":
    main()
