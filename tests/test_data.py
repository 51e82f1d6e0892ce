"""CIFAR-10 binary loader against a file in the real format, written here; synthetic set."""

import pytest
import torch

from remat.data import load_cifar10, read_cifar10_file, synthetic_cifar10
from remat.data.cifar import MEAN, STD


def _write_records(path, labels, images):
    with open(path, "wb") as file:
        file.writelines(
            bytes([label]) + image.contiguous().numpy().tobytes()
            for label, image in zip(labels, images, strict=True)
        )


def _fake_release(tmp_path, counts=(3, 2)):
    gen = torch.Generator().manual_seed(1)
    expected = []
    for i, n in enumerate(counts, start=1):
        labels = torch.randint(0, 10, (n,), generator=gen).tolist()
        images = torch.randint(0, 256, (n, 3, 32, 32), generator=gen, dtype=torch.uint8)
        _write_records(tmp_path / f"data_batch_{i}.bin", labels, images)
        expected.append((labels, images))
    return expected


def test_reads_records_as_label_then_chw_pixels(tmp_path):
    (labels, images), _ = _fake_release(tmp_path)
    data = read_cifar10_file(tmp_path / "data_batch_1.bin")
    assert data.labels.tolist() == labels
    assert torch.equal(data.images, images)
    # CHW: byte 1 of a record is the red pixel (0, 0), byte 1 + 1024 the green one.
    raw = (tmp_path / "data_batch_1.bin").read_bytes()
    assert data.images[0, 1, 0, 0] == raw[1 + 1024]
    assert data.images[0, 0, 0, 5] == raw[1 + 5]


def test_load_concatenates_training_files_in_order(tmp_path):
    expected = _fake_release(tmp_path)
    data = load_cifar10(tmp_path)
    assert len(data) == 5
    assert data.labels.tolist() == expected[0][0] + expected[1][0]
    assert torch.equal(data.images[3:], expected[1][1])


def test_batch_normalises_and_wraps(tmp_path):
    _fake_release(tmp_path)
    data = load_cifar10(tmp_path)
    images, labels = data.batch(1, 4)  # records 4, 0, 1, 2
    assert labels.tolist() == data.labels[[4, 0, 1, 2]].tolist()
    pixel = data.images[4, 2, 7, 9].item() / 255
    assert images[0, 2, 7, 9].item() == pytest.approx((pixel - MEAN[2]) / STD[2], rel=1e-5)


def test_bad_files_are_refused(tmp_path):
    (tmp_path / "data_batch_1.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="multiple of 3073"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="test_batch.bin"):
        load_cifar10(tmp_path, train=False)
    _write_records(tmp_path / "test_batch.bin", [42], torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="label 42"):
        load_cifar10(tmp_path, train=False)


def test_synthetic_set_is_deterministic_and_class_dependent():
    a, b = synthetic_cifar10(200, seed=3), synthetic_cifar10(200, seed=3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, synthetic_cifar10(200, seed=4).images)
    means = torch.stack([a.images[a.labels == c].float().mean(0) for c in range(10)])
    # the per-class mean images differ far more than the noise on a class mean would
    assert (means[0] - means[1]).abs().mean() > 10
