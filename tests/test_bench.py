"""`remat bench` at tiny sizes: the schedule, the configurations, a smoke run."""

import json

import pytest
import torch
from benchmarks.bench import (
    BASELINE,
    COMPILED,
    CONFIGURATIONS,
    BenchConfig,
    configure,
    plan_for,
    preparer,
    render_markdown,
    run_bench,
    schedule,
    workloads,
)

import remat
from remat.cli import main


@pytest.mark.parametrize("count", [1, 2, 5, 6])
@pytest.mark.parametrize("round_index", [0, 1, 3])
def test_schedule_puts_every_configuration_next_to_a_baseline(count, round_index):
    configs = [f"c{i}" for i in range(count)]
    plan = schedule(configs, round_index)
    timed = [name for name, _ in plan if name != BASELINE]
    assert sorted(timed) == configs  # each configuration exactly once per round
    for i, (name, base) in enumerate(plan):
        if name != BASELINE:
            assert plan[base][0] == BASELINE and abs(base - i) == 1
    assert plan[0][0] == BASELINE


def _gradients(model, x, y, forward=None):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy((model if forward is None else forward)(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_every_configuration_gives_the_baseline_gradients_and_switches_back():
    work = workloads(quick=True)["resnet50-cifar-b32"]
    torch.manual_seed(0)
    model = work.build()
    x, y = work.inputs()
    expected = _gradients(model, x, y)
    plan_for(model, work, x, y)
    eager = [name for name in CONFIGURATIONS if name not in COMPILED]
    for name in eager:
        configure(model, name)
        for got, want in zip(_gradients(model, x, y), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    configure(model, BASELINE)
    prepare = preparer(model, list(CONFIGURATIONS))
    for name in CONFIGURATIONS:  # compiled ones on configured copies, eager ones on model
        module, forward = prepare(name)
        for got, want in zip(_gradients(module, x, y, forward), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    prepare(BASELINE)
    assert remat.marked_modules(model) == {}
    assert all("forward" not in block.__dict__ for block in model.recompute_blocks())
    with pytest.raises(ValueError, match="unknown configuration"):
        configure(model, "nothing")


def test_bench_smoke_run_writes_json_and_markdown(tmp_path):
    config = BenchConfig(quick=True, pairs=1, trials=1, warmup=1, out_dir=str(tmp_path),
                         workloads=("resnet50-cifar-b32", "gpt"))
    result = run_bench(config, progress=False)
    saved = json.loads((tmp_path / "bench_quick.json").read_text())
    assert [w["name"] for w in saved["workloads"]] == [w["name"] for w in result["workloads"]]
    assert saved["torch_threads"] == torch.get_num_threads()
    for w in result["workloads"]:
        rows = w["rows"]
        assert list(rows) == list(CONFIGURATIONS)
        assert rows["remat cell marks"]["kept_bytes"] < rows[BASELINE]["kept_bytes"]
        assert rows["remat output_recompute"]["kept_bytes"] < rows["remat cell marks"]["kept_bytes"]
        assert rows["remat cell marks"]["vs_torch"]["against"] == "torch non-reentrant"
        assert rows["torch reentrant"]["pairs"] == 1
        compiled = rows["compiled remat cell marks"]
        assert compiled["kept_bytes"] < rows["compiled none"]["kept_bytes"]
        assert compiled["peak_bytes"] < rows["compiled none"]["peak_bytes"]
    markdown = (tmp_path / "bench_quick.md").read_text()
    assert markdown == render_markdown(saved)
    assert all(name in markdown for name in CONFIGURATIONS)


def test_bench_command_line_refuses_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="pairs and trials"):
        run_bench(BenchConfig(quick=True, pairs=0, out_dir=None), progress=False)
    code = main(["bench", "--quick", "--pairs", "1", "--trials", "1", "--warmup", "0",
                 "--workloads", "gpt", "--configurations", "none", "remat cell marks",
                 "--out", str(tmp_path)])
    assert code == 0
    saved = json.loads((tmp_path / "bench_quick.json").read_text())
    assert list(saved["workloads"][0]["rows"]) == ["none", "remat cell marks"]


def test_bench_without_the_repositorys_harness_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    import remat.cli.bench as command
    from remat.cli import UsageError

    monkeypatch.setattr(command, "BENCHMARKS", tmp_path)
    assert command.load_harness() is None
    with pytest.raises(UsageError) as caught:
        main(["bench"])
    assert caught.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [(f"remat bench: the benchmark harness is not installed with remat; it lives in the "
                      f"repository's benchmarks/ folder (looked for {tmp_path / 'bench.py'}): run remat "
                      f"bench (or make bench) from a clone installed with pip install -e .")]


def test_the_readme_table_is_rewritten_between_its_markers(tmp_path):
    from benchmarks.bench_report import BEGIN, END, include_markdown

    readme = tmp_path / "demo.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    assert include_markdown(str(readme), "| new | table |\n")
    assert readme.read_text() == f"intro\n{BEGIN}\n| new | table |\n{END}\noutro\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not include_markdown(str(plain), "x")
    assert plain.read_text() == "no markers\n"


def test_every_workload_compiles_its_compiled_configurations():
    # Each workload builds a new model whose forward code objects were compiled before;
    # past dynamo's recompile limit (8) the compiled rows of later workloads ran eagerly.
    from torch._dynamo.utils import counters

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

        def recompute_blocks(self) -> list:
            return [self.fc]

    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):  # more workloads than the limit
        prepare = preparer(Net(), ["compiled none"])
        before = counters["stats"]["unique_graphs"]
        _, forward = prepare("compiled none")
        forward(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert counters["stats"]["unique_graphs"] > before  # compiled, not run eagerly
