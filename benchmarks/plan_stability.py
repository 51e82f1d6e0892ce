"""Is ``remat.plan`` stable and is its predicted time right? (issues 18 and 27)

Plans the README's GPT example (``examples/quickstart_plan.py``: 8 blocks, width 128,
8 x 128 tokens) at 60% five times, each from a fresh model, and prints each plan's choices;
then times the plan against the unmarked model in interleaved rounds (median and quartiles
of the per-round overhead) and sets it beside the predicted overhead.

``--example micro`` does the same for a user's own loop (issue 27): a GPT of 6 blocks, AdamW,
and a step of two micro-batches given as ``step=``, with the optimizer given as
``optimizer=``; the overhead measured is that whole step's (both micro-batches' forwards and
backwards, and AdamW's step), the one the plan's prediction is of.

Usage:
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/plan_stability.py [--runs 5] [--rounds 61]
        [--example readme|micro]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import remat
from remat.models.gpt import GPT, GPTConfig

EXAMPLE = "readme"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = 6 if EXAMPLE == "micro" else 8
    return GPT(GPTConfig(layers=layers, width=128, heads=4, seq_len=128, vocab=512))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def two_micro_batches(m: torch.nn.Module, batch: torch.Tensor) -> None:
    """The user's loop body: the batch in two halves, a backward each."""
    for half in batch.chunk(2):
        (m(half).float().sum() / 2).backward()


def tokens() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(0, 512, (8, 128))


def measured_overhead(plan: remat.Plan, rounds: int) -> list[float]:
    """Per-round extra time of the planned step over the unmarked one (the step the planner
    measures: output alive through backward, Adam's step included), in alternating order."""
    x = tokens()
    plain, marked = model(), model()
    plan.apply(marked)
    make = adamw if EXAMPLE == "micro" else torch.optim.Adam
    optimizers = {id(m): make(m.parameters()) for m in (plain, marked)}

    def step(m: torch.nn.Module) -> float:
        begin = time.perf_counter()
        if EXAMPLE == "micro":
            out = two_micro_batches(m, x)
        else:
            out = m(x)
            out.float().sum().backward()
        optimizers[id(m)].step()
        m.zero_grad(set_to_none=True)
        del out
        return time.perf_counter() - begin

    for m in (plain, marked):
        step(m)
    ratios = []
    for r in range(rounds):
        pair = (plain, marked) if r % 2 == 0 else (marked, plain)
        seconds = {id(m): step(m) for m in pair}
        ratios.append(seconds[id(marked)] / seconds[id(plain)] - 1)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--example", choices=("readme", "micro"), default="readme")
    args = parser.parse_args()
    global EXAMPLE
    EXAMPLE = args.example
    extra = {"step": two_micro_batches, "optimizer": adamw} if EXAMPLE == "micro" else {}
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} torch thread(s)")
    plans = []
    for run in range(args.runs):
        begin = time.perf_counter()
        if EXAMPLE == "micro":
            plan = remat.plan(model(), batch=tokens(), budget="60%", **extra)
        else:
            plan = remat.plan(model(), tokens(), budget="60%")
        plans.append(plan)
        timed = plan.measured_overhead
        print(f"run {run}: {time.perf_counter() - begin:.1f} s, predicted +{100 * plan.predicted_overhead:.1f}%"
              + (f" (timed by the planner {100 * timed:+.1f}%)" if timed is not None else "")
              + f", peak {plan.measured_peak_bytes:,} of {plan.budget_bytes:,}: {list(plan.choices.values())}")
    distinct = {tuple(p.choices.values()) for p in plans}
    print(f"{len(distinct)} distinct plan(s) in {args.runs} runs")
    for plan in {tuple(p.choices.values()): p for p in plans}.values():
        ratios = measured_overhead(plan, args.rounds)
        q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        same = [p for p in plans if p.choices == plan.choices]
        errors = [(p.predicted_overhead - q2) / q2 if q2 else float("nan") for p in same]
        print(f"plan {list(plan.choices.values())}: predicted "
              f"{', '.join(f'+{100 * p.predicted_overhead:.1f}%' for p in same)}, "
              f"measured +{100 * q2:.1f}% (IQR +{100 * q1:.1f}..+{100 * q3:.1f}%, {args.rounds} rounds): "
              f"predictions off by {', '.join(f'{100 * e:+.0f}%' for e in errors)} of the measured overhead, "
              f"{sum(abs(e) <= 0.1 for e in errors)} of {len(errors)} within 10%")


if __name__ == "__main__":
    main()
