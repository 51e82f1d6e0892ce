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


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    """Each test compiles from clean caches: past Dynamo's recompile limit (8 per code object,
    e.g. ``Sequential.forward`` across many tests) ``torch.compile`` would run the model
    eagerly, and a test of remat's graph pass would pass without the pass having run."""
    import sys

    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
    yield


@pytest.fixture(autouse=True)
def _fsdp_units_collected():
    """FSDP2 units a test made in this process are collected when it ends: while any is
    alive, parameters' versions are not compared (NOTE [Parameters changed before backward]),
    so a later test of that refusal would pass or fail by the order tests ran in. Units in a
    reference cycle wait for the collector: run it, only when one is left."""
    yield
    import sys

    states = sys.modules.get("torch.distributed._composable_state")
    if states is not None and states._module_state_mapping:
        import gc

        gc.collect()
