"""remat.ms in GRAPH_MODE: seed 001's MindSpore program runs through remat.compile and dumps its graphs."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

from remat.ms import _context

torch.set_num_threads(1)

# Seed 001, "Code Example 1", the MindSpore half, with imports swapped to remat.ms
# and one context line (seed 003's way of asking for graph dumps).
SEED_001 = """
import remat.ms as mindspore
import numpy as np
from remat.ms import nn, ops
{context}
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(12, 24)
        self.relu1 = ops.ReLU()
        self.fc2 = nn.Dense(24, 48)
        self.fc2.recompute()
        self.relu2 = ops.ReLU()
        self.relu2.recompute()
        self.fc3 = nn.Dense(48, 2)

    def construct(self, x):
        x = self.fc1(x)
        x = self.relu1(x)
        x = self.fc2(x)
        x = self.relu2(x)
        x = self.fc3(x)
        return x

model = Net()

def forward_fn(data, label):
    logits = model(data)
    loss = logits.sum()
    return loss, logits

grad_fn = mindspore.value_and_grad(forward_fn, None, (model.fc1.weight,), has_aux=True)
x = mindspore.Tensor(np.random.randn(2, 12), dtype=mindspore.float32)
label = mindspore.Tensor(np.random.randn(2, 12), dtype=mindspore.float32)
(loss, _), grads = grad_fn(x, label)
print(grads)
"""


def run(context: str) -> tuple[dict, str]:
    torch.manual_seed(0)
    np.random.seed(0)
    scope: dict = {"__name__": "__seed__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(SEED_001.format(context=context), "<seed>", "exec"), scope)  # noqa: S102
    return scope, out.getvalue()


@pytest.fixture
def fresh_context(monkeypatch):
    monkeypatch.setattr(_context, "_context", dict(_context._DEFAULTS))
    torch._dynamo.reset()


def test_seed_001_in_graph_mode_prints_pynative_gradients_and_dumps(fresh_context, tmp_path):
    _, pynative = run("mindspore.set_context(mode=mindspore.PYNATIVE_MODE)")
    graph_context = (
        f"mindspore.set_context(mode=mindspore.GRAPH_MODE, save_graphs=True, "
        f"save_graphs_path={str(tmp_path)!r})"
    )
    scope, graph = run(graph_context)
    assert graph == pynative and "[[" in graph
    lines = (tmp_path / "graph0_01_recompute.ir").read_text().splitlines()
    copies = [line for line in lines if "duplicated: true" in line]
    assert len(copies) == 1 and "aten.relu.default" in copies[0] and "model.relu2" in copies[0]
    # a second step reuses the compiled function: no new graph, no new dumps
    before = sorted(p.name for p in tmp_path.iterdir())
    scope["grad_fn"](scope["x"], scope["label"])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_graph_mode_without_save_graphs_writes_nothing(fresh_context, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, pynative = run("")
    _, graph = run("mindspore.set_context(mode=mindspore.GRAPH_MODE)")
    assert graph == pynative
    assert list(tmp_path.iterdir()) == []
