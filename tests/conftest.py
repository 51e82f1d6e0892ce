import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def fresh_ms_context(monkeypatch):
    """``remat.ms``'s context (``set_context``) back at its defaults for one test."""
    from remat.ms import _context

    monkeypatch.setattr(_context, "_context", dict(_context._DEFAULTS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
