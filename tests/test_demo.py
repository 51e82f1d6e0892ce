"""`remat demo` at tiny sizes: same losses in every configuration, files written."""

import json

import torch

import remat
from remat.cli import main
from remat.cli._demo import CONFIGURATIONS, DemoConfig, build_model, run_demo
from remat.data import load_cifar10


def _plain_training(config: DemoConfig) -> float:
    """The demo's no-recompute run, written out by hand: the oracle for its final loss."""
    data = load_cifar10(None, size=max(256, config.batch_size * config.steps))
    torch.manual_seed(config.seed)
    model = build_model(config.model, None)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    for i in range(config.steps):
        images, labels = data.batch(i, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    return loss.item()


def test_demo_smoke_run_keeps_the_numbers_and_writes_results(tmp_path):
    config = DemoConfig(steps=2, batch_size=4, model="tiny", out_dir=str(tmp_path), device="cpu")
    result = run_demo(config, progress=False)
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows)[:-1] == [name for name, _ in CONFIGURATIONS]
    assert result["losses_identical"]
    assert rows["no recompute"]["final_loss"] == _plain_training(config)
    assert [r["marked_blocks"] for r in rows.values()][:-1] == [0, 2, 2, 2]  # tiny net: 2 stages of 2
    planned = result["rows"][-1]
    assert planned["name"].startswith("remat.plan") and len(planned["plan_choices"]) == 4
    assert planned["plan_budget_bytes"] < planned["plan_tutorial_peak_bytes"]
    kept = {n: r["kept_bytes"] for n, r in rows.items()}
    assert kept["tutorial marks"] < kept["no recompute"]
    assert kept["tutorial marks + output_recompute"] < kept["tutorial marks"]
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["rows"][1]["kept_bytes"] == kept["tutorial marks"]
    if hasattr(remat.memory, "track"):
        assert all(r["peak_bytes"] > r["kept_bytes"] for r in rows.values())
        assert planned["plan_measured_peak_bytes"] <= planned["plan_budget_bytes"]
        assert planned["peak_bytes"] <= planned["plan_budget_bytes"]  # the row within its budget line
        assert planned["peak_bytes"] < rows["tutorial marks"]["peak_bytes"]
        assert (tmp_path / "memory_timeline.png").stat().st_size > 0


def test_demo_command_line(tmp_path, capsys):
    code = main(["demo", "--model", "tiny", "--steps", "2", "--batch-size", "2",
                 "--out", str(tmp_path), "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tutorial marks + output_recompute" in out and "identical" in out
    assert "seed marks" not in out and "seed 003" not in out  # MindSpore's tutorial, by its name
    assert (tmp_path / "demo.json").exists()


def test_demo_times_every_configuration_in_interleaved_rotated_rounds(monkeypatch):
    """Steps are timed after training, one per configuration per round, in an order rotated
    every round (the sequential timing showed recompute faster than no recompute on a
    loaded machine); each row has its ratio to no recompute, median and quartiles."""
    import remat.cli._demo as demo

    calls, built = [], []
    original = demo.build_model

    def recorded(name, options):
        model = original(name, options)
        tag = len(built)
        built.append(tag)
        model.register_forward_pre_hook(lambda m, args: calls.append(tag))
        calls.append(None)  # a model built
        return model

    monkeypatch.setattr(demo, "build_model", recorded)
    config = DemoConfig(steps=1, batch_size=2, model="tiny", out_dir=None, device="cpu",
                        planner=False, rounds=3)
    rows = run_demo(config, progress=False)["rows"]
    n = len(rows)
    last_build = len(calls) - 1 - calls[::-1].index(None)
    timed = calls[last_build + 1:]  # the timing phase: built after every training run
    tags = built[-n:]
    assert timed[:n] == tags  # one warm-up step each
    rounds = [timed[n + r * n: n + (r + 1) * n] for r in range(3)]
    assert rounds == [tags[r:] + tags[:r] for r in range(3)]  # rotated every round
    assert rows[0]["step_s_ratio"] == 1.0 and rows[0]["step_s_ratio_iqr"] == (1.0, 1.0)
    for row in rows:
        low, high = row["step_s_ratio_iqr"]
        assert low <= row["step_s_ratio"] <= high and row["median_step_s"] > 0
