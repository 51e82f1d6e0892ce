"""Model definitions: shapes, parameter counts, the seed's marks."""

import pytest
import torch

import remat
from remat.models import GPT, GPTConfig, ResidualBlock, gpt, resnet, resnet50
from tests._harness import assert_bitwise_equal, named_grads

# torchvision's resnet50(num_classes=10) layout: 25,557,032 parameters with 1000 classes,
# minus the 1000-class head (2048 * 1000 + 1000) plus a 10-class head (2048 * 10 + 10).
RESNET50_CIFAR10_PARAMETERS = 25_557_032 - (2048 * 1000 + 1000) + (2048 * 10 + 10)


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_resnet50_has_torchvision_parameter_count():
    assert RESNET50_CIFAR10_PARAMETERS == 23_528_522
    assert _count(resnet50(class_num=10)) == RESNET50_CIFAR10_PARAMETERS


def test_bottleneck_parameter_count_is_analytic():
    block = ResidualBlock(64, 256, stride=1)  # first block of stage 1: projection shortcut
    width = 64
    convs = 64 * width + 9 * width * width + width * 256 + 64 * 256
    batch_norms = 2 * (width + width + 256 + 256)
    assert _count(block) == convs + batch_norms
    assert block.down_sample is not None
    assert ResidualBlock(256, 256).down_sample is None


def test_resnet50_shapes_cifar_and_imagenet():
    model = resnet50(class_num=10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)
    stages = [[type(b).__name__ for b in layer] for layer in model.layers]
    assert [len(s) for s in stages] == [3, 4, 6, 3]
    assert [layer[0].conv3.out_channels for layer in model.layers] == [256, 512, 1024, 2048]
    assert [layer[0].conv2.stride[0] for layer in model.layers] == [1, 2, 2, 2]


def test_seed_marks_every_block_but_the_first_of_each_stage():
    model = resnet50(recompute=True, output_recompute=True)
    names = sorted(remat.marked_modules(model))
    expected = sorted(f"layers.{s}.{i}" for s, n in enumerate([3, 4, 6, 3]) for i in range(1, n))
    assert names == expected and len(names) == 12
    assert all(spec.output_recompute for spec in remat.marked_modules(model).values())
    assert model.recompute_blocks() == [model.get_submodule(n) for n in expected]
    assert remat.marked_modules(resnet50()) == {}


def test_options_without_recompute_are_refused():
    with pytest.raises(TypeError, match="recompute=True"):
        resnet50(output_recompute=True)


def test_tiny_resnet_layout():
    tiny = resnet((2, 1), width=4, class_num=3)
    assert [layer[0].conv3.out_channels for layer in tiny.layers] == [16, 32]
    assert tiny(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    assert len(tiny.recompute_blocks()) == 1


def test_gpt_shapes_and_parameter_count():
    config = GPTConfig(layers=2, width=32, heads=4, seq_len=16, vocab=64)
    model = GPT(config)
    w, v, s = 32, 64, 16
    block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)
    assert _count(model) == v * w + s * w + 2 * block + 2 * w  # head tied to the embedding
    assert model(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 64)
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_marks_every_block():
    model = gpt(layers=3, width=16, heads=2, seq_len=8, vocab=32, recompute=True)
    assert sorted(remat.marked_modules(model)) == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ValueError, match="heads must divide width"):
        GPTConfig(width=10, heads=3)


def _loss_and_grads(model, x, step):
    model.zero_grad()
    loss = step(model, x)
    loss.backward()
    return loss.detach(), named_grads(model)


@pytest.mark.parametrize(
    "options", [{}, {"output_recompute": True}, {"policy": remat.save_compute_intensive}]
)
def test_marked_resnet_gradients_equal_unmarked(options):
    torch.manual_seed(0)
    plain = resnet((2, 2), width=4, class_num=3)
    marked = resnet((2, 2), width=4, class_num=3)
    marked.load_state_dict(plain.state_dict())
    marked.mark_blocks(**options)
    x = torch.randn(4, 3, 32, 32)

    def step(m, x):
        return m(x).square().mean()

    loss_a, grads_a = _loss_and_grads(plain, x, step)
    loss_b, grads_b = _loss_and_grads(marked, x, step)
    assert torch.equal(loss_a, loss_b)
    assert list(grads_b) == list(grads_a)
    assert_bitwise_equal(list(grads_b.values()), list(grads_a.values()))


def test_marked_gpt_gradients_equal_unmarked():
    torch.manual_seed(0)
    sizes = {"layers": 2, "width": 16, "heads": 2, "seq_len": 8, "vocab": 32}
    plain, marked = gpt(**sizes), gpt(**sizes)
    marked.load_state_dict(plain.state_dict())
    marked.mark_blocks(output_recompute=True)
    tokens = torch.randint(0, 32, (2, 8))

    def step(m, x):
        return torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    loss_a, grads_a = _loss_and_grads(plain, tokens, step)
    loss_b, grads_b = _loss_and_grads(marked, tokens, step)
    assert torch.equal(loss_a, loss_b)
    assert list(grads_b) == list(grads_a)
    assert_bitwise_equal(list(grads_b.values()), list(grads_a.values()))
