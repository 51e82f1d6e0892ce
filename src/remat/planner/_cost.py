"""The planner's cost model: what each block keeps and costs under each option (layer 4).

Memory comes from the tracker (`remat.memory.profile.measure`, on real or
fake tensors): one step with no marks and one step per option with every block
marked alike give each block's kept bytes under each option. Time per block is
its measured forward time, or on fake tensors a roofline estimate (FLOPs over
``throughput`` plus bytes moved over ``bandwidth``); the selective option costs
the share of a block's operators that ``save_compute_intensive`` does not keep
(by measured operator times on CPU tensors, by the roofline otherwise).
See NOTE [Plan cost model] in ``_solve.py`` for how these make a peak.

NOTE [Planning a rank]
A plan for one rank of a job (``world_size=``, ``parallelize=``) cannot mark a
model in place and measure it: marks go on before ``parallelize``, which
shards the model (NOTE [Estimating a rank]). So every run of the cost model,
and every verification, builds a fresh model with a `Builder`: build,
truncate a container of identical blocks when composing, mark, parallelize.
The model the blocks are found in is an unsharded one, never run. Bytes are
this rank's: parameters and gradients by their local shard.

NOTE [Options inside blocks]
Besides marking a whole block, an option may mark some of its children (family
``children``, named ``"children:attn"``, ``"children:attn+fc+gelu"``). A child with
submodules (a transformer block's attention or MLP) gets a cell mark: its inputs and
output kept, its internals rebuilt; a single operator (a ``Linear``, a ``GELU``) gets
``output_recompute``, an operator mark: its output is kept by nobody and rebuilt from
its input, and adjacent ones merge into a chain. So a plan keeps the block's input
and the children's boundaries, and re-runs only the children, not the whole block.

Which children: those that run once per step and whose mark would drop, by the
unmarked run's figures, at least `CHILD_SHARE` of the block's kept bytes (a cell: what it keeps
beyond its output; an operator: what it keeps), the `MAX_CHILDREN` largest; not
an operator whose output is the block's own (it would be rebuilt in the next block's
backward, where an FSDP2 unit has resharded its parameters). Each gets an option
alone, and all of them one together. Like every option, each is measured by one run
with every block that has those children marked alike: the tracker
gives the bytes kept, the run's peak what the block's backward holds, its timed step
the calibration of the children's forward times (a roofline on fake tensors; an
operator mark counts two runs: one hands its output to whoever saved it, one rebuilds
what it saved itself, NOTE [Output pass]). Blocks of different classes bring their own
columns; a block lacks the others.

NOTE [Options per operator]
Between ``recompute`` (keep nothing inside a block) and ``selective`` (keep every
matrix product, convolution and attention) lie the per-operator options, family
``ops``: the block marked with [`remat.save_calls`][remat.save_calls], keeping the outputs of the
calls named (``"ops:aten::addmm#3+aten::mm#0"``, NOTE [Counting calls] in
``remat/_vocab/policy.py``) and rebuilding the rest. The candidates are a block's
calls of `remat._vocab.policy.COMPUTE_INTENSIVE_OPS` whose output backward reads (a
saved-tensor hook of the unmarked traced run sees it saved), numbered by that run as the
engine numbers them; ranked by roofline cost per byte of output
(FLOPs and bytes moved: the same ranking run after run, whatever the timer says) and
cut at `OPS_SHARES` of their number and all of them, as torch's knapsack would keep
the dearest per byte first. Each option is then measured like every other: one tracked run with every
block that has it marked alike (bytes kept, peak) and its timed step (calibration); its
forward time is the block's less that of the calls kept (a re-run runs all the others).
Each level also keeps the block's reductions with a small result (`REDUCTIONS`, such
as an RMSNorm's mean, an eighth of its input or less) and one option keeps only those:
next to no memory, and what depends on them (a norm's square, its reduction) is not rebuilt.
Reductions have no in-place forms, so the eager engine and the graph pass number them alike.
The same policy is applied by ``remat.compile``'s graph pass, which numbers the calls alike.

NOTE [Options cut by min-cut]
The ranked options keep products and reductions only, so a value backward reads that a
cheap operator makes from a product (a rotary embedding of a query, a residual sum) is
rebuilt by re-running the product. The min-cut options keep, of every call of the block,
the fewest bytes from which backward rebuilds all it reads while re-running only what
it may: the traced unmarked run records each call (``_Ops.nodes``: its output bytes, the
calls of the same block it reads, storage by storage), and which outputs the block's own
backward reads (the saved-tensor hook, while the block runs); `remat.planner._solve.
min_cut_keep` then solves the cut with the block's small reductions and a share
(`CUT_SHARES`) of its products, convolutions and attentions, dearest per byte first,
banned from re-running. Its cut nearest the backward keeps a rotary embedding's output
rather than the product before it, and a residual sum rather than the product it adds:
the same bytes, less to re-run. This is what torch's min-cut partitioner does for a whole
graph, here per block, as options the cost model measures like any other (their bytes and
peaks from tracked runs, their times timed or fitted): the cut only proposes them.
The engine does not number in-place and ``out=`` calls, and the graph pass (functionalized)
numbers their functional forms (NOTE [Counting calls]): such a call is a node of its own
that no option keeps, reading what it reads and making what it writes into and returns;
the call that made a value written into is never kept either (a dropout mask filled in
place by ``bernoulli_``), nor any call of the operator's functional form (``div`` where the
block runs ``div_``). Nor is a random operator's output (NOTE [Kept random operators] in
``remat/_engine/selective.py``: a kept one still draws in recomputation, so keeping it
buys nothing). A level whose cut would keep one of them gives no option.

NOTE [Plans timing noise cannot flip]
On real tensors the times are measured: each block's forward, each child's, each
operator's on CPU, and each option's whole step (the calibration of its family). Two
plans whose times differ by less than the timer's noise then swap places run after run,
though each is measured as fast as the other (on the README's GPT: three plans in five
runs). So the options are ranked by times that do not move: the same model's operators
costed by FLOPs and bytes (the roofline the fake-tensor planner uses, from the warm-up
trace, which the timed trace needed anyway), plus the engine's share of each call, which
FLOPs and bytes miss and which dominates small tensors (`RERUN_CALL_S` per call
re-run, `POLICY_CALL_S` per call under a per-call policy: without it, ``selective``
looked cheap and the README's GPT got a plan whose predictions missed by up to half),
under the rules every time follows here (an ``output`` block or an operator mark re-runs
twice). The solver chooses on those
(``BlockCosts.problem(ranking=True)``); the measured, calibrated times then predict the
chosen plan's extra time (``Plan.predicted_extra_s``). Memory is measured either way,
and bytes do not jitter: the same model, inputs and budget give the same plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat._engine.rng import drew, generator_states
from remat._front import blocks as _blocks
from remat._front.marks import unmark_module
from remat._vocab.policy import COMPUTE_INTENSIVE_OPS, call_key, save_compute_intensive
from remat.memory.internal import (
    Step,
    local_nbytes,
    local_storages,
    look_away_from_sharding_propagation,
    signature,
    truncated,
)
from remat.memory.profile import OptimizerLike, make_optimizer, measure, prime_optimizer
from remat.planner._settings import Settings, child_mark, children_in, mark_choices
from remat.planner._solve import (
    BLOCK_OPTIONS,
    CHILDREN,
    OPS,
    OUTPUT,
    RECOMPUTE,
    Problem,
    evaluate,
    min_cut_keep,
)

API = "remat.plan"
#: a child gets options when its mark would drop this share of its block's kept bytes
CHILD_SHARE = 0.1
#: at most this many children of a block get options (each alone, then all together)
MAX_CHILDREN = 3
#: the per-operator options of a block keep these shares of its candidate calls (NOTE
#: [Options per operator]), and all of them
OPS_SHARES = (0.25, 0.5, 0.75)
#: reductions whose result, when small, per-operator options keep (NOTE [Options per operator])
REDUCTIONS = frozenset({"aten::mean", "aten::sum", "aten::amax", "aten::amin", "aten::var",
                        "aten::var_mean", "aten::std", "aten::linalg_vector_norm", "aten::norm"})
#: a reduction's result is small when its input has this many times as many elements at least
SMALL = 8


def ops_options(calls: Mapping[str, tuple[float, float]], small: Sequence[str] = ()) -> list[str]:
    """The ``ops:`` options of one block from its candidate calls ``{key: (rank cost, bytes)}``
    in call order (NOTE [Options per operator]): the calls whose outputs are dearest to
    rebuild per byte kept, the most expensive first, cut at `OPS_SHARES` of their number,
    and all of them (unlike ``selective``, none whose output backward does not read); each with
    the ``small`` results (reductions such as a norm's mean) kept too, and those alone.

    Examples:
        >>> ops_options({"aten::mm#0": (1.0, 4), "aten::mm#1": (8.0, 4), "aten::bmm#0": (2.0, 8),
        ...              "aten::mm#2": (0.5, 4)})
        ['ops:aten::mm#1', 'ops:aten::mm#0+aten::mm#1', 'ops:aten::bmm#0+aten::mm#0+aten::mm#1', 'ops:aten::bmm#0+aten::mm#0+aten::mm#1+aten::mm#2']
        >>> ops_options({"aten::mm#0": (1.0, 4)}, small=["aten::mean#0"])
        ['ops:aten::mean#0', 'ops:aten::mean#0+aten::mm#0']
    """
    order = list(calls)
    ranked = sorted(order, key=lambda k: (-calls[k][0] / max(calls[k][1], 1.0), order.index(k)))
    sizes = sorted({round(len(ranked) * share) for share in OPS_SHARES} & set(range(1, len(ranked)))
                   | ({len(ranked)} if ranked else set()))
    levels = [sorted({*small, *ranked[:size]}) for size in ([0] if small else []) + sizes]
    return [f"{OPS}:{'+'.join(keys)}" for keys in levels]


#: the shares of a block's matrix products, convolutions and attentions (the dearest to
#: rebuild per byte first) that its min-cut options never re-run (NOTE [Options cut by min-cut])
CUT_SHARES = (0.5, 1.0)


def cut_options(nodes: Mapping[str, tuple[int, Sequence[str]]], needed: Iterable[str],
                intensive: Mapping[str, tuple[float, float]], small: Sequence[str] = (),
                fixed: Iterable[str] = ()) -> list[str]:
    """The ``ops:`` options of one block that keep the fewest bytes from which backward rebuilds
    what it reads without re-running a banned call (NOTE [Options cut by min-cut]).

    Args:
        nodes: the block's calls in call order, ``{key: (output bytes, keys of the calls read)}``.
        needed: the calls whose output the block's backward reads.
        intensive: its matrix products, convolutions and attentions, ``{key: (roofline cost,
            output bytes)}``: at each level of `CUT_SHARES` the dearest per byte are banned.
        small: its reductions with a small result, always banned (kept when needed).
        fixed: calls no option may keep (a value written into in place, the write itself, an
            operator whose functional form the graph pass counts apart); a level that can only
            be cut by keeping one gives no option.

    Examples:
        >>> nodes = {"aten::mm#0": (8, []), "aten::mul#0": (8, ["aten::mm#0"]),
        ...          "aten::add#0": (8, ["aten::mul#0"]), "aten::mm#1": (8, ["aten::add#0"])}
        >>> cut_options(nodes, ["aten::add#0", "aten::mm#1"], {"aten::mm#0": (2.0, 8), "aten::mm#1": (1.0, 8)})
        ['ops:aten::add#0', 'ops:aten::add#0+aten::mm#1']
    """
    keys = list(nodes)
    where = {key: i for i, key in enumerate(keys)}
    ranked = sorted(intensive, key=lambda k: (-intensive[k][0] / max(intensive[k][1], 1.0), keys.index(k)
                                              if k in where else len(keys)))
    fixed = set(fixed)
    never = 1 + sum(int(nodes[k][0]) for k in keys)  # dearer than keeping every other call
    weights = [never if k in fixed else int(nodes[k][0]) for k in keys]
    found: list[str] = []
    for share in CUT_SHARES:
        banned = {*small, *ranked[:max(1, round(share * len(ranked)))]} if ranked else set(small)
        kept = min_cut_keep(weights, [[where[r] for r in nodes[k][1]] for k in keys],
                            [where[k] for k in needed if k in where], [where[k] for k in banned if k in where])
        option = f"{OPS}:{'+'.join(sorted(keys[i] for i in kept))}"
        if kept and option not in found and not any(keys[i] in fixed for i in kept):
            found.append(option)
    return found


def child_options(name: str, block: torch.nn.Module, rows: Mapping[str, Any],
                  leaving: set[str] = frozenset(), calls: int = 1, *, share: float = CHILD_SHARE,
                  limit: int = MAX_CHILDREN, operators: bool = False) -> list[str]:
    """The ``children:`` options of block ``name`` from the rows of an unmarked run
    (NOTE [Options inside blocks]); ``leaving``: children whose output is the block's;
    ``calls``: how many times the step runs each block (micro-batches); ``share``, ``limit``:
    the least share of the block's kept bytes a child must drop, the most children;
    ``operators``: also all the single-operator children together (norms, activations:
    cheap to rebuild), when that is not already an option."""
    total = rows[name].kept
    scored = []
    for order, (child, kid) in enumerate(block.named_children()):
        row = rows.get(f"{name}.{child}")
        if row is None or row.calls != calls or "+" in child or ":" in child:
            continue
        cell = next(kid.children(), None) is not None
        if not cell and child in leaving:
            continue  # rebuilt in a later block's backward (with an FSDP unit resharded)
        saving = row.kept - row.output_bytes if cell else row.kept
        if total > 0 and saving >= share * total:
            scored.append((-saving, order, child))
    chosen = [child for _, _, child in sorted(sorted(scored)[:limit], key=lambda s: s[1])]
    found = [f"{CHILDREN}:{c}" for c in chosen] + ([f"{CHILDREN}:{'+'.join(chosen)}"] if len(chosen) > 1 else [])
    kids = dict(block.named_children())
    alone = [c for c in chosen if next(kids[c].children(), None) is None]
    if operators and 1 < len(alone) < len(chosen):
        found.append(f"{CHILDREN}:{'+'.join(alone)}")
    return found


def inner_options(traced: Trace, unmarked: Mapping[str, Any], options: Sequence[str], *,
                  share: float = CHILD_SHARE, limit: int = MAX_CHILDREN,
                  operators: bool = False) -> dict[str, list[str]]:
    """Block name -> its options inside the block (``children:``, ``ops:``) from the trace
    and the unmarked run's rows (NOTE [Options inside blocks], [Options per operator])."""
    inner: dict[str, list[str]] = {name: [] for name in traced.names}
    for k, (name, block) in enumerate(traced.blocks):
        if CHILDREN in options:
            inner[name] += child_options(name, block, unmarked, traced.leaving[name], traced.calls,
                                         share=share, limit=limit, operators=operators)
        if OPS in options:
            found = traced.ops
            inner[name] += ops_options(found.candidates(traced.index[k]), found.small_results(traced.index[k]))
            inner[name] += [o for o in found.cut_options(traced.index[k]) if o not in inner[name]]
    return inner


#: Default roofline of the fake-tensor time model: FLOP/s and bytes/s (ratios matter, not units).
THROUGHPUT = {"cpu": 1e11, "cuda": 4e14}
BANDWIDTH = {"cpu": 2e10, "cuda": 2e12}


@dataclass(frozen=True)
class Ranking:
    """Per block, times from FLOPs and bytes that rank the options on real tensors (NOTE
    [Plans timing noise cannot flip]): as `BlockCosts`' fields of the same names."""

    forward_s: list[float]
    selective_s: list[float]
    child_s: list


@dataclass
class BlockCosts:
    """Measured costs of a model's blocks, in forward order (one entry per block)."""

    names: list[str]
    types: list[str]
    kept: list[list[float | None]]
    forward_s: list[float]
    selective_s: list[float]
    output_bytes: list[int]
    grad_bytes: list[int]
    chain: list[bool]
    baseline_bytes: int
    other_grad_bytes: int
    peaks: dict[str, int] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    #: per option, the highest footprint reached in each phase (``ProfileReport.phase_peaks``)
    phase_peaks: dict[str, dict] = field(default_factory=dict)
    step_s: float | None = None
    timed: str = "measured"
    transient_bytes: list = field(default_factory=list)
    optimizer_peak: int | None = None
    option_step_s: dict = field(default_factory=dict)
    time_scale: list = field(default_factory=list)
    #: the columns of ``kept``: `BLOCK_OPTIONS`, then options inside blocks
    options: list = field(default_factory=lambda: list(BLOCK_OPTIONS))
    #: per block, the forward seconds of each option inside blocks (``options[4:]``)
    child_s: list = field(default_factory=list)
    #: forwards of each block per step: above 1 (gradient accumulation), every gradient
    #: exists while the later micro-batches run, and the model counts them all
    calls: int = 1
    #: on real tensors, the times that rank the options (None: ``forward_s`` and the others do)
    ranking: Ranking | None = None

    def problem(self, *, ranking: bool = False) -> Problem:
        """The solver's problem (NOTE [Plan cost model]), calibrated on the measured peaks;
        with ``ranking``, its times are `ranking`'s, not calibrated (NOTE [Plans timing
        noise cannot flip])."""
        n = len(self.names)
        later = [sum(self.grad_bytes[i + 1 if self.calls == 1 else 0:]) for i in range(n)]
        fixed = [self.baseline_bytes + self.other_grad_bytes + g for g in later]
        keep_kept = [k[0] for k in self.kept]
        end = self.peaks["keep"] - sum(keep_kept)
        base = max((p for o, p in self.peaks.items() if self.phases.get(o) == "optimizer"), default=0)
        columns = len(self.options)
        times: Any = self.ranking if ranking and self.ranking is not None else self
        inner = times.child_s or [[]] * n
        # An ``output`` block runs twice in backward, chained or not: once to hand its output
        # to whoever saved it, once to rebuild what it saved itself (NOTE [Output pass]); timed
        # on the README's GPT, a lone output block costs what one in a chain does (2x a re-run)
        # (so a chain adds nothing: ``chain_time`` is zero)
        time_of = [[0.0, f, s, 2 * f, *c] + [0.0] * (columns - 4 - len(c))
                   for f, s, c in zip(times.forward_s, times.selective_s, inner)]
        chain_time = [0.0] * n
        # Calibration: each option's uniform run was timed too; its measured extra time over
        # the unmarked step, against the sum of forward times, scales the times of its family
        # (a re-run costs more than its forward: the engine's hooks, the policy's dispatch mode,
        # the gradients' temporaries). One factor per family, fitted to all its options at once
        # (least squares): whole blocks (``recompute``, the largest and steadiest of the timed
        # differences), re-runs of children, per-call policies (``ops:``), ``selective`` and
        # ``output`` (`_family`). A timer's noise on one option moves its family's
        # factor a little, and every option of the family with it, so it cannot make one
        # option look cheaper than another of its kind: the plan is the same run after run.
        # Children are a family apart from whole blocks: their marks cost more per second of
        # forward (more hooks, operator marks), and pooled with them they made every block
        # re-run look dearer than it is (the prediction of a plan of block re-runs, high).
        scale = [1.0] * columns
        keep_s = self.option_step_s.get("keep") if times is self else None
        fitted: dict[str, list[tuple[float, float]]] = {}
        for o in range(1, columns):
            step_s = self.option_step_s.get(self.options[o])
            if keep_s is None or step_s is None:
                continue
            choice = [o if self.kept[i][o] is not None else 0 for i in range(n)]
            raw = sum(time_of[i][c] for i, c in enumerate(choice))
            if raw > 0:
                fitted.setdefault(_family(self.options[o]), []).append((raw, step_s - keep_s))
        factor = {family: min(4.0, max(0.5, sum(r * d for r, d in pairs) / sum(r * r for r, _ in pairs)))
                  for family, pairs in fitted.items()}
        for o in range(1, columns):
            scale[o] = factor.get(_family(self.options[o]), 1.0)
        # A child's re-run pays the engine's hooks as a block's does, per second of forward
        # at least: an option inside blocks is not scaled below ``recompute``.
        for o in range(len(BLOCK_OPTIONS), columns):
            scale[o] = max(scale[o], scale[RECOMPUTE])
        if times is self:
            self.time_scale = scale
        time_of = [[t * scale[o] for o, t in enumerate(row)] for row in time_of]
        # What follows the last block (a head, a loss) runs backward with the gradients of
        # the parameters outside blocks and the blocks' kept bytes; a final chain is rebuilt there.
        tail = fixed[-1] + self.output_bytes[-1] if n else end
        # block moments only
        rough = Problem(kept=self.kept, time=time_of, rebuilt=keep_kept, fixed=fixed,
                        output=self.output_bytes, end=-float("inf"), chain_time=chain_time,
                        last_held=keep_kept, tail=-float("inf"), options=self.options)
        # Each option's uniform run tells what its backward holds beyond the rough model
        # (gradient temporaries, the rebuilt output of a cell mark): added for that option.
        gaps = [0.0] * columns
        for o in range(columns):
            if self.options[o] in self.peaks:
                choice = [o if self.kept[i][o] is not None else 0 for i in range(n)]
                gaps[o] = max(0.0, self.peaks[self.options[o]] - evaluate(rough, choice)[0])
        self.transient_bytes = gaps
        # Times on a binary grid (2**-30 s): sums of them are exact in any order, so plans of
        # equal cost are exact ties, broken the same way run after run (identical blocks)
        time_of = [[_grid(t) for t in row] for row in time_of]
        return Problem(kept=self.kept, time=time_of,
                       rebuilt=[[k + g for g in gaps] for k in keep_kept],
                       fixed=fixed, output=self.output_bytes, end=end, chain_time=chain_time,
                       base=base, last_held=keep_kept, tail=tail, options=self.options)


def _grid(seconds: float) -> float:
    """``seconds`` rounded to a multiple of 2**-30 s (about a nanosecond), a binary fraction."""
    return round(seconds * 2**30) / 2**30


def _family(option: str) -> str:
    """The options whose re-runs cost alike per second of forward: ``"blocks"`` (whole blocks
    re-run by the hooks), ``"children"`` (children re-run by cell and operator marks), ``"ops"``
    (per-call policies under the dispatch modes), and two of their own: ``"selective"`` (every
    cheap operator of a block re-run under them) and ``"output"`` (a chain of blocks re-run
    twice, measured at 2x a block re-run)."""
    if option in ("selective", "output"):
        return option  # output: each block re-run twice in backward (NOTE [Output pass])
    if option == "recompute":
        return "blocks"
    return "ops" if option.startswith(f"{OPS}:") else "children"


def find_blocks(model: torch.nn.Module, blocks: Any = None) -> list[tuple[str, torch.nn.Module]]:
    """The modules the planner chooses for: ``blocks`` (names or types), else the blocks
    ``remat.apply(model, where="blocks")`` marks (NOTE [Finding blocks] in ``remat/_front/blocks.py``)."""
    if blocks is not None:
        return _select(model, blocks)
    found = _blocks.find_blocks(model)
    if not found:
        raise TypeError(
            f"{API}: found no blocks in {type(model).__name__} (no ModuleList or Sequential of "
            f"repeated modules, no Hugging Face decoder layers); pass blocks=[module names] or "
            f"blocks=BlockType"
        )
    return found


def _select(model: torch.nn.Module, blocks: Any) -> list[tuple[str, torch.nn.Module]]:
    named = dict(model.named_modules())
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(t, type) for t in blocks)):
        chosen = [(n, m) for n, m in named.items() if n and isinstance(m, blocks)]
    elif isinstance(blocks, Iterable) and not isinstance(blocks, str):
        names = list(blocks)
        missing = [n for n in names if n not in named]
        if missing:
            raise ValueError(f"{API}: blocks {missing} are not modules of {type(model).__name__}")
        chosen = [(n, named[n]) for n in names]
    else:
        raise TypeError(f"{API}: blocks must be None, a module type or a list of module names, "
                        f"got {type(blocks).__name__}")
    outer = [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen if o != n)]
    if not outer:
        raise TypeError(f"{API}: blocks={blocks!r} selects no module of {type(model).__name__}")
    return outer


class _Ops(TorchDispatchMode):
    """Per block: cost of all operators and of those a selective policy recomputes; the
    roofline estimate, or with ``timed`` each operator's measured time (CPU tensors)."""

    def __init__(self, throughput: float, bandwidth: float, timed: bool = False) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.throughput, self.bandwidth, self.timed = throughput, bandwidth, timed
        self.block: int | None = None
        self.total: dict[int, float] = {}
        self.recomputed: dict[int, float] = {}
        self.parts: list[tuple[int, str]] = []  # the children of the block running now
        self.part_total: dict[tuple[int, str], float] = {}
        self.part_outs: dict[tuple[int, str], set] = {}  # storages of each child's output
        # the calls behind ``total``, ``recomputed`` and ``part_total`` (NOTE [Plans timing
        # noise cannot flip]: each re-run call costs the engine's dispatch too)
        self.count: dict[int, float] = {}
        self.recomputed_count: dict[int, float] = {}
        self.part_count: dict[tuple[int, str], float] = {}
        # per block: the calls of each operator name in the forward running now, and the cost
        # (as ``total``), roofline cost and output bytes of each call a per-operator option
        # may keep (NOTE [Options per operator])
        self.numbered: dict[int, dict[str, int]] = {}
        self.calls: dict[int, dict[str, list[float]]] = {}
        self.producer: dict[int, tuple[int, str]] = {}  # storage -> the candidate call that made it
        self.held: list = []
        self.small: dict[int, list[str]] = {}  # per block: reductions with a small result
        self.saved: set[tuple[int, str]] = set()  # candidate calls whose output backward reads
        # every call of each block, for the min-cut options (NOTE [Options cut by min-cut]):
        # key -> [cost, output bytes, the keys of the block's calls it reads, keepable]; which
        # call made each storage (overwritten when a storage is made anew), the calls whose
        # output the block's own backward reads, the operators each block runs in place
        self.nodes: dict[int, dict[str, list]] = {}
        self.made: dict[int, tuple[int, str]] = {}
        self.needed: set[tuple[int, str]] = set()
        self.inplace: dict[int, set[str]] = {}  # per block: functional names of its in-place calls
        self._cuts: dict[tuple, list[str]] = {}
        self._propagating = 0
        self._patches: list = []

    def __enter__(self) -> Any:
        self._patches = look_away_from_sharding_propagation(self._count)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches = []

    def _count(self, depth: int) -> None:
        self._propagating += depth

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a DTensor: cost its local operators, this rank's
        if self._propagating:  # DTensor learning output shapes: not this rank's work
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        random = self.block is not None and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        before = generator_states((args, kwargs)) if random else None
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        drawn = random and drew(before, generator_states((args, kwargs)))
        if self.block is not None:
            if self.timed:
                cost = elapsed
            else:
                packet = func._overloadpacket
                flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
                moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, out))
                            if isinstance(t, torch.Tensor))
                cost = flops / self.throughput + moved / self.bandwidth
            self.total[self.block] = self.total.get(self.block, 0.0) + cost
            self.count[self.block] = self.count.get(self.block, 0.0) + 1
            for part in self.parts:
                self.part_total[part] = self.part_total.get(part, 0.0) + cost
                self.part_count[part] = self.part_count.get(part, 0.0) + 1
            if not save_compute_intensive.saves(func.name()):
                self.recomputed[self.block] = self.recomputed.get(self.block, 0.0) + cost
                self.recomputed_count[self.block] = self.recomputed_count.get(self.block, 0.0) + 1
            self._number(func, args, kwargs, out, cost, drawn)
        elif isinstance(func, torch._ops.OpOverload) and not func.is_view and not func._schema.is_mutable:
            for storage in _new_storages(args, kwargs, out):  # made outside every block
                self.made.pop(storage, None)
        return out

    def start_block(self, block: int) -> None:
        """Block ``block``'s forward begins: its calls are numbered from 0 again."""
        self.block = block
        self.numbered[block] = {}
        # each forward records its calls anew (micro-batches: the last stands), reading only
        # what this forward made: a value an earlier forward of the block made is from outside
        self.nodes[block] = {}
        self.made = {s: made for s, made in self.made.items() if made[0] != block}

    def _number(self, func: Any, args: tuple, kwargs: dict, out: Any, cost: float, drawn: bool = False) -> None:
        """Number the call as the selective engine does (NOTE [Counting calls] in
        ``remat/_vocab/policy.py``); record a matrix product's, a convolution's or an attention's."""
        if not isinstance(func, torch._ops.OpOverload) or func.is_view:
            return
        name = func._schema.name
        if func._schema.is_mutable:  # NOTE [Options cut by min-cut]: a write into a value
            self._written_into(name, func, args, kwargs, out, cost)
            return
        numbered = self.numbered.setdefault(self.block, {})
        index = numbered.get(name, 0)
        numbered[name] = index + 1
        key = call_key(name, index)
        # a call that drew is never kept (NOTE [Kept random operators])
        self._node(key, args, kwargs, out, cost, keepable=not drawn, makes=_new_storages(args, kwargs, out))
        if name in REDUCTIONS:  # NOTE [Options per operator]: a small result that cuts a chain
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            largest = max((t.numel() for t in ins), default=0)
            if outs and SMALL * sum(t.numel() for t in outs) <= largest:
                self.small.setdefault(self.block, []).append(call_key(name, index))
            return
        if name not in COMPUTE_INTENSIVE_OPS:
            return
        packet = func._overloadpacket
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, outs)) if isinstance(t, torch.Tensor))
        key = call_key(name, index)
        entry = self.calls.setdefault(self.block, {}).setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += cost
        entry[1] += flops / self.throughput + moved / self.bandwidth
        entry[2] = float(sum(t.numel() * t.element_size() for t in outs))
        self.held.append(outs)  # held until the step ends: no later tensor reuses the storage
        for storage in local_storages(outs):
            self.producer[storage._cdata] = (self.block, key)

    def _written_into(self, name: str, func: Any, args: tuple, kwargs: dict, out: Any, cost: float) -> None:
        """An in-place or ``out=`` call of the running block, which the engine does not number
        (NOTE [Options cut by min-cut]): one node no option keeps, reading what the call reads,
        now makes the values it writes into and any it returns anew; no option keeps the call
        that made a value written into, nor a call of the operator's functional form (the
        graph pass, functionalized, numbers those; the engine does not)."""
        nodes = self.nodes.setdefault(self.block, {})
        self.inplace.setdefault(self.block, set()).add(name.removesuffix("_"))
        touched = [s._cdata for s in local_storages(_written(func, args, kwargs))]
        for storage in touched:
            before = self.made.get(storage)
            if before is not None and before[0] == self.block:
                nodes[before[1]][3] = False
        self._node(f"{name}!{len(nodes)}", args, kwargs, out, cost, keepable=False,
                   makes=[*touched, *_new_storages(args, kwargs, out)])

    def _node(self, key: str, args: tuple, kwargs: dict, out: Any, cost: float, *, keepable: bool,
              makes: list[int]) -> None:
        """Record call ``key`` of the running block: ``[cost, output bytes, the keys of the block's
        calls it reads, whether an option may keep it]``; it now makes the storages ``makes``."""
        reads = {self.made.get(s._cdata) for s in local_storages(tree_leaves((args, kwargs)))}
        self.nodes.setdefault(self.block, {})[key] = [
            cost, sum(local_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)),
            sorted({k for b, k in filter(None, reads) if b == self.block}), keepable]
        for storage in makes:
            self.made[storage] = (self.block, key)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook: note the candidate call whose output autograd saves (a view's too),
        and the call of the running block whose output its backward reads."""
        for storage in local_storages([tensor]):
            made = self.producer.get(storage._cdata)
            if made is not None:
                self.saved.add(made)
            made = self.made.get(storage._cdata)
            if made is not None and made[0] == self.block:
                self.needed.add(made)
        return tensor

    def candidates(self, block: int) -> dict[str, tuple[float, float]]:
        """Block ``block``'s candidate calls, ``{key: (roofline cost, output bytes)}`` in call
        order: those whose output backward reads (keeping another saves no memory in graph mode
        and buys only its own re-run in eager)."""
        found = self.calls.get(block, {})
        return {key: (e[1], e[2]) for key, e in found.items() if (block, key) in self.saved}

    def cut_options(self, block: int) -> list[str]:
        """Block ``block``'s ``ops:`` options found by min-cut (NOTE [Options cut by min-cut])."""
        nodes = self.nodes.get(block, {})
        inplace = self.inplace.get(block, set())
        graph = tuple((key, e[1], tuple(e[2])) for key, e in nodes.items())
        fixed = tuple(key for key, e in nodes.items() if not e[3] or key.partition("#")[0] in inplace)
        needed = tuple(sorted(key for b, key in self.needed if b == block))
        intensive = tuple((key, e[1], e[2]) for key, e in self.calls.get(block, {}).items())
        small = tuple(self.small_results(block))
        memo = (graph, needed, intensive, small, fixed)  # identical blocks: one cut, solved once
        if memo not in self._cuts:
            self._cuts[memo] = cut_options({k: (b, r) for k, b, r in graph}, needed,
                                           {k: (c, b) for k, c, b in intensive}, small, fixed)
        return list(self._cuts[memo])

    def small_results(self, block: int) -> list[str]:
        """Block ``block``'s reductions whose result is small (a norm's mean): keeping them costs
        next to no memory and cuts what recomputation runs (NOTE [Options per operator])."""
        return list(dict.fromkeys(self.small.get(block, [])))


def _new_storages(args: Any, kwargs: Any, out: Any) -> list[int]:
    """Keys of the storages ``out`` holds that none of the operator's inputs does."""
    given = {s._cdata for s in local_storages(tree_leaves((args, kwargs)))}
    return [s._cdata for s in local_storages(tree_leaves(out)) if s._cdata not in given]


def _written(func: Any, args: tuple, kwargs: dict) -> list:
    """The tensors an in-place or ``out=`` operator writes into (its schema's mutable arguments)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


@dataclass
class Trace:
    """What one traced step tells about the blocks (`trace`), in the order they run.

    Args:
        blocks: ``(name, module)`` in call order.
        index: each block's position in the list given to `trace`.
        chain: per block, whether its output feeds only the next block (or it is the last).
        leaving: per block name, the children whose output is the block's.
        ops: the operator costs per block and per child (`_Ops`).
        calls: how many times the step runs each block (micro-batches of gradient accumulation).
    """

    blocks: list
    index: list[int]
    chain: list[bool]
    leaving: dict[str, set]
    ops: Any
    calls: int = 1

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]


@dataclass
class Runs:
    """The tracked runs of `measure_options`: one step per option, blocks marked alike."""

    reports: dict  # option -> ProfileReport
    inner: dict[str, list[str]]  # block name -> its options inside the block
    columns: list[str]  # every option inside blocks, in order
    steps: dict[str, float]  # option -> seconds of its step (interleaved timing; real tensors)
    measured: torch.nn.Module  # the model whose parameters count (a rank's: sharded)


def _run_traced(model: torch.nn.Module, step: Step, blocks: list, ops: Any) -> tuple:
    """Run ``step`` once under ``ops``, hooking the blocks and their children: block call
    order and the storages going in and out of each block and child."""
    ids = {id(m): i for i, (_, m) in enumerate(blocks)}
    order: list[int] = []
    ins: dict[int, set] = {}
    outs: dict[int, set] = {}

    def keys(obj: Any) -> set:
        return {s._cdata for s in local_storages(tree_leaves(obj))}

    def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        i = ids[id(module)]
        order.append(i)
        ins.setdefault(i, set()).update(keys((args, kwargs)))
        ops.start_block(i)

    alive: list = []  # storages stay alive while traced, so their keys are not reused

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        outs.setdefault(ids[id(module)], set()).update(keys(output))
        alive.append(output)
        ops.block = None

    handles = [h for _, m in blocks for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                              m.register_forward_hook(post, with_kwargs=True))]

    def enter(key: tuple[int, str]) -> Any:
        def hook(*_: Any) -> None:
            ops.parts.append(key)
        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        ops.part_outs.setdefault(ops.parts.pop(), set()).update(keys(output))
        alive.append(output)

    for i, (_, block) in enumerate(blocks):  # each child's own cost (options inside blocks)
        for child, kid in block.named_children():
            handles.append(kid.register_forward_pre_hook(enter((i, child))))
            handles.append(kid.register_forward_hook(leave))
    try:
        with ops, torch.autograd.graph.saved_tensors_hooks(ops.pack, lambda t: t):
            alive.append(step.run(model))
    finally:
        ops.held.clear()
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order, ins, outs


def trace(model: torch.nn.Module, blocks: list, settings: Settings, *, timed: bool = False) -> Trace:
    """Run the step once with the blocks hooked: which blocks run, in what order, how
    often, which feed only the next, and what their operators cost (measured times with
    ``timed``, else the roofline).

    Raises:
        TypeError: a block does not run, or blocks run unequal numbers of times.
    """
    ops = _Ops(settings.throughput or THROUGHPUT.get(settings.device, THROUGHPUT["cpu"]),
               settings.bandwidth or BANDWIDTH.get(settings.device, BANDWIDTH["cpu"]), timed=timed)
    order, ins, outs = _run_traced(model, settings.step, blocks, ops)
    counts = {i: order.count(i) for i in set(order)}
    unused = [blocks[i][0] for i in range(len(blocks)) if i not in counts]
    calls = max(counts.values(), default=1)
    uneven = [blocks[i][0] for i, c in counts.items() if c != calls]
    if unused or uneven:
        raise TypeError(f"{API}: every block must run once per forward; "
                        f"{'not run: ' + str(unused) if unused else ''}"
                        f"{' run more than once: ' + str(uneven) if uneven else ''}; "
                        f"pass blocks=[...] naming modules that run once each")
    index = order[:len(counts)]
    n = len(index)
    chain = []
    for k in range(n):
        mine = outs.get(index[k], set())
        later = [ins.get(index[m], set()) for m in range(k + 1, n)]
        chain.append(k == n - 1 or (bool(mine & later[0]) and not any(mine & s for s in later[1:])))
    for cost in (ops.total, ops.recomputed, ops.part_total, ops.count, ops.recomputed_count,
                 ops.part_count):  # per forward of a block
        for key in cost:
            cost[key] /= calls
    for block in ops.calls.values():
        for entry in block.values():
            entry[0] /= calls
            entry[1] /= calls
    ordered = [blocks[i] for i in index]
    leaving = {ordered[k][0]: {child for (i, child), out in ops.part_outs.items()
                               if i == index[k] and out & outs.get(i, set())} for k in range(n)}
    return Trace(blocks=ordered, index=index, chain=chain, leaving=leaving, ops=ops, calls=calls)


def _measure_one(model: torch.nn.Module, blocks: list, chosen: dict, settings: Settings,
                 keep_timing: bool, state: dict | None, optimizer: torch.optim.Optimizer | None = None,
                 unmarked: Any = None) -> tuple[Any, torch.nn.Module]:
    """One tracked step with ``chosen`` (``{block: option}``) marked; the report and the model run.

    ``optimizer``: made and primed once for every run (NOTE [One optimizer phase]); stepped
    unless ``unmarked`` (the unmarked run's report) is given, whose optimizer phase then
    stands in for this run's."""
    if settings.build is not None:  # NOTE [Planning a rank]
        net = settings.build(chosen)
        return measure(net, settings.step.inputs, step=settings.step, optimizer=settings.optimizer,
                       estimated=settings.fake, api=API), net
    marked = mark_choices(dict(blocks), chosen)
    try:
        report = measure(model, settings.step.inputs, step=settings.step,
                         optimizer=settings.optimizer if optimizer is None else optimizer,
                         repeat=settings.repeat if keep_timing else 0, estimated=settings.fake,
                         api=API, optimizer_step=unmarked is None)
        return (report if unmarked is None else _with_optimizer_phase(report, unmarked)), model
    finally:
        for m in marked:
            unmark_module(m)
        if state is not None:
            model.load_state_dict(state)


def _with_optimizer_phase(report: Any, unmarked: Any) -> Any:
    """``report`` of a run without the optimizer's step, given the unmarked run's optimizer
    phase (NOTE [One optimizer phase])."""
    phase = unmarked.phase_peaks.get("optimizer")
    if phase is None:
        return report
    report.phase_peaks = {**report.phase_peaks, "optimizer": phase}
    if phase > report.peak_bytes:
        report.peak_bytes, report.peak_phase = phase, "optimizer"
        report.peak_increase = phase - report.baseline_bytes
    return report


def measure_options(model: torch.nn.Module, traced: Trace, settings: Settings,
                    state: dict | None) -> Runs:
    """Run the step once per option with every block that has it marked alike, under the
    tracker; the unmarked run also chooses the options inside blocks (NOTE [Options inside
    blocks]). On real tensors each option's step is then timed, interleaved.

    NOTE [One optimizer phase]
    The optimizer's step runs after backward, on gradients no mark changes, with only the
    step's outputs still alive, which no mark changes either: its phase is the same under
    every option. On fake tensors (where a step of the optimizer is a large share of a run)
    one optimizer is made and primed for all the runs and steps in the unmarked run only;
    every other run takes that run's optimizer phase. On real tensors each run makes its
    own, as a user's step would."""
    names, blocks = traced.names, traced.blocks
    inner: dict[str, list[str]] = {name: [] for name in names}
    columns: list[str] = []
    pending = ["keep", *(o for o in settings.options if o not in ("keep", CHILDREN, OPS))]
    uniform: dict[str, dict[str, str]] = {}  # option -> the blocks its run marks
    reports = {}
    measured = model
    opt = None  # NOTE [One optimizer phase]
    if settings.fake and settings.build is None and settings.optimizer is not None:
        opt = make_optimizer(settings.optimizer, model, API)
        prime_optimizer(opt)
    while pending:
        option = pending.pop(0)
        chosen = {name: option for name in names if option in BLOCK_OPTIONS or option in inner[name]}
        uniform[option] = chosen
        settings.say(f"measuring '{option}' on {len(chosen)} blocks")
        timing = not settings.fake and option == "keep"
        unmarked = None if opt is None or option == "keep" else reports["keep"]
        reports[option], net = _measure_one(model, blocks, chosen, settings, timing, state, opt, unmarked)
        if option == "keep" and settings.build is not None:
            measured, blocks = net, _named(net, blocks)
        if option == "keep":  # NOTE [Options inside blocks], [Options per operator]
            inner = inner_options(traced, {r.name: r for r in reports["keep"].rows}, settings.options)
            columns = list(dict.fromkeys(c for name in names for c in inner[name]))
            pending += columns
    steps: dict[str, float] = {}
    if not settings.fake and settings.build is None and settings.repeat:
        settings.say(f"timing the {len(uniform)} options, interleaved")
        steps = interleaved_steps(model, settings.step, dict(blocks), uniform, settings.repeat,
                                   settings.optimizer)
    return Runs(reports=reports, inner=inner, columns=columns, steps=steps, measured=measured)


def assemble(traced: Trace, runs: Runs, settings: Settings, roofline: Trace | None = None) -> BlockCosts:
    """The cost model of the blocks from the trace and the runs (per forward of a block);
    ``roofline``: on real tensors, a trace costed by FLOPs and bytes, whose times rank the
    options (NOTE [Plans timing noise cannot flip])."""
    names, blocks, calls = traced.names, traced.blocks, traced.calls
    rows = {o: {r.name: r for r in rep.rows} for o, rep in runs.reports.items()}
    keep, ops = rows["keep"], traced.ops
    every = [*BLOCK_OPTIONS, *runs.columns]
    kept = [[float(rows[o][name].kept) if o in rows and (o in BLOCK_OPTIONS or o in runs.inner[name])
             else None for o in every] for name in names]
    for k, row in enumerate(kept):
        if not traced.chain[k] and row[OUTPUT] is not None:
            row[OUTPUT] = None
    # Identical blocks (one class, one set of parameter shapes, the same bytes kept under every
    # option) cost the same: their times are averaged, so the timer cannot make one
    # of them look cheaper to recompute than its twin (a plan that is stable run after run)
    groups: dict[tuple, list[int]] = {}
    for k, (_, module) in enumerate(blocks):
        groups.setdefault((signature(module), tuple(kept[k])), []).append(k)
    forward, selective, child_s = _times(traced, runs, settings.fake, groups)
    ranking = None
    if not settings.fake:
        ranking = Ranking(*_times(roofline or traced, runs, True, groups, per_call=True))
    report = runs.reports["keep"]
    if settings.fake:
        step = 3 * calls * sum(ops.total.values())
        timed = f"roofline ({settings.device})"
    else:
        # the step users run: forward, backward and the optimizer's step
        step = (runs.steps["keep"] + runs.steps.get("optimizer", 0.0) if runs.steps
                else (report.step_ms or 0.0) / 1e3)
        timed = "measured, each family of options scaled by its timed runs"
    grads = [sum(local_nbytes(p) for p in m.parameters() if p.requires_grad) for _, m in blocks]
    all_grads = sum(local_nbytes(p) for p in runs.measured.parameters() if p.requires_grad)
    return BlockCosts(
        names=names, types=[type(m).__name__ for _, m in traced.blocks],
        kept=kept, forward_s=forward, selective_s=selective,
        output_bytes=[keep[name].output_bytes // calls for name in names], grad_bytes=grads,
        chain=traced.chain, baseline_bytes=report.baseline_bytes,
        other_grad_bytes=all_grads - sum(grads),
        peaks={o: r.peak_bytes for o, r in runs.reports.items()},
        phases={o: r.peak_phase for o, r in runs.reports.items()}, step_s=step, timed=timed,
        phase_peaks={o: dict(r.phase_peaks) for o, r in runs.reports.items()},
        optimizer_peak=report.phase_peaks.get("optimizer"), option_step_s=runs.steps,
        options=every, child_s=child_s, calls=calls,
        ranking=ranking,
    )


#: NOTE [Plans timing noise cannot flip]: what the engine adds per call on top of the call
#: itself, in the ranking times: a call re-run (saved-tensor hooks, the region's modes), and a
#: call run under a per-call policy (``selective``, ``ops:``; its dispatch mode, forward and
#: re-run). Measured on CPU (tiny tensors, 600 calls: 38 us and 58 us per call in all, the
#: calls' own cost included); Python's share of a call, so of the same order on CUDA.
RERUN_CALL_S = 3e-5
POLICY_CALL_S = 2e-5


def _times(traced: Trace, runs: Runs, roofline: bool, groups: Mapping[tuple, list[int]], *,
           per_call: bool = False) -> tuple:
    """Per block: the seconds a re-run of it costs, those of its selective policy's re-run, and
    those of each option inside it (``runs.columns``), averaged over each group of identical
    blocks. With ``roofline``: the trace's operators costed by FLOPs and bytes (with
    ``per_call``, plus the engine's share per call: `RERUN_CALL_S`, `POLICY_CALL_S`);
    else the unmarked run's measured forward times (the trace's operator times share them out)."""
    names, blocks, calls, ops = traced.names, traced.blocks, traced.calls, traced.ops
    keep = {r.name: r for r in runs.reports["keep"].rows}
    rerun, policy = (RERUN_CALL_S, POLICY_CALL_S) if roofline and per_call else (0.0, 0.0)

    def seconds(name: str) -> float:
        return (keep[name].forward_ms or 0.0) / 1e3 / calls

    def child_seconds(k: int, child: str) -> float:
        part = (traced.index[k], child)
        once = (ops.part_total.get(part, 0.0) + rerun * ops.part_count.get(part, 0.0) if roofline
                else seconds(f"{names[k]}.{child}"))
        # an operator mark runs twice in backward: once to hand its output to whoever saved
        # it, once to rebuild what it saved itself (NOTE [Output pass] in _engine/hooked.py)
        return once if child_mark(dict(blocks[k][1].named_children())[child]) == {} else 2 * once

    forward = ([ops.total.get(i, 0.0) for i in traced.index] if roofline
               else [seconds(name) for name in names])
    count = [ops.count.get(i, 0.0) for i in traced.index]

    def inner_seconds(k: int, option: str) -> float:
        if option not in runs.inner[names[k]]:
            return 0.0
        if not option.startswith(f"{OPS}:"):
            return sum(child_seconds(k, c) for c in children_in(option))
        # NOTE [Options per operator]: the re-run runs all but the kept calls
        block = traced.index[k]
        found = ops.nodes.get(block, {})
        keys = [key for key in option.partition(":")[2].split("+") if key in found]
        kept = sum(found[key][0] for key in keys)
        total = ops.total.get(block, 0.0)
        share = max(0.0, 1.0 - kept / total) if total else 1.0
        return forward[k] * share + rerun * max(0.0, count[k] - len(keys)) + policy * count[k]

    child_s = [[inner_seconds(k, o) for o in runs.columns] for k in range(len(names))]
    share = [ops.recomputed.get(i, 0.0) / ops.total[i] if ops.total.get(i) else 1.0 for i in traced.index]
    selective = [f * s + rerun * ops.recomputed_count.get(i, 0.0) + policy * n
                 for f, s, i, n in zip(forward, share, traced.index, count)]
    forward = [f + rerun * n for f, n in zip(forward, count)]
    for members in groups.values():
        for values in (forward, selective):
            mean = sum(values[k] for k in members) / len(members)
            for k in members:
                values[k] = mean
        for c in range(len(runs.columns)):
            mean = sum(child_s[k][c] for k in members) / len(members)
            for k in members:
                child_s[k][c] = mean
    return forward, selective, child_s


def measure_costs(model: torch.nn.Module, blocks: list, settings: Settings) -> BlockCosts:
    """Measure every block under every option: `trace`, `measure_options`,
    `assemble`; see the module docstring.

    With ``settings.build`` (a rank's plan, NOTE [Planning a rank]) each run is of a fresh
    model from it; ``model`` only names the blocks."""
    settings.say("tracing blocks")
    state = None if settings.fake else {k: v.detach().clone() for k, v in model.state_dict().items()}
    # on CPU tensors the selective share comes from operator times (a warm-up step first)
    timed = not settings.fake and settings.device == "cpu"
    roofline = None
    try:
        if timed:  # (also the warm-up of the timed trace) NOTE [Plans timing noise cannot flip]
            roofline = trace(model, blocks, settings)
        traced_model = model if settings.build is None else settings.build({})
        traced = trace(traced_model, _named(traced_model, blocks), settings, timed=timed)
        traced.blocks = _named(model, traced.blocks)  # the model's classes, not the sharded ones
        if state is not None:
            model.load_state_dict(state)
        runs = measure_options(model, traced, settings, state)
    finally:
        if state is not None:
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)
    return assemble(traced, runs, settings, roofline)


def interleaved_steps(model: torch.nn.Module, step: Step, blocks: Mapping[str, torch.nn.Module],
                       uniform: Mapping[str, Mapping[str, str]], rounds: int,
                       optimizer: OptimizerLike = None) -> dict[str, float]:
    """Seconds of ``step`` (forward and backward) with each option's blocks marked (``uniform``:
    option -> ``{block: option}``), over ``rounds`` rounds after one to warm up; and under
    ``"optimizer"`` the seconds of the optimizer's step, timed after the unmarked one.

    Each round steps every option once, in a rotating order, so a busy spell of the machine
    slows them alike. An option's figure is the unmarked step's median times the median over
    rounds of its ratio to the unmarked step of the same round: the statistic a user's loop
    shows (a typical step, not the luckiest), with the machine's slow spells divided out."""
    opt = make_optimizer(optimizer, model, API)
    if opt is not None:
        prime_optimizer(opt)
    order = list(uniform)
    times: dict[str, list[float]] = {option: [] for option in order}
    optimizer_s: list[float] = []
    for r in range(rounds + 1):
        for option in order[r % len(order):] + order[:r % len(order)]:
            marked = mark_choices(blocks, uniform[option])
            try:
                start = time.perf_counter()
                held = step.run(model)
                elapsed = time.perf_counter() - start
                del held
                if opt is not None and option == "keep":
                    start = time.perf_counter()
                    opt.step()
                    optimizer_s.append(time.perf_counter() - start)
            finally:
                for m in marked:
                    unmark_module(m)
                model.zero_grad(set_to_none=True)
            if r:
                times[option].append(elapsed)
    keep = statistics.median(times["keep"])
    out = {option: keep * statistics.median(t / k for t, k in zip(seconds, times["keep"]))
           for option, seconds in times.items()}
    if optimizer_s[1:]:
        out["optimizer"] = statistics.median(optimizer_s[1:])
    return out


def _named(model: torch.nn.Module, blocks: list) -> list[tuple[str, torch.nn.Module]]:
    """``blocks`` (name, module) as the modules of the same names in ``model``."""
    named = dict(model.named_modules())
    return [(name, named[name]) for name, _ in blocks]


def measure_peak(model: torch.nn.Module, step: Step, *, optimizer: OptimizerLike, fake: bool,
                 optimizer_peak: int | None = None) -> int:
    """Peak bytes of one ``step`` of ``model`` as marked (the model's state is restored after).

    With ``optimizer_peak`` (the optimizer phase's peak, which no mark changes) the
    optimizer's step is not run again: the peak is the larger of that and the rest's."""
    state = None if fake else {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        report = measure(model, step.inputs, step=step, optimizer=optimizer,
                         estimated=fake, api=API, optimizer_step=optimizer_peak is None)
        return max(report.peak_bytes, optimizer_peak or 0)
    finally:
        if state is not None:
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)


def composed_costs(model: torch.nn.Module, blocks: list, container: torch.nn.Module,
                   settings: Settings) -> BlockCosts | None:
    """Measure the model with 2 and with 3 of its ``n`` identical blocks and compose the costs of
    all ``n``: per block, the first, a middle one repeated, the last; every step-wide figure
    (baseline, peaks, step time) grows linearly with the number of blocks. None when the model
    does not run a shorter container as a shorter model, or is no longer than the runs.

    A rank's plan (``build``) composes from 3 and 4 blocks: FSDP2 gathers a unit's neighbours
    ahead of it in forward and in backward, so a step grows linearly only once some block has
    blocks on both sides (NOTE [Planning a rank])."""
    n = len(blocks)
    measured = {}
    build = settings.build
    small, large = (2, 3) if build is None else (3, 4)
    if n <= large:
        return None
    where = next(name for name, m in model.named_modules() if m is container)
    for count in (small, large):
        with truncated(container, count):
            try:
                cut = None if build is None else build.cut(where, count)
                measured[count] = measure_costs(model, blocks[:count], settings.replace(build=cut))
            except (TypeError, IndexError):  # the forward does not iterate over the container
                return None
    two, three = measured[small], measured[large]
    if two.options != three.options:  # the short models' blocks differ: measure the whole one
        return None

    def grow(a: float, b: float) -> float:
        return b + (n - large) * (b - a)

    def spread(values: list) -> list:
        return [values[0], *[values[1]] * (n - 2), values[-1]]

    # Each phase's peak grows linearly, at its own rate: the step's peak is the largest grown
    # one, which may be in another phase than the short models' (a rank's backward outgrows
    # its optimizer step, whose peak is mostly replicated parameters and their state).
    grown = {o: {phase: grow(two.phase_peaks[o][phase], peak)
                 for phase, peak in three.phase_peaks.get(o, {}).items()
                 if phase in two.phase_peaks.get(o, {})} for o in three.peaks}
    peaks = {o: int(max(g.values())) if g else int(grow(two.peaks[o], three.peaks[o]))
             for o, g in grown.items()}
    phases = {o: max(g, key=g.get) if g else three.phases[o] for o, g in grown.items()}

    return BlockCosts(
        names=[name for name, _ in blocks], types=spread(three.types), kept=spread(three.kept),
        forward_s=spread(three.forward_s), selective_s=spread(three.selective_s),
        output_bytes=spread(three.output_bytes), grad_bytes=spread(three.grad_bytes),
        chain=spread(three.chain), baseline_bytes=int(grow(two.baseline_bytes, three.baseline_bytes)),
        other_grad_bytes=three.other_grad_bytes,
        peaks=peaks,
        optimizer_peak=(None if three.optimizer_peak is None
                        else int(grow(two.optimizer_peak, three.optimizer_peak))),
        phases=phases, phase_peaks={o: {ph: int(v) for ph, v in g.items()} for o, g in grown.items()},
        step_s=grow(two.step_s, three.step_s) if two.step_s is not None else None,
        timed=three.timed + f"; {n} identical blocks composed from runs with {small} and {large}",
        options=three.options, child_s=spread(three.child_s), calls=three.calls,
    )
