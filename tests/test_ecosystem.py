"""The models people train: Hugging Face transformers, ``where="blocks"``, torch.compile.

Hugging Face models are built from tiny configs in the test (no download); the
tests that need transformers are skipped when it is not installed.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import warnings

import pytest
import torch

import remat
from remat._front import compile_check as _compile_check
from remat.cli import main
from remat.models import resnet
from remat.models.gpt import gpt
from remat.models.llama import llama
from tests._harness import assert_bitwise_equal

# --- where="blocks", class names, globs, every= ------------------------------------------


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _MoELayer(torch.nn.Module):
    """A decoder layer holding a list of identical experts: the layer is the block, not the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + sum(e(h) for e in self.experts)


class _Stage(torch.nn.Module):
    """A ConvNeXt-style stage: a downsample, then repeated blocks."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.downsample = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.Sequential(*(_Expert() for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


def test_blocks_of_remat_models_and_module_lists():
    assert remat.apply(gpt(layers=2, width=16, heads=2, vocab=32, seq_len=8), where="blocks") == [
        "blocks.0", "blocks.1"]
    assert remat.apply(llama(layers=3, width=16, heads=2, hidden=32, vocab=32)) == [
        "blocks.0", "blocks.1", "blocks.2"]
    net = resnet((2, 2, 2, 2), width=4, class_num=3)  # stages in a ModuleList: their blocks
    assert remat.apply(net, where="blocks") == [f"layers.{s}.{b}" for s in range(4) for b in range(2)]


def test_blocks_skip_experts_inside_layers_and_descend_into_stages():
    moe = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleList(_MoELayer() for _ in range(2)))
    assert remat.apply(moe, where="blocks") == ["1.0", "1.1"]
    convnext = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(_Stage(2), _Stage(3)))
    assert remat.apply(convnext, where="blocks") == [
        "1.0.blocks.0", "1.0.blocks.1", "1.1.blocks.0", "1.1.blocks.1", "1.1.blocks.2"]


class _Inverted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU6(), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


def test_blocks_of_mobilenet_and_densenet_shapes():
    stem = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())  # Conv2dNormActivation-like
    mobilenet = torch.nn.Sequential(stem, *(_Inverted() for _ in range(3)), torch.nn.Linear(8, 8))
    assert remat.apply(mobilenet, where="blocks") == ["1", "2", "3"]
    dense = torch.nn.ModuleDict({f"denselayer{i}": _Inverted() for i in range(2)})
    densenet = torch.nn.Sequential(torch.nn.Linear(8, 8), dense, torch.nn.Linear(8, 8))
    assert remat.apply(densenet, where="blocks") == ["1.denselayer0", "1.denselayer1"]
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="found no repeated block"):  # torch layers are no blocks
        remat.apply(mlp, where="blocks")


def test_blocks_marked_train_exactly():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleList(_MoELayer() for _ in range(3)))

    def run(net: torch.nn.Module) -> list:
        x = torch.randn(4, 8, requires_grad=True)
        h = net[0](x)
        for layer in net[1]:
            h = layer(h)
        h.pow(2).sum().backward()
        return [p.grad for p in net.parameters()] + [x.grad]

    marked = copy.deepcopy(base)
    remat.apply(marked, where="blocks", output_recompute=True)
    torch.manual_seed(1)
    want = run(base)
    torch.manual_seed(1)
    assert_bitwise_equal(run(marked), want)


def test_where_takes_class_names_globs_and_every():
    model = llama(layers=4, width=16, heads=2, hidden=32, vocab=32)
    assert remat.apply(model, where="LlamaBlock", every=2) == ["blocks.0", "blocks.2"]
    remat.unmark(model)
    assert remat.apply(model, where="blocks.*.mlp") == [f"blocks.{i}.mlp" for i in range(4)]
    remat.unmark(model)
    assert remat.apply(model, where=["*Block"], every=3) == ["blocks.0", "blocks.3"]


def test_where_errors_name_the_fix_and_mark_nothing():
    model = llama(layers=2, width=16, heads=2, hidden=32, vocab=32)
    with pytest.raises(ValueError, match="matches no module class or name.*LlamaBlock"):
        remat.apply(model, where="GPT2Block")
    with pytest.raises(ValueError, match="'every' must be at least 1"):
        remat.apply(model, every=0)
    with pytest.raises(TypeError, match="'where' must be 'blocks', a class name"):
        remat.apply(model, where=3)
    with pytest.raises(ValueError, match="found no repeated block.*class name"):
        remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), where="blocks")
    assert remat.marked_modules(model) == {}


# --- torch.compile --------------------------------------------------------------------


def test_plain_torch_compile_of_a_marked_model_warns_once(monkeypatch):
    monkeypatch.setattr(_compile_check, "_warned", False)
    torch._dynamo.reset()
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    remat.recompute_module(net[1])
    compiled = torch.compile(net, backend="aot_eager")
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="ignores remat's marks.*remat.compile"):
        compiled(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(x).sum().backward()  # once
    torch._dynamo.reset()
    monkeypatch.setattr(_compile_check, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.compile(net)(x).sum().backward()  # remat's backend applies the marks: no warning


# --- Hugging Face transformers ---------------------------------------------------------

VOCAB = 64


def _hf_model(kind: str) -> torch.nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"vocab_size": VOCAB}
    if kind == "gpt2":
        config = tf.GPT2Config(n_layer=3, n_head=2, n_embd=32, n_positions=32, **small)
        model = tf.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = tf.LlamaConfig(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                hidden_size=32, intermediate_size=64, max_position_embeddings=32,
                                **small)
        model = tf.LlamaForCausalLM(config)
    elif kind == "bert":
        config = tf.BertConfig(num_hidden_layers=3, num_attention_heads=2, hidden_size=32,
                               intermediate_size=64, max_position_embeddings=32, **small)
        model = tf.BertForMaskedLM(config)
    else:
        config = tf.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32, d_kv=16,
                             d_ff=64, **small)
        model = tf.T5ForConditionalGeneration(config)
    return model.train()


def _batch(kind: str, step: int) -> dict:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(step))
    batch = {"input_ids": ids, "labels": ids}
    if kind == "t5":
        batch["decoder_input_ids"] = ids
    return batch


def _train(model: torch.nn.Module, kind: str, steps: int = 2) -> tuple[list, list]:
    """``steps`` AdamW steps; the last step's gradients and the parameters after."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        torch.manual_seed(step)  # the same dropout masks in both runs
        opt.zero_grad(set_to_none=True)
        model(**_batch(kind, step)).loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hugging_face_blocks_train_exactly_with_output_recompute(kind):
    base = _hf_model(kind)
    assert base.config.use_cache in (True, None)  # the config's default: on for decoders
    marked = copy.deepcopy(base)
    names = remat.apply(marked, where="blocks", output_recompute=True)
    assert len(names) == 3
    want = _train(base, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _train(marked, kind)
    assert_bitwise_equal(got[0], want[0])
    assert_bitwise_equal(got[1], want[1])


def _sgd(model: torch.nn.Module, kind: str, steps: int = 2, **options: object) -> list[torch.Tensor]:
    """``steps`` SGD steps; the last loss, the last step's gradients and the parameters after
    (``options``: more keywords for the model's call)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(step)  # the same dropout masks in both runs
        opt.zero_grad(set_to_none=True)
        loss = model(**_batch(kind, step), **options).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return [loss.detach(), *grads, *(p.detach().clone() for p in model.parameters())]


def _cache_of(out: object) -> object:
    """The model's cache in an output: ``cache`` since transformers 5.x, ``past_key_values`` before."""
    return out["cache"] if "cache" in out else out["past_key_values"]


OPTIONS = {"reentrant": {"use_reentrant": True}, "non-reentrant": {"use_reentrant": False},
           "output-recompute": {"output_recompute": True}}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_hugging_face_blocks_train_bitwise_with_the_default_cache(kind, option):
    base = _hf_model(kind)
    assert base.config.use_cache in (True, None)  # the config's default: on for decoders
    marked = copy.deepcopy(base)
    assert len(remat.apply(marked, where="blocks", **OPTIONS[option])) >= 3
    want = _sgd(base, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact run warns of nothing
        got = _sgd(marked, kind)
    assert_bitwise_equal(got, want)


def test_t5_reentrant_is_bitwise_though_every_decoder_layer_reads_the_encoders_output():
    """T5's decoder layers all read the encoder's output, twice each (keys and values): a
    reentrant region returning one summed gradient per input of its Function added them in
    another order than unmarked (the last bits of every encoder gradient moved, as they do
    under torch.utils.checkpoint's reentrant implementation). NOTE [Per-use gradients]:
    the Function takes that argument once per use, each with its own gradient."""
    base = _hf_model("t5")
    marked = copy.deepcopy(base)
    remat.apply(marked, where="blocks", use_reentrant=True)
    assert_bitwise_equal(_sgd(marked, "t5"), _sgd(base, "t5"))


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_the_cache_is_written_once_as_unmarked(kind, option):
    base = _hf_model(kind)
    marked = copy.deepcopy(base)
    remat.apply(marked, where="blocks", **OPTIONS[option])
    caches = []
    for model in (base, marked):
        torch.manual_seed(0)
        out = model(**_batch(kind, 0))
        out.loss.backward()  # recomputation must not write the model's cache a second time
        caches.append(_cache_of(out))
    want, got = caches
    assert got.get_seq_length() == want.get_seq_length() == 10
    assert_bitwise_equal([t for layer in got for t in layer if t is not None],
               [t for layer in want for t in layer if t is not None])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_cache_works_in_eval_and_generate(kind):
    base = _hf_model(kind)
    marked = copy.deepcopy(base)
    remat.apply(marked, where="blocks", output_recompute=True)
    ids = _batch(kind, 0)["input_ids"]
    assert _cache_of(marked(input_ids=ids, use_cache=True)).get_seq_length() == ids.shape[1]
    marked.eval()
    base.eval()
    with torch.no_grad():
        out = marked(input_ids=ids, use_cache=True)
        assert _cache_of(out).get_seq_length() == ids.shape[1]
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(marked.generate(ids, **kwargs), base.generate(ids, **kwargs))
    # evaluation with grad enabled keeps the cache too (and the marks recompute)
    out = marked(input_ids=ids, use_cache=True)
    assert _cache_of(out).get_seq_length() == ids.shape[1]
    out.logits.sum().backward()
    assert _cache_of(out).get_seq_length() == ids.shape[1]


def test_a_cache_written_in_place_is_refused_with_the_fix():
    tf = pytest.importorskip("transformers")
    model = _hf_model("llama")
    remat.apply(model, where="blocks", use_reentrant=True)
    ids = _batch("llama", 0)["input_ids"]
    cache = tf.StaticCache(config=model.config, max_cache_len=16)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert cache.is_compileable  # what the guard asks: its layers are written in place
    with pytest.raises(TypeError, match=r"LlamaDecoderLayer.*StaticCache.*in place.*use_cache=False"):
        model(input_ids=ids, **{key: cache}, use_cache=True)
    with torch.no_grad():  # no recomputation: the cache is used as it is
        assert _cache_of(model(input_ids=ids, **{key: cache}, use_cache=True)) is cache
    assert cache.get_seq_length() == ids.shape[1]


def test_a_marked_attention_module_is_guarded_too():
    base = _hf_model("gpt2")
    marked = copy.deepcopy(base)
    assert remat.apply(marked, where="*.attn", use_reentrant=True) == [f"transformer.h.{i}.attn" for i in range(3)]
    assert_bitwise_equal(_sgd(marked, "gpt2"), _sgd(base, "gpt2"))


def test_the_mark_imports_no_adapter_and_remat_no_transformers():
    import subprocess
    import sys

    from tests.test_layers import SRC, remat_imports

    assert [n for n, _ in remat_imports(SRC / "_front" / "marks.py") if n.split(".")[-1] == "hf"] == []
    code = "import sys, remat; assert 'transformers' not in sys.modules, 'imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _saved_and_grads(model: torch.nn.Module, kind: str) -> tuple[int, list]:
    model.zero_grad(set_to_none=True)
    batch = _batch(kind, 0)
    torch.manual_seed(0)
    holder = []

    def forward() -> torch.Tensor:
        holder.append(model(**batch).loss)
        return holder[-1]

    saved = remat.memory.saved_bytes(forward)
    holder.pop().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_switch_with_remat_matches_torch(kind):
    base = _hf_model(kind)
    with_torch, with_remat, stronger = (copy.deepcopy(base) for _ in range(3))
    with_torch.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' new name of its switch
        names = remat.gradient_checkpointing_enable(with_remat)
    assert len(names) == 3
    remat.gradient_checkpointing_enable(stronger, output_recompute=True)
    plain_bytes, want = _saved_and_grads(base, kind)
    torch_bytes, torch_grads = _saved_and_grads(with_torch, kind)
    remat_bytes, remat_grads = _saved_and_grads(with_remat, kind)
    strong_bytes, strong_grads = _saved_and_grads(stronger, kind)
    # Hugging Face's switch runs its layers without a cache: GPT-2's keys then have another
    # memory layout than in the plain run, and its gradients differ from it in the last bits
    torch.testing.assert_close(torch_grads, want)
    assert_bitwise_equal(remat_grads, torch_grads)
    assert_bitwise_equal(strong_grads, torch_grads)
    assert remat_bytes == torch_bytes < plain_bytes
    assert strong_bytes < remat_bytes


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_remats_switch_trains_bitwise_as_the_model_without_its_cache(kind, option):
    """Hugging Face's switch turns the model's cache off in training (its own doing, with
    torch's checkpoint too: GPT-2's keys get another memory layout, so the last bits move
    against the default run); against the unmarked model run without the cache, remat's
    switch trains two steps bitwise in every mode."""
    base = _hf_model(kind)
    marked = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(remat.gradient_checkpointing_enable(marked, **OPTIONS[option])) >= 3
        got = _sgd(marked, kind)
    assert_bitwise_equal(got, _sgd(base, kind, use_cache=False))


def test_every_n_layers_as_hugging_face_counts_them():
    model = _hf_model("llama")
    marked = copy.deepcopy(model)
    assert remat.gradient_checkpointing_enable(model, every=2) == ["model.layers.0", "model.layers.2"]
    assert remat.apply(marked, every=2) == ["model.layers.0", "model.layers.2"]
    t5 = _hf_model("t5")  # encoder and decoder blocks, numbered through as Hugging Face does
    assert remat.apply(copy.deepcopy(t5), every=3) == remat.gradient_checkpointing_enable(t5, every=3)


def test_trainer_runs_a_few_steps_with_marks(tmp_path):
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    data = [{"input_ids": _batch("gpt2", i)["input_ids"][0], "labels": _batch("gpt2", i)["labels"][0]}
            for i in range(6)]

    def train(mark: bool) -> list:
        model = _hf_model("gpt2")
        if mark:
            remat.apply(model, where="blocks", output_recompute=True)
        args = tf.TrainingArguments(
            output_dir=str(tmp_path / str(mark)), max_steps=3, per_device_train_batch_size=2,
            learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
            use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tf.Trainer(model=model, args=args, train_dataset=data).train()
        return [p.detach().clone() for p in model.parameters()]

    assert_bitwise_equal(train(mark=True), train(mark=False))


def test_profile_and_estimate_take_a_batch_dict_and_the_same_optimizer():
    model = _hf_model("gpt2")
    batch = _batch("gpt2", 0)
    report = remat.profile(model, batch=batch, repeat=0)
    assert report.optimizer_bytes > 2 * report.param_bytes  # Adam by default, as estimate
    factory = functools.partial(_hf_model, "gpt2")
    estimated = remat.estimate(factory, batch=batch, marks="GPT2Block")
    assert estimated.optimizer_bytes == report.optimizer_bytes
    assert sum(r.marked for r in estimated.rows) == 3
    unmarked = remat.estimate(factory, batch=batch)
    assert estimated.total_kept < unmarked.total_kept


def moe_stack() -> torch.nn.Module:
    """A model without ``mark_blocks()``, for ``remat profile --marks blocks``."""
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(*(_MoELayer() for _ in range(2))))


def test_cli_marks_blocks_without_mark_blocks(tmp_path):
    out_json = tmp_path / "b.json"
    main(["profile", "tests.test_ecosystem:moe_stack", "--input-shape", "4,8", "--repeat", "0",
          "--optimizer", "none", "--marks", "blocks", "--json", str(out_json)])
    after = json.loads(out_json.read_text())["after"]
    assert [r["name"] for r in after["rows"] if r["marked"]] == ["1.0", "1.1"]
