"""``remat demo``: MindSpore's recompute tutorial (ResNet-50, CIFAR-10) with and without recompute.

The same network, from the same random seed, trains on the same batches in each
configuration; the table compares what each configuration keeps for backward,
its peak memory, its step time, and its final loss, which recompute must not
change.

Examples:
    >>> from remat.cli._demo import DemoConfig, run_demo
    >>> result = run_demo(DemoConfig(steps=2, batch_size=2, model="tiny", out_dir=None),
    ...                   progress=False)
    >>> result["losses_identical"]
    True
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import remat
from remat.data import load_cifar10
from remat.models import resnet, resnet50

#: ``(name, options of Cell.recompute for the tutorial's blocks, or None for no marks)``.
CONFIGURATIONS: tuple[tuple[str, dict | None], ...] = (
    ("no recompute", None),
    ("tutorial marks", {}),
    ("tutorial marks + output_recompute", {"output_recompute": True}),
    ("selective (save_compute_intensive)", {"policy": remat.save_compute_intensive}),
)
#: The planner's row: budgets tried, as shares of the tutorial marks' measured peak (first that
#: fits).
PLANNER_SHARES = (0.85, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class DemoConfig:
    """Options of `run_demo`.

    Args:
        steps: training steps per configuration.
        batch_size: images per step.
        data_dir: folder of the CIFAR-10 binary files; None for the synthetic set.
        out_dir: where ``demo.json`` and ``memory_timeline.png`` go; None writes nothing.
        device: ``"cpu"``, ``"cuda"``; None picks CUDA when present.
        model: ``"resnet50"`` (the ResNet-50 of MindSpore's recompute tutorial) or ``"tiny"``
            (two small stages, for smoke tests).
        seed: seed of the weights (the batches are the same in every configuration).
        lr: Adam learning rate.
        planner: add a row planned by `remat.plan` for a budget below the tutorial
            marks' peak.
        rounds: timing rounds after training: each round runs one step of every
            configuration, in a rotated order, so that a load on the machine falls on all of
            them alike; a ratio to no recompute is taken within each round.
    """

    steps: int = 16
    batch_size: int = 32
    data_dir: str | None = None
    out_dir: str | None = "demo_out"
    device: str | None = None
    model: str = "resnet50"
    seed: int = 0
    lr: float = 3e-4
    planner: bool = True
    rounds: int = 7


def build_model(name: str, options: dict | remat.Plan | None) -> torch.nn.Module:
    """Build the demo's model, marked as MindSpore's recompute tutorial marks it when
    ``options`` is a dict (``Cell.recompute`` options), or as a `remat.Plan` says."""
    if name == "resnet50":
        net = resnet50(class_num=10)
    elif name == "tiny":
        net = resnet((2, 2), width=4, class_num=10)
    else:
        raise ValueError(f"remat demo: model must be 'resnet50' or 'tiny', got {name!r}")
    if isinstance(options, remat.Plan):
        options.apply(net)
    elif options is not None:
        net.mark_blocks(**options)
    return net


def make_plan(config: DemoConfig, data: Any) -> tuple[remat.Plan, int]:
    """Plan the demo's model for the lowest of `PLANNER_SHARES` of the tutorial marks' peak
    that fits; return the plan and that peak.

    The plan's step is the demo's own (`train_configuration`'s ``forward_backward``):
    load a batch, forward, cross-entropy, backward, without the optimizer step; the tutorial
    marks' peak is measured on the same step, so the plan's row is measured as planned.
    """
    from remat.memory.internal import Step
    from remat.planner import sweep
    from remat.planner.internal import measure_peak

    device = _device(config.device)
    torch.manual_seed(config.seed)
    model = build_model(config.model, None).to(device)

    def step(net: torch.nn.Module, index: int) -> torch.Tensor:
        images, labels = data.batch(index, config.batch_size, device)
        loss = torch.nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        return loss

    tutorial = build_model(config.model, {}).to(device)
    tutorial_peak = measure_peak(tutorial, Step(batch=0, custom=step), optimizer=None, fake=False)
    budgets = [int(share * tutorial_peak) for share in PLANNER_SHARES]
    plans = sweep(model, budgets=budgets, batch=0, step=step, optimizer=None, repeat=1, floors=True)
    fitting = [p for p in plans if isinstance(p, remat.Plan)]
    if not fitting:
        raise plans[-1]
    return fitting[0], tutorial_peak


def has_tracker() -> bool:
    """Whether the exact memory tracker (``remat.memory.track``) is available."""
    return hasattr(remat.memory, "track")


def peak_bytes(step: Callable[[], Any], model: torch.nn.Module, device: torch.device) -> dict:
    """Run ``step()`` once; return ``{"peak_bytes", "peak_increase_bytes", "source", "tracker"}``.

    The exact tracker counts live tensor storage; without it, on CUDA,
    ``torch.cuda.max_memory_allocated``; on CPU without the tracker the peak is None.
    """
    if has_tracker():
        with remat.memory.track(model) as tracker:
            step()
        return {"peak_bytes": int(tracker.peak_bytes), "source": "remat.memory.track",
                "peak_increase_bytes": int(tracker.peak_increase), "tracker": tracker}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                "source": "torch.cuda.max_memory_allocated", "peak_increase_bytes": None,
                "tracker": None}
    step()
    return {"peak_bytes": None, "source": None, "peak_increase_bytes": None, "tracker": None}


def kept_bytes(forward: Callable[[], Any]) -> int | None:
    """Bytes that autograd keeps for backward after ``forward()`` (``remat.memory.saved_bytes``)."""
    try:
        return int(remat.memory.saved_bytes(forward))
    except NotImplementedError:
        return None


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_configuration(
    config: DemoConfig, name: str, options: dict | None, data: Any, advance: Callable[[], None]
) -> dict:
    """Train one configuration for ``config.steps`` steps; return its figures (times are
    taken afterwards, all configurations interleaved: `time_configurations`).

    The forward and backward of step 1 (the second) run under the memory tracker.
    """
    device = _device(config.device)
    torch.manual_seed(config.seed)
    model = build_model(config.model, options).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses, memory = [], None

    def forward_backward(i: int) -> None:
        images, labels = data.batch(i, config.batch_size, device)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        losses.append(loss.item())

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        forward_backward(i)
        optimizer.step()

    for i in range(config.steps):
        if i == min(1, config.steps - 1) and memory is None:
            # the peak of forward and backward: where recompute acts (the optimizer
            # step's own peak is the same with or without marks)
            optimizer.zero_grad(set_to_none=True)
            memory = peak_bytes(lambda i=i: forward_backward(i), model, device)
            optimizer.step()
        else:
            step(i)
        advance()
    images, labels = data.batch(0, config.batch_size, device)
    kept = kept_bytes(lambda: torch.nn.functional.cross_entropy(model(images), labels))
    return {
        "name": name,
        "marks": (options.choices if isinstance(options, remat.Plan)
                  else {k: repr(v) for k, v in (options or {}).items()} if options is not None else None),
        "marked_blocks": len(remat.marked_modules(model)),
        "_options": options,
        "peak_bytes": memory["peak_bytes"],
        "peak_increase_bytes": memory["peak_increase_bytes"],
        "peak_source": memory["source"],
        "kept_bytes": kept,
        "losses": losses,
        "final_loss": losses[-1],
        "_tracker": memory["tracker"],
    }


def run_demo(config: DemoConfig, *, progress: bool = True) -> dict:
    """Train every configuration of `CONFIGURATIONS`; print and return the results.

    Args:
        config: the options.
        progress: show a progress bar and the final table (needs ``rich``).

    Returns:
        A JSON-ready dict: the options, the device, ``rows`` (one per configuration),
        ``losses_identical`` and the paths written.
    """
    if config.steps < 1 or config.batch_size < 1:
        raise ValueError(
            f"remat demo: steps and batch_size must be at least 1, got steps={config.steps}, "
            f"batch_size={config.batch_size}"
        )
    data = load_cifar10(config.data_dir, size=max(256, config.batch_size * config.steps))
    rows = _train_all(config, data, progress)
    time_configurations(config, data, rows)
    baseline = rows[0]
    for row in rows:
        for key in ("peak_bytes", "kept_bytes"):
            a, b = row[key], baseline[key]
            row[key.replace("_bytes", "").replace("median_", "") + "_ratio"] = (
                a / b if a is not None and b else None
            )
        row["loss_equal_to_baseline"] = row["final_loss"] == baseline["final_loss"]
    result = {
        "config": asdict(config),
        "device": str(_device(config.device)),
        "torch_threads": torch.get_num_threads(),
        "data": "synthetic CIFAR-10" if config.data_dir is None else config.data_dir,
        "rows": rows,
        "losses_identical": all(r["loss_equal_to_baseline"] for r in rows),
        "files": [],
    }
    if config.out_dir is not None:
        result["files"] = _write_outputs(config.out_dir, result)
    for row in rows:
        row.pop("_tracker", None)
        row.pop("_options", None)
    if progress:
        print_table(result)
    return result


def time_configurations(config: DemoConfig, data: Any, rows: list[dict]) -> None:
    """Time one training step of every configuration in interleaved rounds; add to each row
    ``median_step_s``, ``step_s_ratio`` (the median over rounds of its step over no
    recompute's in the same round) and ``step_s_ratio_iqr`` (their quartiles).

    All the models are built first (the same weights: the same seed), then each round runs
    one step (forward, loss, backward, optimizer step) of each configuration on the same
    batch, in an order rotated every round: a machine's load or a clock change falls on
    every configuration alike, so the ratios stay put where one-after-another timing
    (the demo's before) showed recompute faster than no recompute.
    """
    if config.rounds < 1:
        for row in rows:
            row.update(median_step_s=None, step_s_ratio=None, step_s_ratio_iqr=None)
        return
    device = _device(config.device)
    images, labels = data.batch(0, config.batch_size, device)
    runs = []
    for row in rows:
        torch.manual_seed(config.seed)
        model = build_model(config.model, row.pop("_options")).to(device)
        runs.append((model, torch.optim.Adam(model.parameters(), lr=config.lr)))

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        _sync(device)
        return time.perf_counter() - start

    for run in runs:  # warm up: allocator, optimizer state
        step(*run)
    times: list[list[float]] = [[] for _ in runs]
    for r in range(config.rounds):
        order = list(range(len(runs)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            times[i].append(step(*runs[i]))
    for row, taken in zip(rows, times, strict=True):
        ratios = [t / base for t, base in zip(taken, times[0], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        row.update(median_step_s=statistics.median(taken), step_s_ratio=statistics.median(ratios),
                   step_s_ratio_iqr=(quartiles[0], quartiles[2]))


def _train_all(config: DemoConfig, data: Any, progress: bool) -> list[dict]:
    total = config.steps * (len(CONFIGURATIONS) + config.planner)
    if not progress:
        rows = [train_configuration(config, n, o, data, lambda: None) for n, o in CONFIGURATIONS]
        if config.planner:
            rows.append(_train_planned(config, data, rows, lambda: None))
        return rows
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    rows = []
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:  # gone once the table prints
        task = bar.add_task("training", total=total)
        for name, options in CONFIGURATIONS:
            bar.update(task, description=f"training: {name}")
            rows.append(
                train_configuration(config, name, options, data, lambda: bar.advance(task))
            )
        if config.planner:
            bar.update(task, description="planning: remat.plan")
            rows.append(_train_planned(config, data, rows, lambda: bar.advance(task)))
    return rows


def _train_planned(config: DemoConfig, data: Any, rows: list[dict], advance: Callable[[], None]) -> dict:
    start = time.perf_counter()
    plan, tutorial_peak = make_plan(config, data)
    seconds = time.perf_counter() - start
    share = plan.budget_bytes / tutorial_peak
    name = f"remat.plan ({share:.2f}x tutorial marks' peak)"
    row = train_configuration(config, name, plan, data, advance)
    row.update(plan_budget_bytes=plan.budget_bytes, plan_predicted_peak_bytes=plan.predicted_peak_bytes,
               plan_predicted_overhead=plan.predicted_overhead, plan_seconds=seconds,
               plan_choices=plan.choices, plan_measured_peak_bytes=plan.measured_peak_bytes,
               plan_tutorial_peak_bytes=tutorial_peak)
    return row


def _write_outputs(out_dir: str, result: dict) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    files = []
    plot = _plot_timeline(out_dir, result["rows"])
    if plot:
        files.append(plot)
    path = os.path.join(out_dir, "demo.json")
    files.append(path)
    result["files"] = files
    clean = {**result, "rows": [{k: v for k, v in r.items() if not k.startswith("_")}
                                for r in result["rows"]]}
    with open(path, "w") as file:
        json.dump(clean, file, indent=2)
    return files


def _plot_timeline(out_dir: str, rows: list[dict]) -> str | None:
    plot = getattr(remat.memory, "plot_timeline", None)
    tracked = [r for r in rows if r.get("_tracker") is not None]
    if plot is None or not tracked:
        return None
    path = os.path.join(out_dir, "memory_timeline.png")
    plot([r["_tracker"] for r in tracked], path, labels=[r["name"] for r in tracked],
         title="ResNet-50 of MindSpore's recompute tutorial: memory over one training step")
    return path


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def _ratio(value: float | None) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def print_table(result: dict) -> None:
    """Print the demo's results as a rich table (ratios to no recompute in parentheses)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ResNet-50 of MindSpore's recompute tutorial on {result['data']}, "
                        f"{result['device']}")
    for column in ("configuration", "peak (fwd+bwd)", "kept for backward",
                   "step (ratio, quartiles)", "final loss"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for r in result["rows"]:
        step = "n/a" if r["median_step_s"] is None else (
            f"{1000 * r['median_step_s']:.0f} ms ({r['step_s_ratio']:.2f}x, "
            f"{r['step_s_ratio_iqr'][0]:.2f}-{r['step_s_ratio_iqr'][1]:.2f})")
        same = "=" if r["loss_equal_to_baseline"] else "DIFFERS"
        table.add_row(
            r["name"], _mib(r["peak_bytes"]) + _ratio(r["peak_ratio"]),
            _mib(r["kept_bytes"]) + _ratio(r["kept_ratio"]), step, f"{r['final_loss']:.9f} {same}",
        )
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: do not wrap at 80 columns
        console = Console(width=120)
    console.print(table)
    rounds = result["config"]["rounds"]
    if rounds:
        console.print(f"step: median of {rounds} interleaved rounds (forward, loss, backward, optimizer "
                      f"step); ratio to no recompute within each round, median and quartiles")
    console.print("the peak falls less than the bytes kept: it also holds the weights, their "
                  "gradients and the optimizer's state, and backward's working set, which recompute "
                  "does not shrink")
    losses = result["rows"][0]["losses"]
    k = max(1, min(3, len(losses) // 2))
    console.print(f"mean loss of steps 1-{k}: {statistics.mean(losses[:k]):.3f} -> of the last "
                  f"{k}: {statistics.mean(losses[-k:]):.3f}; "
                  + ("final losses identical in every configuration"
                     if result["losses_identical"] else "FINAL LOSSES DIFFER"))
    for r in result["rows"]:
        if "plan_choices" in r:
            counts = {c: list(r["plan_choices"].values()).count(c) for c in dict.fromkeys(r["plan_choices"].values())}
            console.print(f"remat.plan: budget {_mib(r['plan_budget_bytes'])} (tutorial marks: "
                          f"{_mib(r['plan_tutorial_peak_bytes'])} on the plan's step: forward, loss, "
                          f"backward of batch 0), predicted {_mib(r['plan_predicted_peak_bytes'])}, measured "
                          f"{_mib(r['plan_measured_peak_bytes'])}; "
                          f"blocks: " + ", ".join(f"{n} {c}" for c, n in counts.items())
                          + f"; planned in {r['plan_seconds']:.1f} s")
    for path in result["files"]:
        console.print(f"wrote {path}")
