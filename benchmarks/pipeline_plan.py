"""A plan per pipeline rank against the fastest uniform marking that fits every rank.

A GPT (``remat.models.GPTStage``) split into 2 stages on 2 gloo ranks
(loopback, one thread each), ``Schedule1F1B`` over 8 micro-batches: the first rank holds 2
micro-batches' activations, the last 1. One byte budget for both ranks, halfway between
what the last rank and the first rank need unmarked. ``remat.plan_pipeline`` chooses per rank; the uniform markings
recompute the first k blocks of every stage (k = 1 .. all), the same on both ranks, and the
fastest one whose measured peak fits the budget on every rank is the baseline. Every
configuration runs in interleaved rounds (the order rotates each round); a round's time is
the slower rank's ``schedule.step``; reported: the median and interquartile range of the
per-round ratio to the unmarked pipeline, and each rank's peak (``remat.memory.track``).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_plan.py [--rounds 20]

Writes ``benchmarks/results/pipeline_plan.{json,md}``.

With ``--seventy``: the speed of a fake-tensor plan beyond this machine (NOTE [A rank's peak
composed]): a Llama-2 70B (``remat.models.llama.llama_70b``, bfloat16, Adam) split into 8
stages on 8 ranks under ``Schedule1F1B`` (16 stages under ``ScheduleInterleaved1F1B``), 32
micro-batches of one 4096-token sequence, a budget of 120 GiB per rank: the seconds of each
``remat.plan_pipeline`` call (``--repeat`` calls, the median kept) and each rank's peaks.
With ``--check`` also each rank's whole loop replayed on fake tensors with its plan applied
(``remat.planner.internal.replayed_peaks``, minutes): its peak beside the composed one.
Writes ``benchmarks/results/pipeline_plan_70b.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import json
import pathlib
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.models import GPTConfig, GPTStage

RESULTS = pathlib.Path(__file__).parent / "results"
CONFIG = GPTConfig(layers=8, width=128, heads=4, seq_len=128, vocab=512)
WORLD, MICRO, BATCH, SEQ = 2, 8, 64, 128
DEADLINE_S = 900


def _stages() -> list[GPTStage]:
    torch.manual_seed(0)
    return [GPTStage(CONFIG, i, WORLD) for i in range(WORLD)]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), target.reshape(-1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, CONFIG.vocab, (BATCH, SEQ), generator=g),
            torch.randint(0, CONFIG.vocab, (BATCH, SEQ), generator=g))


def _configs(budget: int) -> dict:
    """``{name: {rank: plan JSON or a count of blocks to recompute}}``; None: unmarked."""
    from torch.distributed.pipelining import Schedule1F1B

    ids, target = _batch()
    plan = remat.plan_pipeline(_stages(), ids[: BATCH // MICRO], schedule=Schedule1F1B, n_microbatches=MICRO,
                               budget=budget, target=target[: BATCH // MICRO], loss_fn=_loss,
                               optimizer=None, repeat=3)
    configs = {"unmarked": None, "remat.plan_pipeline": plan.to_json()}
    for k in range(1, CONFIG.layers // WORLD + 1):
        configs[f"uniform: first {k} block(s) of each stage"] = k
    return configs, str(plan)


def _apply(module: GPTStage, rank: int, config) -> None:
    if isinstance(config, str):
        remat.PipelinePlan.from_json(config).apply(module, rank=rank)
    elif isinstance(config, int):
        for block in list(module.blocks)[:config]:
            remat.recompute_module(block)


def _rank(rank: int, port: int, configs: dict, rounds: int, out) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    ids, target = _batch()
    runs = {}
    for name, config in configs.items():
        module = _stages()[rank]
        _apply(module, rank, config)
        stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
        runs[name] = (module, Schedule1F1B(stage, MICRO, loss_fn=_loss))

    def step(name: str) -> float:
        module, schedule = runs[name]
        module.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=target, losses=[])
        return time.perf_counter() - start

    peaks, times, names = {}, {n: [] for n in configs}, list(configs)
    for name in names:
        step(name)  # shapes inferred, buffers made
        with remat.memory.track() as tracker:
            step(name)
        peaks[name] = tracker.peak_bytes
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(step(name))
    out.put((rank, {"peaks": peaks, "times": times}))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(configs: dict, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, configs, rounds, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(WORLD):
            rank, result = out.get(timeout=DEADLINE_S)
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _budget() -> int:
    """Halfway between the last rank's peak unmarked and the first rank's (a real-tensor plan's
    replay): below what the first rank needs, above what the last one does."""
    from torch.distributed.pipelining import Schedule1F1B

    ids, target = _batch()
    first = remat.plan_pipeline(_stages(), ids[: BATCH // MICRO], schedule=Schedule1F1B, n_microbatches=MICRO,
                                budget=1.0, target=target[: BATCH // MICRO], loss_fn=_loss, optimizer=None,
                                repeat=1)
    return (first.ranks[0].plan.no_recompute_peak_bytes + first.ranks[-1].plan.no_recompute_peak_bytes) // 2


SEVENTY_BUDGET = "120GiB"


def seventy(repeat: int, check: bool) -> dict:
    """The 70B plans' seconds and per-rank peaks under 1F1B and interleaved 1F1B (with ``check``,
    each rank's peak replayed too)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    from remat.models.llama import llama_70b, llama_stages, next_token_loss

    out = {"torch": torch.__version__, "budget": SEVENTY_BUDGET, "micro_batches": 32, "ranks": 8,
           "tokens": 4096, "schedules": {}}
    from remat.planner.internal import replayed_peaks

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(out)

    for schedule, n_stages in ((Schedule1F1B, 8), (ScheduleInterleaved1F1B, 16)):
        seconds, plan, stages, example = [], None, llama_stages(llama_70b(), n_stages), torch.zeros(1, 4096, dtype=torch.long)
        for _ in range(repeat):
            start = time.perf_counter()
            plan = remat.plan_pipeline(stages, example, schedule=schedule, n_microbatches=32, budget=SEVENTY_BUDGET,
                                       loss_fn=loss, dtype=torch.bfloat16, world_size=8, device="cuda")
            seconds.append(time.perf_counter() - start)
        replayed = (replayed_peaks(plan, stages, example, schedule=schedule, loss_fn=loss, world_size=8,
                                   dtype=torch.bfloat16) if check else [None] * len(plan.ranks))
        print(plan, f"\n{schedule.__name__}: {statistics.median(seconds):.1f} s (median of {repeat})", flush=True)
        out["schedules"][schedule.__name__] = {
            "seconds": seconds, "median_s": statistics.median(seconds), "table": str(plan),
            "ranks": [{"rank": r.rank, "stages": list(r.stages), "in_flight": r.in_flight,
                       "no_recompute_peak": r.plan.no_recompute_peak_bytes, "peak": r.plan.measured_peak_bytes,
                       "replayed_peak": replayed[r.rank], "choices": sorted(set(r.plan.choices.values()))}
                      for r in plan.ranks]}
    return out


def _seventy_markdown(data: dict) -> str:
    gib = 2 ** 30
    lines = [(f"Llama-2 70B (bfloat16, Adam), 8 ranks, {data['micro_batches']} micro-batches of one "
             f"{data['tokens']}-token sequence, budget {data['budget']} per rank, fake tensors "
             f"(`benchmarks/pipeline_plan.py --seventy`, torch {data['torch']}, this machine's CPU)."), ""]
    for name, got in data["schedules"].items():
        lines += [(f"**{name}**: planned in {got['median_s']:.1f} s (median of "
                  f"{len(got['seconds'])}: {', '.join(f'{s:.1f}' for s in got['seconds'])})."), "",
                  "| rank | stages | in flight | peak unmarked (GiB) | peak planned (GiB) | replayed (bytes) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['rank']} | {','.join(map(str, r['stages']))} | {r['in_flight']} | "
                  f"{r['no_recompute_peak'] / gib:.2f} | {r['peak'] / gib:.2f} | {_replayed(r)} |" for r in got["ranks"]]
        lines += ["", "```", got["table"], "```", ""]
    return "\n".join(lines)


def _replayed(row: dict) -> str:
    """The replayed peak's column: equal to the composed one, or both in bytes."""
    if row.get("replayed_peak") is None:
        return "-"
    if row["replayed_peak"] == row["peak"]:
        return f"equal ({row['peak']:,})"
    return f"{row['replayed_peak']:,} (composed {row['peak']:,})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seventy", action="store_true", help="time the 70B fake-tensor plans instead")
    parser.add_argument("--repeat", type=int, default=3, help="--seventy: plans per schedule")
    parser.add_argument("--check", action="store_true", help="--seventy: replay each rank's loop too (minutes)")
    args = parser.parse_args()
    if args.seventy:
        data = seventy(args.repeat, args.check)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "pipeline_plan_70b.json").write_text(json.dumps(data, indent=1))
        (RESULTS / "pipeline_plan_70b.md").write_text(_seventy_markdown(data))
        return
    budget = _budget()
    configs, table = _configs(budget)
    results = _run_ranks(configs, args.rounds)
    rows = []
    for name in configs:
        per_round = [max(results[r]["times"][name][i] for r in range(WORLD)) for i in range(args.rounds)]
        base = [max(results[r]["times"]["unmarked"][i] for r in range(WORLD)) for i in range(args.rounds)]
        ratios = sorted(t / b for t, b in zip(per_round, base, strict=True))
        q = statistics.quantiles(ratios, n=4)
        peaks = [results[r]["peaks"][name] for r in range(WORLD)]
        rows.append({"config": name, "median_ms": 1e3 * statistics.median(per_round), "ratio": statistics.median(ratios),
                     "iqr": [q[0], q[2]], "peaks": peaks, "fits": all(p <= budget for p in peaks)})
    uniform = [r for r in rows if r["config"].startswith("uniform") and r["fits"]]
    best = min(uniform, key=lambda r: r["ratio"]) if uniform else None
    planned = next(r for r in rows if r["config"] == "remat.plan_pipeline")
    data = {"budget_bytes": budget, "rounds": args.rounds, "world": WORLD, "micro_batches": MICRO,
            "schedule": "Schedule1F1B", "config": vars(CONFIG), "torch": torch.__version__, "rows": rows,
            "fastest_uniform_that_fits": best["config"] if best else None,
            "plan_vs_fastest_uniform": planned["ratio"] / best["ratio"] if best else None, "plan": table}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_plan.json").write_text(json.dumps(data, indent=1))
    (RESULTS / "pipeline_plan.md").write_text(_markdown(data))
    print(_markdown(data))


def _markdown(data: dict) -> str:
    mib = 2 ** 20
    lines = [(f"2 gloo ranks, {data['schedule']}, {data['micro_batches']} micro-batches, GPT stages of "
             f"{data['config']['layers'] // data['world']} blocks (width {data['config']['width']}, {SEQ} tokens), "
             f"one thread per rank, {data['rounds']} interleaved rounds; budget "
             f"{data['budget_bytes'] / mib:.2f} MiB on every rank."), "",
             "| configuration | step (ms) | time / unmarked, median [IQR] | rank 0 peak (MiB) | rank 1 peak (MiB) | fits |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        lines.append(f"| {r['config']} | {r['median_ms']:.1f} | {r['ratio']:.3f} [{r['iqr'][0]:.3f}–{r['iqr'][1]:.3f}] | "
                     f"{r['peaks'][0] / mib:.2f} | {r['peaks'][1] / mib:.2f} | {'yes' if r['fits'] else 'no'} |")
    if data["plan_vs_fastest_uniform"] is not None:
        lines += ["", (f"Per-rank plan / fastest uniform marking that fits ({data['fastest_uniform_that_fits']}): "
                      f"{data['plan_vs_fastest_uniform']:.3f}.")]
    lines += ["", "```", data["plan"], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
