"""``remat demo``: train ResNet-50 on CIFAR-10 with and without recompute, and compare.

Examples:
    $ remat demo --steps 12 --batch-size 16
"""

from __future__ import annotations

import argparse

from remat.cli._demo import DemoConfig, run_demo


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``remat demo`` and its options."""
    default = DemoConfig()
    parser = subparsers.add_parser(
        "demo", help="train ResNet-50 on CIFAR-10 with and without recompute",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--steps", type=int, default=default.steps,
                        help=f"training steps per configuration (default {default.steps})")
    parser.add_argument("--batch-size", type=int, default=default.batch_size,
                        help=f"images per step (default {default.batch_size})")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="folder of the CIFAR-10 binary files (default: synthetic data)")
    parser.add_argument("--out", default=default.out_dir, metavar="DIR",
                        help=f"where demo.json and the plot go (default {default.out_dir})")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--model", choices=("resnet50", "tiny"), default=default.model,
                        help="resnet50 (MindSpore's recomputation guide) or a tiny ResNet for smoke tests")
    parser.add_argument("--seed", type=int, default=default.seed, help="seed of the weights")
    parser.add_argument("--no-planner", action="store_true",
                        help="leave out the remat.plan row (planned below the block marks' peak)")
    parser.add_argument("--rounds", type=int, default=default.rounds,
                        help=f"interleaved timing rounds after training (default {default.rounds}; "
                             "0: no timing)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared CPU more threads wait on "
                             "each other and run many times slower)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    config = DemoConfig(
        steps=args.steps, batch_size=args.batch_size, data_dir=args.data, out_dir=args.out,
        device=args.device, model=args.model, seed=args.seed, planner=not args.no_planner,
        rounds=args.rounds,
    )
    result = run_demo(config, progress=True)
    return 0 if result["losses_identical"] else 1
