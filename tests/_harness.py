"""The tests' shared harness: models, runs with and without recompute, equality, two ranks."""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F


def grads_of(model: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of every parameter and every input that requires grad, in a fixed order."""
    out = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return out + [x.grad.clone() for x in inputs if x.requires_grad]


def step_grads(model: torch.nn.Module, forward: Callable, inputs: list[torch.Tensor],
               seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run forward+backward on a deep copy of ``model``; return its grads and the loss."""
    model = copy.deepcopy(model)
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(seed)
    loss = forward(model, *xs)
    loss.backward()
    return grads_of(model, *xs), loss.detach()


def bitwise_equal(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are equal bit for bit: tensors by ``torch.equal``, lists and
    tuples item by item (and of the same length), anything else (``None``, counts) by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True)))
    return a == b


def assert_bitwise_equal(a: list, b: list, what: str = "tensor") -> None:
    """``a`` and ``b`` hold as many tensors, equal bit for bit (``torch.equal``), ``None`` where
    the other is ``None``; ``what`` names them in the failure message."""
    assert len(a) == len(b), f"{what}s: {len(a)} against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x is None) == (y is None), f"{what} #{i}: None on one side only"
        if x is not None:
            assert torch.equal(x, y), f"{what} #{i} differs: max abs diff {(x - y).abs().max()}"


def assert_bitwise_equal_named(a: list[tuple[str, torch.Tensor | None]],
                               b: list[tuple[str, torch.Tensor | None]]) -> None:
    """``a`` and ``b`` are ``(name, tensor or None)`` lists with the same names in the same order,
    their tensors equal bit for bit (``torch.equal``); the failure lists every name that differs."""
    assert [n for n, _ in a] == [n for n, _ in b]
    bad = []
    for (name, x), (_, y) in zip(a, b, strict=True):
        if (x is None) != (y is None):
            bad.append(f"{name}: None in {'the first' if x is None else 'the second'} only")
        elif x is not None and not torch.equal(x, y):
            bad.append(f"{name}: max abs diff {(x - y).abs().max().item():.3g}")
    assert not bad, "\n".join(bad)


def named_grads(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of each parameter's gradient (of those ``names``), by parameter name (every
    parameter chosen must have one)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if names is None or n in names}


def assert_close_within_tolerance(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``a`` and ``b`` hold the same names, their tensors within ``rtol``/``atol``
    (``torch.testing.assert_close``): for compiled code, whose kernels may round differently."""
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], rtol=rtol, atol=atol, msg=name)


def observed_calls(monkeypatch: Any) -> list[str]:
    """The names of the regions whose forward runs watched (``Observe`` entered), in order,
    from now on (NOTE [Observed once, confirmed every call] in ``_engine/facts.py``)."""
    from remat._engine import observe as _observe

    entered: list[str] = []
    enter = _observe.Observe.__enter__

    def counting(self: Any) -> Any:
        entered.append(self.name)
        return enter(self)

    monkeypatch.setattr(_observe.Observe, "__enter__", counting)
    return entered


def run_program(source: str, seed: int = 0) -> tuple[dict, str]:
    """Execute a program's text with torch's and numpy's seeds set; return its globals and
    what it printed."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    scope: dict = {"__name__": "__seed__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<program>", "exec"), scope)  # noqa: S102 - the program, verbatim
    return scope, out.getvalue()


class TransformerBlock(torch.nn.Module):
    """Pre-LN attention (causal, SDPA) and a GELU MLP, with dropout."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLPBlock(torch.nn.Module):
    """Post-norm MLP block: ``norm(x + down(gelu(up(x))))``; up and down split for tensor
    parallelism (up column-wise, down row-wise)."""

    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(F.gelu(self.up(x))))


# --- two ranks -------------------------------------------------------------------------------

WORLD = 2


def free_port() -> int:
    """A free TCP port on loopback, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pack(value: object) -> bytes:
    """Results as bytes: tensors pickled through a queue need their sender alive."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_entry(rank: int, port: int, body: Callable, pg_timeout: float, inbox: object,
                results: object, world: int = WORLD) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        result = body(rank) if inbox is None else body(rank, inbox)
    except BaseException:
        results.put((rank, pack({"error": traceback.format_exc()})))
        raise
    else:
        results.put((rank, pack(result)))
    finally:
        dist.destroy_process_group()


def spawn_two_ranks(body: Callable, *, deadline: float, pg_timeout: float = 30,
                    feed: Callable[[], object] | None = None, world: int = WORLD
                    ) -> tuple[dict, list[int | None]]:
    """Run ``body(rank)`` on 2 (or ``world``) gloo ranks on loopback; return ``({rank:
    result}, exit codes)``.

    ``body`` is a module-level function (the ranks are spawned, so it is pickled by name); a
    rank that raises returns ``{"error": traceback}`` and exits non-zero. With ``feed``,
    ``body(rank, inbox)`` runs instead and ``feed()`` runs here meanwhile; each rank's
    ``inbox`` (a queue) then gets its value. Every collective times out after ``pg_timeout``
    seconds; past ``deadline`` seconds the ranks left are killed and the test fails.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    inboxes = [ctx.Queue() if feed is not None else None for _ in range(world)]
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, port, body, pg_timeout, inboxes[r], results, world),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    start = datetime.datetime.now()
    try:
        if feed is not None:
            fed = feed()  # while the ranks start (an error here kills them)
            for inbox in inboxes:
                inbox.put(fed)
        while len(out) < world:
            left = deadline - (datetime.datetime.now() - start).total_seconds()
            if left <= 0:
                break
            try:
                rank, value = results.get(timeout=min(left, 1.0))
                out[rank] = unpack(value)
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - (datetime.datetime.now() - start).total_seconds()))
    finally:
        overrun = [p for p in procs if p.is_alive()]
        for p in overrun:
            p.kill()
            p.join()
    if overrun:
        pytest.fail(f"distributed test overran its {deadline}s deadline; killed {len(overrun)} rank(s)")
    return out, [p.exitcode for p in procs]


def assert_every_rank_succeeded(out: dict, codes: list[int | None]) -> None:
    """Each rank returned a result, none an error, and every rank exited with status 0."""
    for rank in range(len(codes)):
        assert rank in out, f"rank {rank} returned nothing (exit codes {codes})"
        assert not (isinstance(out[rank], dict) and "error" in out[rank]), out[rank]["error"]
    assert codes == [0] * len(codes)
