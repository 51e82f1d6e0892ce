"""remat.checkpoint against torch.utils.checkpoint on the same model, both modes.

Interleaves the two in alternating pairs (A B B A ...), repeats, and reports the
median ratio of step times (remat / torch) with its spread, and the ratio of
bytes kept for backward (exact, from remat.memory.saved_bytes). One thread.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_vs_torch.py [--pairs 30] [--trials 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import json
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

import remat


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ConvBlock(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.c2, self.b2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def models():
    gpt = torch.nn.ModuleList(Block(256, 4) for _ in range(4))
    cnn = torch.nn.ModuleList(ConvBlock(64) for _ in range(4))
    return {
        "transformer 4x(d256,t128,b8)": (gpt, torch.randn(8, 128, 256)),
        "resnet-style 4x(c64,16x16,b16)": (cnn, torch.randn(16, 64, 16, 16)),
    }


def step(blocks, x, impl: str, reentrant: bool):
    h = x.requires_grad_() if reentrant else x
    for block in blocks:
        h = impl_call(impl, block, h, reentrant)
    return h.float().pow(2).mean()


def impl_call(impl, block, h, reentrant):
    if impl == "torch":
        return tuc.checkpoint(block, h, use_reentrant=reentrant)
    return remat.checkpoint(block, h, use_reentrant=reentrant)


def timed(blocks, x, impl, reentrant) -> float:
    start = time.perf_counter()
    step(blocks, x, impl, reentrant).backward()
    return time.perf_counter() - start


def compare(blocks, x, reentrant: bool, pairs: int, trials: int) -> dict:
    for _ in range(3):  # warm-up
        timed(blocks, x, "torch", reentrant), timed(blocks, x, "remat", reentrant)
    medians = []
    gc.disable()
    try:
        for _ in range(trials):
            ratios = []
            for i in range(pairs):
                order = ("remat", "torch") if i % 2 == 0 else ("torch", "remat")
                t = {impl: timed(blocks, x, impl, reentrant) for impl in order}
                ratios.append(t["remat"] / t["torch"])
            medians.append(statistics.median(ratios))
    finally:
        gc.enable()
    kept = {
        impl: remat.memory.saved_bytes(lambda impl=impl: step(blocks, x.detach(), impl, reentrant))
        for impl in ("remat", "torch")
    }
    return {
        "time_ratio_median": statistics.median(medians),
        "time_ratio_trials": medians,
        "kept_bytes_remat": kept["remat"],
        "kept_bytes_torch": kept["torch"],
        "kept_ratio": kept["remat"] / kept["torch"] if kept["torch"] else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/checkpoint_vs_torch.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cases": {}}
    print(f"threads={results['threads']} pairs={args.pairs} trials={args.trials}")
    print(f"{'model':34} {'mode':13} {'time remat/torch':>30} {'kept remat/torch':>18}")
    for name, (blocks, x) in models().items():
        for reentrant in (False, True):
            r = compare(blocks, x, reentrant, args.pairs, args.trials)
            mode = "reentrant" if reentrant else "non-reentrant"
            results["cases"][f"{name} {mode}"] = r
            lo, hi = min(r["time_ratio_trials"]), max(r["time_ratio_trials"])
            print(f"{name:34} {mode:13} {r['time_ratio_median']:8.3f} (trials {lo:.3f}..{hi:.3f})"
                  f" {r['kept_ratio']:12.3f} ({r['kept_bytes_remat']} B)")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    markdown = args.json.removesuffix(".json") + ".md"
    with open(markdown, "w") as f:
        f.write(to_markdown(results, args))
    print(f"wrote {args.json} and {markdown}")


def to_markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "### remat.checkpoint against torch.utils.checkpoint",
        "",
        (f"`OMP_NUM_THREADS=1 python benchmarks/checkpoint_vs_torch.py --pairs {args.pairs} "
        f"--trials {args.trials}` (generated; torch {results['torch']}, "
        f"{results['threads']} thread, CPU). Every block of each model is checkpointed by both "
        f"libraries; steps alternate in pairs (remat, torch / torch, remat); the time ratio is "
        f"the median over trials of the median pair ratio, with the range of the trial medians. "
        f"Kept bytes are exact (`remat.memory.saved_bytes`)."),
        "",
        "| model | mode | step time remat / torch | trials | kept bytes remat / torch |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for name, r in results["cases"].items():
        model, mode = name.rsplit(" ", 1)
        lo, hi = min(r["time_ratio_trials"]), max(r["time_ratio_trials"])
        lines.append(
            f"| {model} | {mode} | {r['time_ratio_median']:.3f} | {lo:.3f} .. {hi:.3f} | "
            f"{r['kept_ratio']:.3f} ({r['kept_bytes_remat'] / 2**20:.1f} MiB) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
