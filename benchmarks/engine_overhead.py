"""The engine's own cost: remat against torch.utils.checkpoint on the same blocks, every way to mark.

A stack of 12 pre-norm transformer blocks (``nn.MultiheadAttention`` and a GELU MLP),
one thread. Each way to mark runs beside the torch configuration that marks the same
blocks (``torch.utils.checkpoint`` in the same implementation; torch's selective
checkpoint for a policy; a checkpoint around the activation alone, the same tanh GELU, for a
primitive mark (which keeps the activation's output and so rebuilds nothing, where the
primitive mark keeps it neither and runs the GELU again in backward); for ``output_recompute``, which keeps no block's output either, torch's
nested checkpoint: one around the stack of checkpointed blocks, which keeps only the
stack's input between forward and backward and re-runs every block twice in backward, as
a chain of ``output_recompute`` regions does).
All configurations of one case run in interleaved rounds, rotating the order each
round; a ratio is taken within each round and the median and interquartile range of
those ratios are reported, with the microseconds each region adds per operator of its
forward ((remat - torch) / (regions x operators)). Small widths with 2 x 16 tokens are
launch-bound: there each operator's Python cost is the step's cost.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py [--rounds 30] [--quick]

Writes ``benchmarks/results/engine_overhead.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import functools
import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import ops

RESULTS = pathlib.Path(__file__).parent / "results"
BLOCKS = 12


class Block(remat.nn.Cell):
    """Pre-norm attention and a GELU MLP; ``self.act`` is the activation (a primitive or a function)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, max(1, width // 32), batch_first=True)
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.act = F.gelu

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


_MATMULS = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention"))


def _save_matmuls(ctx, op, *args, **kwargs):
    keep = op in _MATMULS
    return tuc.CheckpointPolicy.MUST_SAVE if keep else tuc.CheckpointPolicy.PREFER_RECOMPUTE


class Stack(torch.nn.Module):
    """The blocks, called through ``call(block, x)``."""

    def __init__(self, blocks: torch.nn.ModuleList, call) -> None:
        super().__init__()
        self.blocks, self.call = blocks, call

    def forward(self, x):
        for block in self.blocks:
            x = self.call(block, x)
        return x


def _plain(block, x):
    return block(x)


def _torch(reentrant: bool, context_fn=None):
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return lambda block, x: tuc.checkpoint(block, x, use_reentrant=reentrant, **extra)


def _gelu_tanh(h):
    return F.gelu(h, approximate="tanh")


class _Nested(torch.nn.Module):
    """torch's way to keep only a stack's input between forward and backward, as a chain of
    ``output_recompute`` regions does: a checkpoint around the stack of checkpointed blocks
    (the backward re-runs the stack, then each block again for its own backward)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return tuc.checkpoint(self.inner, x, use_reentrant=False)


def configurations(base: torch.nn.ModuleList) -> dict:
    """``name -> (model, torch baseline name)``; the baselines map to themselves."""
    sac = functools.partial(tuc.create_selective_checkpoint_contexts, _save_matmuls)

    def stack(call=_plain, mark=None):
        blocks = copy.deepcopy(base)
        if mark is not None:
            mark(blocks)
        return Stack(blocks, call)

    def primitive_torch(blocks):  # the same function as ops.GeLU (the tanh form), checkpointed
        for b in blocks:
            b.act = lambda h: tuc.checkpoint(_gelu_tanh, h, use_reentrant=False)

    def primitive_remat(blocks):
        for b in blocks:
            b.act = ops.GeLU()
            b.act.recompute()

    def cells(blocks, **kw):
        for b in blocks:
            b.recompute(**kw)

    out = {"unmarked": (stack(), "unmarked")}
    for r, tag in ((False, "non-reentrant"), (True, "reentrant")):
        baseline = f"torch {tag}"
        out[baseline] = (stack(_torch(r)), baseline)
        out[f"remat.apply {tag}"] = (stack(mark=lambda m, r=r: remat.apply(m, where=Block, use_reentrant=r)),
                                     baseline)
        out[f"remat.checkpoint {tag}"] = (
            stack(lambda b, x, r=r: remat.checkpoint(b, x, use_reentrant=r)), baseline)
        out[f"recompute_module {tag}"] = (
            stack(mark=lambda m, r=r: [remat.recompute_module(b, use_reentrant=r) for b in m]), baseline)
        out[f"cell marks {tag}"] = (stack(mark=lambda m, r=r: cells(m, use_reentrant=r)), baseline)
    out["torch nested"] = (_Nested(stack(_torch(False))), "torch nested")
    out["output_recompute"] = (stack(mark=lambda m: remat.apply(m, where=Block, output_recompute=True)),
                               "torch nested")
    out["torch selective"] = (stack(_torch(False, sac)), "torch selective")
    out["policy save_compute_intensive"] = (
        stack(mark=lambda m: remat.apply(m, where=Block, policy=remat.save_compute_intensive)),
        "torch selective")
    out["torch activation"] = (stack(mark=primitive_torch), "torch activation")
    out["primitive marks"] = (stack(mark=primitive_remat), "torch activation")
    return out


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def operators_per_block(block: torch.nn.Module, x: torch.Tensor) -> int:
    with _Count() as count:
        block(x)
    return count.n


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """One training step's ``(forward, backward)`` seconds; the backward holds the re-runs."""
    xi = x.clone().requires_grad_()
    start = time.perf_counter()
    loss = model(xi).float().pow(2).mean()
    if xi.is_cuda:  # each phase ends when the device has run it, not when the host has queued it
        torch.cuda.synchronize()
    middle = time.perf_counter()
    loss.backward()
    if xi.is_cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return middle - start, end - middle


def _row(times: list, base: list, baseline: str, ops: int) -> dict:
    """Ratios per round (step, forward, backward) and microseconds per operator."""
    def ratios(pick):
        return [pick(a) / pick(b) for a, b in zip(times, base)]

    step = ratios(sum)
    q = statistics.quantiles(step, n=4)

    def added(pick):  # microseconds remat adds per operator of a region's forward
        return (statistics.median(map(pick, times)) - statistics.median(map(pick, base))) * 1e6 / ops

    return {
        "baseline": baseline, "median_ms": statistics.median(map(sum, times)) * 1e3,
        "ratio": statistics.median(step), "iqr": [q[0], q[2]],
        "forward_ratio": statistics.median(ratios(lambda t: t[0])),
        "backward_ratio": statistics.median(ratios(lambda t: t[1])),
        "us_per_op": added(sum), "forward_us_per_op": added(lambda t: t[0]),
        "backward_us_per_op": added(lambda t: t[1]),
    }


def _interleaved(configs: dict, x: torch.Tensor, rounds: int, device: str) -> dict:
    """``name -> [(forward, backward) seconds per round]``, the order rotating each round."""
    for model, _ in configs.values():  # warm-up: the first call of each region is observed
        for _ in range(2):
            _step(model, x)
    names = list(configs)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(_step(configs[name][0], x))
    return times


def run_case(width: int, shape: tuple, rounds: int, device: str) -> dict:
    """One width and input shape: every configuration, interleaved; ratios per round."""
    torch.manual_seed(0)
    base = torch.nn.ModuleList(Block(width) for _ in range(BLOCKS)).to(device)
    x = torch.randn(*shape, width, device=device)
    configs = {name: (model.to(device), baseline) for name, (model, baseline) in configurations(base).items()}
    ops_per_block = operators_per_block(base[0], x)
    times = _interleaved(configs, x, rounds, device)
    rows = {name: _row(times[name], times[configs[name][1]], configs[name][1], BLOCKS * ops_per_block)
            for name in configs}
    case = {"width": width, "shape": list(shape), "ops_per_block": ops_per_block, "rows": rows}
    print(render([case], {"device": device, "rounds": rounds}).split("\n", 4)[-1], flush=True)
    return case


def _hf_configurations(width: int, device: str) -> dict | None:
    """A 12-layer Llama of ``width`` marked through Hugging Face's own switch, by torch's
    checkpoint and by remat's (``remat.gradient_checkpointing_enable``); None without
    transformers."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    heads = max(2, width // 32)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=4 * width,
                                      num_hidden_layers=BLOCKS, num_attention_heads=heads,
                                      num_key_value_heads=heads // 2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(device).train()
    out = {"unmarked": (base, "unmarked")}
    for r, tag in ((False, "non-reentrant"), (True, "reentrant")):
        torch_marked, remat_marked = copy.deepcopy(base), copy.deepcopy(base)
        torch_marked.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": r})
        remat.gradient_checkpointing_enable(remat_marked, use_reentrant=r)
        out[f"torch switch {tag}"] = (torch_marked, f"torch switch {tag}")
        out[f"remat switch {tag}"] = (remat_marked, f"torch switch {tag}")
    return out


class _Loss(torch.nn.Module):
    """A causal LM called as the other stacks are: ``model(ids)`` returns the loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids.long(), labels=ids.long()).loss


def run_hf_case(width: int, rounds: int, device: str) -> dict | None:
    """Hugging Face's switch, torch's checkpoint against remat's, at ``width`` (2 x 16 tokens)."""
    import warnings

    configs = _hf_configurations(width, device)
    if configs is None:
        return None
    configs = {name: (_Loss(model), baseline) for name, (model, baseline) in configs.items()}
    ids = torch.randint(0, 256, (2, 16), device=device).float()  # _step clones it as floats
    with _Count() as count:
        configs["unmarked"][0](ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the switch's notice that it turns the cache off
        times = _interleaved(configs, ids, rounds, device)
    rows = {name: _row(times[name], times[configs[name][1]], configs[name][1], count.n)
            for name in configs}
    case = {"width": width, "shape": [2, 16], "ops_per_block": count.n // BLOCKS, "rows": rows,
            "title": f"Hugging Face's switch, a {BLOCKS}-layer Llama of width {width}"}
    print(render([case], {"device": device, "rounds": rounds}).split("\n", 4)[-1], flush=True)
    return case


def render(cases: list, meta: dict) -> str:
    title = f"### The engine's own cost: remat against torch.utils.checkpoint ({meta['device']})"
    command = (f"`OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py --rounds {meta['rounds']}` "
               f"(generated; torch {meta.get('torch', torch.__version__)}).")
    legend = (f"{BLOCKS} blocks, one thread, {meta['rounds']} interleaved rounds per case; ratio = median "
              "of the per-round ratios to the torch configuration that marks the same blocks (IQR in "
              "brackets); forward and backward: the same for each phase (the backward holds the "
              "re-runs); us/op = microseconds remat adds per operator of a region's forward, in "
              "the whole step and in the backward.")
    lines = [title, "", command, "", legend, ""]
    for case in cases:
        head = case.get("title", f"width {case['width']}, input {case['shape']}")
        lines += [f"#### {head} ({case['ops_per_block']} operators per block)",
                  "", ("| configuration | against | step ms | ratio | IQR | forward | backward | us/op "
                  "| backward us/op |"), "|---|---|---|---|---|---|---|---|---|"]
        for name, row in case["rows"].items():
            lines.append(f"| {name} | {row['baseline']} | {row['median_ms']:.2f} | {row['ratio']:.3f} | "
                         f"{row['iqr'][0]:.3f}-{row['iqr'][1]:.3f} | {row['forward_ratio']:.3f} | "
                         f"{row['backward_ratio']:.3f} | {row['us_per_op']:+.2f} | "
                         f"{row['backward_us_per_op']:+.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="two widths, few rounds (a smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(RESULTS / "engine_overhead"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    small = [(w, (2, 16)) for w in ((32, 128) if args.quick else (32, 128, 512, 1024))]
    # large tensors: kernel time dominates (on a GPU it takes far larger ones to get there)
    large = [(1024, (8, 512)), (2048, (2, 1024))] if args.device == "cuda" else [(256, (4, 128))]
    large = [] if args.quick else large
    rounds = 4 if args.quick else args.rounds
    cases = [run_case(w, s, rounds, args.device) for w, s in small]
    large_rounds = max(8, rounds // 2) if args.device == "cuda" else max(5, rounds // 6)
    cases += [run_case(w, s, large_rounds, args.device) for w, s in large]
    hf = [run_hf_case(w, rounds, args.device) for w in ((64,) if args.quick else (64, 256))]
    cases += [case for case in hf if case is not None]
    meta = {"device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
            "rounds": rounds, "torch": torch.__version__}
    report = render(cases, meta)
    pathlib.Path(args.out + ".json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))
    pathlib.Path(args.out + ".md").write_text(report + "\n")
    return {"meta": meta, "cases": cases}


if __name__ == "__main__":
    main()
