"""remat.ms in GRAPH_MODE: seed 001's MindSpore program runs through remat.compile and dumps its graphs."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_program
from tests.test_seeds import SEED_000_MINDSPORE, swap_imports

torch.set_num_threads(1)



def program(context: str) -> str:
    """Seed 001's MindSpore program with imports swapped, and one context line after them."""
    lines = swap_imports(SEED_000_MINDSPORE).splitlines()
    last_import = max(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    return "\n".join(lines[: last_import + 1] + [context] + lines[last_import + 1 :])


def run(context: str) -> tuple[dict, str]:
    return run_program(program(context))


@pytest.fixture
def fresh_context(fresh_ms_context):
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
