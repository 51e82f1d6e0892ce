"""remat.estimate: fake-tensor step peaks equal real CPU runs; large configs allocate nothing."""

import dataclasses
import functools

import pytest
import torch

import remat
from remat.memory.estimate import build_model
from remat.models.gpt import GPTConfig
from remat.models.llama import Llama, LlamaConfig, llama_7b, next_token_loss

torch.set_num_threads(1)
CONFIG = LlamaConfig(layers=2, width=32, heads=4, kv_heads=2, hidden=64, vocab=64)
TOKENS = torch.zeros(2, 16, dtype=torch.long)


@pytest.mark.parametrize("marks", [None, "blocks"])
def test_estimate_matches_real_cpu_step(marks):
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if marks:
        model.mark_blocks()
    real = remat.profile(model, TOKENS, loss_fn=next_token_loss, optimizer="adam", repeat=0)
    fake = remat.estimate(CONFIG, TOKENS, loss_fn=next_token_loss, optimizer="adam", marks=marks)
    assert fake.estimated and "FakeTensorMode" in fake.device
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes
    assert fake.total_kept == real.total_kept
    assert [r.kept_self for r in fake.rows] == [r.kept_self for r in real.rows]


def test_marks_lower_the_estimate():
    plain = remat.estimate(CONFIG, TOKENS, loss_fn=next_token_loss, optimizer=None)
    marked = remat.estimate(CONFIG, TOKENS, loss_fn=next_token_loss, optimizer=None, marks="blocks")
    assert marked.total_kept < plain.total_kept
    assert "recompute" in marked.peak_by_phase or marked.peak_phase != "recompute"
    assert {p for _, p in marked.timeline} >= {"forward", "backward", "recompute"}


def test_parts_of_the_peak_for_a_model_too_large_to_allocate():
    # 8 GiB of float32 weights: only fake tensors can hold this on a CI machine.
    make = functools.partial(torch.nn.Linear, 32768, 65536, bias=False)
    report = remat.estimate(make, (8, 32768), optimizer="adam")
    weight = 32768 * 65536 * 4
    assert report.param_bytes == weight and report.grad_bytes == weight
    assert report.optimizer_bytes == 2 * weight + 4  # exp_avg, exp_avg_sq, step
    assert report.peak_bytes >= 4 * weight  # params + Adam state + gradient


def test_7b_width_layers_count_parameters_exactly():
    sizes = llama_7b()
    two = LlamaConfig(layers=2, width=sizes.width, heads=sizes.heads, hidden=sizes.hidden, vocab=sizes.vocab)
    report = remat.estimate(two, torch.zeros(1, 64, dtype=torch.long), loss_fn=next_token_loss,
                            optimizer=None, dtype=torch.bfloat16)
    per_block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert report.param_bytes == 2 * (2 * per_block + 2 * 32000 * 4096 + 4096)


def test_marks_as_types_and_functions():
    by_type = remat.estimate(CONFIG, TOKENS, loss_fn=next_token_loss, optimizer=None,
                             marks=[type(Llama(CONFIG).blocks[0])])
    by_function = remat.estimate(CONFIG, TOKENS, loss_fn=next_token_loss, optimizer=None,
                                 marks=lambda m: m.mark_blocks())
    assert by_type.total_kept == by_function.total_kept
    assert [r.name for r in by_type.rows if r.marked] == ["blocks.0", "blocks.1"]


def test_errors_name_the_api():
    with pytest.raises(TypeError, match="remat.estimate: pass a factory"):
        build_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="remat.estimate: each example input"):
        remat.estimate(functools.partial(torch.nn.Linear, 2, 2), "2,2")
    with pytest.raises(ValueError, match="remat.estimate: marks='blocks' found no repeated block"):
        remat.estimate(functools.partial(torch.nn.Linear, 2, 2), (1, 2), marks="blocks")


#: the fields a composed estimate leaves empty (NOTE [Composing an estimate])
NOT_COMPOSED = ("timeline", "peak_by_phase", "peak_by_module", "seconds", "composed")


@pytest.mark.parametrize("config", [
    LlamaConfig(layers=8, width=64, heads=4, kv_heads=2, hidden=128, vocab=300),
    GPTConfig(layers=7, width=64, heads=4, seq_len=32, vocab=200),
], ids=["llama", "gpt"])
@pytest.mark.parametrize("marks, optimizer", [(None, "adam"), ("blocks", "adam"), ("selective", None)])
def test_a_composed_estimate_equals_the_whole_trace_to_the_byte(config, marks, optimizer):
    """NOTE [Composing an estimate]: from the model cut to 3 and 4 blocks, every figure of the
    report (peak, its phase, baseline, parameters, gradients, optimizer state, each phase's
    highest footprint, what is kept, every module's row) equals the whole model's."""
    def mark(model):
        for block in model.blocks:
            remat.recompute_module(block, policy=remat.save_compute_intensive)

    given = mark if marks == "selective" else marks
    tokens = torch.zeros(2, 32, dtype=torch.long)
    whole = remat.estimate(config, tokens, loss_fn=next_token_loss, optimizer=optimizer, marks=given)
    composed = remat.estimate(config, tokens, loss_fn=next_token_loss, optimizer=optimizer, marks=given,
                              compose=True)
    assert composed.composed.startswith(f"{len(whole.rows) and config.layers} identical blocks")
    assert not whole.composed and whole.timeline and not composed.timeline
    for field in dataclasses.fields(remat.memory.ProfileReport):
        if field.name not in NOT_COMPOSED:
            assert getattr(composed, field.name) == getattr(whole, field.name), field.name
    assert "composed: " in composed.table() and "composed: " not in whole.table()


def test_a_model_that_cannot_be_composed_is_traced_whole():
    # blocks marked unalike, too few blocks, no container of identical blocks: traced whole
    def every_other(model):
        for block in list(model.blocks)[::2]:
            remat.recompute_module(block)

    config = LlamaConfig(layers=8, width=64, heads=4, hidden=128, vocab=300)
    for args in [{"model": config, "marks": every_other}, {"model": CONFIG},
                 {"model": functools.partial(torch.nn.Linear, 64, 64), "inputs": (4, 64)}]:
        model, inputs = args["model"], args.get("inputs", TOKENS)
        loss = next_token_loss if inputs is TOKENS else None
        kw = {"loss_fn": loss, "marks": args.get("marks")}
        composed = remat.estimate(model, inputs, compose=True, **kw)
        whole = remat.estimate(model, inputs, **kw)
        assert composed.composed == "" and composed.timeline
        assert composed.peak_bytes == whole.peak_bytes
    with pytest.raises(TypeError, match="remat.estimate: 'compose' must be a bool"):
        remat.estimate(CONFIG, TOKENS, compose="yes")
