"""The three ways to mark a PyTorch model, and the bytes each keeps for backward.

    python examples/three_ways.py
"""

import copy

import torch

import remat

torch.manual_seed(0)
B, T, D = 8, 128, 256


class Block(torch.nn.Module):
    """A plain PyTorch transformer MLP block: nothing remat-specific."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


model = torch.nn.Sequential(*[Block() for _ in range(4)])
x = torch.randn(B, T, D)


def kept(m, forward=None):
    forward = forward or (lambda: m(x).sum())
    return remat.memory.saved_bytes(forward)


def grads(m, forward):
    m.zero_grad()
    forward(m).backward()
    return [p.grad.clone() for p in m.parameters()]


plain = kept(model)
rows = [("no marks", plain)]

# 1. cell marks: any module, MindSpore's Cell.recompute semantics
cells = copy.deepcopy(model)
remat.apply(cells, where=Block)
rows.append(("remat.apply(model, where=Block)", kept(cells)))
cells_out = copy.deepcopy(model)
remat.apply(cells_out, where=Block, output_recompute=True)
rows.append(("... output_recompute=True", kept(cells_out)))
selective = copy.deepcopy(model)
remat.apply(selective, where=Block, policy=remat.save_compute_intensive)
rows.append(("... policy=save_compute_intensive", kept(selective)))

# 2. operator marks (MindSpore's Primitive.recompute): every GELU's output is not kept,
#    even by fc2 which saves it; it is rebuilt from GELU's input when backward needs it
ops = copy.deepcopy(model)
remat.apply(ops, where=torch.nn.GELU, output_recompute=True)
rows.append(("remat.apply(model, where=nn.GELU, output_recompute=True)", kept(ops)))


# 3. functional: remat.recompute(block, x) inside forward
def functional(m):
    h = x
    for block in m:
        h = remat.recompute(block, h)
    return h.sum()


rows.append(("remat.recompute(block, h) per block", kept(model, lambda: functional(model))))

print(f"{'marks':58} {'kept for backward':>18} {'vs none':>8}")
for name, nbytes in rows:
    print(f"{name:58} {nbytes / 2**20:14.1f} MiB {nbytes / plain:8.2f}")

reference = grads(model, lambda m: m(x).pow(2).mean())
for name, m in [("cells", cells), ("cells+output_recompute", cells_out), ("selective", selective), ("op", ops)]:
    same = all(torch.equal(a, b) for a, b in zip(reference, grads(m, lambda m: m(x).pow(2).mean())))
    print(f"gradients of '{name}' equal the unmarked model's: {same}")
