"""remat.memory.track: exact live-storage bytes against analytic figures."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat

torch.set_num_threads(1)
N = 32
ROWS = 4 * N
W = N * N * 4  # bytes of one weight (and of one weight gradient)
A = ROWS * N * 4  # bytes of one activation (4 W)
SCALAR = 4


def _chain(h, a, b):
    return (h @ a) @ b


def _run_chain(checkpointed: bool, preserve_rng_state: bool = False):
    # The analytic figures below leave out the random-state snapshots a region keeps
    # (see test_random_state_snapshots_are_counted).
    torch.manual_seed(0)
    weights = [torch.randn(N, N, requires_grad=True) for _ in range(4)]
    x = torch.randn(ROWS, N)
    with remat.memory.track(baseline=[x, weights]) as tracker:
        h = x
        for i in (0, 2):
            if checkpointed:
                h = remat.checkpoint(_chain, h, weights[i], weights[i + 1], use_reentrant=False,
                                     preserve_rng_state=preserve_rng_state)
            else:
                h = _chain(h, weights[i], weights[i + 1])
        loss = h.sum()
        tracker.kept = tracker.live_bytes
        loss.backward()
    return tracker, weights


def test_chain_of_matmuls_peak_is_analytic():
    # h1..h4 = four matmuls. Forward leaves h1, h2, h3 (saved by the next matmul), h4 (held
    # by `h`) and the scalar loss: 4 A. Backward of h4 = h3 @ w4 makes g_h3 and g_w4 and
    # frees h3; backward of h3 = h2 @ w3 then makes g_h2 and g_w3 while h1, h2, h4, g_h3,
    # g_w4 are alive: 5 A + 2 W, the peak (later nodes free as much as they make), plus
    # the loss and its scalar gradient.
    tracker, _ = _run_chain(checkpointed=False)
    assert tracker.baseline_bytes == A + 4 * W
    assert tracker.kept == 4 * A + SCALAR
    assert tracker.peak_increase == 5 * A + 2 * W + 2 * SCALAR
    assert tracker.peak_bytes == tracker.baseline_bytes + tracker.peak_increase
    assert tracker.peak().phase == "backward"


def test_chain_with_checkpoint_peak_is_analytic():
    # Two regions of two matmuls. Forward keeps h2 (region 2's input) and h4: 2 A.
    # Region 2's backward peaks at 4 A + 2 W (h2, h4, g_h3, g_h2, g_w4, g_w3). Region 1
    # recomputes h1' and its first matmul's backward makes g_h1 and g_w2 while h4, g_h2,
    # h1' and three weight gradients are alive: 4 A + 3 W, the peak.
    tracker, _ = _run_chain(checkpointed=True)
    assert tracker.kept == 2 * A + SCALAR
    assert tracker.peak_increase == 4 * A + 3 * W + 2 * SCALAR
    peak = tracker.peak()
    assert peak.by_phase == {"forward": A + 2 * SCALAR, "recompute": A, "backward": 2 * A + 3 * W}
    assert {phase for _, phase in tracker.timeline} == {"forward", "backward", "recompute"}
    plain, _ = _run_chain(checkpointed=False)
    assert plain.peak_increase - tracker.peak_increase == A - W


def test_random_state_snapshots_are_counted():
    # torch.get_rng_state() allocates outside the dispatcher; the engine reports it
    snapshot = torch.get_rng_state().nbytes
    plain, _ = _run_chain(checkpointed=True)
    kept, _ = _run_chain(checkpointed=True, preserve_rng_state=True)
    assert kept.kept - plain.kept == 2 * snapshot  # one per region, until its backward
    # the re-run also snapshots the caller's state for its duration
    assert kept.peak_increase - plain.peak_increase >= snapshot


def test_gradients_equal_with_and_without_checkpoint():
    _, plain = _run_chain(checkpointed=False)
    _, marked = _run_chain(checkpointed=True)
    for a, b in zip(plain, marked, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_views_and_aliases_are_counted_once():
    x = torch.randn(1000)
    with remat.memory.track(baseline=[x]) as tracker:
        y = x * 2
        views = [y.view(10, 100), y[::2], y.t(), y.unsqueeze(0).expand(3, 1000), y.detach()]
    assert len(views) == 5
    assert tracker.peak_increase == 4000
    assert tracker.baseline_bytes == 4000


def test_in_place_ops_allocate_nothing():
    x = torch.randn(256)
    with remat.memory.track(baseline=[x]) as tracker:
        y = x.clone()
        y.add_(1).relu_().mul_(3)
        torch.add(y, 1, out=y)
    assert tracker.peak_increase == 256 * 4
    assert tracker.live_bytes == 256 * 4


def test_saved_tensors_freed_in_backward():
    x = torch.randn(500, requires_grad=True)
    with remat.memory.track(baseline=[x]) as tracker:
        loss = x.exp().sin().sum()  # exp saves its output, sin saves its input (the same storage)
        kept_before_backward = tracker.live_bytes
        loss.backward()
        del loss
    assert kept_before_backward == 500 * 4 + SCALAR
    assert tracker.live_bytes == 500 * 4  # only x.grad is left
    assert x.grad is not None


def test_baseline_storage_freed_during_step_lowers_footprint():
    x = torch.randn(100)
    held = [x]
    with remat.memory.track(baseline=held) as tracker:
        del x
        held.clear()
    assert tracker.baseline_bytes == 400
    assert tracker.live_bytes == -400


def test_allocations_are_grouped_by_module_and_phase():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 16)
    with remat.memory.track(net, baseline=[x]) as tracker:
        loss = net(x).sum()
        kept = tracker.live_by_module(exclude=[loss])
        loss.backward()
    # ReLU keeps its own output (also Linear 2's input); Linear 0's output is freed.
    assert kept == {"1": 4 * 64 * 4}
    grads = tracker.peak().by_module
    assert grads["0"] >= (16 * 64 + 64) * 4  # gradients made by Linear 0's backward
    assert tracker.baseline_bytes == sum(p.numel() * 4 for p in net.parameters()) + x.numel() * 4


def test_global_hooks_are_removed_on_exit():
    hooks = torch.nn.modules.module
    before = (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks))
    with remat.memory.track():
        assert len(hooks._global_forward_pre_hooks) == before[0] + 1
    assert (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks)) == before


def _peak_of_block_step(fake: bool) -> int:
    torch.manual_seed(0)
    mode = FakeTensorMode() if fake else None
    if mode:
        mode.__enter__()
    try:
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                  torch.nn.Linear(256, 64))
        x = torch.randn(32, 64, requires_grad=True)
        with remat.memory.track(net, baseline=[x]) as tracker:
            net(x).square().mean().backward()
        return tracker.peak_bytes
    finally:
        if mode:
            mode.__exit__(None, None, None)


def test_fake_tensor_peak_matches_real_run():
    real, fake = _peak_of_block_step(False), _peak_of_block_step(True)
    assert abs(real - fake) <= 0.01 * real
    assert real == fake  # on CPU kernels the fake run is exact


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_agrees_with_max_memory_allocated():
    torch.cuda.init()
    net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    net(x).sum().backward()  # cuBLAS takes its workspaces (one per stream) at its first products
    net.zero_grad()
    torch.cuda.synchronize()
    with remat.memory.track(net, baseline=[x]) as tracker:
        net(x).sum().backward()
    # The caching allocator rounds blocks up to 512 bytes; cuBLAS's workspaces (taken in the
    # warm-up above) are in the absolute peak, not in the rise.
    assert tracker.cuda_peak_bytes >= tracker.peak_bytes
    assert abs(tracker.cuda_peak_increase - tracker.peak_increase) <= 0.05 * tracker.peak_increase
