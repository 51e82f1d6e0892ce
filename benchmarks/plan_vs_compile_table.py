"""Print the planner against torch.compile's ``activation_memory_budget`` as a table, from the
committed results of ``benchmarks/plan_sweep.py --sections compile`` (the README shows it).

Usage:
    python benchmarks/plan_vs_compile_table.py [benchmarks/results/plan_sweep_compile.json]
"""

from __future__ import annotations

import json
import pathlib
import sys

DEFAULT = pathlib.Path(__file__).resolve().parent / "results" / "plan_sweep_compile.json"


def table(results: dict) -> str:
    m = max([6, *(len(run["model"]) for run in results["versus_compile"])])  # the model column's width
    head = (f"{'model':<{m}} {'budget':>6}  {'torch.compile':>22}  {'remat.compile(budget=)':>30}  "
            f"{'remat.plan, eager':>28}")
    units = (f"{'':<{m}} {'':>6}  {'peak MiB':>10} {'step ms':>11}  {'peak':>8} {'step ms':>11} "
             f"{'x compile':>9}  {'peak':>8} {'step ms':>10} {'x compile':>8}")
    lines = [head, units]
    for run in results["versus_compile"]:
        rows = run["rows"]
        for verdict in run["verdicts"]:
            fraction = verdict["budget"]
            torch_row = rows[f"torch.compile, activation_memory_budget={fraction}"]
            first = (f"{run['model']:<{m}} {fraction:>6}  {torch_row['peak_bytes'] / 2**20:>10.2f} "
                     f"{_ms(torch_row):>11}")
            cells = [first]
            for kind, label, width in (("compiled", "remat.compile(budget=)", 11),
                                       ("eager", "remat.plan (eager)", 10)):
                row = rows.get(f"{label} at the peak of budget={fraction}")
                if row is None:  # with the floor above the peak, where the log has it
                    missed = run.get("missed", {}).get(f"{label} at the peak of budget={fraction}", {})
                    floor = missed.get("floor")
                    shown = (f"no plan (floor {(floor - run['baseline_bytes']) / 2**20:.2f})"
                             if floor is not None and "baseline_bytes" in run else "no plan")
                    cells.append(f"{shown:>{width + 19}}")
                    continue
                cells.append(f"{row['peak_bytes'] / 2**20:>8.2f} {_ms(row):>{width}} "
                             f"{verdict[f'{kind}_time_ratio']:>8.3f}x")
            lines.append("  ".join(cells))
    return "\n".join(lines)


def _ms(row: dict) -> str:
    return f"{row['median_ms']:.1f}±{(row['q3_ms'] - row['q1_ms']) / 2:.1f}"


if __name__ == "__main__":
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    print(table(json.loads(path.read_text())))
