"""Hugging Face models through remat's doors: router losses captured by hooks (Mixtral),
adapters on a frozen base (T5 with LoRA), a prefix cache, the two one-liners' bytes, T5's
reentrant switch, and what a trained model leaves alive.

Each test is bitwise against the unmarked model, or against torch's checkpoint through the
same Hugging Face switch where the switch itself changes the model, or asserts a typed
error before anything changed.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import remat
from tests._harness import assert_bitwise_equal
from tests.test_ecosystem import OPTIONS, VOCAB, _batch, _cache_of, _hf_model, _sgd


def _marked(base: torch.nn.Module, switch: str, option: str) -> torch.nn.Module:
    """A copy of ``base`` marked through ``switch`` (``where="blocks"`` or remat's switch)."""
    marked = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation of its switch's name
        if switch == "apply":
            remat.apply(marked, where="blocks", **OPTIONS[option])
        else:
            remat.gradient_checkpointing_enable(marked, **OPTIONS[option])
    return marked


@pytest.mark.parametrize("switch", ["apply", "gradient_checkpointing_enable"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_prefix_cache_trains_exactly_through_both_one_liners(option, switch):
    """Hugging Face's switch drops the cache in training, so a continuation on a prefix
    cache gets a mask over keys it does not have (torch's checkpoint through the switch:
    a raw size error; remat's switch refused it before). ``where="blocks"`` keeps the cache
    and recomputes; remat's switch runs that call with the switch off, without recompute,
    says so, and sets the switch back (NOTE [A prefix cache under the switch])."""
    base = _hf_model("gpt2")
    g = torch.Generator().manual_seed(1)
    prefix, ids = (torch.randint(2, VOCAB, (2, n), generator=g) for n in (3, 5))
    key = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    reruns = []

    def step(model):
        model.eval()
        with torch.no_grad():
            past = _cache_of(model(input_ids=prefix, use_cache=True))
        model.train()
        torch.manual_seed(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(input_ids=ids, labels=ids, **{key: past}, use_cache=True).loss
        loss.backward()
        return [p.grad for p in model.parameters()], [str(w.message) for w in caught]

    want, _ = step(copy.deepcopy(base))
    marked = _marked(base, switch, option)
    flags = {n for n, m in marked.named_modules() if getattr(m, "gradient_checkpointing", False)}
    for layer in marked.transformer.h:  # a re-run calls the layer's forward, and so its children
        layer.mlp.register_forward_pre_hook(lambda m, a: reruns.append(remat.is_recomputing()))
    got, said = step(marked)
    assert_bitwise_equal(got, want)
    if switch == "apply":
        assert any(reruns)  # the blocks recomputed, with the cache
    else:
        assert not any(reruns) and any("runs without recompute" in m for m in said)
        assert flags and flags == {n for n, m in marked.named_modules()
                                   if getattr(m, "gradient_checkpointing", False)}  # set back


@pytest.mark.parametrize("option", list(OPTIONS))
def test_t5_trains_bitwise_through_remats_switch(option):
    """T5Attention makes its position bias a leaf that requires grad inside each layer when
    gradient checkpointing is on; remat's reentrant re-run refused it (a RecomputeError in
    the first backward) where Hugging Face's own switch with torch trains. Its decoder
    layers all read the encoder's output: NOTE [Per-use gradients] makes the reentrant
    regions bitwise. The switch turns the model's cache off in training (Hugging Face's
    own doing, with torch's checkpoint too), so the oracle runs without the cache."""
    base = _hf_model("t5")
    marked = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.gradient_checkpointing_enable(marked, **OPTIONS[option])
        want, got = _sgd(base, "t5", use_cache=False), _sgd(marked, "t5")
    assert_bitwise_equal(got, want)


def _mixtral():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                           num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.1, use_cache=False)
    return tf.MixtralForCausalLM(cfg).train()


def _mixtral_steps(model, steps: int = 2) -> list:
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        assert out.aux_loss.requires_grad  # the router's balancing loss trains
        out.loss.backward()
        seen += [out.loss.detach()] + [p.grad for p in model.parameters()]
        opt.step()
    return seen


@pytest.mark.parametrize("switch", ["apply", "gradient_checkpointing_enable"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_mixtral_router_losses_train_bitwise(option, switch):
    """Router logits are recorded by forward hooks on each layer's gate: under
    use_reentrant=True they are handed back as outputs of the region's Function (NOTE
    [Escapes handed back by position]); torch's reentrant checkpoint trains the router
    without its balancing loss, silently."""
    base = _mixtral()
    marked = _marked(base, switch, option)
    assert_bitwise_equal(_mixtral_steps(marked, steps=3), _mixtral_steps(base, steps=3))


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@pytest.mark.parametrize("marks", ["every=2 reentrant", "blocks + attention"])
def test_a_model_with_its_default_cache_is_freed_after_training(marks):
    """The cache's tensors led back to the regions through autograd (the cache argument of a
    layer, a facts key holding it): every model built and dropped leaked a step's tensors."""
    import transformers as tf

    ids = torch.randint(2, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    start = _live_tensors()
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=96, use_cache=True)
    model = tf.LlamaForCausalLM(config).train()
    if marks == "every=2 reentrant":
        remat.apply(model, where="blocks", every=2, use_reentrant=True)
    else:
        remat.apply(model, where="blocks")
        remat.apply(model, where="LlamaAttention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
    del model
    assert _live_tensors() - start <= 0


def test_the_two_one_liners_keep_the_same_bytes_without_the_cache():
    """The docs' "Which one to use": the switch turns the cache off in training, where="blocks"
    keeps it; with use_cache=False both keep the same bytes, exactly."""
    base = _hf_model("gpt2")
    ids = _batch("gpt2", 0)["input_ids"]
    marked, switched = copy.deepcopy(base), copy.deepcopy(base)
    remat.apply(marked, where="blocks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.gradient_checkpointing_enable(switched)
        kept = {use_cache: [remat.memory.saved_bytes(
            lambda m=m, u=use_cache: m(input_ids=ids, labels=ids, use_cache=u).loss)
            for m in (marked, switched)] for use_cache in (True, False)}
    assert kept[False][0] == kept[False][1]
    assert kept[True][0] > kept[True][1] == kept[False][1]  # the cache's bytes, where="blocks" only


class _Adapter(torch.nn.Module):
    """LoRA on a frozen Linear (what peft puts on q and v), written out: no peft here."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(base.in_features)
        self.a = torch.nn.Parameter(torch.randn(2, base.in_features, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, 2, generator=g) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _t5_with_adapters() -> torch.nn.Module:
    model = _hf_model("t5")
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name in ("q", "v"):
            if isinstance(getattr(module, name, None), torch.nn.Linear):
                setattr(module, name, _Adapter(getattr(module, name)))
    return model


@pytest.mark.parametrize("switch", ["apply", "gradient_checkpointing_enable"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_t5_with_adapters_on_the_frozen_model_trains_exactly(option, switch):
    """T5 with LoRA adapters on q and v, the base frozen and no input requiring grad (no
    enable_input_require_grads): torch's reentrant checkpoint refuses or trains nothing.
    remat trains two steps bitwise in every mode (NOTE [Per-use gradients] for reentrant
    regions: T5's decoder layers all read the encoder's output)."""
    base = _t5_with_adapters()
    marked, with_torch, without_cache = _marked(base, switch, option), copy.deepcopy(base), copy.deepcopy(base)
    names = [n for n, p in base.named_parameters() if p.requires_grad]
    assert names and all(n.endswith((".a", ".b")) for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = _adapter_steps(marked), _adapter_steps(base)
    assert all(g.abs().sum() > 0 for g in want[1:1 + len(names)])  # every adapter trains
    if switch == "apply":
        assert_bitwise_equal(got, want)
        return
    # Hugging Face's switch turns T5's cache off in training: the oracle runs without it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_bitwise_equal(got, _adapter_steps(without_cache, use_cache=False))
    if option == "non-reentrant":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with_torch.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert_bitwise_equal(got, _adapter_steps(with_torch))


def _adapter_steps(model: torch.nn.Module, steps: int = 2, **options: object) -> list[torch.Tensor]:
    """``steps`` SGD steps of the trainable parameters: the last loss and gradients, then
    those parameters after."""
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.1)
    for step in range(steps):
        torch.manual_seed(step)
        opt.zero_grad(set_to_none=True)
        loss = model(**_batch("t5", step), **options).loss
        loss.backward()
        grads = [p.grad.clone() for p in trained]
        opt.step()
    return [loss.detach(), *grads, *(p.detach().clone() for p in trained)]
