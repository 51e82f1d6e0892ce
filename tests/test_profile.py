"""remat.profile: per-module kept bytes that add up, against remat.memory.saved_bytes."""

import pytest
import torch

import remat
from remat.memory import ProfileReport, plot_timeline
from remat.models.llama import Llama, LlamaConfig, next_token_loss

torch.set_num_threads(1)
CONFIG = LlamaConfig(layers=2, width=32, heads=4, hidden=64, vocab=64)
TOKENS = torch.zeros(2, 16, dtype=torch.long)


def _llama(marked: bool = False) -> Llama:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if marked:
        model.mark_blocks()
    return model


@pytest.fixture(scope="module")
def reports():
    before = remat.profile(_llama(), TOKENS, loss_fn=next_token_loss, repeat=1, label="before")
    after = remat.profile(_llama(True), TOKENS, loss_fn=next_token_loss, repeat=1, label="after")
    return before, after


def test_kept_bytes_add_up(reports):
    for report in reports:
        assert sum(r.kept_self for r in report.rows) + report.outside_kept == report.total_kept
        root = report.rows[0]
        assert root.kept == report.total_kept - report.outside_kept
        children = [r for r in report.rows if r.depth == 1]
        assert root.kept == root.kept_self + sum(r.kept for r in children)


def test_total_kept_equals_saved_bytes(reports):
    # remat.memory.saved_bytes is an independent count of what a forward leaves for backward.
    for report, marked in zip(reports, (False, True), strict=True):
        model = _llama(marked)
        saved = remat.memory.saved_bytes(lambda m=model: next_token_loss(m(TOKENS)))
        # the profile also counts the random state each marked block keeps to replay
        snapshots = sum(row.marked for row in report.rows) * torch.get_rng_state().nbytes
        assert report.total_kept == saved + snapshots


def test_marked_blocks_keep_only_their_output(reports):
    before, after = reports
    for i in range(CONFIG.layers):
        name = f"blocks.{i}"
        assert after.row(name).marked and not before.row(name).marked
        # Cell.recompute keeps the output, and the random state to replay (allocated outside
        # the dispatcher; remat's engine reports it)
        assert after.row(name).kept == after.row(name).output_bytes + torch.get_rng_state().nbytes
        assert before.row(name).kept > after.row(name).kept
    assert after.total_kept < before.total_kept


def test_if_recomputed_is_inputs_plus_output(reports):
    before, after = reports
    row = before.row("blocks.0")
    assert row.calls == 1
    assert row.output_bytes == 2 * 16 * 32 * 4
    assert row.if_recomputed == row.input_bytes + row.output_bytes
    assert after.row("blocks.0").calls == 1  # the re-run in backward is not counted
    assert after.row("blocks.0").if_recomputed == row.if_recomputed
    dropped = remat.profile(_llama(), TOKENS, loss_fn=next_token_loss, repeat=0, output_recompute=True)
    assert dropped.row("blocks.0").if_recomputed == row.input_bytes


def test_forward_times_and_parameters(reports):
    before, _ = reports
    assert before.row("blocks.0").forward_ms > 0
    assert before.row("Llama").param_bytes == sum(p.numel() * 4 for p in _llama().parameters())
    assert before.row("head").param_bytes == 32 * 64 * 4


def test_optimizer_state_and_step_peak():
    report = remat.profile(_llama(), TOKENS, loss_fn=next_token_loss, optimizer="adam", repeat=0)
    assert report.optimizer_bytes == 2 * report.param_bytes + 4 * len(list(_llama().parameters()))
    assert report.peak_bytes >= report.param_bytes + report.optimizer_bytes + report.grad_bytes
    assert "optimizer" in {phase for _, phase in report.timeline}


def test_json_round_trip_and_compare(reports, tmp_path):
    before, after = reports
    path = tmp_path / "report.json"
    text = before.to_json(str(path))
    again = ProfileReport.from_json(path.read_text())
    assert again == ProfileReport.from_json(text)
    assert again.total_kept == before.total_kept and again.rows[3] == before.rows[3]
    table = before.compare(after)
    assert "blocks.0" in table and "total kept" in table and "step peak" in table


def test_table_lists_modules_and_totals(reports):
    before, _ = reports
    table = before.table(depth=1)
    assert "embedding" in table and "head" in table and "blocks.0" not in table
    assert "total kept for backward" in table


def test_plot_writes_png(reports, tmp_path):
    path = plot_timeline(list(reports), str(tmp_path / "timeline.png"))
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_profile_rejects_non_module():
    with pytest.raises(TypeError, match="remat.profile: model must be a torch.nn.Module"):
        remat.profile(lambda x: x, torch.ones(1))
