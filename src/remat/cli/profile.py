"""``remat profile``: the per-module memory table of a model, before and after marks.

Examples:
    $ remat profile remat.models.resnet:resnet50 --input-shape 8,3,32,32 --marks blocks \\
          --json profile.json --plot timeline.png
    $ remat profile remat.models.llama:llama --arg layers=2 --input-shape 1,128 \\
          --input-dtype int64 --loss next-token --estimate --marks LlamaBlock
    $ remat profile remat.models.llama:llama --arg layers=16 --input-shape 1,1024 \\
          --input-dtype int64 --loss next-token --estimate --world-size 8 --parallelize fsdp
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

API = "remat profile"
#: What ``--input-dtype`` accepts: names of torch dtypes.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
#: What ``--optimizer`` accepts (none: no optimizer step).
OPTIMIZERS = ("adam", "adamw", "sgd", "none")


def add_model_arguments(parser: Any, example: str) -> None:
    """The arguments that say which model and inputs: shared by ``remat profile`` and ``remat plan``."""
    parser.add_argument("factory", help="the model, as module:function returning an nn.Module: "
                                        "my_model:make calls make() of ./my_model.py; e.g. "
                                        f"{example}")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", type=keyword_argument,
                        help="keyword argument for the factory (a Python literal), repeatable")
    parser.add_argument("--input-shape", action="append", required=True, metavar="N,N,...",
                        type=parse_shape,
                        help="shape of one positional input of the model, e.g. 8,3,32,32; "
                             "repeat it for a model of several inputs")
    parser.add_argument("--input-dtype", default=None, choices=DTYPES, metavar="DTYPE",
                        help=f"dtype of the inputs: {', '.join(DTYPES)} (default: int64 when the "
                             "model looks its inputs up in an embedding, as token ids; else float32)")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="torch threads (default: torch's own choice)")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_rank_arguments(parser: Any) -> None:
    """``--world-size``, ``--parallelize``, ``--rank``: one rank of a job, with ``--estimate``
    (shared by ``remat profile`` and ``remat plan``)."""
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="with --estimate: one rank of an N-rank job, on a fake process group")
    parser.add_argument("--parallelize", choices=sorted(PARALLELISMS),
                        help="how --world-size shards the model: fsdp (default: fully_shard on each "
                             "block, then on the model) or tp (tensor parallelism: "
                             "remat.models.llama.tensor_parallel)")
    parser.add_argument("--rank", type=int, help="with --world-size: the rank measured (default 0)")


def fully_shard_blocks(model: torch.nn.Module, mesh: Any) -> None:
    """FSDP2 as ``--parallelize fsdp`` applies it: a unit per block, then the model's root."""
    from torch.distributed.fsdp import fully_shard

    from remat._front.blocks import find_blocks

    for _, block in find_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tensor_parallel(model: torch.nn.Module, mesh: Any) -> None:
    """``--parallelize tp``: `remat.models.llama.tensor_parallel` (Llama models only)."""
    from remat.models.llama import Llama
    from remat.models.llama import tensor_parallel as shard

    if not isinstance(model, Llama):
        raise SystemExit(f"--parallelize tp shards remat.models.llama's Llama only, got "
                         f"{type(model).__name__}; use --parallelize fsdp")
    shard(model, mesh)


PARALLELISMS = {"fsdp": fully_shard_blocks, "tp": tensor_parallel}


def rank_options(args: argparse.Namespace, api: str) -> dict[str, Any]:
    """The ``world_size``, ``parallelize``, ``rank`` keywords the command line asks for."""
    if args.world_size is None:
        if args.parallelize is not None or args.rank is not None:
            raise SystemExit(f"{api}: --parallelize and --rank need --world-size N")
        return {}
    if not args.estimate:
        raise SystemExit(f"{api}: --world-size estimates one rank on a fake process group: add "
                         f"--estimate (on a real rank, run under torchrun without --world-size)")
    from remat.memory.estimate import Ranks

    options = {"world_size": args.world_size, "parallelize": PARALLELISMS[args.parallelize or "fsdp"],
               "rank": args.rank}
    try:
        Ranks(**options, api=api)
    except (TypeError, ValueError) as err:
        raise SystemExit(str(err).replace("world_size", "--world-size")) from None
    return options


def add_parser(subparsers: Any) -> None:
    """Register ``remat profile`` on the ``remat`` command line."""
    parser = subparsers.add_parser("profile", help="per-module memory and time of a training step",
                                   description=__doc__.splitlines()[0])
    add_model_arguments(parser, "remat.models.resnet:resnet50")
    parser.add_argument("--marks", action="append", default=[], metavar="WHICH",
                        help="modules to recompute: 'blocks' (the model's mark_blocks(), else the "
                             "repeated block remat.apply(where='blocks') finds), a class "
                             "name, or a glob over module names; profiles before and after")
    parser.add_argument("--output-recompute", action="store_true", help="mark with output_recompute=True")
    parser.add_argument("--loss", choices=("sum", "next-token"), default="sum",
                        help="loss on the output: sum, or next-token cross-entropy for logits")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                        help="optimizer of the step: adam (default), adamw, sgd or none")
    parser.add_argument("--estimate", action="store_true",
                        help="build the model on fake tensors: nothing is allocated, no times")
    add_rank_arguments(parser)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per profile (default 3)")
    parser.add_argument("--depth", type=int, default=2, help="module depth shown in the table")
    parser.add_argument("--json", metavar="PATH", help="write the report(s) as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the memory timeline as PNG")
    parser.set_defaults(run=run)


def load_factory(spec: str, api: str = API) -> Callable[..., torch.nn.Module]:
    """Import ``module:function`` and return the function.

    The module is looked up in the current directory first, then on ``sys.path``
    (as ``python -m`` does), so ``remat plan my_model:make`` finds ``./my_model.py``.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"{api}: the model must be given as module:function (e.g. my_model:make, "
                         f"for ./my_model.py's make()), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name.split(".")[0] and err.name != module_name:
            raise
        raise SystemExit(f"{api}: cannot import module {module_name!r} of {spec!r}: no "
                         f"{module_name.replace('.', '/')}.py in the current directory or on "
                         f"sys.path") from None
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise SystemExit(f"{api}: module {module_name!r} has no {attr!r} (from {spec!r})") from None
    if not callable(target):
        raise SystemExit(f"{api}: {spec!r} is not callable")
    return target


def call_factory(factory: Callable[..., torch.nn.Module], kwargs: dict[str, Any],
                 api: str = API) -> torch.nn.Module:
    """``factory(**kwargs)``; a keyword it does not take, or a value it refuses (a ``ValueError``,
    as a config's check raises), is a mistake in ``--arg``, said in one line."""
    try:
        return factory(**kwargs)
    except TypeError as err:
        if "unexpected keyword argument" in str(err) and any(repr(k) in str(err) for k in kwargs):
            raise SystemExit(f"{api}: --arg: {err}") from None
        raise
    except ValueError as err:
        given = " ".join(f"--arg {k}={v!r}" for k, v in kwargs.items()) or "no --arg"
        raise SystemExit(f"{api}: the model factory refused its arguments ({given}): {err}; "
                         f"change --arg") from None


def keyword_argument(text: str) -> tuple[str, Any]:
    """An argparse type for ``--arg KEY=VALUE``: the value as a Python literal, else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. layers=4), got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_kwargs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """The factory's keyword arguments from ``--arg`` items (parsed by `keyword_argument`)."""
    return dict(item if isinstance(item, tuple) else keyword_argument(item) for item in items)


def parse_shape(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """An argparse type for ``--input-shape``: ``2,3,32,32`` (or ``2x3x32x32``) into a shape."""
    if isinstance(text, tuple):
        return text
    parts = text.replace("x", ",").split(",")
    shape = tuple(int(n) for n in parts) if all(n.isdigit() for n in parts) else ()
    if not shape or any(n < 0 for n in shape):
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas (e.g. 8,3,32,32), "
                                         f"got {text!r}")
    return shape


class _Lookup(Exception):
    """An input reached an embedding as its indices (raised to stop the probe there)."""


def input_dtype(given: str | None, build: Callable, shapes: list[tuple[int, ...]]) -> torch.dtype:
    """``--input-dtype``, or when not given what the model does with its inputs: int64 when one
    reaches an embedding as its indices (token ids), else float32. Observed by running the
    model once on float inputs on the meta device (no memory, no compute: a model too large
    for this machine too) under a dispatch mode that stops at the first embedding."""
    if given is not None:
        return getattr(torch, given)
    from torch.utils._python_dispatch import TorchDispatchMode

    with torch.device("meta"):
        inputs = make_inputs(shapes, torch.float32)
    ids = {id(t) for t in inputs}

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.embedding.default, torch.ops.aten._embedding_bag.default) and (
                    len(args) > 1 and id(args[1]) in ids):
                raise _Lookup
            return func(*args, **(kwargs or {}))

    try:
        with torch.device("meta"), torch.no_grad(), Probe():
            build()(*inputs)
    except _Lookup:
        return torch.int64
    except Exception:  # noqa: BLE001 - a model that cannot run on meta: the measuring
        return torch.float32  # run reports the model's own error
    return torch.float32


def make_inputs(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> tuple:
    """Random inputs (zeros for integer dtypes, i.e. token 0) of the given shapes."""
    if dtype.is_floating_point:
        return tuple(torch.randn(*s, dtype=dtype) for s in shapes)
    return tuple(torch.zeros(*s, dtype=dtype) for s in shapes)


def mark(model: torch.nn.Module, which: list[str], output_recompute: bool) -> list[str]:
    """Mark the modules ``which`` selects; return their names (raise SystemExit if none)."""
    from remat._front.marks import apply, recompute_module

    options = {"output_recompute": True} if output_recompute else {}
    chosen: list[str] = []
    for pattern in which:
        if pattern == "blocks":
            if not hasattr(model, "mark_blocks"):  # remat.apply's where="blocks"
                try:
                    chosen += apply(model, where="blocks", **options)
                except ValueError as err:
                    raise SystemExit(f"{API}: --marks blocks: {err}") from None
                continue
            blocks = {id(b) for b in model.mark_blocks(**options)}
            chosen += [n for n, m in model.named_modules() if id(m) in blocks]
            continue
        found = [(n, m) for n, m in model.named_modules()
                 if type(m).__name__ == pattern or (n and fnmatch.fnmatchcase(n, pattern))]
        if not found:
            raise SystemExit(f"{API}: --marks {pattern!r} matches no module class or name in "
                             f"{type(model).__name__}")
        for name, module in found:
            recompute_module(module, **options)
            chosen.append(name)
    return chosen


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """Show ``message`` with a spinner on stderr while the block runs (plain line without rich)."""
    try:
        from rich.console import Console
    except ImportError:
        print(f"{message} ...", file=sys.stderr, flush=True)
        yield
        return
    with Console(stderr=True).status(message):
        yield


def _profile_one(args: argparse.Namespace, factory: Callable, kwargs: dict, marks: list[str],
                 label: str) -> Any:
    import remat
    from remat.memory.profile import default_loss

    shapes = [parse_shape(s) for s in args.input_shape]
    dtype = input_dtype(args.input_dtype, lambda: call_factory(factory, kwargs), shapes)
    loss_fn = default_loss
    if args.loss == "next-token":
        from remat.models.llama import next_token_loss as loss_fn
    optimizer = None if args.optimizer == "none" else args.optimizer

    def build() -> torch.nn.Module:
        model = call_factory(factory, kwargs)
        if marks:
            mark(model, marks, args.output_recompute)
        return model

    with progress(f"{'estimating' if args.estimate else 'profiling'} {label}"):
        if args.estimate:
            return remat.estimate(build, lambda: make_inputs(shapes, dtype), loss_fn=loss_fn,
                                  optimizer=optimizer, label=label, **rank_options(args, API))
        torch.manual_seed(0)
        return remat.profile(build(), *make_inputs(shapes, dtype), loss_fn=loss_fn,
                             optimizer=optimizer, repeat=args.repeat, label=label)


def run(args: argparse.Namespace) -> int:
    """Profile (or estimate) the model without marks, and with ``--marks`` when given."""
    rank_options(args, API)  # bad rank arguments fail before anything runs
    factory = load_factory(args.factory)
    kwargs = parse_kwargs(args.arg)
    reports = [_profile_one(args, factory, kwargs, [], "no marks")]
    if args.marks:
        reports.append(_profile_one(args, factory, kwargs, args.marks, "marks: " + ",".join(args.marks)))
    for report in reports:
        report.print(depth=args.depth)
        print()
    if len(reports) == 2:
        print(reports[0].compare(reports[1], depth=min(args.depth, 1)))
    if args.json:
        data = [json.loads(r.to_json()) for r in reports]
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data[0] if len(data) == 1 else {"before": data[0], "after": data[1]}, fh, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from remat.memory import plot_timeline

        plot_timeline(reports, args.plot, title=f"remat profile {args.factory}")
        print(f"wrote {args.plot}")
    return 0
