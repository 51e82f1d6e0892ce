"""`remat profile`: table, JSON and plot from a model factory, before and after marks."""

import json
import subprocess
import sys

import pytest
import torch

from remat.cli import main

torch.set_num_threads(1)
TINY = ["remat.models.llama:llama", "--arg", "layers=2", "--arg", "width=32", "--arg", "heads=4",
        "--arg", "hidden=64", "--arg", "vocab=64", "--input-shape", "2,16", "--input-dtype", "int64",
        "--loss", "next-token", "--repeat", "1"]


def test_profile_prints_table_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "p.json", tmp_path / "p.png"
    code = main(["profile", *TINY, "--marks", "blocks", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    text = capsys.readouterr().out
    assert "blocks.0" in text and "total kept" in text and "step peak" in text
    data = json.loads(out_json.read_text())
    before, after = data["before"], data["after"]
    assert after["total_kept"] < before["total_kept"]
    for report in (before, after):
        assert sum(r["kept_self"] for r in report["rows"]) + report["outside_kept"] == report["total_kept"]
    assert [r["name"] for r in after["rows"] if r["marked"]] == ["blocks.0", "blocks.1"]
    assert out_png.stat().st_size > 10_000


def test_estimate_mode_and_marks_by_class_name(tmp_path, capsys):
    out_json = tmp_path / "e.json"
    main(["profile", *TINY, "--estimate", "--marks", "LlamaBlock", "--json", str(out_json)])
    data = json.loads(out_json.read_text())
    assert data["before"]["estimated"] and data["after"]["estimated"]
    assert data["after"]["total_kept"] < data["before"]["total_kept"]
    assert "estimated on fake tensors" in capsys.readouterr().out


def test_marks_by_name_glob(tmp_path):
    out_json = tmp_path / "g.json"
    main(["profile", *TINY, "--marks", "blocks.1", "--optimizer", "none", "--json", str(out_json)])
    after = json.loads(out_json.read_text())["after"]
    assert [r["name"] for r in after["rows"] if r["marked"]] == ["blocks.1"]


@pytest.mark.parametrize("argv, message", [
    (["profile", "no_colon", "--input-shape", "2,16"], "module:function"),
    (["profile", "remat.models.llama:nothing", "--input-shape", "2,16"], "has no 'nothing'"),
    (["profile", *TINY, "--marks", "NoSuchBlock"], "matches no module"),
])
def test_errors_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_python_dash_m_remat_profile_help():
    done = subprocess.run([sys.executable, "-m", "remat", "profile", "--help"], capture_output=True,
                          text=True, check=True)
    assert "--input-shape" in done.stdout and "--marks" in done.stdout


def test_estimate_of_a_rank_with_tensor_parallelism_and_fsdp(tmp_path, capsys):
    path = tmp_path / "r.json"

    def estimate(*extra: str) -> dict:
        assert main(["profile", *TINY, "--estimate", "--optimizer", "none", "--json", str(path), *extra]) == 0
        return json.loads(path.read_text())

    one = estimate()
    tp = estimate("--world-size", "2", "--parallelize", "tp")
    assert (one["world_size"], tp["rank"], tp["world_size"]) == (None, 0, 2)
    # q, k, v, o (32x32) and gate, up, down (32x64) of 2 blocks: half on each rank
    assert one["param_bytes"] - tp["param_bytes"] == 2 * (4 * 32 * 32 + 3 * 32 * 64) * 4 // 2
    fsdp = estimate("--world-size", "2")  # fsdp by default: every parameter halved
    assert fsdp["param_bytes"] * 2 == one["param_bytes"]
    assert "rank 0 of 2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    ([*TINY, "--world-size", "2"], "add --estimate"),
    ([*TINY, "--estimate", "--parallelize", "tp"], "need --world-size"),
    ([*TINY, "--estimate", "--world-size", "0"], "--world-size must be at least 1"),
    ([*TINY, "--estimate", "--world-size", "2", "--rank", "2"], r"rank must be in \[0, 2\)"),
    (["remat.models.gpt:gpt", "--arg", "layers=1", "--arg", "width=16", "--arg", "heads=2",
      "--input-shape", "1,8", "--input-dtype", "int64", "--estimate", "--world-size", "2",
      "--parallelize", "tp"], "Llama only"),
])
def test_rank_arguments_exit_with_a_message(argv, message):
    import torch.distributed as dist

    with pytest.raises(SystemExit, match=message):
        main(["profile", *argv])
    assert not dist.is_initialized()
