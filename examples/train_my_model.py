"""Train your own PyTorch model with remat: mark it in one line, then plan it for a budget.

A plain training loop on a small transformer-style model (replace ``make_model`` and
``batches`` with yours). Three runs of the same steps from the same weights: without
recompute, with every block recomputed (``remat.apply(model, where="blocks")``), and
with what ``remat.plan`` chooses for 80% of the peak without recompute. Each prints the
peak memory of a training step (``remat.memory.track``: every live tensor, exactly) and
the time of a step; the losses are the same in all three, bit for bit.

    python examples/train_my_model.py [--steps 6] [--width 256] [--budget 80%]
"""

from __future__ import annotations

import argparse
import time

import torch

import remat
from remat.planner import BLOCK_OPTIONS  # whole blocks: keep, recompute, selective, output


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def make_model(width: int, layers: int = 6, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(*[Block(width) for _ in range(layers)],
                               torch.nn.Flatten(0, 1), torch.nn.Linear(width, classes))


def batches(steps: int, width: int, batch: int = 8, seq: int = 64) -> list:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, seq, width, generator=gen),
             torch.randint(0, 10, (batch * seq,), generator=gen)) for _ in range(steps)]


def train(model: torch.nn.Module, data: list) -> tuple[list[float], int, float]:
    """A plain training loop; return the losses, the highest step peak (bytes), the median step (s)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks, times = [], [], []
    for x, y in data:
        start = time.perf_counter()
        with remat.memory.track() as tracker:  # exact live tensor bytes, on any device
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        peaks.append(tracker.peak_bytes)
        losses.append(loss.item())
    return losses, max(peaks), sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--budget", default="80%", help="for remat.plan: bytes, '64MiB' or '70%%'")
    args = parser.parse_args(argv)
    data = batches(args.steps, args.width)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return make_model(args.width)

    runs = {}
    runs["no recompute"] = train(fresh(), data)

    model = fresh()
    remat.apply(model, where="blocks")  # the one line: every block recomputes in backward
    runs['remat.apply(where="blocks")'] = train(model, data)

    model = fresh()
    plan = remat.plan(model, data[0][0], budget=args.budget, blocks=Block, options=BLOCK_OPTIONS,
                      loss_fn=lambda out: torch.nn.functional.cross_entropy(out, data[0][1]),
                      optimizer="adamw")
    print(plan, end="\n\n")
    plan.apply(model)
    runs[f"remat.plan(budget={args.budget!r})"] = train(model, data)

    base_losses, base_peak, base_time = runs["no recompute"]
    print(f"{'run':<32} {'step peak':>12} {'step time':>14} {'losses equal':>13}")
    for name, (losses, peak, seconds) in runs.items():
        print(f"{name:<32} {peak / 2**20:8.1f} MiB {peak / base_peak:4.2f}x "
              f"{1e3 * seconds:6.0f} ms {seconds / base_time:4.2f}x {losses == base_losses!s:>7}")
    return 0 if all(r[0] == base_losses for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
