"""remat.estimate: fake-tensor step peaks equal real CPU runs; large configs allocate nothing."""

import functools

import pytest
import torch

import remat
from remat.memory.estimate import build_model
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
