"""`remat plan` on the command line: the table, the JSON plan, the Pareto plot, --max-batch."""

from __future__ import annotations

import re

import pytest

import remat
from remat.cli import main
from remat.cli.plan import largest_batch, mark_strategy
from remat.models import gpt

TINY = ["remat.models.gpt:gpt", "--arg", "layers=4", "--arg", "width=32", "--arg", "heads=4",
        "--arg", "seq_len=32", "--arg", "vocab=64", "--input-shape", "8,32", "--input-dtype", "int64",
        "--loss", "next-token"]


def test_plan_command_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    path, png = tmp_path / "plan.json", tmp_path / "pareto.png"
    code = main(["plan", *TINY, "--budget", "70%", "--json", str(path), "--plot", str(png),
                 "--sweep", "3", "--repeat", "1"])
    assert code == 0
    out = capsys.readouterr().out
    plan = remat.Plan.from_json(path.read_text())
    # a run of identical rows prints as one ("blocks.0..3 (4)"): expand those ranges
    shown = set(re.findall(r"[\w.]+", out))
    for stem, first, last in re.findall(r"([\w.]+?)\.(\d+)\.\.(\d+)", out):
        shown |= {f"{stem}.{i}" for i in range(int(first), int(last) + 1)}
    assert all(name in shown for name in plan.choices) and "within budget" in out
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert png.stat().st_size > 0


def test_plan_command_reports_a_budget_below_the_floor(capsys):
    assert main(["plan", *TINY, "--budget", "1000"]) == 1
    assert "smallest reachable peak" in capsys.readouterr().err


def test_anchor_strategies_mark_the_planned_blocks():
    model = gpt(layers=4, width=32, heads=4, seq_len=32, vocab=64)
    mark_strategy(model, "sqrt(n) segments")
    specs = remat.marked_modules(model)
    assert [specs[f"blocks.{i}"].output_recompute for i in range(4)] == [True, False, True, False]
    remat.unmark(model)
    mark_strategy(model, "selective policy")
    assert {s.policy for s in remat.marked_modules(model).values()} == {remat.save_compute_intensive}
    with pytest.raises(ValueError, match="unknown strategy"):
        mark_strategy(model, "offload")


def test_largest_batch_searches_by_doubling_then_bisection():
    calls = []

    def fits(batch: int) -> bool:
        calls.append(batch)
        return batch <= 37

    assert largest_batch(fits, 4) == 37
    assert largest_batch(lambda b: False, 4) == 0
    assert len(calls) <= 12


def test_plan_command_plans_a_rank(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--estimate", "--world-size", "2", "--budget", "90%", "--json", str(path)]) == 0
    plan = remat.Plan.from_json(path.read_text())
    assert (plan.rank, plan.world_size) == (0, 2)
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.no_recompute_peak_bytes
    assert "per rank (rank 0 of 2)" in capsys.readouterr().out


def test_plan_command_options_restrict_the_families(tmp_path, capsys):
    path = tmp_path / "plan.json"
    chosen = {}
    for options in (None, "keep,recompute,selective,output"):
        extra = [] if options is None else ["--options", options]
        assert main(["plan", *TINY, "--estimate", "--budget", "90%", "--json", str(path), *extra]) == 0
        chosen[options] = set(remat.Plan.from_json(path.read_text()).choices.values())
    assert any(c.startswith(("children:", "ops:")) for c in chosen[None]), chosen  # options inside blocks
    assert chosen["keep,recompute,selective,output"] <= {"keep", "recompute", "selective", "output"}
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--options: unknown option.*offload"):
        main(["plan", *TINY, "--estimate", "--budget", "70%", "--options", "keep,offload"])


def _accumulate(model, batch, n=2):
    """The loop `--micro-batches 2` stands for, written out: the oracle of the test below."""
    from remat.models.llama import next_token_loss

    for (chunk,) in zip(*(t.chunk(n) for t in batch), strict=True):
        next_token_loss(model(chunk)).backward()


@pytest.mark.parametrize("how", ["--micro-batches", "--step"])
def test_plan_command_holds_its_budget_in_the_users_loop(how, tmp_path, capsys, monkeypatch):
    """A plan made for the standard step peaked 9.6% over its budget in a two micro-batch
    loop (issue 27); `--micro-batches 2` or `--step module:function` plans that loop, and
    the plan holds its budget there, measured again here on a fresh model."""
    import torch

    from remat.memory.internal import Step
    from remat.planner.internal import measure_peak

    (tmp_path / "my_loop.py").write_text(
        "from tests.test_cli_plan import _accumulate\n\n"
        "def step(model, batch):\n    _accumulate(model, batch)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "plan.json"
    loop = ["--micro-batches", "2"] if how == "--micro-batches" else ["--step", "my_loop:step"]
    assert main(["plan", *TINY, "--budget", "80%", *loop, "--json", str(path), "--repeat", "1"]) == 0
    assert "within budget" in capsys.readouterr().out
    plan = remat.Plan.from_json(path.read_text())
    torch.manual_seed(0)
    model = gpt(layers=4, width=32, heads=4, seq_len=32, vocab=64)
    plan.apply(model)
    batch = (torch.zeros(8, 32, dtype=torch.int64),)
    peak = measure_peak(model, Step(batch=batch, custom=_accumulate), optimizer="adam", fake=False)
    assert peak <= plan.budget_bytes


@pytest.mark.parametrize("extra, message", [
    (["--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--micro-batches", "3"], "--micro-batches 3 does not divide the batch"),
    (["--step", "my_loop:step", "--estimate"], "--step is the whole loop body"),
])
def test_plan_command_loop_options_are_checked(extra, message, capsys):
    with pytest.raises(SystemExit):
        main(["plan", *TINY, "--budget", "80%", *extra])
    assert message in capsys.readouterr().err


def test_plan_command_states_one_measured_overhead(capsys):
    """It printed two "measured" overheads in one output (+37.7% and +39.1%, issue 27): the
    planner's timing of the plan and a second timing by the command. One figure now."""
    assert main(["plan", *TINY, "--budget", "80%", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    header = re.findall(r"measured ([+-][\d.]+)%", out)
    row = re.findall(r"^overhead\s+[+-][\d.]+%\s+([+-][\d.]+)%", out, re.MULTILINE)
    assert len(header) == 1 and row == header
