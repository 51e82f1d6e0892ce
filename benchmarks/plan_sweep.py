"""The planner's targets (issue 11), measured: budget held, monotone, optimal, anchors, speed.

Usage:
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/plan_sweep.py [--quick] [--out benchmarks/results]

Sections (each prints its figures and lands in plan_sweep.json):
1. budget held / monotone: for each model, >= 10 budgets from the floor to the no-recompute
   peak; each plan's measured peak (remat.memory.track, real tensors) against its budget.
2. optimality: the dynamic program against the exact optimum on random chains, the MILP
   against the exact dynamic program on random graphs of up to 50 blocks.
3. anchors: at the measured peak of per-block checkpointing, the plan's measured overhead
   (step time ratios timed in adjacent pairs) against per-block checkpointing's.
3b. inside (options inside blocks): at per-block checkpointing's measured peak, the plan with
   options inside blocks and the plan restricted to whole blocks (both from one cost-model run),
   timed interleaved with per-block checkpointing and the unmarked model; median and spread.
4. --max-batch on the GPT-style model (fake tensors): planner against per-block checkpointing.
5. speed: solve time for a 32-layer transformer; remat.estimate of a 7B Llama step; remat.plan
   end to end on fake tensors for 7B and 70B Llama-style configurations, its plan verified by
   composition (the default) and on the whole traced model (verify="full"), with the load average.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch

import remat
from remat.models import gpt, resnet50
from remat.models.llama import LlamaConfig, llama, next_token_loss
from remat.models.unet import unet
from remat.planner import Choice, Problem, evaluate, floor, solve_chain, solve_milp, sweep

KEEP = remat.planner.OPTIONS.index("keep")


def models(quick: bool) -> dict:
    """name -> (build, inputs, loss_fn)."""
    scale = 1 if quick else 2
    tokens = torch.zeros(4, 64 * scale, dtype=torch.long)
    long_tokens = torch.zeros(4, 256, dtype=torch.long)
    return {
        "gpt": (functools.partial(gpt, layers=6, width=128, heads=4, seq_len=64 * scale, vocab=512),
                (tokens,), next_token_loss),
        "llama": (functools.partial(llama, layers=6, width=128, heads=4, hidden=344, vocab=512),
                  (tokens,), next_token_loss),
        "resnet50": (functools.partial(resnet50, class_num=10),  # activations above Adam's state
                     (torch.randn(4 * scale, 3, 128, 128),), None),
        "unet": (functools.partial(unet, channels=(16, 32, 64), dropout=0.1),
                 (torch.randn(2 * scale, 3, 64, 64),), None),
        # issue 27's shapes (section 'compile'): vocabulary 1,000, 256 tokens, batch 4; the
        # Llama with RMSNorm, rotary positions, 8 query and 2 key/value heads, SwiGLU
        "gpt256": (functools.partial(gpt, layers=4, width=256, heads=8, seq_len=256, vocab=1000),
                   (long_tokens,), next_token_loss),
        "llama256": (functools.partial(llama, layers=4, width=256, heads=8, kv_heads=2, hidden=688,
                                       vocab=1000),
                     (long_tokens,), next_token_loss),
    }


def budget_sweep(name: str, build, inputs, loss_fn, count: int) -> dict:
    torch.manual_seed(0)
    model = build()
    start = time.perf_counter()
    first = sweep(model, *inputs, budgets=[1.0], loss_fn=loss_fn, repeat=1)[0]
    low, high = first.floor_bytes, first.no_recompute_peak_bytes
    budgets = [int(high - (high - low) * k / (count - 1)) for k in range(count)]
    plans = sweep(model, *inputs, budgets=budgets, loss_fn=loss_fn, repeat=1, floors=True)
    seconds = time.perf_counter() - start
    rows = []
    for b, p in zip(budgets, plans):
        if isinstance(p, Exception):
            rows.append({"budget": b, "error": str(p).split(";")[0], "floor": p.floor_bytes})
            continue
        binds = any(c != "keep" for c in p.choices.values())
        rows.append({"budget": b, "predicted": p.predicted_peak_bytes, "measured": p.measured_peak_bytes,
                     "overhead": p.predicted_overhead, "binds": binds,
                     "choices": short(p.choices)})
    ok = [r for r in rows if "measured" in r]
    held = all(r["measured"] <= r["budget"] for r in ok)
    tight = [r["measured"] / r["budget"] for r in ok if r["binds"]]
    inversions = {key: sum(1 for a, b in itertools.pairwise(ok) if (b[key] > a[key] if key != "overhead"
                                                          else b[key] < a[key]))
                  for key in ("predicted", "measured", "overhead")}
    summary = {"model": name, "blocks": len(first.decisions), "budgets": len(budgets),
               "planned": len(ok), "held": held, "min_tightness": min(tight) if tight else None,
               "inversions": inversions, "seconds": seconds, "rows": rows,
               "floor": low, "no_recompute": high}
    print(f"[{name}] {len(ok)}/{len(budgets)} budgets planned, held at every one: {held}, "
          f"measured/budget where binding >= {summary['min_tightness'] and round(summary['min_tightness'], 4)}, "
          f"inversions {inversions}, {seconds:.1f} s")
    for r in rows:
        print("   ", r)
    return summary


def random_problem(rng: random.Random, n: int, chain: bool) -> Problem:
    kept, times, rebuilt, output = [], [], [], []
    for i in range(n):
        act, out, t = rng.randint(40, 400), rng.randint(10, 80), rng.uniform(1, 20)
        allow = chain or rng.random() < 0.6 or i == n - 1
        kept.append([act + out, out, out + act // 2, 0 if allow else None])
        times.append([0, t, t * rng.uniform(0.1, 0.6), t])
        rebuilt.append(act + out + 50)
        output.append(out)
    return Problem(kept=kept, time=times, rebuilt=rebuilt, fixed=[rng.randint(0, 300) for _ in range(n)],
                   output=output, end=rng.randint(0, 100), last_held=[o + 40 for o in output])


def optimality(trials: int) -> dict:
    rng = random.Random(0)
    chain_ratios, graph_ratios, milp_times = [], [], []
    for _ in range(trials):
        n = rng.randint(8, 32)
        p = random_problem(rng, n, chain=True)
        low, high = floor(p), evaluate(p, [KEEP] * n)[0]
        budget = rng.uniform(low, high)
        exact = solve_chain(p, budget, resolution=1.0)
        fast = solve_chain(p, budget, resolution=budget / 8192)  # what remat.plan runs
        chain_ratios.append(fast.time / exact.time if exact.time else 1.0)
    for _ in range(max(3, trials // 3)):
        n = rng.randint(20, 50)
        p = random_problem(rng, n, chain=False)
        low, high = floor(p), evaluate(p, [KEEP] * n)[0]
        budget = rng.uniform(low, high)
        exact = solve_chain(p, budget, resolution=1.0)
        start = time.perf_counter()
        found = solve_milp(p, budget)
        milp_times.append(time.perf_counter() - start)
        graph_ratios.append(found.time / exact.time if exact.time else 1.0)
    out = {"chains": len(chain_ratios), "chain_worst_ratio": max(chain_ratios),
           "graphs": len(graph_ratios), "graph_worst_ratio": max(graph_ratios),
           "milp_median_s": statistics.median(milp_times)}
    print(f"[optimality] DP (as remat.plan runs it) / exact: worst {out['chain_worst_ratio']:.4f} "
          f"over {out['chains']} chains of 8-32 blocks; MILP / exact: worst {out['graph_worst_ratio']:.4f} "
          f"over {out['graphs']} graphs of 20-50 blocks (median {out['milp_median_s']:.2f} s)")
    return out


def anchors(name: str, build, inputs, loss_fn, pairs: int) -> dict:
    """Planner at per-block checkpointing's measured peak: measured overheads side by side."""
    import argparse as _argparse

    from remat.cli.plan import Setup, mark_strategy

    setup = Setup.__new__(Setup)
    setup.args = _argparse.Namespace(estimate=False, repeat=pairs, device=None, throughput=None)
    setup.build = lambda: (torch.manual_seed(0), build())[1]
    setup.inputs = lambda batch=None: inputs
    setup.loss_fn, setup.optimizer = loss_fn, "adam"
    per_block = setup.measure(lambda m: mark_strategy(m, "per-block checkpointing"))
    plan = sweep(setup.build(), *inputs, budgets=[per_block["peak_bytes"]], loss_fn=loss_fn,
                 repeat=3, floors=True)[0]  # each option's timed run calibrates its times
    if isinstance(plan, Exception):
        print(f"[anchors {name}] no plan at per-block's peak: {plan}")
        return {"model": name, "error": str(plan)}
    planned = setup.measure(plan.apply)
    ratio = planned["overhead"] / per_block["overhead"] if per_block["overhead"] > 0 else None
    out = {"model": name, "per_block_peak": per_block["peak_bytes"], "per_block_overhead": per_block["overhead"],
           "plan_peak": planned["peak_bytes"], "plan_overhead": planned["overhead"],
           "plan_predicted_overhead": plan.predicted_overhead, "overhead_ratio": ratio,
           "choices": short(plan.choices)}
    print(f"[anchors {name}] per-block: peak {per_block['peak_bytes']:,} overhead {per_block['overhead']:+.3f}; "
          f"plan: peak {planned['peak_bytes']:,} overhead {planned['overhead']:+.3f} "
          f"(predicted {plan.predicted_overhead:+.3f}) -> ratio {ratio}")
    return out


def short(choices: dict) -> str:
    """Choices as letters (k, r, s, o), children as ``c(attn+fc)``, per-operator options as
    ``p(addmm#0+addmm#2)``, staged ones as ``st(addmm#0+addmm#2)``."""
    def one(c: str) -> str:
        choice = Choice.parse(c)
        if choice.children:
            return f"c({'+'.join(choice.children)})"
        if choice.family in ("ops", "staged"):
            letter = "p" if choice.family == "ops" else "st"
            return f"{letter}({'+'.join(choice.calls).replace('aten::', '')})"
        return c[0]
    return " ".join(one(c) for c in choices.values())


def inside_blocks(name: str, build, inputs, loss_fn, rounds: int, repeat: int = 3,
                  between: tuple = (0.5,)) -> dict:
    """Options inside blocks at per-block checkpointing's measured peak (and at budgets
    ``between`` it and the no-recompute peak): two plans from one cost-model run per budget,
    with children and restricted to whole blocks (the planner before them), timed interleaved
    with per-block checkpointing and the unmarked model, ``rounds`` rounds."""
    from remat.cli.plan import mark_strategy
    from remat.memory.internal import Step
    from remat.memory.profile import default_loss
    from remat.planner.internal import Machine, Settings, find_blocks, fit, measure_costs

    def fresh():
        torch.manual_seed(0)
        return build()

    per_block = fresh()
    mark_strategy(per_block, "per-block checkpointing")
    peak = remat.profile(per_block, *inputs, loss_fn=loss_fn, optimizer="adam", repeat=0).peak_bytes
    model = fresh()
    start = time.perf_counter()
    settings = Settings(step=Step(inputs=inputs, loss_fn=loss_fn), optimizer="adam",
                        machine=Machine(device="cpu"), repeat=repeat)
    costs = measure_costs(model, find_blocks(model), settings)
    full = costs.problem()
    blocks_only = Problem(**{**full.__dict__, "kept": [
        [None if full.options[o].startswith("children:") else k for o, k in enumerate(row)]
        for row in full.kept]})
    budgets = [peak, *(int(peak + f * (costs.memory.peaks["keep"] - peak)) for f in between)]
    plans = {}
    for b in budgets:
        for key, problem in (("blocks", blocks_only), ("children", full)):
            plans[(b, key)] = fit(model, costs, problem, b, floor(problem), settings)
    planned_s = time.perf_counter() - start
    models = {"unmarked": fresh(), "per-block": per_block}
    label = {}
    for (b, key), plan in plans.items():
        same = next((k for k, m in label.items() if m == plan.choices), None)
        label[f"{key}@{b}"] = plan.choices
        if same is None:
            models[f"{key}@{b}"] = fresh()
            plan.apply(models[f"{key}@{b}"])
        else:  # the same marks: one model, timed once per round
            models[f"{key}@{b}"] = models[same]
    loss_of = loss_fn or default_loss

    def step(net) -> float:
        begin = time.perf_counter()
        loss_of(net(*inputs)).backward()
        elapsed = time.perf_counter() - begin
        net.zero_grad(set_to_none=True)
        return elapsed

    distinct = list(dict.fromkeys(id(m) for m in models.values()))
    by_id = {id(m): m for m in models.values()}
    for net in by_id.values():  # warm-up
        step(net)
    times: dict[int, list] = {i: [] for i in distinct}
    for r in range(rounds):  # each round times every distinct model once, the order rotating
        for i in distinct[r % len(distinct):] + distinct[:r % len(distinct)]:
            times[i].append(step(by_id[i]))
    base = times[id(models["unmarked"])]
    over = {k: [t / b - 1 for t, b in zip(times[id(m)], base)] for k, m in models.items() if k != "unmarked"}
    ratios = {k: [o / p for o, p in zip(over[k], over["per-block"]) if p > 0]
              for k in over if k != "per-block"}

    def spread(values: list) -> dict:
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return {"median": statistics.median(values), "q1": q[0], "q3": q[2],
                "min": min(values), "max": max(values)}

    out = {"model": name, "per_block_peak": peak, "no_recompute_peak": costs.memory.peaks["keep"],
           "budgets": budgets, "rounds": rounds, "planned_s": planned_s, "options": costs.options,
           "overhead": {k: spread(v) for k, v in over.items()},
           "ratio_to_per_block": {k: spread(v) for k, v in ratios.items()},
           "ratio_of_medians": {k: statistics.median(over[k]) / statistics.median(over["per-block"])
                                for k in ratios},
           "plans": {f"{key}@{b}": {"choices": short(p.choices), "predicted_overhead": p.predicted_overhead,
                                    "predicted_peak": p.predicted_peak_bytes,
                                    "measured_peak": p.measured_peak_bytes}
                     for (b, key), p in plans.items()}}
    print(f"[inside {name}] per-block checkpointing's measured peak {peak:,} (no recompute "
          f"{costs.memory.peaks['keep']:,}); {rounds} interleaved rounds; options {costs.options[4:]}")
    o = out["overhead"]["per-block"]
    print(f"    per-block            overhead median {o['median']:+.3f} (IQR {o['q1']:+.3f}..{o['q3']:+.3f})")
    for (b, key), p in plans.items():
        k = f"{key}@{b}"
        o, r = out["overhead"][k], out["ratio_to_per_block"][k]
        print(f"    {key:<8} budget {b:,}: overhead median {o['median']:+.3f} (IQR {o['q1']:+.3f}.."
              f"{o['q3']:+.3f}), predicted {p.predicted_overhead:+.3f}; / per-block's: median "
              f"{r['median']:.3f} (IQR {r['q1']:.3f}..{r['q3']:.3f}, min {r['min']:.3f}, max "
              f"{r['max']:.3f}), ratio of medians {out['ratio_of_medians'][k]:.3f}; measured peak "
              f"{p.measured_peak_bytes:,}; {short(p.choices)}")
    return out


def versus_compile(name: str, build, inputs, loss_fn, fractions=(0.8, 0.5, 0.2), rounds: int = 15) -> dict:
    """The plan against torch.compile's ``activation_memory_budget`` (backend aot_eager, whose
    min-cut partitioner honours it) on one model, side by side: every configuration's peak from
    allocator events (torch.profiler; the tracker cannot see into compiled code) over one forward
    and backward, step times in interleaved rounds (median and quartiles)."""
    import copy

    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.debugging import aot_eager

    from remat._graph.internal import allocation_peak

    torch._dynamo.config.cache_size_limit = 64
    loss_fn = loss_fn or (lambda out: out.sum())
    torch.manual_seed(0)
    base = build()
    configs: dict[str, tuple] = {"eager, no recompute": (base, base)}

    def backend_for(fraction: float):
        def backend(gm, example_inputs):
            with functorch_config.patch(activation_memory_budget=fraction):
                return aot_eager(gm, example_inputs)
        return backend

    def step(target) -> None:
        module, forward = target
        loss_fn(forward(*inputs)).backward()
        module.zero_grad(set_to_none=True)

    peaks = {}
    for fraction in fractions:
        model = copy.deepcopy(base)
        label = f"torch.compile, activation_memory_budget={fraction}"
        configs[label] = (model, torch.compile(model, backend=backend_for(fraction)))
        step(configs[label])  # compiles (the partition reads the budget then)
        peaks[label] = allocation_peak(lambda t=configs[label]: step(t))
    step(configs["eager, no recompute"])
    peaks["eager, no recompute"] = allocation_peak(lambda: step(configs["eager, no recompute"]))
    # what is alive when a step starts (remat.compile's budget counts it; allocation_peak does not)
    baseline = sum(t.numel() * t.element_size() for t in (*base.parameters(), *base.buffers(), *inputs))
    def measured_step(model, batch):  # the loop measured here: the output freed before backward
        return loss_fn(model(*batch) if isinstance(batch, tuple) else model(batch))

    plans, missed = {}, {}
    for fraction in fractions:
        label = f"torch.compile, activation_memory_budget={fraction}"
        target = peaks[label]
        # remat.compile(budget=): planned and compiled in one call, held by the compiled peak
        try:
            model = copy.deepcopy(base)
            compiled = remat.compile(model, budget=int(baseline + target), example_inputs=inputs,
                                     step=measured_step, rounds=5)
        except remat.BudgetError as err:
            print(f"[vs compile {name}] remat.compile: no plan within {label}'s peak {target:,}: {err}")
            missed[f"remat.compile(budget=) at the peak of budget={fraction}"] = {
                "budget": int(baseline + target), "floor": getattr(err, "floor_bytes", None),
                "error": str(err).split(";")[0]}
        else:
            step((model, compiled))
            c_label = f"remat.compile(budget=) at the peak of budget={fraction}"
            configs[c_label] = (model, compiled)
            peaks[c_label] = allocation_peak(lambda t=configs[c_label]: step(t))
            plans[c_label] = short(compiled.remat_plan.choices)
            print(compiled.remat_plan)
        budget = target + baseline
        for _ in range(4):  # the tracker's peak and the allocator's differ by a little: re-plan
            plan = sweep(base, *inputs, budgets=[int(budget)], step=measured_step, optimizer=None,
                         repeat=1, floors=True)[0]
            if isinstance(plan, Exception):
                break
            model = copy.deepcopy(base)
            plan.apply(model)
            measured = allocation_peak(lambda m=model: step((m, m)))
            if measured <= target:
                break
            budget -= measured - target
        if isinstance(plan, Exception) or measured > target:
            why = (f"{str(plan).split(';')[0]} (floor {plan.floor_bytes:,})" if isinstance(plan, Exception)
                   else f"measured {measured:,} after re-planning")
            print(f"[vs compile {name}] no eager plan within {label}'s peak {target:,}: {why}")
            missed[f"remat.plan (eager) at the peak of budget={fraction}"] = {
                "budget": int(budget), "floor": getattr(plan, "floor_bytes", None), "error": why}
            continue
        plan_label = f"remat.plan (eager) at the peak of budget={fraction}"
        configs[plan_label] = (model, model)
        peaks[plan_label] = measured
        plans[plan_label] = short(plan.choices)
    times: dict[str, list] = {k: [] for k in configs}
    for target in configs.values():  # warm-up
        step(target)
    gc.collect()  # what the compiles and plans left in cycles, collected before any is timed
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for k in order:
            start = time.perf_counter()
            step(configs[k])
            times[k].append(time.perf_counter() - start)
    rows = {}
    for k in configs:
        q1, q2, q3 = statistics.quantiles(times[k], n=4, method="inclusive")
        rows[k] = {"peak_bytes": peaks[k], "median_ms": q2 * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
                   "choices": plans.get(k)}
        print(f"[vs compile {name}] {k:<48} peak {peaks[k]:>12,}  step {q2 * 1e3:8.1f} ms "
              f"[{q1 * 1e3:.1f}, {q3 * 1e3:.1f}] {plans.get(k) or ''}")
    verdicts = []
    for fraction in fractions:
        c = f"torch.compile, activation_memory_budget={fraction}"
        verdict = {"budget": fraction}
        for kind, p in (("compiled", f"remat.compile(budget=) at the peak of budget={fraction}"),
                        ("eager", f"remat.plan (eager) at the peak of budget={fraction}")):
            if p in rows:
                verdict[f"{kind}_peak_ratio"] = rows[p]["peak_bytes"] / rows[c]["peak_bytes"]
                verdict[f"{kind}_time_ratio"] = rows[p]["median_ms"] / rows[c]["median_ms"]
                verdict[f"{kind}_round_ratio"] = statistics.median(
                    a / b for a, b in zip(times[p], times[c], strict=True))
        verdicts.append(verdict)
    for v in verdicts:
        shown = ", ".join(f"{k} {x:.3f}" for k, x in v.items() if k != "budget")
        print(f"[vs compile {name}] budget {v['budget']}: {shown or 'no plan'}")
    return {"model": name, "rounds": rounds, "rows": rows, "verdicts": verdicts, "missed": missed,
            "baseline_bytes": baseline}


def max_batch(budget: str) -> dict:
    import argparse as _argparse

    from remat.cli.internal import fits
    from remat.cli.plan import Setup, largest_batch
    from remat.planner import parse_budget

    args = _argparse.Namespace(factory="remat.models.gpt:gpt", estimate=True, repeat=0, device=None,
                               throughput=None, loss="next-token", optimizer="adam", input_dtype="int64",
                               input_shape=["4,256"], arg=["layers=8", "width=256", "heads=4",
                                                           "seq_len=256", "vocab=4096"])
    setup = Setup(args)
    value = parse_budget(budget)[0]
    out = {}
    for strategy in ("per-block checkpointing", "planner"):
        start = time.perf_counter()
        out[strategy] = largest_batch(lambda b, s=strategy: fits(setup, s, b, value), 4)
        print(f"[max-batch] {strategy}: {out[strategy]} within {budget} ({time.perf_counter() - start:.0f} s)")
    return out


def speed(full_70b: bool) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory.internal import Step, build_in
    from remat.planner import solve
    from remat.planner.internal import (
        Machine,
        Settings,
        composed_costs,
        find_blocks,
        identical_container,
        measure_costs,
        measure_peak,
    )

    out = {}
    with FakeTensorMode():
        model = gpt(layers=32, width=256, heads=4, seq_len=256, vocab=4096)
        inputs = (torch.zeros(4, 256, dtype=torch.long),)
        costs = measure_costs(model, find_blocks(model), Settings(
            step=Step(inputs=inputs, loss_fn=next_token_loss), optimizer="adam",
            machine=Machine(fake=True, device="cpu")))
    problem = costs.problem()
    low, high = floor(problem), costs.memory.peaks["keep"]
    times = []
    for k in range(10):
        budget = low + (high - low) * k / 9
        start = time.perf_counter()
        solve(problem, budget, resolution=max(1.0, budget / 8192))
        times.append(time.perf_counter() - start)
    out["solve_32_layers_s"] = {"median": statistics.median(times), "max": max(times)}
    print(f"[speed] solve for a 32-layer transformer: median {statistics.median(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms over 10 budgets")
    from remat.models.llama import llama_7b

    for label, config, batch, fraction in (
            ("7B", llama_7b(), 1, 0.9),
            ("70B", LlamaConfig(layers=80, width=8192, heads=64, kv_heads=8, hidden=28672,
                                vocab=32000), 8, 0.7)):
        if label == "70B" and not full_70b:
            continue
        factory = config  # a LlamaConfig: built in bfloat16 (dtype= below), as remat.estimate does

        def inputs(batch: int = batch) -> tuple:
            return (torch.zeros(batch, 4096, dtype=torch.long),)

        start = time.perf_counter()
        with FakeTensorMode():
            model = build_in(factory, torch.bfloat16)
            blocks = find_blocks(model)
            step = Step(inputs=inputs(), loss_fn=next_token_loss)  # the planner's: logits held
            composed = composed_costs(model, blocks, identical_container(model, blocks), Settings(
                step=step, optimizer="adam", machine=Machine(fake=True, device="cpu"),
                options=("keep",)))
            composed_s = time.perf_counter() - start
            traced = measure_peak(model, step, optimizer="adam", fake=True)  # the same step, every block
        start = time.perf_counter()
        # remat.estimate's step frees the logits before backward (loss_fn(model(x)).backward())
        full = remat.estimate(factory, inputs, loss_fn=next_token_loss, dtype=torch.bfloat16)
        full_s = time.perf_counter() - start
        start = time.perf_counter()  # the same, from 3 and 4 blocks (NOTE [Composing an estimate])
        quick = remat.estimate(factory, inputs, loss_fn=next_token_loss, dtype=torch.bfloat16, compose=True)
        quick_s = time.perf_counter() - start
        start = time.perf_counter()
        p = remat.plan(factory, inputs, budget=fraction, loss_fn=next_token_loss, dtype=torch.bfloat16)
        plan_s = time.perf_counter() - start
        # the same plan verified on the whole traced model (verify="full"), for its time and peak
        start = time.perf_counter()
        whole = remat.plan(factory, inputs, budget=fraction, loss_fn=next_token_loss, dtype=torch.bfloat16,
                           verify="full")
        whole_s = time.perf_counter() - start
        load = os.getloadavg()[0]
        out[label] = {"composed_estimate_s": composed_s, "full_estimate_s": full_s,
                      "estimate_compose_s": quick_s, "estimate_compose_peak": quick.peak_bytes,
                      "plan_full_verify_s": whole_s, "full_verify_measured": whole.measured_peak_bytes,
                      "same_plan": whole.choices == p.choices, "load_1min": load,
                      "composed_peak": composed.memory.peaks["keep"], "traced_peak": traced,
                      "estimate_peak": full.peak_bytes,
                      "plan_s": plan_s, "budget": p.budget_bytes, "predicted": p.predicted_peak_bytes,
                      "measured": p.measured_peak_bytes, "no_recompute": p.no_recompute_peak_bytes,
                      "choices": {c: list(p.choices.values()).count(c) for c in set(p.choices.values())}}
        print(f"[speed] Llama {label} (seq 4096, batch {batch}, bf16) on fake tensors: remat.estimate "
              f"{full_s:.2f} s (peak {full.peak_bytes:,}), with compose=True {quick_s:.2f} s (peak "
              f"{quick.peak_bytes:,}, equal: {quick.peak_bytes == full.peak_bytes}); the planner's step (logits held through "
              f"backward) composed from short models {composed_s:.2f} s, peak "
              f"{composed.memory.peaks['keep']:,} vs {traced:,} every block traced (equal: "
              f"{composed.memory.peaks['keep'] == traced}); remat.plan end "
              f"to end at {fraction}x: {plan_s:.1f} s, predicted {p.predicted_peak_bytes:,}, measured "
              f"{p.measured_peak_bytes:,} (verified by composition); with verify='full' {whole_s:.1f} s, "
              f"measured {whole.measured_peak_bytes:,}, same plan: {whole.choices == p.choices}; "
              f"load average {load:.2f}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer trials")
    parser.add_argument("--budgets", type=int, default=10)
    parser.add_argument("--sections", default="held,optimality,anchors,inside,compile,maxbatch,speed")
    parser.add_argument("--no-70b", action="store_true", help="skip the 70B fake-tensor plan")
    parser.add_argument("--models", default="gpt,llama,resnet50,unet", help="models of 'held'")
    parser.add_argument("--anchor-models", default="gpt,resnet50", help="models of 'anchors'")
    parser.add_argument("--pairs", type=int, default=5, help="timed pairs per configuration in 'anchors'")
    parser.add_argument("--compile-models", default="gpt", help="models of 'compile'")
    parser.add_argument("--compile-fractions", default="0.8,0.5,0.2",
                        help="torch.compile's activation_memory_budget values of 'compile' (comma-separated)")
    parser.add_argument("--compile-rounds", type=int, default=15, help="interleaved rounds of 'compile'")
    parser.add_argument("--inside-models", default="gpt", help="models of 'inside' (options inside blocks)")
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds of 'inside'")
    parser.add_argument("--max-batch-budgets", default="160MiB,400MiB",
                        help="budgets of 'maxbatch' (comma-separated)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    chosen = models(args.quick)
    if "held" in sections:
        result["held"] = [budget_sweep(n, *chosen[n], args.budgets) for n in args.models.split(",")]
    if "optimality" in sections:
        result["optimality"] = optimality(12 if args.quick else 30)
    if "anchors" in sections:
        result["anchors"] = [anchors(n, *chosen[n], pairs=args.pairs) for n in args.anchor_models.split(",")]
    if "inside" in sections:
        result["inside"] = [inside_blocks(n, *chosen[n], rounds=args.rounds) for n in args.inside_models.split(",")]
    if "compile" in sections:
        fractions = tuple(float(f) for f in args.compile_fractions.split(","))
        result["versus_compile"] = [versus_compile(n, *chosen[n], fractions=fractions,
                                                   rounds=args.compile_rounds)
                                    for n in args.compile_models.split(",")]
    if "maxbatch" in sections:
        result["max_batch"] = {b: max_batch(b) for b in args.max_batch_budgets.split(",")}
    if "speed" in sections:
        result["speed"] = speed(not args.no_70b)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"plan_sweep{'_quick' if args.quick else ''}_{'_'.join(sections)}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
