"""Plan for a compiled step: ``remat.compile(model, budget=...)`` (layer 4).

NOTE [Planning a compiled step]
Under ``remat.compile`` the graph pass rebuilds only what backward reads and the
compiled step allocates otherwise than the eager one (an ``output`` chain, for one,
keeps more there), so the eager cost model cannot tell what a plan costs compiled.
The compiled plan measures the compiled step instead:

1. the options are the eager planner's families, per block (whole-block marks, children,
   per-operator ``ops:`` options: NOTE [Options per operator] in ``_options.py``), from one
   traced and one tracked unmarked eager step. More children are offered than the eager
   planner measures (each dropping `WIDE_SHARE` of the block's kept bytes, up to
   `WIDE_LIMIT`; and the single-operator children, norms and activations, together):
   an option costs a compile here, and in graph mode such a child is rebuilt alone, cheaply;
2. each option is compiled with every block that has it marked alike, and so is the
   unmarked model; each compiled step's peak comes from the allocator's own events
   (`remat._graph.internal.allocation_peak`: the tracker cannot see into compiled
   code), its time from interleaved rounds (the median);
3. the model is separable: block ``i`` under option ``o`` saves ``(P_keep - P_o) / n_o`` of
   the peak (``n_o`` the blocks that run marked in option ``o``'s run) for ``W_o / n_o``
   seconds, ``W_o`` what the option's copies in backward compute: their FLOPs, and their
   bytes and nodes (the graph pass's report), on the device's roofline (a matrix product, an
   addition and a one-element operator timed once), the two parts weighted by two factors
   fitted to the timed steps of all options together (``T_o - T_keep``, least squares: how
   far this model's products and pointwise operators are from the roofline). A timer's
   noise on one option moves the factors a little and every option with them, so it rarely
   reorders them. The least-time choice saving enough is the multiple-choice knapsack
   `remat.planner.solve_savings`;
4. the choice is compiled and measured; while its peak exceeds the budget, the next best
   choice is taken with the excess added to what must be saved; after six misses, the
   fastest option marking every block alike whose own compiled run fits is taken (the loop
   the eager planner runs too: NOTE [Solve, measure, lower the target] in ``_loop.py``).

NOTE [Modules outside the blocks]
What runs outside the blocks (a final norm, an embedding, a head) keeps bytes too, and
torch's partitioner rebuilds its cheap operators as it does the blocks'. Each largest
module outside the blocks that runs once and keeps bytes in the unmarked step is one more
item of the knapsack, with one option: ``output`` for a single operator (a norm: its
output is rebuilt in backward, not kept for the head's product), ``recompute`` for a module
with children. It is measured like a block's option (one compile with it marked, its peak
and its copies), and a plan names it only when it is marked.

Each option compiles the model's forward code anew; Dynamo keeps one cache entry per
compiled copy and, past its recompile limit (8), silently runs the code eagerly. The
limit is raised while planning, a run that did not compile is refused, and the caches
are reset after (``torch.compiler.reset()``), so the model compiled last starts clean.

The budget is the compiled step's peak: the bytes alive when the step starts (parameters,
buffers, the inputs) plus the most the step allocates above them (forward, loss,
backward and the gradients; the optimizer's step is the user's, outside the compiled
model). A fraction scales the unmarked compiled step's peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat._front.marks import marked_modules
from remat._graph import compile as graph_compile
from remat.memory import format_bytes
from remat.memory.internal import Step, StepFn, local_nbytes
from remat.memory.profile import measure
from remat.planner._budget import parse_budget
from remat.planner._compiled_runs import Run, build_run, interleaved, machine
from remat.planner._loop import fit, let_go
from remat.planner._options import inner_options
from remat.planner._plan import Decision, Plan, _check_step, _step
from remat.planner._result import Measured
from remat.planner._settings import Settings, Solving
from remat.planner._solve import BLOCK_OPTIONS, OPTIONS, STAGED, BudgetError, Choice, solve_savings
from remat.planner._trace import find_blocks, trace

API = "remat.compile"
#: children offered inside a block when planning a compiled step: those dropping this share of
#: the block's kept bytes, at most this many (wider than the eager planner's: NOTE [Planning a
#: compiled step])
WIDE_SHARE = 0.03
#: the option families a compiled plan may use: the eager planner's but ``staged``
COMPILED_OPTIONS = OPTIONS
WIDE_LIMIT = 4


def plan_compiled(model: torch.nn.Module, *example_inputs: Any, budget: float | str, batch: Any = None,
                  loss_fn: Callable | None = None, step: StepFn | None = None,
                  options: Sequence[str] = COMPILED_OPTIONS, backend: str = "aot_eager", rounds: int = 5,
                  blocks: Any = None, progress: Callable[[str], None] | None = None) -> Plan:
    """A `remat.Plan` whose peak is held by the step compiled with ``remat.compile``
    (NOTE [Planning a compiled step]); the arguments as [`remat.compile`][remat.compile]'s."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{API}: budget= plans a torch.nn.Module, got {type(model).__name__}; "
                        f"compile a function without budget=, or pass the model")
    if marked_modules(model):
        raise ValueError(f"{API}: {type(model).__name__} already has recompute marks on "
                         f"{sorted(marked_modules(model))[:3]}; call remat.unmark(model) first, "
                         f"or compile without budget= to keep your marks")
    if not example_inputs and batch is None:
        raise TypeError(f"{API}: budget= needs the step's inputs to measure it: "
                        f"example_inputs=(x,) or batch={{...}}")
    value, fractional = parse_budget(budget, api=API)
    bad = [o for o in options if o not in OPTIONS]
    if bad:
        why = (" (a staged re-run is an eager option: the compiled step's backward rebuilds each "
               "operator where it reads it already)" if STAGED in bad else "")
        raise ValueError(f"{API}: unknown option(s) {bad}{why}; choose from {OPTIONS}")
    _check_step(example_inputs, batch, loss_fn, step)
    made = _step(example_inputs, batch, loss_fn, step)
    settings = Settings(step=made, optimizer=None, blocks=blocks,
                        options=tuple(dict.fromkeys(("keep", *options))), solving=Solving(verify=False), repeat=0,
                        progress=progress)
    import torch._dynamo.config as dynamo_config

    # Every option compiles the model's forward code anew (one Dynamo cache entry each): past
    # the recompile limit Dynamo would run the rest eagerly, unmeasured. The limit is raised
    # while planning and the caches are reset after (NOTE [Planning a compiled step]).
    try:
        with dynamo_config.patch(recompile_limit=1024, accumulated_recompile_limit=4096):
            return _plan(model, example_inputs, batch, made, settings, value, fractional, backend, rounds)
    finally:
        torch.compiler.reset()
        let_go()  # NOTE [What planning leaves behind]


def _plan(model: torch.nn.Module, example_inputs: tuple, batch: Any, made: Step, settings: Settings,
          value: float, fractional: bool, backend: str, rounds: int) -> Plan:
    """The plan of NOTE [Planning a compiled step]: the options from the unmarked eager step
    (1), each compiled and measured (2), the separable model's least-time choice saving enough
    (3), measured until one fits (4)."""
    start = time.perf_counter()
    items = _items(model, example_inputs, batch, made, settings)

    def build(choices: dict[str, str]) -> Run:
        return build_run(model, made, backend, items.base, choices)

    runs, marked = _compile_options(items, build, settings.say)
    settings.say(f"timing the {len(runs)} compiled options, interleaved")
    times = interleaved(made, runs, rounds)
    keep = runs["keep"]
    target = value * keep.peak if fractional else value
    columns = list(runs)
    saving = _savings(runs, marked, items)
    compute, memory, extra = _extra_times(model, runs, times, marked, len(items.items))
    floor = min(r.peak for r in runs.values())

    def measured_peak(choice: tuple[int, ...]) -> int:
        choices = {name: columns[c] for name, c in zip(items.items, choice, strict=True) if c}
        settings.say(f"measuring the compiled plan for {format_bytes(target)}")
        return keep.peak if not choices else build(choices).peak

    # NOTE [Solve, measure, lower the target]: a choice measured over the budget is never
    # solved for again (the separable model erred: save the excess more, never this one)
    choice, measured, _ = fit(
        target, lambda lowered, rejected: solve_savings(saving, extra, keep.peak - lowered, exclude=rejected),
        measured_peak, lambda _over: _uniform(runs, times, columns, items.allowed, items.items, target),
        lambda _over, _exhausted: _budget_error(target, floor, keep.peak))
    return Plan(decisions=_decisions(items, columns, choice, saving, extra), budget_bytes=int(target),
                predicted_peak_bytes=int(keep.peak - sum(saving[i][c] for i, c in enumerate(choice))),
                predicted_extra_s=sum(extra[i][c] for i, c in enumerate(choice)),
                step_s=times["keep"], no_recompute_peak_bytes=keep.peak,
                floor_bytes=floor, measured=Measured(peak_bytes=measured),
                solver="compiled knapsack", solve_s=time.perf_counter() - start,
                timing=f"compiled ({backend}): copies' FLOPs x{compute:.2f} and bytes x{memory:.2f} "
                       f"on the roofline, fitted to every option's timed step")


@dataclass(frozen=True)
class _Items:
    """The compiled plan's knapsack: its items and the options each allows, and what the
    unmarked eager step tells of them.

    Args:
        names: the blocks, in call order.
        items: the blocks, then the modules outside them (NOTE [Modules outside the blocks]).
        allowed: per item, its options (``"keep"`` first).
        options: every option to compile, in order (a module outside: ``"<module>=<option>"``).
        types: per item, its class name.
        kept_unmarked: per item, the bytes the eager tracker counts it keeping unmarked.
        base: the bytes alive when the step starts (parameters, buffers, the inputs).
    """

    names: list[str]
    items: list[str]
    allowed: dict[str, list[str]]
    options: list[str]
    types: list[str]
    kept_unmarked: list[float]
    base: int


def _items(model: torch.nn.Module, example_inputs: tuple, batch: Any, made: Step,
           settings: Settings) -> _Items:
    """The knapsack's items and their options (NOTE [Planning a compiled step], 1)."""
    chosen = find_blocks(model, settings.blocks)
    # the options, from the unmarked eager step (traced once, tracked once): whole blocks, and
    # inside them more children than the eager planner measures (each compiled option costs a
    # compile, not a tracked run per option) and the cheap single operators together
    settings.say("tracing blocks")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        traced = trace(model, chosen, settings)
        report = measure(model, made.inputs, step=made, optimizer=None, api=API)
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
    rows = {r.name: r for r in report.rows}
    names = traced.names
    inner = inner_options(traced, rows, settings.options, share=WIDE_SHARE, limit=WIDE_LIMIT,
                          operators=True)
    allowed = {name: [o for o in settings.options if o in BLOCK_OPTIONS
                      and (o != "output" or traced.chain[k])] + inner[name]
               for k, name in enumerate(names)}
    options = list(dict.fromkeys(o for name in names for o in allowed[name]))
    # NOTE [Modules outside the blocks]: each is one more item of the knapsack, with one option
    outside = _outside(model, names, rows) if {"recompute", "output"} & set(settings.options) else {}
    for name, option in outside.items():  # a column of its own: "<module>=<option>"
        allowed[name] = ["keep", str(Choice(option, module=name))]
        options.append(allowed[name][1])
    items = [*names, *outside]
    named = dict(model.named_modules())
    base = sum(local_nbytes(t) for t in (*model.parameters(), *model.buffers())) + sum(
        local_nbytes(t) for t in _tensors((example_inputs, batch)))
    return _Items(names=names, items=items, allowed=allowed, options=options,
                  types=[type(named[name]).__name__ for name in items],
                  kept_unmarked=[float(rows[name].kept) for name in items], base=base)


def _compile_options(items: _Items, build: Callable[[dict[str, str]], Run],
                     say: Callable[[str], None]) -> tuple[dict[str, Run], dict[str, int]]:
    """Each option compiled with every item allowing it marked (``"keep"``: none): the runs,
    and how many items each marks (NOTE [Planning a compiled step], 2)."""
    runs: dict[str, Run] = {}
    marked: dict[str, int] = {}
    for option in items.options:
        having = {name: option for name in items.items if option in items.allowed[name]}
        if option != "keep" and not having:
            continue
        say(f"compiling '{option}' on {len(having) if option != 'keep' else 0} blocks")
        runs[option] = build({} if option == "keep" else having)
        marked[option] = len(having)
    return runs, marked


def _savings(runs: dict[str, Run], marked: dict[str, int], items: _Items) -> list[list[float | None]]:
    """Per item and option (the columns of ``runs``), the bytes of the peak it saves: its
    run's saving shared among the items the run marks (None: not an option of the item)."""
    keep = runs["keep"]
    saving = [[(keep.peak - runs[o].peak) / marked[o] if o == "keep" or o in items.allowed[name] else None
               for o in runs] for name in items.items]
    for row in saving:
        row[0] = 0.0
    return saving


def _extra_times(model: torch.nn.Module, runs: dict[str, Run], times: dict[str, float],
                 marked: dict[str, int], count: int) -> tuple[float, float, list[list[float]]]:
    """The factors of FLOPs and of bytes fitted to the options' timed steps, and per item (of
    ``count``) and option the seconds its copies cost (NOTE [Planning a compiled step], 3)."""
    # Time: what each option's copies compute, on the device's roofline, weighted by two factors
    # fitted to all the options' timed steps at once (a timer's noise on one option cannot
    # reorder the options: NOTE [Planning a compiled step])
    columns = list(runs)
    figures = machine(next((p.device for p in model.parameters()), torch.device("cpu")))
    parts = {o: runs[o].parts(figures) for o in columns}
    gained = {o: times[o] - times["keep"] for o in columns if o != "keep"}
    compute, memory = _fit(parts, gained)
    work = {o: compute * parts[o][0] + memory * parts[o][1] for o in columns}
    return compute, memory, [[work[o] / max(marked[o], 1) for o in columns] for _ in range(count)]


def _decisions(items: _Items, columns: list[str], choice: tuple[int, ...], saving: list,
               extra: list) -> tuple[Decision, ...]:
    """The plan's decisions: every block's, and each module outside the blocks that the choice
    marks; a block's kept bytes the eager tracker's unmarked figure less the compiled saving."""
    return tuple(Decision(name, items.types[i], str(Choice.parse(columns[c]).without_module()),
                          max(0.0, items.kept_unmarked[i] - saving[i][c]), extra[i][c])
                 for i, (name, c) in enumerate(zip(items.items, choice, strict=True))
                 if name in items.names or c)  # a module outside the blocks: only when marked


def _uniform(runs: dict[str, Run], times: dict[str, float], columns: list[str],
             allowed: dict[str, list[str]], items: list[str], target: float) -> tuple[tuple[int, ...], int] | None:
    """When the separable model keeps erring: the fastest option marking every block alike
    whose own compiled run (measured while planning) fits ``target``, as a choice with its
    peak; None if none fits."""
    fits = [o for o in columns[1:] if runs[o].peak <= target]
    if not fits:
        return None
    best = min(fits, key=lambda o: (times[o], columns.index(o)))
    return tuple(columns.index(best) if best in allowed[name] else 0 for name in items), runs[best].peak


def _budget_error(target: float, floor: int, no_recompute: int) -> BudgetError:
    """No compiled plan measured within ``target``; ``floor``: the lowest compiled peak measured."""
    return BudgetError(
        f"{API}: no plan measured within a budget of {format_bytes(target)} ({target:,.0f} "
        f"bytes) for the compiled step; the lowest compiled peak measured is "
        f"{format_bytes(floor)} ({floor:,} bytes; no recompute: {format_bytes(no_recompute)}); "
        f"raise the budget or shrink the batch", budget_bytes=target, floor_bytes=floor)


def _outside(model: torch.nn.Module, blocks: Sequence[str], rows: dict) -> dict[str, str]:
    """The modules outside the blocks a compiled plan may mark (NOTE [Modules outside the
    blocks]): ``{name: option}`` for each largest module that neither holds nor sits in a
    block, runs once and keeps bytes in the unmarked step; ``"output"`` for a single operator
    (its output rebuilt too), ``"recompute"`` for a module with children."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or any(name == b or name.startswith(b + ".") or b.startswith(name + ".") for b in blocks):
            continue
        if any(name.startswith(f + ".") for f in found):
            continue
        row = rows.get(name)
        if row is None or row.calls != 1 or row.kept <= 0:
            continue
        found[name] = "recompute" if next(module.children(), None) is not None else "output"
    return found


def _fit(parts: dict[str, tuple[float, float]], gained: dict[str, float]) -> tuple[float, float]:
    """``(a, b)`` of ``gained[o] ~ a * parts[o][0] + b * parts[o][1]``, least squares over every
    option at once, each factor kept in [1/4, 8] (the roofline is off by that much at most)."""
    def clamp(x: float) -> float:
        return min(8.0, max(0.25, x))

    keys = list(gained)
    sxx = sum(parts[o][0] ** 2 for o in keys)
    syy = sum(parts[o][1] ** 2 for o in keys)
    sxy = sum(parts[o][0] * parts[o][1] for o in keys)
    sxg = sum(parts[o][0] * gained[o] for o in keys)
    syg = sum(parts[o][1] * gained[o] for o in keys)
    det = sxx * syy - sxy * sxy
    if det > 1e-12 * max(sxx * syy, 1e-300):
        a, b = (sxg * syy - syg * sxy) / det, (syg * sxx - sxg * sxy) / det
        if a > 0 and b > 0:
            return clamp(a), clamp(b)
    total = sxx + syy + 2 * sxy  # one factor for both parts
    one = (sxg + syg) / total if total else 1.0
    return clamp(one), clamp(one)


def _tensors(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def compile(model_or_fn: Any, *, backend: str = "aot_eager", save_graphs: str | None = None,
            fullgraph: bool = False, dynamic: bool | None = None, budget: float | str | None = None,
            example_inputs: Sequence[Any] = (), batch: Any = None, loss_fn: Callable | None = None,
            step: StepFn | None = None, options: Sequence[str] = COMPILED_OPTIONS, rounds: int = 5,
            progress: Callable[[str], None] | None = None) -> Any:
    """Compile a model or a training-step function with MindSpore's graph-mode recomputation;
    with ``budget=``, plan what to recompute for that peak and compile, in one call.

    ``torch.compile`` with a backend whose partitioner applies every remat mark
    (``Cell.recompute``, ``remat.recompute_module``, ``remat.apply``, primitives
    of ``remat.ops``, ``remat.checkpoint`` and ``remat.recompute`` called inside,
    ``output_recompute``, selective and per-call policies) on the joint forward/backward
    graph: marked forward operators are not saved for backward; their copies run in the
    backward graph right before the gradient operators that need them. What no mark
    covers is partitioned by torch's min-cut, as ``torch.compile`` partitions it: an
    unmarked model compiles to ``torch.compile(backend="aot_eager")``'s own partition
    (cheap operators rebuilt where that saves memory, a read of a buffer the forward
    updates always kept).

    With ``budget``, the model must be unmarked: each option of `remat.plan` (whole
    blocks, children, per-operator ``ops:`` options) is compiled and its step measured
    (peak from the allocator's events, time in interleaved rounds), the fastest choice
    whose compiled peak fits is chosen, measured again, and its marks set on the model
    before it is compiled (NOTE [Planning a compiled step] in ``planner/_compiled.py``).
    Planning compiles the model once per option, then resets ``torch.compile``'s caches
    (``torch.compiler.reset()``): other compiled code recompiles at its next call.

    Args:
        model_or_fn: a ``torch.nn.Module``, or a function calling modules (found through
            its closure, the globals it names, ``self`` of a bound method, or its arguments).
        backend: ``"aot_eager"`` (graphs run as traced; works everywhere) or
            ``"inductor"`` (needs a C++ compiler on CPU).
        save_graphs: a directory; when given, every compiled graph is dumped there at
            each stage (``graph<k>_00_captured``, ``_01_recompute``, ``_02_cse``,
            ``_03_forward``, ``_04_backward``; ``.ir`` text and ``.dot`` Graphviz).
        fullgraph: passed to ``torch.compile`` (True: fail on graph breaks).
        dynamic: passed to ``torch.compile``.
        budget: the compiled step's peak: bytes (int, ``"6GiB"``) counting the parameters,
            buffers and inputs alive when it starts, or a fraction of the unmarked compiled
            step's (``0.6``, ``"60%"``), read as `remat.planner.parse_budget` reads it.
        example_inputs: the model's positional inputs for the measured steps (with ``budget``).
        batch: its keyword inputs, or ``step``'s batch, as for `remat.plan`.
        loss_fn: ``loss_fn(output) -> scalar``, as for `remat.plan`.
        step: ``step(model, batch) -> loss``, the loop's body, as for `remat.plan`.
        options: the option families, as for `remat.plan`.
        rounds: interleaved timing rounds of the compiled options.
        progress: called with a short message at each planning stage.

    Returns:
        The compiled module or function. Its ``remat_reports`` attribute lists one
        report per compiled graph (copied nodes, saved activation bytes, dump files);
        with ``budget``, ``remat_plan`` is the `remat.Plan` applied.

    Raises:
        ValueError: an unknown ``backend``; with ``budget``, a model already marked, a
            malformed budget or option.
        TypeError: ``model_or_fn`` is not callable; planning options without ``budget``;
            ``budget`` for a function, or without inputs.
        remat.BudgetError: no compiled plan measured within ``budget``.

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> _ = remat.recompute_module(net[1], output_recompute=True)
        >>> compiled = remat.compile(net)
        >>> compiled(torch.randn(3, 4, requires_grad=True)).sum().backward()
        >>> compiled.remat_reports[0].duplicated
        [('relu_recompute', 'aten::relu', '1 (ReLU)')]

        Planned for 70% of the unmarked compiled step's peak, then compiled:

        >>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256),
        ...     torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4)])
        >>> x = torch.randn(256, 64)
        >>> fast = remat.compile(blocks, budget=0.7, example_inputs=(x,), rounds=1)
        >>> fast.remat_plan.measured_peak_bytes <= fast.remat_plan.budget_bytes
        True
    """
    if budget is None:
        given = {"example_inputs": example_inputs != (), "batch": batch is not None,
                 "loss_fn": loss_fn is not None, "step": step is not None,
                 "options": tuple(options) != COMPILED_OPTIONS, "rounds": rounds != 5, "progress": progress is not None}
        named = [k for k, v in given.items() if v]
        if named:
            raise TypeError(f"{API}: {named[0]}= plans the recompute for a budget; give budget= "
                            f"too (e.g. budget=0.6), or leave it out to compile the marks as set")
        return graph_compile(model_or_fn, backend=backend, save_graphs=save_graphs,
                             fullgraph=fullgraph, dynamic=dynamic)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"{API}: rounds must be a positive int, got {rounds!r}")
    plan = plan_compiled(model_or_fn, *tuple(example_inputs), budget=budget, batch=batch,
                         loss_fn=loss_fn, step=step, options=options, backend=backend, rounds=rounds,
                         progress=progress)
    plan.apply(model_or_fn)
    compiled = graph_compile(model_or_fn, backend=backend, save_graphs=save_graphs,
                             fullgraph=fullgraph, dynamic=dynamic)
    object.__setattr__(compiled, "remat_plan", plan)
    return compiled
