"""Per-operator options of ``remat.plan`` (NOTE [Options per operator]): which operator
outputs a block keeps, chosen per block, applied in eager mode and by ``remat.compile`` alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from remat.planner import sweep
from tests.test_plan import (
    assert_compiled_plan_trains_bitwise,
    grads,
    sequence,
    tiny_transformer,
    with_choices,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ops_of(plan: remat.Plan) -> set[str]:
    return {c for c in plan.choices.values() if c.startswith("ops:")}


@pytest.fixture(scope="module")
def plans() -> list[remat.Plan]:
    out = sweep(tiny_transformer(), sequence(), budgets=[0.95, 0.9, 0.85, 0.8, 0.75, 0.7],
                options=("keep", "ops"), repeat=1, floors=True)
    return [p for p in out if isinstance(p, remat.Plan)]


def test_each_block_gets_the_same_options_keyed_by_its_own_calls():
    from remat.memory.internal import Step
    from remat.planner._cost import measure_costs
    from remat.planner._settings import Settings
    from remat.planner._trace import find_blocks

    model, x = tiny_transformer(), sequence()
    settings = Settings(step=Step(inputs=(x,), api="test"), optimizer=None, options=("keep", "ops"), repeat=1)
    costs = measure_costs(model, find_blocks(model), settings)
    ops = [o for o in costs.options if o.startswith("ops:")]
    keys = [set(o.partition(":")[2].split("+")) for o in ops]
    # the candidates are the products whose output backward reads: only fc (addmm#2, read by
    # the GELU's backward). Not qkv (addmm#0: the attention reshapes q, k, v into copies,
    # which its products save), the scores or att @ v (bmm#0, #1: the division and the
    # reshape after them save nothing of theirs), proj (addmm#1) or the MLP's last (addmm#3),
    # whose outputs flow into additions: keeping those would keep bytes for nothing.
    assert keys[0] == {"aten::addmm#2"}
    # the others are the min-cut options (NOTE [Options cut by min-cut]): each keeps the
    # residual sum, which the ranked ones never key
    assert len(keys) > 1 and all("aten::add#0" in k for k in keys[1:])
    # every block has every column
    for row in costs.kept:
        columns = [row[costs.options.index(o)] for o in ops]
        assert None not in columns
    other = tiny_transformer()
    again = measure_costs(other, find_blocks(other), settings)
    assert [o for o in again.options if o.startswith("ops:")] == ops  # no timer decides them


def test_plans_with_per_operator_options_hold_their_budgets(plans):
    assert len(plans) >= 4
    assert any(_ops_of(p) for p in plans)
    for p in plans:
        assert p.measured_peak_bytes <= p.budget_bytes, p.choices


def test_per_operator_plans_train_bitwise_equal_eager_and_compiled_dropout_included(plans):
    x = sequence()
    expected = grads(tiny_transformer(), x)
    chosen = [p for p in plans if _ops_of(p)]
    forced = sorted({o for p in plans for o in _ops_of(p)})
    mixed = with_choices(chosen[0], [forced[0], "keep", forced[-1], "recompute"])
    for plan in [*chosen, mixed]:
        eager = tiny_transformer()
        plan.apply(eager)
        got = grads(eager, x)
        assert all(torch.equal(got[n], expected[n]) for n in expected), plan.choices
        model = tiny_transformer()
        plan.apply(model)
        compiled = remat.compile(model)
        torch.manual_seed(123)
        compiled(x).float().pow(2).mean().backward()
        assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters()), plan.choices
        copies = compiled.remat_reports[0].duplicated
        assert copies, plan.choices  # the graph pass rebuilt something: the marks reached it


def test_a_per_operator_plan_round_trips_through_json_and_sets_save_calls(plans):
    plan = next(p for p in plans if _ops_of(p))
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan
    model = tiny_transformer()
    names = again.apply(model)
    marks = remat.marked_modules(model)
    assert sorted(marks) == sorted(names)
    for d in plan.decisions:
        if d.choice.startswith("ops:"):
            keys = d.choice.partition(":")[2].split("+")
            assert marks[d.name].policy == remat.save_calls(*keys)
    assert "ops:" in str(plan)


@pytest.mark.parametrize("choice", ["ops:aten::mm", "ops:mm#0", "ops:aten::mm#0+aten::mm#0"])
def test_a_malformed_per_operator_option_is_refused_and_marks_nothing(plans, choice):
    plan = with_choices(plans[0], ["keep", "recompute", choice, "keep"])
    model = tiny_transformer()
    with pytest.raises(ValueError, match="remat.Plan.apply: option 'ops:"):
        plan.apply(model)
    assert remat.marked_modules(model) == {}


def test_per_operator_options_can_be_left_out():
    plan = remat.plan(tiny_transformer(), sequence(), budget=0.8, repeat=1,
                      options=remat.planner.BLOCK_OPTIONS)
    assert not _ops_of(plan)
    assert dataclasses.asdict(plan)["decisions"]


def _trains_bitwise_eager_and_compiled(plan, make, x, expected):
    """``plan`` on fresh ``make()`` models, eager and under ``remat.compile``, gives ``expected``
    bit for bit; the compiled model, for its reports."""
    eager = make()
    plan.apply(eager)
    got = grads(eager, x)
    assert all(torch.equal(got[n], expected[n]) for n in expected), plan.choices
    return assert_compiled_plan_trains_bitwise(plan, make, x, expected)


def test_small_reductions_are_kept_and_cut_what_recomputation_runs():
    """An RMSNorm's mean (a 128th of its input) is kept by every per-operator option of a Llama
    block, and alone by one: compiled, its copies in backward rebuild the norms' products but
    neither their squares nor their means; eager and compiled train bitwise equal to unmarked."""
    from remat.memory.internal import Step
    from remat.models.llama import llama
    from remat.planner._cost import measure_costs
    from remat.planner._settings import Settings
    from remat.planner._trace import find_blocks

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return llama(layers=2, width=128, heads=4, hidden=64, vocab=64)

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = make()
    settings = Settings(step=Step(inputs=(x,), api="test"), optimizer=None, options=("keep", "ops"), repeat=0)
    ops = [o for o in measure_costs(model, find_blocks(model), settings).options if o.startswith("ops:")]
    assert ops[0] == "ops:aten::mean#0+aten::mean#1"
    # every option keeps each norm's mean, or (a min-cut option: NOTE [Options cut by min-cut])
    # the one-element-per-row scale computed from it, so no option re-runs a norm's reduction
    for o in ops:
        keys = set(o[4:].split("+"))
        assert all({f"aten::mean#{i}", f"aten::rsqrt#{i}"} & keys for i in (0, 1)), o
    expected = grads(make(), x)
    plan = with_choices(remat.plan(make(), x, budget=1.0, options=("keep",), repeat=0), [ops[0]] * 2)
    compiled = _trains_bitwise_eager_and_compiled(plan, make, x, expected)
    copied = {op.partition(".")[0] for r in compiled.remat_reports for _, op, _ in r.duplicated}
    assert "aten::mul" in copied and "aten::mean" not in copied and "aten::pow" not in copied


def _llama_options(make, x, options=("keep", "selective", "ops")):
    from remat.memory.internal import Step
    from remat.planner._cost import measure_costs
    from remat.planner._settings import Settings
    from remat.planner._trace import find_blocks

    model = make()
    settings = Settings(step=Step(inputs=(x,), api="test"), optimizer=None, options=options, repeat=0)
    return measure_costs(model, find_blocks(model), settings)


def test_min_cut_options_keep_less_than_selective_and_rebuild_no_product():
    """NOTE [Options cut by min-cut]: in a Llama block the deepest min-cut option keeps the
    rotary embeddings' outputs and the residual sum instead of the products before them, so
    backward re-runs no product, no attention and no reduction. Eager it keeps fewer bytes than
    ``selective`` (which keeps every product); compiled (where selective's copies rebuild only
    what backward reads) about as many, and its copies move less. Bitwise equal to unmarked."""
    from remat.models.llama import llama

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return llama(layers=2, width=128, heads=4, hidden=344, vocab=64)

    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    costs = _llama_options(make, x)
    cut = [o for o in costs.options if "aten::add#1" in o.split("+")]
    assert cut, costs.options
    deepest = max(cut, key=lambda o: o.count("+"))
    keys = set(deepest[4:].split("+"))
    assert {"aten::add#1", "aten::add#2", "aten::add#3"} <= keys  # roped q, k; the residual sum
    assert not {"aten::mm#0", "aten::mm#1", "aten::mm#3"} & keys  # q, k, o: not kept
    column = costs.options.index(deepest)
    selective = costs.options.index("selective")
    assert all(row[column] < row[selective] for row in costs.kept), costs.kept

    expected = grads(make(), x)
    plan = with_choices(remat.plan(make(), x, budget=1.0, options=("keep",), repeat=0), [deepest] * 2)
    compiled = _trains_bitwise_eager_and_compiled(plan, make, x, expected)
    copied = {op.partition(".")[0] for r in compiled.remat_reports for _, op, _ in r.duplicated}
    assert copied and not copied & {"aten::mm", "aten::mean", "aten::pow",
                                     "aten::_scaled_dot_product_flash_attention_for_cpu"}, copied
    selective_plan = with_choices(plan, ["selective"] * 2)
    other = assert_compiled_plan_trains_bitwise(selective_plan, make, x, expected)
    mine, theirs = compiled.remat_reports[0], other.remat_reports[0]
    assert mine.copy_bytes < theirs.copy_bytes and mine.saved_bytes <= 1.01 * theirs.saved_bytes


class _Inplace(torch.nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h.relu_() if self.inplace else h.relu()
        return x + self.out(h * 2)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_value_written_in_place_is_never_kept(inplace):
    """NOTE [Options cut by min-cut]: the engine does not number in-place calls and the graph
    pass numbers their functional forms, so no option keeps a value written in place, the call
    that made it, or a call of the operator's functional form. Out of place, the ReLU's output
    is kept (the product before it is banned); in place (``relu_`` on the product's output),
    the only cut would keep the product the write changed, so there is no option."""
    from remat.memory.internal import Step
    from remat.planner._settings import Settings
    from remat.planner._trace import find_blocks, trace

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Inplace(inplace) for _ in range(3)])
    x = torch.randn(8, 32)
    traced = trace(model, find_blocks(model), Settings(step=Step(inputs=(x,), api="test"), optimizer=None))
    found = [traced.ops.cut_options(i) for i in traced.index]
    assert found == ([[], [], []] if inplace else [["ops:aten::relu#0"]] * 3)


def test_min_cut_options_of_blocks_with_dropout_train_bitwise_eager_and_compiled():
    """A dropout mask is made in place (``empty_like``, ``bernoulli_``, ``div_``): the blocks
    still get min-cut options, none keying the mask or a ``div`` or ``bernoulli`` call, and
    plans of them train bitwise equal to unmarked, eager and compiled, dropout included."""
    from remat.memory.internal import Step
    from remat.planner._settings import Settings
    from remat.planner._trace import find_blocks, trace

    model, x = tiny_transformer(), sequence()
    traced = trace(model, find_blocks(model), Settings(step=Step(inputs=(x,), api="test"), optimizer=None))
    cut = traced.ops.cut_options(traced.index[0])
    assert cut and all(traced.ops.cut_options(i) == cut for i in traced.index), cut
    keys = {k.partition("#")[0] for o in cut for k in o[4:].split("+")}
    assert not keys & {"aten::div", "aten::bernoulli", "aten::empty_like"}, keys
    expected = grads(tiny_transformer(), x)
    base = remat.plan(tiny_transformer(), x, budget=1.0, options=("keep",), repeat=0)
    for choices in ([cut[0]] * 4, [cut[-1], "keep", cut[0], "recompute"]):
        _trains_bitwise_eager_and_compiled(with_choices(base, choices), tiny_transformer, x, expected)
