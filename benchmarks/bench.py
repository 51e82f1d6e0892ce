"""``remat bench``: remat against ``torch.utils.checkpoint`` on the same marks (a tool, out of the package).

Method (steady on a shared 2-core machine): one thread; warm-up steps for every
configuration; memory measured once per configuration with the exact tracker
(peak) and ``remat.memory.saved_bytes`` (kept bytes), never sampled; then
timing in rounds where every configuration runs right next to a run of the
baseline (no recompute): ``B c1 c2 B c3 c4 B ...``, the order rotated each
round so each configuration is timed as often before as after its baseline.
Each configuration's figure is the median of its pair ratios
``time(config) / time(adjacent baseline)`` with the quartiles, over several
trials, with garbage collection off while timing. A step is forward, loss and
backward (no optimizer: the weights, hence the work, stay the same).

Only the benchmark calls ``torch.utils.checkpoint``: it is the baseline.

Example:
    >>> from benchmarks.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(quick=True, pairs=1, trials=1, warmup=1,
    ...                                workloads=("gpt",), out_dir=None), progress=False)
    >>> list(result["workloads"][0]["rows"])[0]
    'none'
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.utils.checkpoint

import remat
from benchmarks.bench_report import BASELINE, include_markdown, render_markdown
from remat.cli.internal import kept_bytes, peak_bytes
from remat.models import gpt, resnet, resnet50

#: Configurations, in table order. ``torch *`` wrap the same blocks ``remat *`` mark.
CONFIGURATIONS = (
    BASELINE,
    "torch reentrant",
    "torch non-reentrant",
    "remat cell marks",
    "remat plan",
    "remat output_recompute",
    "remat selective",
    "remat primitive marks",
    "compiled none",
    "compiled remat cell marks",
    "compiled torch non-reentrant",
)
#: Compiled configurations: ``remat.compile`` (unmarked: the compiled baseline; marked) and
#: ``torch.compile`` over ``torch.utils.checkpoint`` on the same blocks. Their peaks come
#: from allocator events (the tracker's dispatch mode would make Dynamo run eagerly) and
#: their memory ratios are to ``compiled none``.
COMPILED = {
    "compiled none": (BASELINE, "remat"),
    "compiled remat cell marks": ("remat cell marks", "remat"),
    "compiled torch non-reentrant": ("torch non-reentrant", "torch"),
}
COMPILED_BASELINE = "compiled none"
#: ``remat plan``: the planner's choice for a budget of the cell marks' measured peak, set by
#: :func:`plan_for` per model (keyed by ``id``) before the model is configured with it.
_PLANS: dict[int, remat.Plan] = {}
#: For each remat configuration, the torch configuration with the same marks.
TORCH_EQUIVALENT = {
    "remat cell marks": "torch non-reentrant",
    "remat output_recompute": "torch non-reentrant",
    "remat selective": "torch non-reentrant",
    "compiled remat cell marks": "compiled torch non-reentrant",
}


@dataclass(frozen=True)
class Workload:
    """One model and batch to benchmark.

    Args:
        name: how the tables name it.
        build: returns the model (with ``recompute_blocks()``).
        inputs: returns ``(model inputs, targets)``.
        loss: ``loss(output, targets) -> scalar``.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _images(batch: int, size: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(batch, 3, size, size, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen))
    return make


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        return tokens[:, :-1], tokens[:, 1:]
    return make


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


GPT_SIZES = {"layers": 4, "width": 256, "heads": 4, "seq_len": 256, "vocab": 4096}
TINY_GPT = {"layers": 2, "width": 32, "heads": 4, "seq_len": 16, "vocab": 64}


def workloads(quick: bool = False) -> dict[str, Workload]:
    """Return the benchmark's workloads by name (tiny stand-ins when ``quick``)."""
    cross_entropy = torch.nn.functional.cross_entropy
    if quick:
        def tiny_resnet() -> torch.nn.Module:
            return resnet((2, 2), width=4, class_num=10)
        return {
            "resnet50-cifar-b32": Workload("tiny resnet, 32x32, batch 4", tiny_resnet,
                                           _images(4, 32), cross_entropy),
            "resnet50-cifar-b64": Workload("tiny resnet, 32x32, batch 8", tiny_resnet,
                                           _images(8, 32), cross_entropy),
            "resnet50-imagenet-b8": Workload("tiny resnet, 64x64, batch 2", tiny_resnet,
                                             _images(2, 64), cross_entropy),
            "gpt": Workload("tiny GPT, batch 2", functools.partial(gpt, **TINY_GPT),
                            _tokens(2, TINY_GPT["seq_len"], TINY_GPT["vocab"]), _lm_loss),
        }
    sizes = ", ".join(f"{k} {v}" for k, v in GPT_SIZES.items())
    return {
        "resnet50-cifar-b32": Workload("ResNet-50, CIFAR-10 32x32, batch 32", resnet50,
                                       _images(32, 32), cross_entropy),
        "resnet50-cifar-b64": Workload("ResNet-50, CIFAR-10 32x32, batch 64", resnet50,
                                       _images(64, 32), cross_entropy),
        "resnet50-imagenet-b8": Workload("ResNet-50, ImageNet 224x224, batch 8", resnet50,
                                         _images(8, 224), cross_entropy),
        "gpt": Workload(f"GPT-2-style ({sizes}), batch 4", functools.partial(gpt, **GPT_SIZES),
                        _tokens(4, GPT_SIZES["seq_len"], GPT_SIZES["vocab"]), _lm_loss),
    }


def configure(model: torch.nn.Module, name: str) -> None:
    """Remove every mark and checkpoint wrapper from ``model``, then apply configuration ``name``."""
    remat.unmark(model)
    blocks = model.recompute_blocks()
    for block in blocks:
        block.__dict__.pop("forward", None)
    if name == BASELINE:
        return
    if name.startswith("torch"):
        reentrant = name == "torch reentrant"
        for block in blocks:
            block.forward = functools.partial(
                torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=reentrant
            )
    elif name == "remat cell marks":
        model.mark_blocks()
    elif name == "remat plan":
        if id(model) not in _PLANS:
            raise ValueError("remat bench: configuration 'remat plan' needs plan_for(model, ...) first")
        _PLANS[id(model)].apply(model)
    elif name == "remat output_recompute":
        model.mark_blocks(output_recompute=True)
    elif name == "remat selective":
        model.mark_blocks(policy=remat.save_compute_intensive)
    elif name == "remat primitive marks":
        remat.apply(model, where=(torch.nn.ReLU, torch.nn.GELU), output_recompute=True)
    else:
        raise ValueError(f"remat bench: unknown configuration {name!r}; one of {CONFIGURATIONS}")


@dataclass(frozen=True)
class BenchConfig:
    """Options of :func:`run_bench`.

    Args:
        workloads: names from :func:`workloads` to run.
        pairs: timing rounds per trial (each gives one pair ratio per configuration).
        trials: independent repetitions of the rounds.
        warmup: untimed steps per configuration before measuring.
        quick: tiny models and batches (smoke tests).
        out_dir: where ``bench.json`` and ``bench.md`` go (``bench_quick.*`` when quick);
            None writes nothing.
        configurations: the configurations to run (the baseline always runs).
        readme: a markdown file whose bench markers receive the table (not when quick).
    """

    workloads: tuple[str, ...] = (
        "resnet50-cifar-b32", "resnet50-cifar-b64", "resnet50-imagenet-b8", "gpt",
    )
    pairs: int = 7
    trials: int = 3
    warmup: int = 3
    quick: bool = False
    out_dir: str | None = "benchmarks/results"
    configurations: tuple[str, ...] = field(default=CONFIGURATIONS)
    readme: str | None = "docs/sections/demo.md"


Prepare = Callable[[str], tuple[torch.nn.Module, Callable]]


def preparer(model: torch.nn.Module, configs: list[str], backend: str = "aot_eager") -> Prepare:
    """Return ``prepare(name) -> (module, step function)`` for the configurations ``configs``.

    Eager configurations reconfigure ``model`` itself; each compiled one gets a
    configured deep copy, compiled once here.
    """
    from remat._graph.internal import compile_configuration

    compiled = {}
    if any(name in COMPILED for name in configs):
        # Each workload compiles the same forward code objects again (a new model instance
        # each time); without a reset, dynamo's recompile limit (8) would silently run later
        # workloads' compiled configurations eagerly.
        torch._dynamo.reset()
    for name in configs:
        if name in COMPILED:
            eager_name, compiler = COMPILED[name]
            configure(model, BASELINE)
            twin = copy.deepcopy(model)
            configure(twin, eager_name)
            compiled[name] = (twin, compile_configuration(twin, compiler, backend=backend))
    configure(model, BASELINE)

    def prepare(name: str) -> tuple[torch.nn.Module, Callable]:
        if name in compiled:
            return compiled[name]
        configure(model, name)
        return model, model

    return prepare


def _step(target: tuple[torch.nn.Module, Callable], workload: Workload, x: torch.Tensor,
          y: torch.Tensor) -> None:
    module, forward = target
    module.zero_grad(set_to_none=True)
    workload.loss(forward(x), y).backward()


def _timed(prepare: Prepare, workload: Workload, x: torch.Tensor, y: torch.Tensor,
           name: str) -> float:
    target = prepare(name)
    start = time.perf_counter()
    _step(target, workload, x, y)
    return time.perf_counter() - start


def schedule(configs: list[str], round_index: int) -> list[tuple[str, int]]:
    """Order of one timing round: ``[(config, index of its baseline in the round), ...]``.

    Two configurations per baseline run, the first after it and the second before
    the next one; the order rotates with ``round_index``.

    Example:
        >>> schedule(["a", "b", "c"], 0)
        [('none', -1), ('a', 0), ('b', 3), ('none', -1), ('c', 3)]
    """
    shift = round_index % max(1, len(configs))
    order = configs[shift:] + configs[:shift]
    plan: list[tuple[str, int]] = []
    for i in range(0, len(order), 2):
        base = len(plan)
        plan.append((BASELINE, -1))
        plan.append((order[i], base))
        if i + 1 < len(order):
            plan.append((order[i + 1], base + 3))
    if plan and plan[-1][1] == len(plan):  # the last configuration needs a closing baseline
        plan.append((BASELINE, -1))
    return plan


def time_round(prepare: Prepare, workload: Workload, x: torch.Tensor, y: torch.Tensor,
               configs: list[str], round_index: int) -> tuple[dict[str, float], list[float]]:
    """Run one round of :func:`schedule`; return each configuration's pair ratio and the
    baseline's step times."""
    plan = schedule(configs, round_index)
    times = [_timed(prepare, workload, x, y, name) for name, _ in plan]
    ratios = {name: times[i] / times[base] for i, (name, base) in enumerate(plan) if base >= 0}
    return ratios, [t for t, (name, base) in zip(times, plan) if base < 0]


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def measure_memory(prepare: Prepare, workload: Workload, x: torch.Tensor,
                   y: torch.Tensor, name: str) -> dict:
    """Peak bytes of one step and kept bytes of one forward, for ``name``.

    Eager: the exact tracker and ``saved_bytes``. Compiled: allocator events and the
    saved bytes the graph pass reports (None for ``torch.compile``).
    """
    target = prepare(name)
    module, forward = target
    if name in COMPILED:
        from remat._graph.internal import allocation_peak

        module.zero_grad(set_to_none=True)
        peak = allocation_peak(lambda: _step(target, workload, x, y))
        reports = getattr(forward, "remat_reports", None)
        kept = int(reports[0].saved_bytes) if reports else None  # the first (static) graph
        return {"peak_bytes": peak, "peak_increase_bytes": peak,
                "peak_source": "allocator events (torch.profiler)", "kept_bytes": kept}
    peak = peak_bytes(lambda: _step(target, workload, x, y), module, x.device)
    module.zero_grad(set_to_none=True)
    kept = kept_bytes(lambda: workload.loss(forward(x), y))
    return {"peak_bytes": peak["peak_bytes"], "peak_increase_bytes": peak["peak_increase_bytes"],
            "peak_source": peak["source"], "kept_bytes": kept}


def plan_for(model: torch.nn.Module, workload: Workload, x: torch.Tensor, y: torch.Tensor) -> remat.Plan:
    """Plan ``model`` for a budget of the measured peak of ``remat cell marks`` (same step,
    same tracker); register the plan for configuration ``remat plan`` and return it."""
    configure(model, "remat cell marks")
    budget = peak_bytes(lambda: _step((model, model), workload, x, y), model, x.device)["peak_bytes"]
    configure(model, BASELINE)
    model.zero_grad(set_to_none=True)
    plan = remat.plan(model, x, budget=budget, loss_fn=lambda out: workload.loss(out, y),
                      optimizer=None, repeat=2)
    _PLANS[id(model)] = plan
    return plan


def bench_workload(config: BenchConfig, workload: Workload, advance: Callable[[], None]) -> dict:
    """Benchmark every configuration on one workload; return its figures."""
    torch.manual_seed(0)
    model = workload.build()
    x, y = workload.inputs()
    configs = [c for c in config.configurations if c != BASELINE]
    plan = plan_for(model, workload, x, y) if "remat plan" in configs else None
    prepare = preparer(model, configs)
    rows: dict[str, dict] = {}
    for name in [BASELINE, *configs]:
        for _ in range(config.warmup):
            _step(prepare(name), workload, x, y)
        rows[name] = measure_memory(prepare, workload, x, y, name)
        advance()
    ratios: dict[str, list[list[float]]] = {c: [] for c in configs}
    baseline_times: list[float] = []
    for _ in range(config.trials):
        trial: dict[str, list[float]] = {c: [] for c in configs}
        gc.collect()
        gc.disable()
        try:
            for r in range(config.pairs):
                pair_ratios, base_times = time_round(prepare, workload, x, y, configs, r)
                baseline_times += base_times
                for name, ratio in pair_ratios.items():
                    trial[name].append(ratio)
                advance()
        finally:
            gc.enable()
        for c in configs:
            ratios[c].append(trial[c])
    configure(model, BASELINE)
    rows[BASELINE]["step_s"] = statistics.median(baseline_times)
    _summarise(rows, ratios)
    if plan is not None:
        rows["remat plan"]["plan"] = {"budget_bytes": plan.budget_bytes, "choices": plan.choices,
                                      "predicted_peak_bytes": plan.predicted_peak_bytes,
                                      "predicted_overhead": plan.predicted_overhead}
    return {"name": workload.name, "rows": rows}


def _summarise(rows: dict[str, dict], ratios: dict[str, list[list[float]]]) -> None:
    base = rows[BASELINE]
    base.update(time_ratio=1.0, time_q1=1.0, time_q3=1.0, trial_medians=[1.0])
    for name, row in rows.items():
        reference = rows.get(COMPILED_BASELINE, base) if name in COMPILED else base
        for key in ("peak_bytes", "kept_bytes"):
            a, b = row[key], reference[key]
            row[key.replace("_bytes", "_ratio")] = a / b if a is not None and b else None
        if name == BASELINE:
            continue
        every = [r for trial in ratios[name] for r in trial]
        q1, median, q3 = _quartiles(every)
        row.update(time_ratio=median, time_q1=q1, time_q3=q3, pairs=len(every),
                   trial_medians=[statistics.median(t) for t in ratios[name]])
    for name, torch_name in TORCH_EQUIVALENT.items():
        if name in rows and torch_name in rows:
            rows[name]["vs_torch"] = _versus(rows[name], rows[torch_name], torch_name)


def _versus(row: dict, other: dict, other_name: str) -> dict:
    def div(key: str) -> float | None:
        a, b = row.get(key), other.get(key)
        return a / b if a is not None and b else None
    return {"against": other_name, "peak": div("peak_bytes"), "kept": div("kept_bytes"),
            "time": div("time_ratio")}


def run_bench(config: BenchConfig, *, progress: bool = True) -> dict:
    """Run the benchmark; write ``bench.json`` and ``bench.md``; return the results.

    Args:
        config: the options.
        progress: show a progress bar and print the markdown table (needs ``rich``).

    Returns:
        A JSON-ready dict: the method's settings, the threads, one entry per workload.
    """
    if config.pairs < 1 or config.trials < 1 or config.warmup < 0:
        raise ValueError(
            f"remat bench: pairs and trials must be at least 1 and warmup at least 0, got "
            f"pairs={config.pairs}, trials={config.trials}, warmup={config.warmup}"
        )
    table = workloads(config.quick)
    unknown = [w for w in config.workloads if w not in table]
    if unknown:
        raise ValueError(f"remat bench: unknown workloads {unknown}; choose from {sorted(table)}")
    started = time.time()
    result = {
        "method": asdict(config),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "device": "cpu",
        "memory_source": "remat.memory.track" if hasattr(remat.memory, "track") else None,
        "seconds": 0.0,
        "workloads": [],
    }

    def done(entry: dict) -> None:  # write after every workload: a long run keeps its results
        result["workloads"].append(entry)
        result["seconds"] = round(time.time() - started, 1)
        write_results(config, result)

    _run_all(config, [table[w] for w in config.workloads], progress, done)
    if progress:
        print(render_markdown(result))
    return result


def write_results(config: BenchConfig, result: dict) -> None:
    """Write ``bench.json``, ``bench.md`` and the README table for ``result``."""
    if config.out_dir is None:
        return
    stem = "bench_quick" if config.quick else "bench"
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, stem + ".json"), "w") as file:
        json.dump(result, file, indent=2)
    with open(os.path.join(config.out_dir, stem + ".md"), "w") as file:
        file.write(render_markdown(result))
    if not config.quick and config.readme and os.path.isfile(config.readme):
        include_markdown(config.readme, render_markdown(result))


def _run_all(config: BenchConfig, chosen: list[Workload], progress: bool,
             done: Callable[[dict], None]) -> None:
    per = len(config.configurations) + config.trials * config.pairs
    if not progress:
        for w in chosen:
            done(bench_workload(config, w, lambda: None))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("bench", total=per * len(chosen))
        for w in chosen:
            bar.update(task, description=w.name)
            done(bench_workload(config, w, lambda: bar.advance(task)))
