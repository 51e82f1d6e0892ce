"""Graph mode with the inductor backend (generated C++ kernels): slow on two cores, so opt-in.

Run with ``REMAT_TEST_INDUCTOR=1`` on a machine with a C++ compiler.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import remat
from remat import ops

pytestmark = pytest.mark.skipif(
    os.environ.get("REMAT_TEST_INDUCTOR") != "1" or shutil.which("g++") is None,
    reason="inductor compiles C++ (tens of seconds); set REMAT_TEST_INDUCTOR=1 to run",
)


def test_seed_mlp_with_inductor_copies_only_the_relu_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 24), ops.ReLU(), torch.nn.Linear(24, 48), ops.ReLU(), torch.nn.Linear(48, 2)
    )
    remat.recompute_module(model[2])
    model[3].recompute()
    x = torch.randn(2, 12)
    model(x).sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = remat.compile(model, backend="inductor")
    compiled(x).sum().backward()
    for p, g in zip(model.parameters(), eager, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    (report,) = compiled.remat_reports
    assert [(op, path) for _, op, path in report.duplicated] == [("aten::relu", "3 (ReLU)")]
