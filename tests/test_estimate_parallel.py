"""One rank of a job, estimated and planned on a fake process group (``remat.estimate`` and
``remat.plan`` with ``world_size=``, ``parallelize=``), against real 2-process gloo runs.

The real group starts once for the file (process start-up is most of its cost) and measures
every scenario with ``remat.memory.track`` and the CPU allocator; the estimates run here, in
the test process, with no real group. The group has a process-group timeout and an overall
deadline: the parent joins with a timeout, kills what is left and fails.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import remat
from remat.memory._storages import local_nbytes
from tests._harness import WORLD, MLPBlock, assert_every_rank_succeeded, spawn_two_ranks

PG_TIMEOUT_S = 30
DEADLINE_S = 120
D, ROWS, BLOCKS = 64, 512, 4
TP_HIDDEN, FSDP_HIDDEN = 256, 255  # 255: FSDP2 shards the MLP unevenly, ranks differ
STEPS = 3


# --- the model, its parallelisms, its step ----------------------------------------------


def make(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[MLPBlock(D, hidden) for _ in range(BLOCKS)])


def tensor_parallel(model: nn.Sequential, mesh: object) -> nn.Sequential:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def fully_shard_blocks(model: nn.Sequential, mesh: object) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


SCENARIOS = {  # name: (parallelize, hidden, mark options or None)
    "TP": (tensor_parallel, TP_HIDDEN, None),
    "TP marked": (tensor_parallel, TP_HIDDEN, {}),
    "TP marked mp=False": (tensor_parallel, TP_HIDDEN, {"mp_comm_recompute": False}),
    "FSDP": (fully_shard_blocks, FSDP_HIDDEN, None),
    "FSDP marked": (fully_shard_blocks, FSDP_HIDDEN, {}),
    "FSDP marked po=False": (fully_shard_blocks, FSDP_HIDDEN, {"parallel_optimizer_comm_recompute": False}),
}


def _marks(options: dict | None) -> object:
    return None if options is None else (lambda model: remat.apply(model, MLPBlock, **options))


@functools.cache
def estimated(name: str, rank: int = 0, marks: object = None) -> remat.memory.ProfileReport:
    """The estimate of ``rank`` in scenario ``name`` (its marks, or ``marks``); read only."""
    parallelize, hidden, options = SCENARIOS[name]
    return remat.estimate(functools.partial(make, hidden), (ROWS, D), loss_fn=loss_of,
                          marks=marks or _marks(options), world_size=WORLD, parallelize=parallelize,
                          rank=rank)


# --- what the real ranks run ---------------------------------------------------------------


def _real_steps(model: nn.Module, x: torch.Tensor | None = None, loss: object = loss_of) -> dict:
    """Steps of Adam under the tracker: its peak per step, and the rank's parameter bytes.

    (``tests/test_parallel.py`` checks the tracker against the CPU allocator per rank.) As
    there, gloo's worker is let go first after each collective (NOTE [Frees on gloo's worker
    thread]): a result it holds a little longer is not the step's."""
    from remat.memory._allocator import _LetWorkersRelease

    if x is None:
        x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # the optimizer's state exists before a steady step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        loss(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    runs = []
    for _ in range(STEPS):
        gc.collect()  # no collection of older garbage in the middle of a step
        gc.disable()
        try:
            with remat.memory.track(model, baseline=[x, optimizer]) as tracker, _LetWorkersRelease():
                step()
        finally:
            gc.enable()
        runs.append(tracker.peak_bytes)
    return {"runs": runs, "params": sum(local_nbytes(p) for p in model.parameters())}


def real_group(rank: int, inbox: mp.Queue) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    gc.collect()
    gc.freeze()  # what the imports made is never garbage: each step's collection skips it
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name, (parallelize, hidden, options) in SCENARIOS.items():
        model = make(hidden)
        if options is not None:
            remat.apply(model, MLPBlock, **options)
        out[name] = _real_steps(parallelize(model, mesh))
    plans = inbox.get(timeout=DEADLINE_S)  # made meanwhile by the test process
    for name, text in plans.items():  # a rank's plan, made on a fake group, run for real
        parallelize, hidden, _ = SCENARIOS[name]
        model = make(hidden)
        remat.Plan.from_json(text).apply(model)
        out[f"plan {name}"] = _real_steps(parallelize(model, mesh))
    model = tensor_parallel(make(TP_HIDDEN), mesh)
    report = remat.profile(model, torch.randn(8, D), repeat=0)
    out["profile"] = (report.rank, report.world_size, report.param_bytes)
    out["llama"] = _llama_tensor_parallel(mesh)
    return out


LLAMA = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "hidden": 128, "vocab": 256}
TOKENS = (2, 32)


def _llama_tensor_parallel(mesh: object) -> dict:
    """remat.models.llama.tensor_parallel on a real rank: gradients against one process, and
    the rank's steps under the tracker (blocks marked)."""
    from remat.models.llama import LlamaConfig, llama, next_token_loss
    from remat.models.llama import tensor_parallel as shard

    tokens = torch.randint(0, LLAMA["vocab"], TOKENS, generator=torch.Generator().manual_seed(2))
    grads = []
    for parallel in (False, True):
        torch.manual_seed(0)
        model = llama(LlamaConfig(**LLAMA))
        if parallel:
            shard(model, mesh)
        next_token_loss(model(tokens)).backward()
        grads.append([p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                      for p in model.parameters()])
    model = llama(LlamaConfig(**LLAMA), recompute=True)
    return {"grads": grads, **_real_steps(shard(model, mesh), tokens, next_token_loss)}


# --- the assertions -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group() -> dict:
    """The real ranks' results, and the plans they ran: a plan per rank for 60% of each
    parallelism's no-recompute peak, made here on a fake group while the ranks start."""
    plans = {}

    def make_plans() -> dict:
        for name in ("TP", "FSDP"):
            parallelize, hidden, _ = SCENARIOS[name]
            plans[name] = remat.plan(functools.partial(make, hidden), (ROWS, D), budget=0.6,
                                     loss_fn=loss_of, world_size=WORLD, parallelize=parallelize)
        return {name: p.to_json() for name, p in plans.items()}

    out, codes = spawn_two_ranks(real_group, deadline=DEADLINE_S, pg_timeout=PG_TIMEOUT_S, feed=make_plans)
    assert_every_rank_succeeded(out, codes)
    return {"real": out, "plans": plans}


@pytest.fixture(scope="module")
def real(group: dict) -> dict:
    return group["real"]


@pytest.fixture(scope="module")
def plans(group: dict) -> dict:
    return group["plans"]


def _collective_bytes(name: str) -> int:
    """The tensors one collective of scenario ``name`` holds: a tensor-parallel all-reduce's
    (in place: its result), or a fully sharded block's all-gather's, its output (every rank's
    shard, dimension 0 padded to the world size, as FSDP2 lays them out) and its input (this
    rank's shard). A CI run once held 256 bytes more than the output alone."""
    parallelize, hidden, _ = SCENARIOS[name]
    if parallelize is tensor_parallel:
        return ROWS * D * 4
    padded = -(-hidden // WORLD) * WORLD
    gathered = (padded * D + padded + D * hidden + D) * 4
    return gathered + gathered // WORLD


def _settled(name: str, runs: list[int]) -> int:
    """The real rank's peak: its least over the steps. A collective's tensors are held until
    gloo's worker drops its work; the step waits for that (50 ms at most), so on a busy
    machine a step now and then still holds one collective's tensors more when it peaks
    (NOTE [Frees on gloo's worker thread]): timing, not the program. The spread stays within
    one such collective's tensors, or something else varies."""
    assert max(runs) - min(runs) <= _collective_bytes(name), runs
    return min(runs)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_estimate_of_a_rank_equals_the_real_rank(real, name):
    for rank in range(WORLD):
        report = estimated(name, rank=rank)
        # the tracker's figure for a real gloo rank, to the byte
        assert report.peak_bytes == _settled(name, real[rank][name]["runs"]), (rank, name, real[rank][name])
        assert report.param_bytes == real[rank][name]["params"]
        assert (report.rank, report.world_size) == (rank, WORLD)
        assert f"rank {rank} of {WORLD}" in report.table()


def test_dtensor_sharding_propagation_is_not_counted():
    # DTensor propagates shardings on fake tensors of global shape, once per operator and
    # shapes (then cached): in an estimate they were the estimate's own fake tensors
    parallelize, hidden, _ = SCENARIOS["TP"]
    rows = ROWS + 8  # shapes no other test runs: nothing cached yet
    first, second = [remat.estimate(functools.partial(make, hidden), (rows, D), loss_fn=loss_of,
                                    world_size=WORLD, parallelize=parallelize) for _ in range(2)]
    assert first.peak_bytes == second.peak_bytes


def test_ranks_differ_where_a_dimension_does_not_divide(real):
    first, second = estimated("FSDP", rank=0), estimated("FSDP", rank=1)
    assert first.param_bytes > second.param_bytes  # 255 rows: 128 on rank 0, 127 on rank 1
    assert [real[r]["FSDP"]["params"] for r in range(WORLD)] == [first.param_bytes, second.param_bytes]


def test_marks_lower_the_estimate_of_a_rank():
    for parallelism in ("TP", "FSDP"):
        plain, marked = estimated(parallelism), estimated(f"{parallelism} marked")
        assert marked.peak_bytes < plain.peak_bytes and marked.total_kept < plain.total_kept
    # kept collective results and gathered parameters cost this rank memory
    assert estimated("TP marked mp=False").peak_bytes > estimated("TP marked").peak_bytes
    assert estimated("FSDP marked po=False").peak_bytes > estimated("FSDP marked").peak_bytes


def test_parameters_of_a_rank_are_its_share():
    for name, (_, hidden, _) in SCENARIOS.items():
        one = remat.estimate(functools.partial(make, hidden), (ROWS, D), loss_fn=loss_of)
        rank = estimated(name)
        assert one.rank is None and one.world_size is None
        if name.startswith("FSDP"):  # every parameter sharded on dim 0, padded to 128 rows
            assert rank.param_bytes == sum(
                (p.shape[0] + 1) // WORLD * p[0].numel() * 4 for p in make(hidden).parameters())
        else:  # up's weight and bias, down's weight sharded; down's bias and the norm replicated
            replicated = BLOCKS * 3 * D * 4
            assert rank.param_bytes == (one.param_bytes - replicated) // WORLD + replicated
        assert rank.param_bytes < 0.55 * one.param_bytes
        assert rank.optimizer_bytes < 0.55 * one.optimizer_bytes


def test_llama_tensor_parallel_is_the_same_model_and_its_estimate_the_real_rank(real):
    from remat.models.llama import LlamaConfig, next_token_loss
    from remat.models.llama import tensor_parallel as shard

    for rank in range(WORLD):
        llama = real[rank]["llama"]
        for one, parallel in zip(*llama["grads"], strict=True):  # row-wise layers sum in another order
            torch.testing.assert_close(parallel, one, rtol=1e-4, atol=1e-5)
        report = remat.estimate(LlamaConfig(**LLAMA), torch.zeros(TOKENS, dtype=torch.long),
                                loss_fn=next_token_loss, marks="blocks",
                                world_size=WORLD, parallelize=shard, rank=rank)
        assert report.peak_bytes == _settled("TP", llama["runs"])
        assert report.param_bytes == llama["params"]


def test_profile_on_a_real_rank_says_which(real):
    for rank in range(WORLD):
        assert real[rank]["profile"][:2] == (rank, WORLD)


@pytest.mark.parametrize("name", ["TP", "FSDP"])
def test_a_plan_for_a_rank_fits_its_budget_on_the_real_rank(plans, real, name):
    plan = plans[name]
    assert (plan.rank, plan.world_size) == (0, WORLD) and "rank 0 of 2" in str(plan)
    assert any(c != "keep" for c in plan.choices.values()), plan.choices  # something is rebuilt
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.no_recompute_peak_bytes
    # the plan's whole step (the optimizer's included) on each rank, estimated and real: rank
    # 1 of the FSDP model holds one row of the MLP less than rank 0, which was planned
    for rank in range(WORLD):
        marked = estimated(name, rank, marks=plan.apply)
        assert _settled(name, real[rank][f"plan {name}"]["runs"]) == marked.peak_bytes <= plan.budget_bytes
        if rank == 0:
            assert marked.peak_bytes <= plan.measured_peak_bytes
            # the plan's step holds the model's output (ROWS x D floats) until it ends, as a
            # loop does (NOTE [The step users run]); the loop here frees it before backward,
            # a peak lower by it where the peak is in backward (FSDP), not in Adam's step (TP)
            freed = plan.no_recompute_peak_bytes - _settled(name, real[rank][name]["runs"])
            assert freed == (ROWS * D * 4 if name == "FSDP" else 0), freed


def test_a_billion_parameter_llama_on_8_ranks_holds_an_eighth_of_its_parameters():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.models.llama import Llama, LlamaConfig, next_token_loss

    config = LlamaConfig(layers=16, width=2048, heads=16, hidden=5632, vocab=32000)
    with FakeTensorMode():
        whole = sum(p.numel() for p in Llama(config).parameters())
    assert 0.9e9 < whole < 1.1e9

    report = remat.estimate(config, torch.zeros(1, 256, dtype=torch.long), loss_fn=next_token_loss,
                            optimizer="adam", marks="blocks", world_size=8, parallelize=_shard_llama)
    assert report.param_bytes * 8 == whole * 4
    assert report.optimizer_bytes >= 2 * report.param_bytes
    assert report.world_size == 8 and not dist.is_initialized()


def _shard_llama(model: nn.Module, mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank_costs(config: object, parallelize: object, world: int, seq: int, whole: bool = False) -> object:
    """The cost model of a rank's plan (option "keep"): composed, or of the whole model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.memory._step import Step
    from remat.memory.estimate import Ranks
    from remat.memory.internal import identical_container
    from remat.models.llama import Llama, next_token_loss
    from remat.planner._cost import composed_costs, measure_costs
    from remat.planner._settings import Builder, Machine, Settings
    from remat.planner._trace import find_blocks

    ranks = Ranks(world, parallelize, 0)
    with ranks.group(), FakeTensorMode():
        template = Llama(config)
        blocks = find_blocks(template)
        build = Builder(make=functools.partial(Llama, config), finish=lambda m: ranks.apply(m, "cpu"))
        tokens = (torch.zeros(1, seq, dtype=torch.long),)
        settings = Settings(step=Step(inputs=tokens, loss_fn=next_token_loss), optimizer="adam",
                            machine=Machine(fake=True, device="cpu"), options=("keep",), build=build)
        if whole:
            return measure_costs(template, blocks, settings)
        return composed_costs(template, blocks, identical_container(template, blocks), settings)


def test_a_rank_plan_composes_identical_blocks_from_runs_with_three_and_four():
    # Units holding more parameters than activations: during a block's backward FSDP2 holds
    # it and its gathered neighbour, so the step grows linearly from 3 blocks, not from 2.
    from remat.models.llama import LlamaConfig, next_token_loss

    config = LlamaConfig(layers=6, width=512, heads=4, hidden=1408, vocab=8000)
    costs = _rank_costs(config, _shard_llama, 8, 64)
    whole = _rank_costs(config, _shard_llama, 8, 64, whole=True)  # every block traced
    assert costs.memory.peaks["keep"] == whole.memory.peaks["keep"]
    assert costs.memory.baseline_bytes == whole.memory.baseline_bytes
    freed = remat.estimate(config, torch.zeros(1, 64, dtype=torch.long), loss_fn=next_token_loss,
                           world_size=8, parallelize=_shard_llama)  # the logits freed before backward
    assert costs.memory.baseline_bytes == freed.baseline_bytes
    assert costs.memory.peaks["keep"] >= freed.peak_bytes
    assert "composed from runs with 3 and 4" in costs.step.timing


def test_a_composed_rank_plan_grows_each_phase_at_its_own_rate():
    # Tensor parallelism replicates the embedding and the head: with 3 and 4 blocks the peak
    # is the optimizer's step (their Adam state), with 10 the backward pass (the blocks').
    from remat.models.llama import LlamaConfig, tensor_parallel

    config = LlamaConfig(layers=10, width=256, heads=8, hidden=704, vocab=16000)
    costs = _rank_costs(config, tensor_parallel, 8, 256)
    whole = _rank_costs(config, tensor_parallel, 8, 256, whole=True)
    memory = costs.memory
    assert (memory.peaks["keep"], memory.phases["keep"]) == (whole.memory.peaks["keep"], "backward")
    # times from the rank's own operators: DTensor's sharding propagation, which runs once
    # per shape (here in the run with 3 blocks, not with 4), is not this rank's work
    assert costs.step.seconds == pytest.approx(whole.step.seconds)


# --- errors: typed, named, and nothing left behind ------------------------------------------------


def _tiny() -> nn.Sequential:
    return nn.Sequential(MLPBlock(D, 8), MLPBlock(D, 8))


def test_bad_arguments_name_the_api_and_the_fix():
    cases = [
        (ValueError, "world_size=2 needs parallelize", {"world_size": 2}),
        (ValueError, "parallelize= needs world_size", {"parallelize": fully_shard_blocks}),
        (ValueError, "world_size must be at least 1", {"world_size": 0, "parallelize": fully_shard_blocks}),
        (TypeError, "world_size must be an int", {"world_size": "2", "parallelize": fully_shard_blocks}),
        (ValueError, r"rank must be in \[0, 2\)", {"world_size": 2, "parallelize": fully_shard_blocks,
                                                    "rank": 2}),
        (TypeError, "parallelize must be a function", {"world_size": 2, "parallelize": "fsdp"}),
        (ValueError, "rank=1 needs world_size", {"rank": 1}),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=f"remat.estimate: {message}"):
            remat.estimate(_tiny, (4, D), **kwargs)
        with pytest.raises(error, match=f"remat.plan: {message}"):
            remat.plan(_tiny, (4, D), budget=0.9, **kwargs)
        assert not dist.is_initialized()
    with pytest.raises(ValueError, match="remat.plan: world_size= plans a rank from a factory"):
        remat.plan(_tiny(), torch.randn(4, D), budget=0.9, world_size=2, parallelize=fully_shard_blocks)


def test_the_fake_group_is_destroyed_after_an_error():
    import sys

    hook = sys.excepthook

    def fails(model: nn.Module, mesh: object) -> None:
        assert dist.get_world_size() == 2 and dist.get_backend() == "fake"
        raise RuntimeError("parallelize failed")

    with pytest.raises(RuntimeError, match="parallelize failed"):
        remat.estimate(_tiny, (4, D), world_size=2, parallelize=fails)
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="remat.estimate: parallelize must return the model"):
        remat.estimate(_tiny, (4, D), world_size=2, parallelize=lambda model, mesh: "sharded")
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError):  # an error in the step itself
        remat.estimate(_tiny, (4, D), world_size=2, parallelize=fully_shard_blocks,
                       loss_fn=lambda out: 1 / 0)
    assert not dist.is_initialized()
    report = remat.estimate(_tiny, (4, D), world_size=2, parallelize=fully_shard_blocks)  # again
    assert report.world_size == 2 and not dist.is_initialized()
    assert sys.excepthook is hook  # the group's rank prefix on uncaught errors is gone too


def test_a_real_process_group_is_left_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="remat.estimate: world_size= runs rank 0 of 2 on a fake "
                                               "process group, but a process group is already"):
            remat.estimate(_tiny, (4, D), world_size=2, parallelize=fully_shard_blocks)
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        one = remat.estimate(_tiny, (4, D))  # one process needs no group: still works
        assert one.world_size is None
    finally:
        dist.destroy_process_group()
