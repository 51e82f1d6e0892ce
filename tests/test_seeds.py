"""The MindSpore programs of the seed documents run on remat.ms with only their imports swapped.

Each program below is the seed's text as written for MindSpore. ``swap_imports``
changes nothing but the import lines; the program is then executed as is.
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch

import remat
from tests._harness import run_program

torch.set_num_threads(1)
F32 = 4  # bytes per float32 element

# Seeds 000 and 001, "Code Example 1", the MindSpore half.
SEED_000_MINDSPORE = """
import mindspore
import numpy as np
from mindspore import nn, ops

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(12, 24)
        self.relu1 = ops.ReLU()
        self.fc2 = nn.Dense(24, 48)
        self.fc2.recompute()
        self.relu2 = ops.ReLU()
        self.relu2.recompute()
        self.fc3 = nn.Dense(48, 2)

    def construct(self, x):
        x = self.fc1(x)
        x = self.relu1(x)
        x = self.fc2(x)
        x = self.relu2(x)
        x = self.fc3(x)
        return x

model = Net()

def forward_fn(data, label):
    logits = model(data)
    loss = logits.sum()
    return loss, logits

grad_fn = mindspore.value_and_grad(forward_fn, None, (model.fc1.weight,), has_aux=True)
x = mindspore.Tensor(np.random.randn(2, 12), dtype=mindspore.float32)
label = mindspore.Tensor(np.random.randn(2, 12), dtype=mindspore.float32)
(loss, _), grads = grad_fn(x, label)
print(grads)
"""

# Seed 002, the example of mindspore.recompute.
SEED_002_MINDSPORE = """
import numpy as np
import mindspore.nn as nn
from mindspore import ops
from mindspore import Tensor, recompute

class MyCell(nn.Cell):
    def __init__(self):
        super(MyCell, self).__init__(auto_prefix=False)
        self.conv = nn.Conv2d(2, 2, 2, has_bias=False, weight_init='ones')
        self.relu = ops.ReLU()

    def construct(self, x):
        y = recompute(self.conv, x)
        return self.relu(y)

inputs = Tensor(np.ones([2, 2, 2, 2]).astype(np.float32) * 2)
my_net = MyCell()
grad = ops.grad(my_net)(inputs)
print(grad)
"""

# What seed 002 shows printed (the page folds numpy's line breaks into spaces).
SEED_002_PRINTED = (
    "[[[[2. 4.] [4. 8.]] [[2. 4.] [4. 8.]]] [[[2. 4.] [4. 8.]] [[2. 4.] [4. 8.]]]]"
)
# The same text with numpy's line breaks, as print() writes it.
SEED_002_PRINTED_LINES = """\
[[[[2. 4.]
   [4. 8.]]

  [[2. 4.]
   [4. 8.]]]


 [[[2. 4.]
   [4. 8.]]

  [[2. 4.]
   [4. 8.]]]]
"""


def swap_imports(source: str) -> str:
    """Change only the import lines: ``mindspore`` becomes ``remat.ms``."""
    source = re.sub(r"^import mindspore\.nn as nn$", "import remat.ms.nn as nn", source, flags=re.MULTILINE)
    source = re.sub(r"^import mindspore$", "import remat.ms as mindspore", source, flags=re.MULTILINE)
    return re.sub(r"^from mindspore import ", "from remat.ms import ", source, flags=re.MULTILINE)


def without_recompute(source: str) -> str:
    """The same program with every recompute mark removed (the baseline)."""
    source = re.sub(r"^\s*self\.\w+\.recompute\(\)\n", "", source, flags=re.MULTILINE)
    return source.replace("recompute(self.conv, x)", "self.conv(x)")


def test_swap_changes_only_import_lines():
    for program in (SEED_000_MINDSPORE, SEED_002_MINDSPORE):
        before, after = program.splitlines(), swap_imports(program).splitlines()
        changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert len(before) == len(after) and changed
        assert all(a.split()[0] in ("import", "from") for a, _ in changed)


# --- seed 000/001 ------------------------------------------------------------------------------


def test_seed_000_runs_and_prints_the_gradient_of_fc1_weight():
    scope, printed = run_program(swap_imports(SEED_000_MINDSPORE))
    grads, model = scope["grads"], scope["model"]
    assert isinstance(grads, tuple) and len(grads) == 1 and grads[0].shape == (24, 12)
    assert printed == str(grads) + "\n"
    assert printed.startswith("(Tensor(shape=[24, 12], dtype=Float32, value=\n[[")
    assert remat.marked_modules(model) == {
        "fc2": remat.RegionSpec(keep_outputs=True),
        "relu2": remat.RegionSpec(output_recompute=True),
    }


def test_seed_000_gradients_equal_the_program_without_marks():
    marked, _ = run_program(swap_imports(SEED_000_MINDSPORE))
    bare, _ = run_program(swap_imports(without_recompute(SEED_000_MINDSPORE)))
    assert remat.marked_modules(bare["model"]) == {}
    assert torch.equal(marked["loss"], bare["loss"])
    assert torch.equal(marked["grads"][0], bare["grads"][0])


def test_seed_000_every_parameter_gradient_equals_the_unmarked_model():
    marked, _ = run_program(swap_imports(SEED_000_MINDSPORE))
    bare, _ = run_program(swap_imports(without_recompute(SEED_000_MINDSPORE)))
    ms = marked["mindspore"]
    grad_of = lambda scope: ms.value_and_grad(
        scope["forward_fn"], 0, tuple(scope["model"].parameters()), has_aux=True
    )(scope["x"], scope["label"])[1]
    (gx_m, gw_m), (gx_b, gw_b) = grad_of(marked), grad_of(bare)
    assert torch.equal(gx_m, gx_b) and len(gw_m) == 6
    assert all(torch.equal(a, b) for a, b in zip(gw_m, gw_b, strict=True))


def _kept(model, x):
    """Bytes kept after forward, and whether fc2's output h2 and relu2's output r2 are alive."""
    outputs = {}

    def remember(name):
        def hook(module, args, output):
            if not remat.is_recomputing():
                outputs[name] = weakref.ref(output.untyped_storage())

        return hook

    handles = [model.fc2.register_forward_hook(remember("h2"), prepend=True),
               model.relu2.register_forward_hook(remember("r2"), prepend=True)]  # fmt: skip
    kept = {}

    def step():
        loss = model(x).sum()
        kept.update({k: ref() is not None for k, ref in outputs.items()})
        return loss

    saved = remat.memory.saved_bytes(step)
    for h in handles:
        h.remove()
    return saved, kept


def test_seed_000_memory_relu2_is_rebuilt_from_fc2s_kept_output():
    """Seed MLP at batch B (12 -> fc1 -> relu1 -> fc2 -> relu2 -> fc3 -> 2).

    Unmarked, autograd keeps relu1's output r1 (B x 24, fc2's input) and relu2's
    output r2 (B x 48, saved by relu2 and by fc3). With the seed's marks, fc2's
    output h2 (B x 48) is kept and r2 is not: r2 is rebuilt from h2 in backward.
    Same bytes, other tensor: the seed's marks trade r2 for h2.
    With relu1, fc2 (output_recompute=True) and relu2 all marked, the three merge
    into one chain that keeps only its first input, fc1's output (B x 24).
    """
    B = 32
    scope, _ = run_program(swap_imports(SEED_000_MINDSPORE))
    model, x = scope["model"], torch.randn(B, 12)
    assert _kept(model, x) == (B * (24 + 48) * F32, {"h2": True, "r2": False})
    remat.unmark(model)
    assert _kept(model, x) == (B * (24 + 48) * F32, {"h2": False, "r2": True})
    model.relu1.recompute()
    model.fc2.recompute(output_recompute=True)
    model.relu2.recompute()
    assert _kept(model, x) == (B * 24 * F32, {"h2": False, "r2": False})


# --- seed 002 ------------------------------------------------------------------------------


def test_seed_002_prints_exactly_the_seeds_gradient():
    """print(grad) writes numpy's text, as MindSpore's print does; the seed folds its lines."""
    scope, printed = run_program(swap_imports(SEED_002_MINDSPORE))
    assert printed == SEED_002_PRINTED_LINES
    assert " ".join(printed.split()) == SEED_002_PRINTED
    assert isinstance(scope["grad"], torch.Tensor) and scope["grad"].shape == (2, 2, 2, 2)


def test_seed_002_gradient_equals_the_program_without_recompute():
    marked, _ = run_program(swap_imports(SEED_002_MINDSPORE))
    bare, printed = run_program(swap_imports(without_recompute(SEED_002_MINDSPORE)))
    assert "recompute(" not in without_recompute(SEED_002_MINDSPORE).split("class")[1]
    assert torch.equal(marked["grad"], bare["grad"]) and printed == SEED_002_PRINTED_LINES
    # the weight inside the reentrant block too, and no .grad is left behind
    ops, nets = marked["ops"], (marked["my_net"], bare["my_net"])
    (gx_m, gw_m), (gx_b, gw_b) = (ops.grad(n, 0, n.conv.weight)(marked["inputs"]) for n in nets)
    assert torch.equal(gx_m, gx_b) and torch.equal(gw_m, gw_b)
    assert all(n.conv.weight.grad is None for n in nets)


def test_seed_002_conv_runs_again_in_backward():
    scope, _ = run_program(swap_imports(SEED_002_MINDSPORE))
    net, runs = scope["my_net"], []
    net.conv.register_forward_pre_hook(lambda m, a: runs.append(remat.is_recomputing()))
    scope["ops"].grad(net)(scope["inputs"])
    assert runs == [False, True]  # forward, then one recomputation in backward


def _example_program(name: str) -> str:
    """An ``examples/ms`` program without its comments and the lines that seed it."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "ms" / name
    seeding = ("import torch", "torch.manual_seed(0)", "np.random.seed(0)")
    lines = [line for line in path.read_text().splitlines()
             if not line.startswith("#") and line not in seeding]
    return re.sub(r"\n+", "\n", "\n".join(lines).strip())


@pytest.mark.parametrize("name, seed", [("cell_recompute.py", SEED_000_MINDSPORE),
                                        ("functional_recompute.py", SEED_002_MINDSPORE)])
def test_the_examples_are_the_seed_programs_with_their_imports_swapped(name, seed):
    """``examples/ms`` are the copies users run; they may not drift from the seed's text."""
    assert _example_program(name) == re.sub(r"\n+", "\n", swap_imports(seed).strip())
