"""The examples a user copies run, at tiny sizes, and say what they promise."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_my_model_marks_plans_and_keeps_the_losses():
    out = run("examples/train_my_model.py", "--steps", "2", "--width", "32", "--budget", "90%")
    rows = [line for line in out.splitlines() if line.endswith(("True", "False"))]
    assert [r.split()[0] for r in rows] == ["no", 'remat.apply(where="blocks")', "remat.plan(budget='90%')"]
    assert all(r.endswith("True") for r in rows)  # the same losses, bit for bit
    assert "remat.plan: budget" in out


def test_hf_trainer_trains_with_remat():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = run("examples/hf_trainer.py", "--steps", "2")
    assert "recomputing 4 layers: transformer.h.0" in out and "trained 2 steps" in out


@pytest.mark.parametrize("program", ["functional_recompute", "cell_recompute"])
def test_mindspore_programs_run_with_their_imports_swapped(program):
    source = (ROOT / "examples" / "ms" / f"{program}.py").read_text()
    assert "import remat.ms" in source and "import torch.nn" not in source
    out = run(f"examples/ms/{program}.py")
    assert out.startswith("[[[[2. 4.]" if program == "functional_recompute" else "(Tensor(shape=[24, 12]")


def test_pipeline_example_plans_each_rank_and_trains_bitwise_within_each_budget():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = run("examples/pipeline.py", "--schedule", "1F1B", "--budget", "0.8")
    assert "remat.plan_pipeline: Schedule1F1B, 4 micro-batches, 2 ranks" in out
    ranks = sorted(line for line in out.splitlines() if line.startswith(("rank 0:", "rank 1:")))
    assert [r.split(":")[0] for r in ranks] == ["rank 0", "rank 1"], out
    assert all("within: True" in r and "bitwise equal to unmarked: True" in r for r in ranks), ranks
