"""``remat bench``: remat against torch.utils.checkpoint on ResNet-50 and a GPT-2-style model.

Example:
    $ OMP_NUM_THREADS=1 remat bench --quick --pairs 2 --trials 1
"""

from __future__ import annotations

import argparse
import json
import os

from remat.cli._bench import CONFIGURATIONS, BenchConfig, run_bench, workloads, write_results


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``remat bench`` and its options."""
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


def _run(args: argparse.Namespace) -> int:
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
