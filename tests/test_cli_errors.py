"""Every mistake on the ``remat`` command line is one line on stderr and exit status 2.

A bad value names the flag and the values it accepts; a misspelled option shows the
subcommand's usage and the nearest option; nothing prints a traceback.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from remat.cli import UsageError, main

SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")
GPT = ["remat.models.gpt:gpt", "--arg", "layers=1", "--arg", "width=16", "--arg", "heads=2",
       "--arg", "seq_len=8", "--arg", "vocab=32", "--input-shape", "2,8", "--input-dtype", "int64"]


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    return exit.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, expected", [
    (["plan", *GPT, "--budget", "60%", "--optimizer", "adagrad"],
     "argument --optimizer: invalid choice: 'adagrad' (choose from 'adam', 'adamw', 'sgd', 'none')"),
    (["profile", *GPT, "--optimizer", "adagrad"], "argument --optimizer: invalid choice"),
    (["plan", "remat.models.gpt:gpt", "--budget", "60%"],
     "the following arguments are required: --input-shape"),
    (["profile", "remat.models.gpt:gpt"], "the following arguments are required: --input-shape"),
    (["plan", *GPT, "--budget", "60%", "--input-dtype", "int65"],
     "argument --input-dtype: invalid choice: 'int65' (choose from 'float32'"),
    (["plan", *GPT, "--budget", "60%", "--input-shape", "8,a"], "argument --input-shape: expected sizes"),
    (["plan", *GPT, "--budget", "60%", "--input-shape", "8,x"], "argument --input-shape: expected sizes"),
    (["profile", *GPT, "--input-shape", "8,,2"], "argument --input-shape: expected sizes"),
    (["plan", *GPT, "--budget", "-10%"], "argument --budget: cannot read budget '-10%'"),
    (["plan", *GPT, "--budget", "60"], "argument --budget: budget '60' has no unit; did you mean '60%'"),
    (["plan", *GPT, "--budget", "lots"], "argument --budget: cannot read budget 'lots'"),
    (["plan", *GPT, "--budget", "-5"], "argument --budget: cannot read budget '-5'"),
    (["plan", *GPT], "give --budget"),
    (["plan", *GPT, "--budget", "60%", "--arg", "layers"], "argument --arg: expected KEY=VALUE"),
    (["plan", *GPT, "--budget", "60%", "--arg", "depth=3"], "--arg: GPTConfig.__init__() got an"),
    (["plan", *GPT, "--budget", "60%", "--arg", "heads=3"],  # the factory's own check
     "the model factory refused its arguments (--arg layers=1 --arg width=16 --arg heads=3"),
    (["profile", *GPT, "--arg", "heads=3"], "heads must divide width, got width=16 and heads=3"),
    (["plan", *GPT, "--budget", "60%", "--threads", "0"], "argument --threads: expected a positive"),
    (["profile", *GPT, "--threads", "many"], "argument --threads: expected a positive integer"),
    (["plan", *GPT, "--budget", "60%", "--options", "keep,offload"], "--options: unknown option"),
    (["plan", *GPT, "--budget", "60%", "--loss", "mse"], "argument --loss: invalid choice: 'mse'"),
    (["plan", "remat.models.gpt", "--input-shape", "2,8", "--budget", "60%"],
     "remat plan: the model must be given as module:function"),
    (["plan", "no_such_module:make", "--input-shape", "2,8", "--budget", "60%"],
     "remat plan: cannot import module 'no_such_module'"),
    (["profile", *GPT, "--marks", "NoSuchBlock"], "matches no module"),
    (["plna"], "argument COMMAND: invalid choice: 'plna'"),
])
def test_a_bad_value_is_one_line_naming_the_flag(argv, expected, capsys):
    code, lines = run(argv, capsys)
    assert code == 2
    assert len(lines) == 1, lines
    assert expected in lines[0]
    assert lines[0].startswith(f"remat {argv[0]}:" if argv[0] != "plna" else "remat:")


def test_a_misspelled_option_shows_the_subcommands_usage_and_the_nearest_option(capsys):
    code, lines = run(["plan", *GPT, "--budjet", "60%"], capsys)
    assert code == 2
    assert lines[0].startswith("usage: remat plan ")
    assert lines[-1] == ("remat plan: error: unrecognized arguments: --budjet 60% "
                         "('--budjet': did you mean --budget?)")


def test_usage_error_is_a_system_exit_of_status_2():
    error = UsageError("remat plan: give --budget")
    assert isinstance(error, SystemExit) and error.code == 2 and str(error) == "remat plan: give --budget"


def test_help_has_no_docstring_markup_or_internal_words():
    for command in ("demo", "bench", "profile", "plan"):
        parser = main.__globals__["build_parser"]()[1][command]
        text = parser.format_help()
        assert "``" not in text and "seed 003" not in text and "seed marks" not in text, command


def test_the_remat_command_loads_a_model_from_the_working_directory(tmp_path):
    (tmp_path / "my_model.py").write_text(textwrap.dedent("""
        import torch

        def make(width=8):
            return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 1))
    """))
    # the console script's sys.path holds no working directory: run main() as it would
    code = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
            "from remat.cli import main; sys.exit(main())")
    argv = ["profile", "my_model:make", "--input-shape", "4,8", "--repeat", "0", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert "total kept" in done.stdout
    bad = subprocess.run([sys.executable, "-c", code, *argv, "--optimizer", "adagrad"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        ("remat profile: error: argument --optimizer: invalid choice: 'adagrad' "
         "(choose from 'adam', 'adamw', 'sgd', 'none')")]


def test_token_ids_are_inferred_without_input_dtype(capsys):
    """A model that looks its inputs up in an embedding gets int64 inputs (observed on the
    meta device); before, float inputs gave a 47-line torch traceback."""
    argv = [a for a in GPT if a not in ("--input-dtype", "int64")]
    assert main(["profile", *argv, "--arg", "layers=2", "--loss", "next-token", "--repeat", "0"]) == 0
    assert "step" in capsys.readouterr().out


def test_the_python_api_refuses_a_model_with_nothing_to_train_and_a_unitless_budget():
    import torch

    import remat

    relus = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.ReLU()) for _ in range(3)])
    x = torch.randn(2, 3, requires_grad=True)
    for call in (lambda: remat.profile(relus, x), lambda: remat.plan(relus, x, budget="60%")):
        with pytest.raises(ValueError, match="no parameter that requires grad.*optimizer=None"):
            call()
    net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(3)])
    with pytest.raises(ValueError, match="budget '60' has no unit; did you mean '60%'.*'60B'"):
        remat.plan(net, x, budget="60")
    assert remat.profile(relus, x, optimizer=None, repeat=0).rows
