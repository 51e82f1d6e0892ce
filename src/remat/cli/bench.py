"""``remat bench``: remat against torch.utils.checkpoint on ResNet-50 and a GPT-2-style model.

The harness is not part of the installed package: it lives in ``benchmarks/bench.py``
of a clone of the repository, which this command loads (``make bench`` runs it).

Examples:
    $ OMP_NUM_THREADS=1 remat bench --quick --pairs 2 --trials 1
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import sys
from types import ModuleType

#: ``benchmarks/`` of the clone this package runs from (``src/remat/cli/bench.py``, three up).
BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
MISSING = ("remat bench: the benchmark harness is not installed with remat; it lives in the "
           "repository's benchmarks/ folder (looked for {}): run remat bench (or make bench) "
           "from a clone installed with pip install -e .")


def load_harness(folder: pathlib.Path | None = None) -> ModuleType | None:
    """Import ``benchmarks.bench`` from ``folder`` (default `BENCHMARKS`); ``None`` without it."""
    folder = BENCHMARKS if folder is None else folder
    if not (folder / "bench.py").is_file():
        return None
    if "benchmarks" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "benchmarks", folder / "__init__.py", submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = package
        spec.loader.exec_module(package)
    return importlib.import_module("benchmarks.bench")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``remat bench`` and its options (only a one-line error without the harness)."""
    harness = load_harness()
    if harness is None:
        parser = subparsers.add_parser("bench", help="benchmark remat (needs a clone's benchmarks/)",
                                       description=__doc__.splitlines()[0])
        parser.set_defaults(run=_missing)
        return
    BenchConfig, CONFIGURATIONS, workloads = harness.BenchConfig, harness.CONFIGURATIONS, harness.workloads
    default = BenchConfig()
    parser = subparsers.add_parser(
        "bench", help="benchmark remat against torch.utils.checkpoint",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and batches (a smoke test), results in bench_quick.*")
    parser.add_argument("--workloads", nargs="+", choices=sorted(workloads()),
                        default=list(default.workloads), help="which models and batches")
    parser.add_argument("--configurations", nargs="+", choices=CONFIGURATIONS,
                        default=list(CONFIGURATIONS), metavar="NAME",
                        help=f"which configurations (default all: {', '.join(CONFIGURATIONS)})")
    parser.add_argument("--pairs", type=int, default=default.pairs,
                        help=f"timing pairs per trial and configuration (default {default.pairs})")
    parser.add_argument("--trials", type=int, default=default.trials,
                        help=f"trials (default {default.trials})")
    parser.add_argument("--warmup", type=int, default=default.warmup,
                        help=f"warm-up steps per configuration (default {default.warmup})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default=default.out_dir, metavar="DIR",
                        help=f"where bench.json and bench.md go (default {default.out_dir})")
    parser.add_argument("--readme", default=default.readme, metavar="FILE",
                        help="markdown file whose bench markers receive the table "
                             f"(default {default.readme})")
    parser.add_argument("--render", metavar="JSON",
                        help="only re-render bench.md and the README table from a saved bench.json")
    parser.set_defaults(run=_run)


def _missing(args: argparse.Namespace) -> int:
    raise SystemExit(MISSING.format(BENCHMARKS / "bench.py"))


def _run(args: argparse.Namespace) -> int:
    harness = load_harness()
    BenchConfig, run_bench, write_results = harness.BenchConfig, harness.run_bench, harness.write_results
    if args.render:
        with open(args.render) as file:
            result = json.load(file)
        config = BenchConfig(**{**result["method"], "out_dir": args.out, "readme": args.readme,
                                "workloads": tuple(result["method"]["workloads"]),
                                "configurations": tuple(result["method"]["configurations"])})
        write_results(config, result)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    config = BenchConfig(
        workloads=tuple(args.workloads), pairs=args.pairs, trials=args.trials,
        warmup=args.warmup, quick=args.quick, out_dir=args.out,
        configurations=tuple(args.configurations), readme=args.readme,
    )
    run_bench(config, progress=True)
    return 0
