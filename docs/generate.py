"""Write every output the README and the documentation pages show, by running what made it.

Each entry of :data:`OUTPUTS` is a command (run from the repository root, with
``src`` on the path and one torch thread) and the file its output goes to; the
pages include those files (``<!-- include: docs/outputs/NAME.out -->``), and
``docs/build_readme.py`` then rebuilds the README and the pages.

    python docs/generate.py              # the fast outputs (seconds each)
    python docs/generate.py --all        # also the slow ones (minutes: plan_gpt, its plot)
    python docs/generate.py three_ways   # the named ones only

Outputs with measured times differ from run to run; the tests check the exact text
of the deterministic ones (``tests/test_docs_pages.py``) and the shape of the others.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "outputs"


@dataclasses.dataclass(frozen=True)
class Output:
    """``command``'s stdout, written to ``docs/outputs/<name>.out``."""

    name: str
    command: str
    #: the file shows ``$ <command>`` on its first line (shell commands users type)
    show_command: bool = False
    #: keep only the first ``head`` lines, then ``...`` (None: all)
    head: int | None = None
    #: same text on every run: tests compare it exactly
    deterministic: bool = True
    #: minutes rather than seconds: only with --all or by name
    slow: bool = False
    #: files the command writes, copied to docs/ (source, destination)
    copies: tuple[tuple[str, str], ...] = ()


PLAN_GPT = ("remat plan remat.models.gpt:gpt --arg layers=8 --arg width=128 --arg heads=4 "
            "--arg seq_len=128 --arg vocab=512 --input-shape 8,128 --input-dtype int64 "
            "--loss next-token --budget 60% --json plan.json --plot pareto.png --sweep 6 --repeat 9")

OUTPUTS = (
    Output("quickstart", "python examples/quickstart.py"),
    Output("quickstart_plan", "python examples/quickstart_plan.py", deterministic=False),
    Output("three_ways", "python examples/three_ways.py"),
    Output("plan_vs_compile", "python benchmarks/plan_vs_compile_table.py"),
    Output("ms_functional_recompute", "python examples/ms/functional_recompute.py"),
    Output("ms_cell_recompute", "python examples/ms/cell_recompute.py", head=10),
    Output("train_my_model", "python examples/train_my_model.py", deterministic=False),
    Output("profile_resnet50", "remat profile remat.models.resnet:resnet50 --input-shape 32,3,32,32 "
           "--marks blocks --optimizer sgd --depth 1 --repeat 2 --plot timeline.png",
           show_command=True, deterministic=False, slow=True,
           copies=(("timeline.png", "docs/memory_timeline_resnet50.png"),)),
    Output("profile_gpt", "remat profile remat.models.gpt:gpt --arg layers=4 --arg width=256 "
           "--arg heads=4 --arg seq_len=128 --arg vocab=4096 --input-shape 8,128 --input-dtype int64 "
           "--loss next-token --marks blocks --repeat 2 --plot timeline.png",
           show_command=True, deterministic=False, slow=True,
           copies=(("timeline.png", "docs/memory_timeline_gpt.png"),)),
    Output("demo", "remat demo --out .", deterministic=False, slow=True,
           copies=(("memory_timeline.png", "docs/demo_memory_timeline.png"),)),
    Output("plan_gpt", PLAN_GPT, show_command=True, deterministic=False, slow=True,
           copies=(("pareto.png", "docs/plan_pareto_gpt.png"),)),
)


def environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}


def run(output: Output, workdir: pathlib.Path | None = None) -> str:
    """Run ``output``'s command and return the text its file holds."""
    argv = shlex.split(output.command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "remat":
        argv[:1] = [sys.executable, "-m", "remat"]
    workdir = workdir or ROOT
    argv = [str(ROOT / a) if a.startswith(("examples/", "docs/", "benchmarks/")) else a for a in argv]
    done = subprocess.run(argv, cwd=workdir, env=environment(), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"docs/generate.py: {output.command!r} failed:\n{done.stderr}")
    lines = done.stdout.strip("\n").split("\n")
    if output.head is not None and len(lines) > output.head:
        lines = [*lines[:output.head], " ..."]
    if output.show_command:
        lines.insert(0, f"$ {output.command}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("-")]
    unknown = set(names) - {o.name for o in OUTPUTS}
    if unknown:
        raise SystemExit(f"docs/generate.py: unknown output(s) {sorted(unknown)}; "
                         f"choose from {[o.name for o in OUTPUTS]}")
    chosen = [o for o in OUTPUTS if o.name in names or (not names and ("--all" in argv or not o.slow))]
    OUT.mkdir(exist_ok=True)
    scratch = ROOT / "docs" / ".scratch"
    for output in chosen:
        print(f"docs/generate.py: {output.command}", file=sys.stderr, flush=True)
        scratch.mkdir(exist_ok=True)
        try:
            (OUT / f"{output.name}.out").write_text(run(output, scratch))
            for source, destination in output.copies:
                shutil.copyfile(scratch / source, ROOT / destination)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return subprocess.call([sys.executable, str(ROOT / "docs" / "build_readme.py")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
