"""Each saved tensor rebuilt on its own (NOTE [Each saved tensor rebuilt on its own] in
``remat/_engine/recipes.py``).

A selective region marked ``stages="each"`` rebuilds a saved tensor, when backward reads it,
from the operator calls that made it, without running the region's code again. Every test
trains bitwise against the unmarked model; the memory test measures the step's peak against
the same marks re-run once and in two stages, and counts the region's runs and the products;
the doors a replay cannot see (a write through ``.data``, an alias with a version of its own,
a random operator, a buffer changed after forward) end bitwise through the
ordinary re-run, which the tests count too.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._graph.internal import allocation_peak
from remat.models.llama import LlamaBlock, next_token_loss
from tests._harness import assert_bitwise_equal
from tests.test_dead_calls import _Count
from tests.test_stages import _KEEP, _TOKENS, _llama, _train

#: the calls ``_KEEP`` keeps (benchmarks/dead_calls.py)
_KEEP_CALLS = ("aten::_scaled_dot_product_flash_attention_for_cpu#0", "aten::add#1", "aten::add#2", "aten::add#3",
               "aten::mm#2", "aten::mm#4", "aten::mm#5", "aten::rsqrt#0", "aten::rsqrt#1")

_FRONTS = {
    "recompute_module": lambda m: [remat.recompute_module(b, policy=_KEEP, stages="each") for b in m.blocks],
    "apply": lambda m: remat.apply(m, where=LlamaBlock, policy=_KEEP, stages="each"),
    "cell": lambda m: [b.recompute(policy=_KEEP, stages="each") for b in m.blocks],
}


class _Runs:
    """Counts the forward calls of ``modules``, children of marked blocks (their forward hooks
    run in a re-run too)."""

    def __init__(self, modules) -> None:
        self.count = 0
        self.handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, *_) -> None:
        self.count += 1


@pytest.mark.parametrize("front", sorted(_FRONTS))
def test_each_trains_bitwise(front: str) -> None:
    assert_bitwise_equal(_train(_llama()), _train(_llama(_FRONTS[front])))


@pytest.mark.parametrize("switch", ["apply", "gradient_checkpointing_enable"])
def test_each_hugging_face_llama_trains_bitwise(switch: str) -> None:
    from tests.test_ecosystem import _hf_model, _sgd

    base = _hf_model("llama")
    marked = copy.deepcopy(base)
    options = {"policy": remat.save_compute_intensive, "stages": "each"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation of its switch's name
        if switch == "apply":
            remat.apply(marked, where="blocks", **options)
        else:
            remat.gradient_checkpointing_enable(marked, **options)
        assert_bitwise_equal(_sgd(base, "llama"), _sgd(marked, "llama"))


def _step(model) -> None:
    next_token_loss(model(_TOKENS)).backward()
    model.zero_grad(set_to_none=True)


def test_each_holds_one_rebuilt_tensor_at_a_time_and_never_reruns_the_block() -> None:
    """The backward holds one rebuilt tensor (and what later replays share) at a time: a peak
    no higher than two stages', lower than one re-run's; the blocks' code runs once a step (no
    re-run), and no matrix product runs again."""
    from tests.test_stages import _FRONTS as staged

    models = {1: _llama(staged["recompute_module"](1)), 2: _llama(staged["recompute_module"](2)),
              "each": _llama(_FRONTS["recompute_module"])}
    for model in models.values():
        _step(model)
    peaks = {k: allocation_peak(lambda m=m: _step(m)) for k, m in models.items()}
    assert peaks["each"] <= peaks[2] < 0.97 * peaks[1], peaks
    runs = {}
    for k, model in models.items():
        counter = _Runs([b.attn_norm for b in model.blocks])
        with _Count() as count:
            _step(model)
        runs[k] = (counter.count, count.matmuls)
    assert runs["each"] == (3, runs[1][1]), runs  # 3 blocks run once each; the products of one re-run
    assert runs[1][0] == 6


class _Norm3(torch.nn.Module):
    """One normalized tensor read by three products (attention's q, k and v)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        n = torch.tanh(self.norm(x))
        return x + self.q(n) * torch.sigmoid(self.k(n)) + self.v(n)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_replays_share_what_they_both_read() -> None:
    """NOTE [Replays share what they both read]: the tanh of the norm, saved by three products,
    is rebuilt once per backward, not once per product (the layer norm with it)."""
    torch.manual_seed(0)
    plain = _Norm3()
    marked = remat.recompute_module(copy.deepcopy(plain), policy=remat.save_compute_intensive, stages="each")
    x = torch.randn(4, 16, requires_grad=True)
    results = []
    for model in (plain, marked):
        loss = model(x).pow(2).sum()
        with _Ops() as ops:
            loss.backward()
        results.append([p.grad for p in model.parameters()] + [x.grad.clone()])
        x.grad = None
        rebuilt = [ops.seen.count(op) for op in (torch.ops.aten.native_layer_norm.default, torch.ops.aten.tanh.default)]
        assert rebuilt == ([0, 0] if model is plain else [1, 1]), rebuilt
    assert_bitwise_equal(*results)


class _Door(torch.nn.Module):
    """A block whose forward changes an activation where a replay cannot see it."""

    def __init__(self, door: str) -> None:
        super().__init__()
        self.door = door
        self.fc1 = torch.nn.Linear(16, 32, bias=door != "alias")
        self.fc2 = torch.nn.Linear(32, 16)
        self.register_buffer("scale", torch.full((32,), 1.5))
        self.register_buffer("shift", torch.full((32,), 0.25))

    def forward(self, x):
        h = self.fc1(x)
        if self.door == "data":  # written through .data: no version change on h
            h.data.mul_(2)
        elif self.door == "numpy":  # written where the dispatcher does not see
            values = h.detach().numpy()
            values *= 2
        elif self.door == "alias":  # a 3-D bias-free Linear: mm, then _unsafe_view, with a version of its own
            h.add_(1)
        h = torch.sin(h * self.scale + self.shift)  # sin saves its input; add saves nothing
        return self.fc2(torch.cos(h))


@pytest.mark.parametrize("door", ["data", "numpy", "alias"])
def test_doors_a_replay_cannot_see_end_bitwise(door: str) -> None:
    """A write through ``.data`` (no version change), one through numpy (no operator), and one
    through an alias with a version of its own (NOTE [Aliases with a version of their own] in ``selective.py``): the replay refuses
    what it cannot vouch for, the ordinary re-run (which the counter sees) rebuilds it, and
    training ends as without the mark."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_Door(door), _Door(door))
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))

    def run(model):
        model(x).pow(2).sum().backward()
        return [p.grad for p in model.parameters()]

    expected = run(plain)
    marked = _marked(plain, "each")
    counter = _Runs([b.fc1 for b in marked])
    assert_bitwise_equal(expected, run(marked))
    assert counter.count > 2, "the replay should have refused and the block re-run"


@pytest.mark.parametrize("stages", [1, 2, "each"])
def test_a_kept_output_written_through_numpy_in_forward_is_rebuilt(stages) -> None:
    """NOTE [Kept outputs detached in forward] (``selective.py``): the block's first product is
    kept, then written through numpy; handed back to the re-run, which wrote it again, its
    gradients were off by up to 1.02 in every selective mode, silently. Bitwise now."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_Door("numpy"), _Door("numpy"))
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))

    def run(model):
        model(x).pow(2).sum().backward()
        return [p.grad for p in model.parameters()]

    assert_bitwise_equal(run(plain), run(_marked(plain, stages)))


def _marked(plain: torch.nn.Module, stages) -> torch.nn.Module:
    marked = copy.deepcopy(plain)
    for block in marked:
        remat.recompute_module(block, policy=remat.save_compute_intensive, stages=stages)
    return marked


@pytest.mark.parametrize("stages", [1, "each"])
def test_a_buffer_changed_after_forward_is_refused_as_by_the_rerun(stages) -> None:
    """A buffer the block read (and saved nothing of) changed in place between forward and
    backward: the replay does not read it as it is now; the re-run refuses, typed, in both."""
    torch.manual_seed(0)
    marked = _marked(torch.nn.Sequential(_Door("none"), _Door("none")), stages)
    out = marked(torch.randn(2, 4, 16))
    with torch.no_grad():
        marked[1].shift.add_(0.0)  # a new version, the same values
    with pytest.raises(remat.RecomputeError, match="shift .* was changed in place after the region's forward"):
        out.pow(2).sum().backward()


@pytest.mark.parametrize("kwargs, fault", [
    ({"stages": "all", "policy": remat.save_compute_intensive}, 'or "each"'),
    ({"stages": "each"}, "needs a selective policy"),
    ({"stages": "each", "policy": remat.save_compute_intensive, "output_recompute": True}, "output_recompute=False"),
])
def test_bad_stages_are_refused_before_marking(kwargs: dict, fault: str) -> None:
    block = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=fault) as err:
        remat.recompute_module(block, **kwargs)
    assert "remat.recompute_module" in str(err.value)
    assert remat.mark_of(block) is None


class _Mixed(torch.nn.Module):
    """A block whose second product runs with autocast turned off inside it, in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        with torch.autocast("cpu", enabled=False):
            return torch.nn.functional.gelu(self.fc2(h.float()))


def _two_blocks(block: type, kept: str, stages: str | None) -> torch.nn.Sequential:
    """Two ``block`` s made from seed 0, each marked keeping the call ``kept`` (None: unmarked)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(block(), block())
    for b in model if stages else ():
        remat.recompute_module(b, policy=remat.save_calls(kept), stages=stages)
    return model


def test_each_replays_as_forward_ran_whatever_autocast_says_in_backward() -> None:
    """The forward's operators are noted below autocast (its casts are operators too) and
    replayed with autocast off: a float32 product forward ran with autocast turned off is
    rebuilt in float32 by a backward that runs under bfloat16 autocast (bitwise)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    results = []
    for stages in (None, "each"):
        model = _two_blocks(_Mixed, "aten::tanh#0", stages)
        counter = _Runs([b.fc1 for b in model])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).sum()
            loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
        assert counter.count == 2  # no block ran again: every saved tensor was replayed
    assert_bitwise_equal(*results)


def test_an_attention_that_drew_nothing_is_replayed_not_the_block() -> None:
    """NOTE [Random operators that drew nothing] (``recipes.py``): the attention is tagged as
    random for its dropout; at ``dropout_p=0`` it draws nothing and is replayed alone, where
    its saved tensors sent every block to its re-run before (its code ran twice)."""
    keep = remat.save_calls(*[k for k in _KEEP_CALLS if "attention" not in k])
    model = _llama(lambda m: [remat.recompute_module(b, policy=keep, stages="each") for b in m.blocks])
    counter = _Runs([b.attn_norm for b in model.blocks])
    assert_bitwise_equal(_train(_llama()), _train(model))
    assert counter.count == 2 * 3  # two steps, three blocks, no re-run


class _Dropping(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
        return x + torch.tanh(out.transpose(1, 2).reshape(2, 6, 16))


def test_an_attention_that_drew_is_rebuilt_by_the_rerun() -> None:
    """At ``dropout_p=0.4`` the attention draws: the replay refuses it, the re-run replays the
    forward's random state (bitwise)."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7))
    results = []
    for stages in (None, "each"):
        model = _two_blocks(_Dropping, "aten::addmm#0", stages)
        torch.manual_seed(3)
        model(x).pow(2).sum().backward()
        results.append([p.grad for p in model.parameters()])
    assert_bitwise_equal(*results)
