"""Every public name has a docstring with a runnable example, and the examples run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import remat

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(remat.__path__, "remat.")
    if not name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    torch.manual_seed(0)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def _public_callables():
    for name in remat.__all__:
        obj = getattr(remat, name)
        if callable(obj) and not isinstance(obj, type(remat)):
            yield name, obj


@pytest.mark.parametrize("name,obj", list(_public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_names_have_an_example(name, obj):
    doc = obj.__doc__ or ""
    assert ">>>" in doc, f"remat.{name} has no runnable example in its docstring"
