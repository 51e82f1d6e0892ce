"""What skipping dead calls in a selective re-run saves (NOTE [Dead operators in a selective re-run]).

The Llama of issue 27 (4 blocks, width 256, 8 query and 2 key/value heads, SwiGLU of 688,
vocabulary 1,000, 4 x 256 tokens), every block marked with the per-call policy that
``torch.compile``'s min-cut partitioner and ``remat.compile`` keep at an
``activation_memory_budget`` of 0.8 (the attention, the rotary embeddings' outputs, the first
residual sum, the value, gate and up projections, the norms' scales). Its re-run needs only
cheap operators; torch's selective checkpoint runs the query, key and output projections
again too, whose outputs only feed kept calls. Three configurations, interleaved rounds
(the order rotated each round), median and interquartile range of the per-round ratios to
the unmarked step, the peak of one step (allocator events) and the matrix products run in
backward:

- ``unmarked``;
- ``remat``: the dead calls skipped;
- ``remat, every call re-run``: the same marks with the forward's reads not noted, so
  nothing is skipped (early stop still ends the re-run after its last saved tensor, as
  torch's does);
- ``remat, two stages``: the same marks with ``stages=2`` (NOTE [Re-runs in stages]): each
  block's backward rebuilds its MLP's tensors, then its attention's, skipping in each re-run
  what only the other reads;
- ``remat, each tensor on its own``: the same marks with ``stages="each"`` (NOTE [Each saved
  tensor rebuilt on its own]): no block's code runs again; each saved tensor is rebuilt from
  the kept outputs by the calls that make it, as backward reads it.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/dead_calls.py [--rounds 15]

Writes ``benchmarks/results/dead_calls.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import json
import pathlib
import statistics
import time
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._engine import dead
from remat._graph.internal import allocation_peak
from remat.models.llama import Llama, LlamaConfig, next_token_loss

RESULTS = pathlib.Path(__file__).parent / "results"
#: what the min-cut keeps per block at activation_memory_budget=0.8 (benchmarks/results/plan_sweep_compile.log)
KEEP = ("aten::_scaled_dot_product_flash_attention_for_cpu#0", "aten::add#1", "aten::add#2", "aten::add#3",
        "aten::mm#2", "aten::mm#4", "aten::mm#5", "aten::rsqrt#0", "aten::rsqrt#1")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Products(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _nothing_skipped() -> Iterator[None]:
    """Regions record no flow while active, so their re-runs skip nothing."""
    before = dead.worth_recording
    dead.worth_recording = lambda policy: False
    try:
        yield
    finally:
        dead.worth_recording = before


def _model(stages: int | str) -> torch.nn.Module:
    """The Llama, every block marked with the min-cut policy in ``stages`` stages (0: unmarked)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=4, width=256, heads=8, kv_heads=2, hidden=688, vocab=1000))
    for block in model.blocks if stages else ():
        remat.recompute_module(block, policy=remat.save_calls(*KEEP), stages=stages)
    return model


def run(rounds: int) -> dict:
    tokens = torch.zeros(4, 256, dtype=torch.long)
    plain, marked, staged, each = _model(0), _model(1), _model(2), _model("each")

    def step(model: torch.nn.Module, skip: bool = True) -> None:
        with contextlib.nullcontext() if skip else _nothing_skipped():
            next_token_loss(model(tokens)).backward()
        model.zero_grad(set_to_none=True)

    configs = {"unmarked": lambda: step(plain), "remat": lambda: step(marked),
               "remat, every call re-run": lambda: step(marked, skip=False),
               "remat, two stages": lambda: step(staged), "remat, each tensor on its own": lambda: step(each)}
    peaks, products = {}, {}
    for name, go in configs.items():
        go()
        peaks[name] = allocation_peak(go)
        with _Products() as count:
            go()
        products[name] = count.count
    times = {name: [] for name in configs}
    for r in range(rounds):
        names = list(configs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            configs[name]()
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name, seconds in times.items():
        ratios = [s / u for s, u in zip(seconds, times["unmarked"])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        rows[name] = {"median_ms": statistics.median(seconds) * 1e3, "ratio": q2, "q1": q1, "q3": q3,
                      "peak_bytes": peaks[name], "matmuls": products[name]}
    return {"torch": torch.__version__, "rounds": rounds, "keep": KEEP, "rows": rows}


def render(result: dict) -> str:
    lines = [f"# Dead calls skipped in selective re-runs ({result['rounds']} interleaved rounds, "
             f"torch {result['torch']}, 1 thread)", "",
             "| configuration | step | x unmarked (IQR) | peak | matrix products a step |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['median_ms']:.1f} ms | {r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) "
                     f"| {r['peak_bytes'] / 2**20:.2f} MiB | {r['matmuls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "dead_calls"))
    args = parser.parse_args(argv)
    result = run(args.rounds)
    text = render(result)
    print(text)
    pathlib.Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    pathlib.Path(args.out + ".md").write_text(text)
    return result


if __name__ == "__main__":
    main()
