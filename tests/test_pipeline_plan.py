"""A plan per pipeline rank (``remat.plan_pipeline``): counts from the schedule, plans that
train exactly on gloo ranks and hold each rank's budget in the real pipeline.

The in-flight counts are checked against what each schedule is known to hold (1F1B: the
first of p ranks p micro-batches, the last one; GPipe: every micro-batch on every rank). The
plans are made here, once, for a byte budget below what the first rank needs unmarked, and
handed to 2 gloo ranks, which apply their own and train; their stages' gradients and losses
must be bitwise equal to the unmarked pipeline's, and each rank's peak, measured by
``remat.memory.track`` around the real ``schedule.step``, within its budget.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import remat
from remat.models.llama import LlamaConfig, llama_stages, next_token_loss
from remat.planner import RankPlan, in_flight_counts
from tests._harness import assert_bitwise_equal, assert_every_rank_succeeded, spawn_two_ranks
from tests.test_pipeline import (
    MICRO,
    VOCAB,
    Block,
    Stage,
    _loss,
    _stages,
    rank_stages,
    schedule_class,
    schedule_of,
    step_once,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 240
BATCH, SEQ = 32, 64  # activations outweigh the small stages' parameters, as in training
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two adjacent stages on a rank


def _schedule(name: str) -> type:
    return schedule_class(name)


def test_in_flight_counts_come_from_the_schedule():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    assert in_flight_counts(Schedule1F1B, 4, 4, 8) == [4, 3, 2, 1]
    assert in_flight_counts(ScheduleGPipe, 4, 4, 8) == [8, 8, 8, 8]
    interleaved = in_flight_counts(ScheduleInterleaved1F1B, 4, 2, 4)
    assert interleaved[0] > interleaved[1] >= 2  # two stages per rank, the first rank holds more


def _micro_example() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH // MICRO, SEQ), generator=g)


def _micro_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (BATCH // MICRO, SEQ), generator=g)


def _plan(name: str, budget: float | list, world: int = 2, fake: bool = False) -> remat.PipelinePlan:
    interleaved = name.startswith("Interleaved")
    n_stages = 2 * world if interleaved else world
    if fake:  # factories: planned on fake tensors
        per = max(4, n_stages) // n_stages
        stages = [functools.partial(Stage, per, i == 0, i == n_stages - 1, False) for i in range(n_stages)]
    else:
        stages = _stages(n_stages, list(range(n_stages)), batch_norm=False)
    return remat.plan_pipeline(stages, _micro_example(), schedule=_schedule(name), n_microbatches=MICRO,
                               budget=budget, world_size=world, target=_micro_target(), loss_fn=_loss,
                               optimizer=None, repeat=1, blocks=Block)


def _plans(world: int) -> dict[str, str]:
    """For each schedule, a plan for a budget below what the first rank needs unmarked (a quarter
    of the way from its peak unmarked down to its floor), and the fake-tensor plan's unmarked peaks."""
    out = {}
    for name in SCHEDULES:
        unmarked = [r.plan for r in _plan(name, 1.0, world).ranks]
        first = (unmarked[0].floor_bytes + 3 * unmarked[0].no_recompute_peak_bytes) // 4
        # one budget for every rank, or a rank's own 3/4 point where its floor is above it
        budgets = [first if p.floor_bytes <= first else (p.floor_bytes + 3 * p.no_recompute_peak_bytes) // 4
                   for p in unmarked]
        out[name] = _plan(name, budgets, world).to_json()
        out[(name, "fake")] = [r.plan.no_recompute_peak_bytes for r in _plan(name, 1.0, world, fake=True).ranks]
    return out


def test_a_pipeline_plan_round_trips_and_refuses_bad_input():
    p = _plan("1F1B", 1.0)
    assert remat.PipelinePlan.from_json(p.to_json()) == p
    assert [r.in_flight for r in p.ranks] == [2, 1]
    assert all(isinstance(r, RankPlan) for r in p.ranks)
    text = str(p)
    assert "in flight" in text and text.count("\n") == 1 + len(p.ranks)
    with pytest.raises(ValueError, match="rank 0 holds 1 stage"):
        p.apply(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), rank=0)
    stages = _stages(2, [0, 1], batch_norm=False)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        remat.plan_pipeline(stages, _micro_example(), schedule=_schedule("1F1B"), n_microbatches=0, budget=1.0)
    with pytest.raises(TypeError, match="schedule must be a schedule class"):
        remat.plan_pipeline(stages, _micro_example(), schedule="1F1B", n_microbatches=4, budget=1.0)
    with pytest.raises(ValueError, match="3 budgets for 2 ranks"):
        remat.plan_pipeline(stages, _micro_example(), schedule=_schedule("1F1B"), n_microbatches=4,
                            budget=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="step= is set by the pipeline planner"):
        remat.plan_pipeline(stages, _micro_example(), schedule=_schedule("1F1B"), n_microbatches=4,
                            budget=1.0, step=lambda m, b: None)
    with pytest.raises(ValueError, match="not a mix"):
        remat.plan_pipeline([stages[0], lambda: stages[1]], _micro_example(), schedule=_schedule("1F1B"),
                            n_microbatches=4, budget=1.0)
    with pytest.raises(remat.BudgetError, match="rank 0"):
        _plan("1F1B", 1000)
    assert remat.mark_of(stages[0].blocks[0]) is None  # planning marks nothing


def _run(rank: int, world: int, name: str, plan_json: str | None) -> dict:
    modules, indices, n_stages = rank_stages(rank, world, name, batch_norm=False)
    if plan_json is not None:
        plan = remat.PipelinePlan.from_json(plan_json)
        assert list(plan.ranks[rank].stages) == indices
        plan.apply(*modules, rank=rank)
    schedule = schedule_of(name, modules, indices, n_stages)
    return _two_steps(modules, rank, lambda ids, target: step_once(schedule, rank, world, ids, target))


def _two_steps(modules: list, rank: int, step) -> dict:
    """``step(ids, target)`` (it returns the losses) twice: the first infers the stages'
    shapes, the second is measured; its gradients, losses and tracked peak."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    peak, losses = 0, []
    for _ in range(2):
        for module in modules:
            module.zero_grad(set_to_none=True)
        torch.manual_seed(10 + rank)
        with remat.memory.track() as tracker:
            losses = step(ids, target)
        peak = tracker.peak_bytes
    return {"grads": [p.grad for m in modules for p in m.parameters()], "losses": [x.detach() for x in losses],
            "peak": peak}


def _ranks(rank: int, inbox, world: int) -> dict:
    plans = inbox.get(timeout=DEADLINE_S)
    out = {}
    for name in SCHEDULES:
        out[(name, "unmarked")] = _run(rank, world, name, None)
        out[(name, "planned")] = _run(rank, world, name, plans[name])
    return out


def two_ranks(rank: int, inbox) -> dict:
    return _ranks(rank, inbox, 2)


def four_ranks(rank: int, inbox) -> dict:
    return _ranks(rank, inbox, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_a_plan_per_rank_trains_bitwise_and_holds_each_rank_budget(world):
    plans = {}

    def feed() -> dict:
        plans.update(_plans(world))
        return plans

    body = two_ranks if world == 2 else four_ranks
    out, codes = spawn_two_ranks(body, deadline=DEADLINE_S, pg_timeout=60, feed=feed, world=world)
    assert_every_rank_succeeded(out, codes)
    for name in SCHEDULES:
        # the real-tensor replay (its unmarked peak) and the fake-tensor plan's predict what
        # each rank of the real pipeline peaks at, unmarked: within 1% (here to the byte)
        real = [out[rank][(name, "unmarked")]["peak"] for rank in range(world)]
        replayed = [r.plan.no_recompute_peak_bytes for r in remat.PipelinePlan.from_json(plans[name]).ranks]
        for predicted in (replayed, plans[(name, "fake")]):
            assert all(abs(p - m) <= 0.01 * m for p, m in zip(predicted, real, strict=True)), (name, predicted, real)
        plan = remat.PipelinePlan.from_json(plans[name])
        first, last = plan.ranks[0].plan, plan.ranks[-1].plan
        assert set(first.choices.values()) != {"keep"}  # the first rank must recompute something
        for rank, results in out.items():
            got, want = results[(name, "planned")], results[(name, "unmarked")]
            assert_bitwise_equal(got["grads"], want["grads"], f"rank {rank} {name} grad")
            assert_bitwise_equal(got["losses"], want["losses"], f"rank {rank} {name} loss")
            budget = plan.ranks[rank].plan.budget_bytes
            assert got["peak"] <= budget, (name, rank, got["peak"], budget, want["peak"])
        if name == "1F1B":
            assert first.choices != last.choices  # the last rank holds one micro-batch


# --- V layouts: two adjacent stages on a rank hand tensors over without a send ---

V_LAYOUT = {0: [0, 3], 1: [1, 2]}  # rank r holds stages r and 2p - 1 - r


def _v_plan(name: str, budget: float | list, fake: bool = False) -> remat.PipelinePlan:
    stages = ([functools.partial(Stage, 1, i == 0, i == 3, False) for i in range(4)] if fake
              else _stages(4, list(range(4)), batch_norm=False))
    return remat.plan_pipeline(stages, _micro_example(), schedule=_schedule(name), n_microbatches=MICRO,
                               budget=budget, world_size=2, target=_micro_target(), loss_fn=_loss,
                               optimizer=None, repeat=1, blocks=Block)


def _v_plans() -> dict:
    """Per V schedule: the replay's and the composed unmarked peaks, and a plan for each rank's
    own budget a quarter of the way from its unmarked peak down to its floor."""
    out = {}
    for name in V_SCHEDULES:
        unmarked = [r.plan for r in _v_plan(name, 1.0).ranks]
        out[(name, "replayed")] = [p.no_recompute_peak_bytes for p in unmarked]
        out[(name, "fake")] = [r.plan.no_recompute_peak_bytes for r in _v_plan(name, 1.0, fake=True).ranks]
        out[name] = _v_plan(name, [(p.floor_bytes + 3 * p.no_recompute_peak_bytes) // 4 for p in unmarked]).to_json()
    return out


def _held_over(schedule: object) -> None:
    """Read every receive buffer (no reference kept): a V's hold tensors handed over in the last
    step, which the step frees unread; read, the tracker counts them, as the allocator does."""
    for stage in schedule._stages:
        for table in (stage.args_recv_info, stage.grad_recv_info):
            for infos in table.values():
                for info in infos:
                    if isinstance(getattr(info, "buffer", None), torch.Tensor):
                        info.buffer.detach()


def _v_run(rank: int, name: str, plan_json: str | None, counted: bool) -> dict:
    indices = V_LAYOUT[rank]
    modules = _stages(4, indices, batch_norm=False)
    if plan_json is not None:
        remat.PipelinePlan.from_json(plan_json).apply(*modules, rank=rank)
    schedule = schedule_of(name, modules, indices, 4)

    def step(ids: torch.Tensor, target: torch.Tensor) -> list:
        losses: list = []
        if counted:
            _held_over(schedule)
        if rank == 0:  # the first and the last stage
            schedule.step(ids, target=target, losses=losses)
        else:
            schedule.step()
        return losses

    return _two_steps(modules, rank, step)


def v_ranks(rank: int, inbox) -> dict:
    plans = inbox.get(timeout=DEADLINE_S)
    out = {}
    for name in V_SCHEDULES:
        out[(name, "unmarked")] = _v_run(rank, name, None, counted=True)
        out[(name, "tracked")] = _v_run(rank, name, None, counted=False)["peak"]
        out[(name, "planned")] = _v_run(rank, name, plans[name], counted=True)
    return out


def test_a_plan_per_rank_of_a_v_schedule_trains_bitwise_and_holds_each_rank_budget():
    plans = {}

    def feed() -> dict:
        plans.update(_v_plans())
        return plans

    out, codes = spawn_two_ranks(v_ranks, deadline=DEADLINE_S, pg_timeout=60, feed=feed, world=2)
    assert_every_rank_succeeded(out, codes)
    for name in V_SCHEDULES:
        # the replay and the composed fake plan predict each rank's peak unmarked, buffers
        # held over from the last step counted: within 1% (here to the byte); a tracker that
        # does not count them measures no more
        real = [out[rank][(name, "unmarked")]["peak"] for rank in range(2)]
        for predicted in (plans[(name, "replayed")], plans[(name, "fake")]):
            assert all(abs(p - m) <= 0.01 * m for p, m in zip(predicted, real, strict=True)), (name, predicted, real)
        assert all(out[rank][(name, "tracked")] <= real[rank] for rank in range(2))
        plan = remat.PipelinePlan.from_json(plans[name])
        assert all(set(r.plan.choices.values()) != {"keep"} for r in plan.ranks)  # every rank recomputes
        for rank, results in out.items():
            got, want = results[(name, "planned")], results[(name, "unmarked")]
            assert_bitwise_equal(got["grads"], want["grads"], f"rank {rank} {name} grad")
            assert_bitwise_equal(got["losses"], want["losses"], f"rank {rank} {name} loss")
            budget = plan.ranks[rank].plan.budget_bytes
            assert got["peak"] <= budget, (name, rank, got["peak"], budget, want["peak"])


# --- fake-tensor plans composed from one micro-batch per stage (NOTE [A rank's peak composed]) ---

LLAMA = LlamaConfig(layers=8, width=64, heads=4, hidden=128, vocab=256)


def _next_token(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return next_token_loss(output)


def _llama_plan(name: str, n_stages: int, world: int, micro: int, budget, **options) -> remat.PipelinePlan:
    return remat.plan_pipeline(llama_stages(LLAMA, n_stages), torch.zeros(2, 32, dtype=torch.long),
                               schedule=_schedule(name), n_microbatches=micro, budget=budget,
                               loss_fn=_next_token, world_size=world, **options)


def _replayed_peaks(name: str, world: int, plan: remat.PipelinePlan, optimizer, stages: list | None = None,
                    example: torch.Tensor | None = None, loss=None) -> list[int]:
    """Each rank's peak with its plan applied, its whole loop replayed on fake tensors."""
    from remat.planner.internal import replayed_peaks

    return replayed_peaks(plan, stages or llama_stages(LLAMA, 4),
                          torch.zeros(2, 32, dtype=torch.long) if example is None else example,
                          schedule=_schedule(name), loss_fn=loss or _next_token, world_size=world,
                          optimizer=optimizer)


# every schedule, each with one of the two optimizers (both kinds of schedule, flat and
# V-shaped, get both): the composition does not depend on the pair
@pytest.mark.parametrize("name, optimizer", [
    ("GPipe", None), ("1F1B", "adam"), ("Interleaved1F1B", None), ("InterleavedZeroBubble", "adam"),
    ("ZBVZeroBubble", None), ("DualPipeV", "adam")])
def test_a_composed_fake_plan_predicts_the_replay_of_each_rank(name, optimizer):
    # each rank marked (a budget below its unmarked peak); its composed peak must be what the
    # replay of its whole loop measures with the plan applied: within 1% (here to the byte)
    world = 2 if name.startswith("Interleaved") or name in V_SCHEDULES else 4
    marked = _llama_plan(name, 4, world, 6, 0.96 if optimizer else 0.9, optimizer=optimizer)
    unmarked = _llama_plan(name, 4, world, 6, 1.0, optimizer=optimizer)
    assert any(set(r.plan.choices.values()) != {"keep"} for r in marked.ranks)
    assert all(r.plan.measured_peak_bytes <= r.plan.budget_bytes for r in marked.ranks)
    assert all(set(r.plan.choices.values()) == {"keep"} for r in unmarked.ranks)
    for p in (marked, unmarked):
        composed = [r.plan.measured_peak_bytes for r in p.ranks]
        replayed = _replayed_peaks(name, world, p, optimizer)
        assert all(abs(c - m) <= 0.01 * m for c, m in zip(composed, replayed, strict=True)), (composed, replayed)
    assert [r.plan.no_recompute_peak_bytes for r in marked.ranks] == [
        r.plan.measured_peak_bytes for r in unmarked.ranks]


def _sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def _mlp_stage() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                     torch.nn.Linear(128, 32)) for _ in range(2)])


def test_equal_stages_of_a_float_input_keep_the_first_apart():
    # four equal stages: the first one's input takes no gradient and sends none, so it is
    # measured apart from the other three (which share one measurement)
    stages, example = [_mlp_stage] * 4, torch.randn(16, 32)
    p = remat.plan_pipeline(stages, example, schedule=_schedule("1F1B"), n_microbatches=6, budget=[0.9, 0.9, 1.0, 1.0],
                            world_size=4, optimizer=None, loss_fn=_sum)
    composed = [r.plan.measured_peak_bytes for r in p.ranks]
    replayed = _replayed_peaks("1F1B", 4, p, None, stages, example, _sum)
    assert composed == replayed


def test_a_fake_plan_of_8_stages_and_32_microbatches_measures_each_distinct_stage_once(monkeypatch):
    # the shape of the 70B benchmark (benchmarks/pipeline_plan.py --seventy), small: 8 Llama
    # stages under 1F1B with 32 micro-batches; the first, the middle and the last stages are
    # three kinds, so the unmarked profiles are three runs, and one cost model serves all blocks
    import remat.planner._pipeline_compose as compose

    runs = {"profile": 0, "costs": 0}
    for name, key in (("stage_profile", "profile"), ("_stage_costs", "costs")):
        original = getattr(compose, name)

        def counted(*args, _original=original, _key=key):
            runs[_key] += 1
            return _original(*args)

        monkeypatch.setattr(compose, name, counted)
    config = LlamaConfig(layers=16, width=64, heads=4, hidden=128, vocab=256)
    p = remat.plan_pipeline(llama_stages(config, 8), torch.zeros(2, 32, dtype=torch.long),
                            schedule=_schedule("1F1B"), n_microbatches=32, budget=1.0, loss_fn=_next_token)
    assert [r.in_flight for r in p.ranks] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert runs == {"profile": 3, "costs": 1}
    peaks = [r.plan.measured_peak_bytes for r in p.ranks]
    assert peaks[1:7] == sorted(peaks[1:7], reverse=True) and len(set(peaks[1:7])) == 6
    assert all(r.plan.measured_peak_bytes == r.plan.no_recompute_peak_bytes for r in p.ranks)
    with pytest.raises(ValueError, match="blocks= must be a module type"):  # before any work
        remat.plan_pipeline(llama_stages(config, 8), torch.zeros(2, 32, dtype=torch.long), schedule=_schedule("1F1B"),
                            n_microbatches=32, budget=1.0, blocks=["blocks.0"])
    assert runs == {"profile": 3, "costs": 1}
