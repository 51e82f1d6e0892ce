"""The planner's options inside blocks: which children, which operator calls a block may
mark or keep (layer 4). `inner_options` draws them from a traced unmarked run (`_trace.py`);
the cost model then measures each like every other option (`_measure.py`, `_cost.py`).

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

NOTE [Every child]
The children that keep least (a block's layer norms: a tenth of what its attention keeps)
get no option of their own, but they set how low a block can go inside: with the
attention, the MLP's products and the activation marked, a block still keeps each norm's
output (the input of what is marked), and on a vocabulary-heavy GPT that left the eager
floor 7% above the peak torch.compile reaches at an ``activation_memory_budget`` of 0.1.
So the eager planner also offers every child that may be marked, together (``"children:
ln1+attn+ln2+fc+gelu+proj"``): the lowest a block goes without being re-run whole, measured like
every other option and chosen only where it is the fastest within the budget.

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
In eager plans the block is marked ``stages="each"`` (NOTE [Each saved tensor rebuilt on its
own] in ``remat/_engine/recipes.py``): its backward rebuilds each saved tensor from the calls
that make it, as it reads them, and holds one at a time, as the graph pass's partitioner
places each rebuilt operator just before its use; the block's code is not run again.

NOTE [Options cut by min-cut]
The ranked options keep products and reductions only, so a value backward reads that a
cheap operator makes from a product (a rotary embedding of a query, a residual sum) is
rebuilt by re-running the product. The min-cut options keep, of every call of the block,
the fewest bytes from which backward rebuilds all it reads while re-running only what
it may: the traced unmarked run records each call (``CutGraph.nodes`` in ``_ops.py``: its
output bytes, the calls of the same block it reads, storage by storage), and which outputs
the block's own backward reads (the saved-tensor hook, while the block runs);
`remat.planner._solve.min_cut_keep` then solves the cut with the block's small reductions
and a share (`CUT_SHARES`) of its products, convolutions and attentions, dearest per byte
first, banned from re-running. Its cut nearest the backward keeps a rotary embedding's output
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

NOTE [Cuts one product apart]
The cut that re-runs no product keeps every product backward reads, or what it makes; the
next level (half of them re-runnable) lets the cut re-run many at once and drop everything
cheap they feed. Between the two lie the options a plan near torch.compile's loose budgets
wants: that cut less one product, re-run in backward (the Llama of issue 27 at compile's
peak of 0.8 needed 2 MiB less than the first cut keeps). So the cut is solved again with
each product it keeps allowed to re-run, one at a time: an option each (none new where the
cut finds nothing cheaper to keep than that product).

NOTE [Options re-run in stages]
A min-cut option leaves a re-run of cheap operators only, but an eager re-run rebuilds all
of the block's saved tensors at once, so the block's backward holds the MLP's rebuilt
activations and the attention's together (torch.compile's partitioner places each rebuilt
operator just before its use, and on the Llama of issue 27 its peak at an
``activation_memory_budget`` of 0.8 stayed 6.5 MiB below the same choice's eager one). So each
min-cut option also comes as family ``staged`` (``"staged:aten::add#1+aten::mm#2"``): the same
policy, the block re-run in ``STAGES`` (2) stages (NOTE [Re-runs in stages] in
``remat/_engine/stages.py``), which lowers the peak for about one more pass through the block's
Python in backward. Like every option it is measured, bytes, peak and time, and chosen only
where it is the fastest within the budget; but a plan uses the family only when asked
(``options=(*remat.planner.OPTIONS, "staged")``, `FAMILIES`): priced with the per-call policies it
came out cheaper than it ran (a GPT of issue 27 planned at compile's peak at 0.1 took four
staged blocks at 1.207x compile's step, where every child marked ran 1.036x), and priced as a
family of its own its few timed runs do not yet make a fit that ranks it reliably. Eager plans
only: under ``remat.compile`` the partitioner places each rebuilt operator itself, so the
compiled planner refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from remat.planner._solve import CHILDREN, OPS, STAGED, Choice, min_cut_keep

if TYPE_CHECKING:  # a trace is read, never made, here (``_trace`` imports this module)
    from remat.planner._trace import Trace

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
    return [str(Choice(OPS, tuple(keys))) for keys in levels]


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
    reads = [[where[r] for r in nodes[k][1]] for k in keys]

    def cut(banned: set) -> list[int] | None:
        kept = min_cut_keep(weights, reads, [where[k] for k in needed if k in where],
                            [where[k] for k in banned if k in where])
        if not kept or any(keys[i] in fixed for i in kept):
            return None
        option = str(Choice(OPS, tuple(sorted(keys[i] for i in kept))))
        if option not in found:
            found.append(option)
        return kept

    every = None
    for share in CUT_SHARES:
        every = cut({*small, *ranked[:max(1, round(share * len(ranked)))]} if ranked else set(small))
    # NOTE [Cuts one product apart]: the cut that re-runs no product, less each product it keeps
    for i in every or ():
        if keys[i] in intensive:
            cut({*small, *ranked} - {keys[i]})
    return found


def child_options(name: str, block: torch.nn.Module, rows: Mapping[str, Any],
                  leaving: set[str] = frozenset(), calls: int = 1, *, share: float = CHILD_SHARE,
                  limit: int = MAX_CHILDREN, operators: bool = False, every: bool = False) -> list[str]:
    """The ``children:`` options of block ``name`` from the rows of an unmarked run
    (NOTE [Options inside blocks]); ``leaving``: children whose output is the block's;
    ``calls``: how many times the step runs each block (micro-batches); ``share``, ``limit``:
    the least share of the block's kept bytes a child must drop, the most children;
    ``operators``: also all the single-operator children together (norms, activations:
    cheap to rebuild), when that is not already an option; ``every``: also every child
    that may be marked, together (NOTE [Every child]), when that is not already one."""
    total = rows[name].kept
    scored, eligible = [], []
    for order, (child, kid) in enumerate(block.named_children()):
        row = rows.get(f"{name}.{child}")
        if row is None or row.calls != calls or "+" in child or ":" in child:
            continue
        cell = next(kid.children(), None) is not None
        if not cell and child in leaving:
            continue  # rebuilt in a later block's backward (with an FSDP unit resharded)
        eligible.append(child)
        saving = row.kept - row.output_bytes if cell else row.kept
        if total > 0 and saving >= share * total:
            scored.append((-saving, order, child))
    chosen = [child for _, _, child in sorted(sorted(scored)[:limit], key=lambda s: s[1])]
    found = [str(Choice(CHILDREN, (c,))) for c in chosen] + ([str(Choice(CHILDREN, tuple(chosen)))]
                                                           if len(chosen) > 1 else [])
    kids = dict(block.named_children())
    alone = [c for c in chosen if next(kids[c].children(), None) is None]
    if operators and 1 < len(alone) < len(chosen):
        found.append(str(Choice(CHILDREN, tuple(alone))))
    if every and chosen and len(eligible) > len(chosen):  # NOTE [Every child]
        found.append(str(Choice(CHILDREN, tuple(eligible))))
    return found


def inner_options(traced: Trace, unmarked: Mapping[str, Any], options: Sequence[str], *,
                  share: float = CHILD_SHARE, limit: int = MAX_CHILDREN,
                  operators: bool = False, every: bool = False) -> dict[str, list[str]]:
    """Block name -> its options inside the block (``children:``, ``ops:``) from the trace
    and the unmarked run's rows (NOTE [Options inside blocks], [Options per operator])."""
    inner: dict[str, list[str]] = {name: [] for name in traced.names}
    for k, (name, block) in enumerate(traced.blocks):
        if CHILDREN in options:
            inner[name] += child_options(name, block, unmarked, traced.leaving[name], traced.calls,
                                         share=share, limit=limit, operators=operators, every=every)
        i = traced.index[k]
        if OPS in options:
            candidates = traced.ops.candidates
            inner[name] += ops_options(candidates.of(i), candidates.small_results(i))
            inner[name] += [o for o in traced.ops.cut_options(i) if o not in inner[name]]
        if STAGED in options:  # NOTE [Options re-run in stages]
            inner[name] += [str(Choice(STAGED, Choice.parse(o).calls)) for o in traced.ops.cut_options(i)]
    return inner

