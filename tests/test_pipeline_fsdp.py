"""Marks on pipeline stages that FSDP2 or tensor parallelism shards: 4 gloo ranks, 2 stages x 2.

A 2 x 2 device mesh (``pp`` x ``dp``): ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1,
each stage's blocks ``fully_shard``-ed over its ``dp`` pair, and each ``dp`` coordinate runs
its own pipeline of the two stages over its half of the batch (torchtitan's layout). With
remat's marks under ``parallel_optimizer_comm_recompute`` True (the re-run gathers its
parameters again) and False (it reuses the gathered ones), in both implementations and with
``output_recompute``, every rank's gradient shards, buffers and losses must be bitwise equal
to the same pipeline unmarked. The same with each block's MLP split over a ``tp`` pair
instead (column-wise then row-wise) under ``mp_comm_recompute`` True (the re-run issues the
forward's all-reduce again) and False (it reuses the forward's result).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import remat
from tests._harness import assert_bitwise_equal, assert_every_rank_succeeded, spawn_two_ranks
from tests.test_pipeline import BATCH, MICRO, SEQ, VOCAB, Block, _loss, _stages, schedule_class

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 240  # the whole test; each collective times out after 60 s
SCHEDULES = ("GPipe", "1F1B")
MARKS = {
    "po=True": {"parallel_optimizer_comm_recompute": True},
    "po=False": {"parallel_optimizer_comm_recompute": False},
    "po=True reentrant": {"parallel_optimizer_comm_recompute": True, "use_reentrant": True},
    "po=False output_recompute": {"parallel_optimizer_comm_recompute": False, "output_recompute": True},
}
TP_MARKS = {
    "mp=True": {"mp_comm_recompute": True},
    "mp=False": {"mp_comm_recompute": False},
    "mp=False reentrant": {"mp_comm_recompute": False, "use_reentrant": True},
}
FRESH = {"preserve_rng_state": False}  # dropout drawn anew in the re-run: must differ


def _sharded_stage(pp: int, mesh: object, marks: dict | None) -> torch.nn.Module:
    """Stage ``pp`` of two, marked (or not), its blocks and itself sharded over ``dp``."""
    from torch.distributed.fsdp import fully_shard

    stage = _stages(2, [pp], batch_norm=False)[0]
    if marks is not None:
        remat.apply(stage, where=Block, **marks)
    for block in stage.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    return stage


def _tensor_parallel_stage(pp: int, mesh: object, marks: dict | None) -> torch.nn.Module:
    """Stage ``pp`` of two, marked (or not), each block's MLP split over ``tp``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    stage = _stages(2, [pp], batch_norm=False)[0]
    if marks is not None:
        remat.apply(stage, where=Block, **marks)
    for block in stage.blocks:
        parallelize_module(block, mesh["dp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return stage


def _run(rank: int, schedule_name: str, marks: dict | None, tp: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # "dp": the tp pair with tp
    pp, dp = divmod(rank, 2)
    stage = (_tensor_parallel_stage if tp else _sharded_stage)(pp, mesh, marks)
    if tp:
        dp = 0  # both ranks of a tp pair run the same batch
    pipe = PipelineStage(stage, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = schedule_class(schedule_name)(pipe, MICRO, loss_fn=_loss)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g)[dp * BATCH:(dp + 1) * BATCH]
    target = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=g)[dp * BATCH:(dp + 1) * BATCH]
    losses: list = []
    for _ in range(2):  # the first step infers the stages' shapes
        stage.zero_grad(set_to_none=True)
        # the dropout draws: the same per rank in every configuration (per tp pair with tp)
        torch.manual_seed(10 + (pp if tp else rank))
        Block.reruns, losses = 0, []
        if pp == 0:
            schedule.step(ids)
        else:
            schedule.step(target=target, losses=losses)
    return {"grads": [_local(p.grad) for p in stage.parameters()],
            "losses": [loss.detach() for loss in losses], "reruns": Block.reruns}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def four_ranks(rank: int) -> dict:
    out = {}
    for schedule in SCHEDULES:
        out[(schedule, "unmarked")] = _run(rank, schedule, None)
        for name, marks in MARKS.items():
            out[(schedule, name)] = _run(rank, schedule, marks)
    out["fresh"] = _run(rank, "1F1B", FRESH)
    out[("tp", "unmarked")] = _run(rank, "1F1B", None, tp=True)
    for name, marks in TP_MARKS.items():
        out[("tp", name)] = _run(rank, "1F1B", marks, tp=True)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    out, codes = spawn_two_ranks(four_ranks, deadline=DEADLINE_S, pg_timeout=60, world=4)
    assert_every_rank_succeeded(out, codes)
    return out


def test_marked_stages_sharded_by_fsdp2_train_bitwise_as_the_unmarked_pipeline(results):
    out = results
    for rank in range(4):
        for schedule in SCHEDULES:
            plain = out[rank][(schedule, "unmarked")]
            assert all(g is not None for g in plain["grads"])
            for name in MARKS:
                marked = out[rank][(schedule, name)]
                assert_bitwise_equal(plain["grads"], marked["grads"], f"rank {rank} {schedule} {name} grad")
                assert_bitwise_equal(plain["losses"], marked["losses"], f"rank {rank} {schedule} {name} loss")
                # each of the stage's 2 blocks re-run once per micro-batch (output_recompute: also
                # to hand its output to whoever saved it)
                runs = marked["reruns"]
                assert runs > 2 * MICRO if "output" in name else runs == 2 * MICRO, (name, runs)
        fresh = out[rank]["fresh"]  # the comparison can fail: fresh dropout draws change gradients
        assert fresh["reruns"] > 0
        assert any(not torch.equal(a, b) for a, b in zip(plain["grads"], fresh["grads"], strict=True))
    assert all(len(out[r][("1F1B", "unmarked")]["losses"]) == MICRO for r in (2, 3))  # the last stage


def test_marked_stages_split_by_tensor_parallelism_train_bitwise_as_the_unmarked_pipeline(results):
    for rank in range(4):
        plain = results[rank][("tp", "unmarked")]
        for name in TP_MARKS:
            marked = results[rank][("tp", name)]
            assert_bitwise_equal(plain["grads"], marked["grads"], f"rank {rank} tp {name} grad")
            assert_bitwise_equal(plain["losses"], marked["losses"], f"rank {rank} tp {name} loss")
            assert marked["reruns"] == 2 * MICRO, (name, marked["reruns"])
