"""Re-runs in stages (NOTE [Re-runs in stages] in ``remat/_engine/stages.py``).

A selective region marked ``stages=k`` rebuilds its saved tensors a stage at a time as its
backward reads them. Every test trains bitwise against the unmarked model; the memory test
measures the step's peak against the same marks in one stage, and counts the products and
the re-runs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import remat
from remat._graph.internal import allocation_peak
from remat.models.llama import Llama, LlamaBlock, LlamaConfig, next_token_loss
from tests._harness import assert_bitwise_equal
from tests.test_dead_calls import _Count

#: what torch.compile's min-cut keeps in a Llama block at activation_memory_budget=0.8
#: (benchmarks/dead_calls.py): a re-run needs only cheap operators
_KEEP = remat.save_calls("aten::_scaled_dot_product_flash_attention_for_cpu#0", "aten::add#1", "aten::add#2",
                         "aten::add#3", "aten::mm#2", "aten::mm#4", "aten::mm#5", "aten::rsqrt#0",
                         "aten::rsqrt#1")
def _llama(mark=None) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=3, width=64, heads=4, kv_heads=2, hidden=160, vocab=97))
    if mark is not None:
        mark(model)
    return model


_TOKENS = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))


def _train(model: torch.nn.Module, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        next_token_loss(model(_TOKENS)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads + [p.detach().clone() for p in model.parameters()]


_FRONTS = {
    "recompute_module": lambda s: lambda m: [remat.recompute_module(b, policy=_KEEP, stages=s) for b in m.blocks],
    "apply": lambda s: lambda m: remat.apply(m, where=LlamaBlock, policy=_KEEP, stages=s),
    "cell": lambda s: lambda m: [b.recompute(policy=_KEEP, stages=s) for b in m.blocks],
}


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("front", sorted(_FRONTS))
def test_staged_regions_train_bitwise(front: str, stages: int) -> None:
    assert_bitwise_equal(_train(_llama()), _train(_llama(_FRONTS[front](stages))))


@pytest.mark.parametrize("switch", ["apply", "gradient_checkpointing_enable"])
def test_staged_hugging_face_llama_trains_bitwise(switch: str) -> None:
    """Both one-liners on a Hugging Face Llama, every layer re-run in two stages."""
    from tests.test_ecosystem import _hf_model, _sgd

    base = _hf_model("llama")
    marked = copy.deepcopy(base)
    options = {"policy": remat.save_compute_intensive, "stages": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation of its switch's name
        if switch == "apply":
            remat.apply(marked, where="blocks", **options)
        else:
            remat.gradient_checkpointing_enable(marked, **options)
        assert_bitwise_equal(_sgd(base, "llama"), _sgd(marked, "llama"))


def test_stages_lower_the_peak_and_rerun_no_product() -> None:
    """Two stages: the backward holds one stage's rebuilt tensors at a time (a lower peak than
    one re-run of the same marks) and runs no matrix product more (the MLP's stage skips the
    attention's operators, the attention's stage stops before the MLP)."""
    one = _llama(_FRONTS["recompute_module"](1))
    two = _llama(_FRONTS["recompute_module"](2))

    def step(model):
        next_token_loss(model(_TOKENS)).backward()
        model.zero_grad(set_to_none=True)

    for model in (one, two):
        step(model)
    peaks = {id(m): allocation_peak(lambda m=m: step(m)) for m in (one, two)}
    assert peaks[id(two)] < 0.97 * peaks[id(one)], peaks  # 4.3% lower here
    products = {}
    for model in (one, two):
        with _Count() as count:
            step(model)
        products[id(model)] = count.matmuls
    assert products[id(two)] == products[id(one)] == 3 * 7 + 1 + 3 * (7 * 2) + 2  # no product re-run


class _Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        return x + self.fc2(torch.tanh(h) * h)


def _dropped(stages: int | str | None) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Dropped(), _Dropped())
    if stages:
        for block in model:
            remat.recompute_module(block, policy=remat.save_compute_intensive, stages=stages)
    return model


@pytest.mark.parametrize("stages", [2, 4, "each"])  # "each": what a dropout feeds goes to the re-run
def test_stages_replay_random_operators(stages) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))

    def run(model):
        torch.manual_seed(5)
        out = model(x).pow(2).sum()
        out.backward()
        return [out.detach()] + [p.grad for p in model.parameters()]

    assert_bitwise_equal(run(_dropped(None)), run(_dropped(stages)))


@pytest.mark.parametrize("stages", [2, "each"])
def test_stages_backward_twice_and_partial_grad(stages) -> None:
    """``retain_graph`` twice re-runs every stage (or replays every saved tensor) twice;
    ``torch.autograd.grad`` of some parameters only reaches what it needs."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    results = []
    for model in (_dropped(None), _dropped(stages)):
        torch.manual_seed(5)
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        torch.manual_seed(5)
        partial = torch.autograd.grad(model(x).pow(2).sum(), [model[1].fc2.weight, model[0].fc1.bias])
        results.append([p.grad for p in model.parameters()] + list(partial))
    assert_bitwise_equal(*results)


@pytest.mark.parametrize("kwargs, fault", [
    ({"stages": 0}, "stages must be an int >= 1"),
    ({"stages": 2.0, "policy": remat.save_compute_intensive}, "stages must be an int >= 1"),
    ({"stages": 2}, "needs a selective policy"),
    ({"stages": 2, "policy": remat.save_compute_intensive, "output_recompute": True}, "output_recompute=False"),
])
def test_bad_stages_are_refused_before_marking(kwargs: dict, fault: str) -> None:
    block = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=fault) as err:
        remat.recompute_module(block, **kwargs)
    assert "remat.recompute_module" in str(err.value)
    assert remat.mark_of(block) is None


# --- the planner's staged options ----------------------------------------------------------


def test_the_planner_offers_staged_options_and_a_staged_plan_holds_its_budget_bitwise() -> None:
    """NOTE [Options re-run in stages]: each min-cut option of a block comes staged too; a plan
    that may only keep a block or stage it reaches its floor with staged blocks, held, and
    trains bitwise; its choices round-trip through JSON."""
    options = ("keep", "staged")
    loose = remat.plan(_llama(), _TOKENS, loss_fn=next_token_loss, budget=1.0, repeat=1, options=options)
    tight = remat.plan(_llama(), _TOKENS, loss_fn=next_token_loss, budget=loose.floor_bytes, repeat=1,
                       options=options)
    staged = [c for c in tight.choices.values() if c.startswith("staged:")]
    assert staged and set(tight.choices.values()) <= {"keep", *staged}, tight.choices
    assert tight.measured_peak_bytes <= tight.budget_bytes
    assert remat.Plan.from_json(tight.to_json()).choices == tight.choices
    marked = _llama()
    tight.apply(marked)
    assert all(remat.mark_of(marked.get_submodule(n)).stages == 2 for n, c in tight.choices.items() if c != "keep")
    assert_bitwise_equal(_train(_llama()), _train(marked))


def test_a_compiled_plan_refuses_staged_options_saying_why() -> None:
    assert "staged" not in remat.planner.OPTIONS  # a plan uses it only when asked
    with pytest.raises(ValueError, match="a staged re-run is an eager option"):
        remat.compile(_llama(), budget=0.5, example_inputs=(_TOKENS,), loss_fn=next_token_loss,
                      options=("keep", "staged"))


def test_staged_options_are_priced_apart_with_a_pass_per_stage() -> None:
    """A staged option runs the block's code once more than its ``ops:`` twin: priced with the
    per-call policies, the planner took staged plans that ran slower than it predicted."""
    from remat.planner._cost import _family

    calls = "aten::add#1+aten::mm#2"
    assert _family(f"staged:{calls}") == "staged" != _family(f"ops:{calls}") == "policies"


def test_a_staged_region_inside_a_selective_region_reads_its_inputs_once_per_backward() -> None:
    """Found by the project's fuzzer (case 2468): a staged region inside another selective
    region saves its inputs through the outer region's hooks; its second stage read them again
    and the outer region refused the second unpack as 'unpacked twice'. Bitwise now."""
    import tests.fuzz_models as fm

    case = fm.make_case(2468)
    assert any(m.get("opts", {}).get("stages") for m in case.plan)
    assert fm.run_case(case).verdict == "ok"
