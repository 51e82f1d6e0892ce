"""Dead operators in a selective re-run (NOTE [Dead operators in a selective re-run]).

A selective region's re-run skips the calls whose outputs nothing it rebuilds reads: every
test trains bitwise against the unmarked model and against the same marks with early stop
off (every call re-run), and counts the calls the re-run ran or skipped.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat._engine import dead as _dead
from remat._engine.dead import skipped_calls
from tests._harness import assert_bitwise_equal


@pytest.fixture(autouse=True)
def _fresh_judgement():
    """Each test starts with no policy judged (NOTE [Flows recorded where they pay])."""
    _dead._WORTH.clear()


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Count(TorchDispatchMode):
    """Counts matrix products run under it (in backward: the re-runs' and the gradients')."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func in _MATMULS
        return func(*args, **(kwargs or {}))


def _rotate(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


class _Block(torch.nn.Module):
    """A Llama-shaped block: rotary q and k, attention, residual sums, a gated MLP."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)
        self.norm = torch.nn.LayerNorm(d)
        self.register_buffer("cos", torch.linspace(0.5, 1.0, d))
        self.register_buffer("sin", torch.linspace(-0.3, 0.3, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q = torch.addcmul(self.q(h) * self.cos, _rotate(self.q(h)), self.sin)
        k = torch.addcmul(self.k(h) * self.cos, _rotate(self.k(h)), self.sin)
        a = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], self.v(h)[:, None])[:, 0]
        x = x + self.o(a)
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


#: keeps the rotary outputs, the attention and the first residual sum: the q, k and o
#: projections (and the down projection, past the last saved tensor) feed nothing rebuilt
_KEEP = remat.save_calls("aten::addcmul#0", "aten::addcmul#1",
                         "aten::_scaled_dot_product_flash_attention_for_cpu#0", "aten::add#0")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block())


def _train(model: torch.nn.Module, x: torch.Tensor, steps: int = 1, *, early_stop: bool = True,
           backward=None) -> tuple[list[torch.Tensor], _Count]:
    count = _Count()
    for _ in range(steps):
        with remat.set_checkpoint_early_stop(early_stop):
            loss = model(x).square().sum()
        with count:
            (backward or torch.autograd.backward)(loss)
    return [p.grad for p in model.parameters()] + [x.grad], count


def _marked(policy=_KEEP, **options) -> torch.nn.Module:
    model = _model()
    remat.apply(model, where=_Block, policy=policy, **options)
    return model


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 6, 16, requires_grad=True)


def test_dead_projections_are_skipped_and_gradients_are_bitwise():
    want, plain = _train(_model(), _x())
    full, everything = _train(_marked(), _x(), early_stop=False)
    before = skipped_calls()
    got, pruned = _train(_marked(), _x())
    assert_bitwise_equal(got, want, "grad")
    assert_bitwise_equal(full, want, "grad")
    # per block, the full re-run runs 9 products (q, k twice each, v, o, gate, up, down);
    # early stop carried through runs v, gate and up: q, k and o are dead (their outputs
    # only feed kept calls), the down projection is past the last saved tensor
    assert everything.matmuls - plain.matmuls == 2 * 9
    assert pruned.matmuls - plain.matmuls == 2 * 3
    assert skipped_calls() - before >= 2 * 5  # the five dead products, and their pointwise tails


def test_placeholders_a_hook_records_keep_the_device_and_hold_no_value():
    """NOTE [Placeholders keep the device]: the skipped output projection's stand-in reports
    the forward's device and layout; reading its values raises, it never yields one."""
    seen = []

    def hook(module, args, out):
        if not remat.is_recomputing():
            seen.append(("forward", out.device.type, tuple(out.shape)))
            return
        with pytest.raises(RuntimeError, match="not supported for tensor subclasses"):
            out.tolist()
        with pytest.raises(remat.RecomputeError, match="the output of an operator"):
            out.sum()  # an operator outside the re-run's own (the hook's)
        seen.append((type(out).__name__, out.device.type, tuple(out.shape)))

    model = _marked()
    model[0].o.register_forward_hook(hook)
    got, _ = _train(model, _x())
    assert seen == [("forward", "cpu", (2, 6, 16)), ("Placeholder", "cpu", (2, 6, 16))]
    assert_bitwise_equal(got, _train(_model(), _x())[0], "grad")


def test_two_backwards_through_one_forward_rebuild_what_the_first_let_go():
    def twice(loss):
        loss.backward(retain_graph=True)
        loss.backward()

    want, _ = _train(_model(), _x(), backward=twice)
    got, _ = _train(_marked(), _x(), backward=twice)
    assert_bitwise_equal(got, want, "grad")


@pytest.mark.parametrize("options", [{"output_recompute": True}, {}], ids=["output_recompute", "plain"])
def test_three_steps_with_an_optimizer(options):
    def steps(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = _x()
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return list(model.parameters()) + [x.grad]

    assert_bitwise_equal(steps(_marked(**options)), steps(_model()), "parameter")


def test_counts_read_by_tolist_and_a_detached_numpy_copy_stay_live():
    """An MoE block splits its tokens by routing counts read with ``tolist()`` (no operator
    shows that read) and logs a statistic through ``numpy()``: neither is skipped."""

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.a, self.b = (torch.nn.Linear(16, 16) for _ in range(3))
            self.seen = []

        def forward(self, x):
            logits = self.router(x)
            choice = logits.argmax(-1).flatten()
            counts = torch.bincount(choice % 2, minlength=2).tolist()
            self.seen.append(float(logits.detach().numpy().mean()))
            order = torch.argsort(choice % 2, stable=True)
            parts = torch.split(x.flatten(0, 1)[order], counts)
            out = torch.cat([self.a(parts[0]).relu(), self.b(parts[1]).tanh()])
            return out.sum() + logits.softmax(-1).sum()

    def grads(marked):
        torch.manual_seed(0)
        model = Routed()
        if marked:
            remat.recompute_module(model, policy=remat.save_calls("aten::addmm#0"))
        x = _x()
        model(x).backward()
        return [p.grad for p in model.parameters()] + [x.grad], model.seen

    got, seen = grads(True)
    want, _ = grads(False)
    assert_bitwise_equal(got, want, "grad")
    assert len(seen) == 2 and seen[0] == seen[1]  # the re-run read the same logits


def test_a_re_run_that_reads_a_dead_output_otherwise_is_refused_and_runs_without_early_stop():
    class Differs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            kept = h * 2.0  # kept: h is dead while it is handed back
            if remat.is_recomputing():  # the re-run reads h where forward did not
                kept = h
            return self.b(kept).relu()

    def grads(marked, early_stop=True):
        torch.manual_seed(0)
        model = Differs()
        if marked:
            remat.recompute_module(model, policy=remat.save_calls("aten::mul#0"))
        x = _x()
        with remat.set_checkpoint_early_stop(early_stop):
            y = model(x)
        y.sum().backward()
        return [p.grad for p in model.parameters()]

    with pytest.raises(remat.RecomputeError, match="read, in recomputation, the output of an operator"):
        grads(True)
    # without early stop nothing is skipped: the re-run computes what it reads, as torch's
    # checkpoint would (another value than forward's: the region is not deterministic)
    grads(True, early_stop=False)


def test_a_gradient_inside_the_forward_turns_skipping_off():
    class Force(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            z = x if x.requires_grad else x.requires_grad_()
            energy = self.b(self.a(z).tanh()).square().sum()
            (force,) = torch.autograd.grad(energy, z, create_graph=True)
            return -force

    def grads(marked):
        torch.manual_seed(0)
        model = Force()
        if marked:
            remat.recompute_module(model, policy=remat.save_calls("aten::tanh#0"))
        x = _x()
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    before = skipped_calls()
    assert_bitwise_equal(grads(True), grads(False), "grad")
    assert skipped_calls() == before


def test_a_kept_output_changed_after_forward_is_rebuilt_from_live_inputs():
    class Returns(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 16)

        def forward(self, x):
            y = self.a(x) * 2.0  # kept: the product is dead while y is handed back
            return (y + 1).sin(), y

    def grads(marked):
        torch.manual_seed(0)
        model = Returns()
        if marked:
            remat.recompute_module(model, policy=remat.save_calls("aten::mul#0"))
        x = _x()
        out, y = model(x)
        y.mul_(3)  # the kept output changed: the re-run rebuilds it, from a live product
        (out.sum() + y.sum()).backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    before = skipped_calls()
    assert_bitwise_equal(grads(True), grads(False), "grad")
    assert skipped_calls() == before


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_call_returning_a_nested_or_sparse_tensor_is_never_skipped():
    """A nested tensor has no sizes or strides to stand in for (noting them raised, in a
    forward), a sparse one no dense placeholder: such a call is live whatever reads it."""
    x = torch.randn(3, 4, requires_grad=True)
    outputs = {torch.ops.aten._nested_tensor_from_tensor_list.default:
               torch.nested.as_nested_tensor([x.detach(), x.detach()[:2]]),
               torch.ops.aten._to_sparse.default: x.detach().to_sparse(),
               torch.ops.aten.mul.Tensor: x.detach() * 2}
    flow = _dead.Flow()
    for func, out in outputs.items():
        flow.after(flow.before(func, (x,), {}), func, out)
    assert [out is None for out in flow.outs] == [True, True, False]
    assert flow.needed == {0, 1}


def test_an_attention_inside_an_inner_region_under_a_selective_region_trains():
    """``nn.MultiheadAttention`` in an inner region, the whole under a selective region that
    keeps matrix products: what the inner region saves is live in the outer re-run, and a
    kept output is handed back, dead or not."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.attn = torch.nn.LayerNorm(16), torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            h = self.norm(x)
            return x + self.attn(h, h, h, need_weights=False)[0]

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.attn = torch.nn.Linear(16, 16), Attention()

        def forward(self, x):
            return remat.checkpoint(self.attn, self.fc(x).relu(), use_reentrant=False)

    def grads(marked):
        torch.manual_seed(0)
        stage = Stage()
        x = _x()
        if marked:
            context = remat.policy_context(remat.save_compute_intensive)
            y = remat.checkpoint(stage, x, use_reentrant=False, context_fn=context)
        else:
            y = stage.attn(stage.fc(x).relu())
        y.square().sum().backward()
        return [p.grad for p in stage.parameters()] + [x.grad]

    assert_bitwise_equal(grads(True), grads(False), "grad")


def test_fuzz_case_8154_an_attention_region_inside_a_selective_region():
    """The project's fuzzer, case 8154 (shrunk: an attention block's checkpoint inside a stage
    checkpointed with ``save_compute_intensive``, two backwards, a user's saved-tensor hook):
    the outer re-run took the attention's kept input projection for dead; its placeholder
    reached ``nn.MultiheadAttention``, whose attention chose another kernel for a tensor on
    another device, and the re-run was refused as running other operators than its forward."""
    from tests import fuzz_models as fm

    case = fm.make_case(8154)
    case.plan = [m for m in case.plan if m["kind"] == "call"]
    assert fm.run_case(case).verdict == "ok"
