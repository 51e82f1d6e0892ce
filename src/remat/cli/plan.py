"""``remat plan``: choose what to recompute for a memory budget, and measure the plan.

Examples:
    $ remat plan remat.models.gpt:gpt --arg layers=8 --input-shape 8,256 --input-dtype int64 \\
          --loss next-token --budget 60% --json plan.json --plot pareto.png
    $ remat plan remat.models.llama:llama --arg layers=4 --input-shape 1,512 --input-dtype int64 \\
          --loss next-token --estimate --budget 2GiB
    $ remat plan remat.models.gpt:gpt --input-shape 8,256 --input-dtype int64 --max-batch --budget 300MiB
    $ remat plan remat.models.gpt:gpt --input-shape 8,256 --input-dtype int64 --budget 60% \
          --options keep,recompute,selective,output      # whole blocks only, no children
    $ remat plan remat.models.llama:llama --arg layers=16 --input-shape 1,1024 --input-dtype int64 \\
          --loss next-token --estimate --world-size 8 --parallelize tp --budget 4GiB
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from remat.cli.profile import (
    OPTIMIZERS,
    add_model_arguments,
    add_rank_arguments,
    call_factory,
    input_dtype,
    load_factory,
    make_inputs,
    parse_kwargs,
    parse_shape,
    rank_options,
)
from remat.planner import FAMILIES, OPTIONS, parse_budget

API = "remat plan"
#: The anchors the planner is compared with, in plot order.
STRATEGIES = ("no recompute", "per-block checkpointing", "sqrt(n) segments", "selective policy")


def add_parser(subparsers: Any) -> None:
    """Register ``remat plan`` on the ``remat`` command line."""
    parser = subparsers.add_parser("plan", help="choose what to recompute for a memory budget",
                                   description=__doc__.splitlines()[0])
    add_model_arguments(parser, "remat.models.gpt:gpt")
    parser.add_argument("--loss", choices=("sum", "next-token"), default="sum",
                        help="loss on the output: sum, or next-token cross-entropy for logits")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                        help="optimizer of the step: adam (default), adamw, sgd or none")
    parser.add_argument("--budget", type=_budget_arg,
                        help="peak budget: '60%%' or 0.6 (of the no-recompute peak), '6GiB', "
                             "'512MB' or bytes, read as remat.plan reads it")
    parser.add_argument("--estimate", action="store_true",
                        help="plan on fake tensors: nothing allocated, times from FLOPs (roofline)")
    parser.add_argument("--device", help="device of the roofline for --estimate (cpu, cuda)")
    parser.add_argument("--throughput", type=float, help="FLOP/s of that device for --estimate")
    parser.add_argument("--options", default=",".join(OPTIONS),
                        help="option families the plan may use, comma-separated (default: "
                             f"{','.join(OPTIONS)}; 'children' marks parts of blocks; 'staged' "
                             f"re-runs the 'ops' min-cut options in two stages, only when listed)")
    add_rank_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a Pareto PNG (peak against step time) of the anchors and a budget sweep")
    parser.add_argument("--sweep", type=int, default=8, help="planner budgets in --plot (default 8)")
    parser.add_argument("--max-batch", action="store_true",
                        help="find the largest batch (dimension 0 of the inputs) each strategy fits in --budget")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed pairs (with the unmarked model) per measured point")
    parser.add_argument("--micro-batches", type=int, default=1, metavar="N",
                        help="plan the loop that splits the batch (dimension 0) in N micro-batches, "
                             "a backward each, as gradient accumulation does (default 1)")
    parser.add_argument("--step", metavar="MODULE:FUNCTION",
                        help="plan your loop's body instead: step(model, batch) runs forward and "
                             "backward (or returns the loss); batch is the tuple of inputs")
    parser.set_defaults(run=run)


class Setup:
    """The model, its inputs and loss as the command line describes them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.factory = load_factory(args.factory, API)
        self.kwargs = parse_kwargs(args.arg)
        self.shapes = [parse_shape(s) for s in args.input_shape]
        self.dtype = input_dtype(args.input_dtype, self.build, self.shapes)
        self.optimizer = None if args.optimizer == "none" else args.optimizer
        self.loss_fn = None
        self.ranks = rank_options(args, API)  # one rank of a job: the budget is the rank's
        if args.loss == "next-token":
            from remat.models.llama import next_token_loss

            self.loss_fn = next_token_loss
        self.step = _user_step(args, self.loss_fn)  # None: the standard step
        n = args.micro_batches
        if n > 1 and any(shape[0] % n for shape in self.shapes):  # before any work
            raise SystemExit(f"{API}: --micro-batches {n} does not divide the batch "
                             f"{[shape[0] for shape in self.shapes]} (dimension 0 of --input-shape)")

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return call_factory(self.factory, self.kwargs, API)

    def inputs(self, batch: int | None = None) -> tuple:
        shapes = [(batch, *s[1:]) if batch else s for s in self.shapes]
        return make_inputs(shapes, self.dtype)

    def plan(self, budgets: list, batch: int | None = None, progress: Callable | None = None) -> list:
        from remat.planner import sweep

        options = _options_arg(getattr(self.args, "options", None))
        if self.args.estimate:
            return sweep(self.build, lambda: self.inputs(batch), budgets=budgets, loss_fn=self.loss_fn,
                         optimizer=self.optimizer, device=self.args.device,
                         throughput=self.args.throughput, progress=progress, floors=True,
                         options=options, **self.ranks)
        if self.step is not None:  # the user's loop: its body and the whole batch
            return sweep(self.build(), budgets=budgets, batch=self.inputs(batch), step=self.step,
                         optimizer=self.optimizer, progress=progress, floors=True, options=options)
        return sweep(self.build(), *self.inputs(batch), budgets=budgets, loss_fn=self.loss_fn,
                     optimizer=self.optimizer, progress=progress, floors=True, options=options)

    def measure(self, mark: Callable[[torch.nn.Module], Any], batch: int | None = None,
                timed: bool = True) -> dict:
        """Peak bytes (and step ms) of the model marked by ``mark``."""
        import remat
        from remat.memory.internal import Step
        from remat.planner.internal import measure_peak

        def build() -> torch.nn.Module:
            model = self.build()
            mark(model)
            return model

        if self.args.estimate:
            report = remat.estimate(build, lambda: self.inputs(batch), loss_fn=self.loss_fn,
                                    optimizer=self.optimizer, **self.ranks)
            return {"peak_bytes": report.peak_bytes, "step_ms": None, "overhead": None}
        model = build()
        inputs = self.inputs(batch)
        # the step the plan holds its budget on: outputs alive until it ends (NOTE [The step users run])
        step = (Step(inputs=inputs, loss_fn=self.loss_fn, api=API) if self.step is None
                else Step(batch=inputs, custom=self.step, api=API))
        peak = measure_peak(model, step, optimizer=self.optimizer, fake=False)
        out = {"peak_bytes": peak, "step_ms": None, "overhead": None}
        if timed:
            out["overhead"], out["step_ms"] = self.paired_time(model, inputs)
        return out

    def paired_time(self, model: torch.nn.Module, inputs: tuple) -> tuple[float, float]:
        """Median ratio of ``model``'s step time to the unmarked model's, timed in adjacent
        pairs (robust to a busy machine), and the step time that ratio gives (ms)."""
        import statistics
        import time

        from remat.memory.internal import Step
        from remat.memory.profile import default_loss

        if not hasattr(self, "_baseline"):
            self._baseline = self.build()
        loss_fn = self.loss_fn or default_loss
        ratios, base_times = [], []

        def step(net: torch.nn.Module) -> float:
            start = time.perf_counter()
            if self.step is None:
                loss_fn(net(*inputs)).backward()
            else:
                Step(batch=inputs, custom=self.step, api=API).run(net)
            elapsed = time.perf_counter() - start
            net.zero_grad(set_to_none=True)
            return elapsed

        step(model), step(self._baseline)
        for k in range(max(1, self.args.repeat)):
            if k % 2:
                t, b = step(model), step(self._baseline)
            else:
                b, t = step(self._baseline), step(model)
            ratios.append(t / b)
            base_times.append(b)
        ratio = statistics.median(ratios)
        return ratio - 1, 1e3 * ratio * statistics.median(base_times)


def mark_strategy(model: torch.nn.Module, name: str, blocks: list[str] | None = None) -> None:
    """Mark ``model`` as anchor ``name`` of `STRATEGIES` on the planner's blocks."""
    import remat
    from remat.planner.internal import find_blocks  # the blocks remat.apply(where="blocks") marks

    named = dict(model.named_modules())
    chosen = [named[n] for n in blocks] if blocks else [m for _, m in find_blocks(model)]
    if name == "no recompute":
        return
    if name == "per-block checkpointing":
        for module in chosen:
            remat.recompute_module(module)
    elif name == "selective policy":
        for module in chosen:
            remat.recompute_module(module, policy=remat.save_compute_intensive)
    elif name == "sqrt(n) segments":  # Chen et al.: keep one output per segment of sqrt(n) blocks
        size = max(1, round(math.sqrt(len(chosen))))
        for i, module in enumerate(chosen):
            last = (i + 1) % size == 0 or i == len(chosen) - 1
            remat.recompute_module(module, output_recompute=not last)
    else:
        raise ValueError(f"{API}: unknown strategy {name!r}; choose from {STRATEGIES}")


def _progress() -> tuple[Any, Callable[[str], None]]:
    try:
        from rich.console import Console
    except ImportError:
        return None, lambda message: print(f"{message} ...", file=sys.stderr, flush=True)
    status = Console(stderr=True).status("planning")
    status.start()
    return status, lambda message: status.update(message)


def run(args: argparse.Namespace) -> int:
    """Plan for ``--budget``; with ``--plot`` or ``--max-batch``, measure the anchors too."""
    setup = Setup(args)
    if args.budget is None:
        raise SystemExit(f"{API}: give --budget (bytes, '6GiB', '60%' or a fraction)")
    budget = _budget_arg(args.budget)
    _options_arg(args.options)
    if args.max_batch:
        return _max_batch(setup, budget)
    status, say = _progress()
    try:
        result = setup.plan([budget], progress=say)[0]
    finally:
        if status is not None:
            status.stop()
    if isinstance(result, Exception):
        print(result, file=sys.stderr)
        return 1
    plan = result
    print(plan)
    print()
    if not args.estimate:
        # the peak measured again on a fresh model; the time is the planner's own measurement
        # (interleaved rounds of the same step), so the output states one overhead figure
        timed = plan.measured_overhead is None
        measured = setup.measure(plan.apply, timed=timed)
        if not timed:
            measured["overhead"] = plan.measured_overhead
        print(plan.report(measured=_Measured(**measured)))
    else:
        print(plan.report())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(plan.to_json())
        print(f"wrote {args.json}")
    if args.plot:
        points = pareto_points(setup, plan, args.sweep, progress=True)
        plot_pareto(points, args.plot, title=f"remat plan {args.factory}")
        print(f"wrote {args.plot}")
    return 0


class _Measured:
    def __init__(self, peak_bytes: int, step_ms: float | None, overhead: float | None = None) -> None:
        self.peak_bytes, self.step_ms, self.overhead = peak_bytes, step_ms, overhead


def _options_arg(text: str | None) -> tuple[str, ...]:
    """``--options``: comma-separated families of `remat.planner.OPTIONS`."""
    if text is None:
        return OPTIONS
    options = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in options if o not in FAMILIES]
    if bad:
        raise SystemExit(f"{API}: --options: unknown option(s) {', '.join(bad)}; "
                         f"choose from {','.join(FAMILIES)}")
    return options


def _user_step(args: argparse.Namespace, loss_fn: Callable | None) -> Callable | None:
    """``--step`` loaded, or ``--micro-batches N`` as a step; None for the standard step."""
    from remat.memory.profile import default_loss

    if args.micro_batches < 1:
        raise SystemExit(f"{API}: --micro-batches must be at least 1, got {args.micro_batches}")
    if args.step is not None:
        if args.micro_batches != 1 or args.estimate:
            raise SystemExit(f"{API}: --step is the whole loop body; give it without "
                             f"--micro-batches and --estimate")
        return load_factory(args.step, API)
    if args.micro_batches == 1:
        return None
    if args.estimate:
        raise SystemExit(f"{API}: --micro-batches plans a measured loop; give it without --estimate")
    n, loss = args.micro_batches, loss_fn or default_loss

    def accumulate(model: torch.nn.Module, batch: tuple) -> None:
        """The batch in ``n`` micro-batches along dimension 0, a backward each."""
        if any(t.shape[0] % n for t in batch):
            raise SystemExit(f"{API}: --micro-batches {n} does not divide the batch "
                             f"{[t.shape[0] for t in batch]} (dimension 0 of --input-shape)")
        for chunk in zip(*(t.chunk(n) for t in batch), strict=True):
            loss(model(*chunk)).backward()

    return accumulate


def _budget_arg(text: str) -> str:
    """``--budget`` (an argparse type), checked as `remat.planner.parse_budget` reads it."""
    try:
        parse_budget(text, api=API)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"{API}: ")) from None
    return text


def pareto_points(setup: Setup, plan: Any, count: int, progress: bool = False) -> list[dict]:
    """Measure every anchor and the planner over ``count`` budgets from the floor to no recompute."""
    blocks = [d.name for d in plan.decisions]
    points = []
    status, say = _progress() if progress else (None, lambda _: None)
    try:
        for name in STRATEGIES:
            say(f"measuring {name}")
            m = setup.measure(lambda model, n=name: mark_strategy(model, n, blocks))
            points.append({"strategy": name, **m})
        low, high = plan.floor_bytes, plan.no_recompute_peak_bytes
        budgets = [int(high - (high - low) * k / max(1, count - 1)) for k in range(count)]
        for p in setup.plan(budgets, progress=say):
            if isinstance(p, Exception):
                continue
            say(f"measuring the plan for {p.budget_bytes:,} bytes")
            m = setup.measure(p.apply)
            points.append({"strategy": "planner", "budget_bytes": p.budget_bytes,
                           "predicted_peak_bytes": p.predicted_peak_bytes, **m})
    finally:
        if status is not None:
            status.stop()
    return points


def plot_pareto(points: list[dict], path: str, *, title: str = "") -> None:
    """Write peak (MiB) against step time (ms) of ``points`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    planner = sorted((p for p in points if p["strategy"] == "planner"), key=lambda p: p["peak_bytes"])
    def x(p: dict) -> float:
        return 1 + (p.get("overhead") or 0)

    if planner:
        ax.plot([x(p) for p in planner], [p["peak_bytes"] / 2**20 for p in planner],
                "o-", color="tab:blue", label="remat.plan (budget sweep)")
    markers = dict(zip(STRATEGIES, "s^Dv"))
    for p in points:
        if p["strategy"] in markers:
            ax.plot([x(p)], [p["peak_bytes"] / 2**20], markers[p["strategy"]],
                    markersize=9, label=p["strategy"])
    ax.set_xlabel("step time / no-recompute step time (forward + backward, timed in adjacent pairs)")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fits(setup: Setup, strategy: str, batch: int, budget_bytes: float) -> bool:
    if strategy == "planner":
        return not isinstance(setup.plan([int(budget_bytes)], batch=batch)[0], Exception)
    peak = setup.measure(lambda m: mark_strategy(m, strategy), batch=batch, timed=False)["peak_bytes"]
    return peak <= budget_bytes


def largest_batch(fits: Callable[[int], bool], start: int) -> int:
    """The largest batch ``b`` with ``fits(b)`` (0: none), by doubling then bisection from ``start``."""
    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 20:
            return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _max_batch(setup: Setup, budget: Any) -> int:
    from remat.memory import format_bytes

    value, fractional = parse_budget(budget, api=API)
    if fractional:
        raise SystemExit(f"{API}: --max-batch needs an absolute --budget such as '2GiB'")
    if not setup.shapes:
        raise SystemExit(f"{API}: --max-batch needs --input-shape")
    start = setup.shapes[0][0]
    rows = []
    for strategy in (*STRATEGIES, "planner"):
        print(f"searching the largest batch for {strategy} ...", file=sys.stderr, flush=True)
        best = largest_batch(lambda b, s=strategy: _fits(setup, s, b, value), start)
        rows.append((strategy, best))
    print(f"largest batch within {format_bytes(value)}:")
    for strategy, best in rows:
        print(f"  {strategy:<26} {best}")
    return 0
