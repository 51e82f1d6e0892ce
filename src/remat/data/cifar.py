"""CIFAR-10: the binary files of the standard release, or a synthetic stand-in (layer 4).

The binary release (``cifar-10-batches-bin``) holds ``data_batch_1.bin`` ...
``data_batch_5.bin`` and ``test_batch.bin``; each record is one label byte then
3,072 pixel bytes (1,024 red, 1,024 green, 1,024 blue: a 3x32x32 CHW image).
Without a directory, `synthetic_cifar10` builds a deterministic data set
of the same shape in which every class adds its own smooth colour pattern to
the noise, so a network learns it within a few dozen steps.

Examples:
    >>> from remat.data import load_cifar10
    >>> data = load_cifar10(None, size=64)
    >>> images, labels = data.batch(0, 8)
    >>> tuple(images.shape), labels.dtype
    ((8, 3, 32, 32), torch.int64)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["ImageSet", "load_cifar10", "read_cifar10_file", "synthetic_cifar10"]

RECORD_BYTES = 1 + 3 * 32 * 32
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class ImageSet:
    """Images (uint8, N x 3 x 32 x 32) and their labels (int64, N).

    Examples:
        >>> import torch
        >>> from remat.data import ImageSet
        >>> data = ImageSet(torch.zeros(4, 3, 32, 32, dtype=torch.uint8), torch.arange(4))
        >>> len(data)
        4
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(
        self, step: int, batch_size: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return batch number ``step``: normalised float images and labels, cycling the set.

        Args:
            step: which batch (0, 1, ...); batches wrap around the end of the set.
            batch_size: images per batch.
            device: where to put the tensors.

        Returns:
            ``(images, labels)``: float32 N x 3 x 32 x 32 (per-channel normalised) and int64 N.
        """
        index = (torch.arange(batch_size) + step * batch_size) % len(self)
        images = self.images[index].to(device=device, dtype=torch.float32).div_(255)
        mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        return (images - mean) / std, self.labels[index].to(device)


def read_cifar10_file(path: str | os.PathLike) -> ImageSet:
    """Read one CIFAR-10 binary file (records of 1 label byte + 3,072 CHW pixel bytes).

    Args:
        path: a file such as ``data_batch_1.bin``.

    Returns:
        Its images and labels.

    Raises:
        ValueError: the file size is not a whole number of records, or a label is not 0-9.
    """
    with open(path, "rb") as file:
        raw = file.read()
    if not raw or len(raw) % RECORD_BYTES:
        raise ValueError(
            f"remat.data.read_cifar10_file: {path} holds {len(raw)} bytes, expected a positive "
            f"multiple of {RECORD_BYTES} (1 label byte + 3072 pixel bytes per image)"
        )
    records = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, RECORD_BYTES)
    labels = records[:, 0].long()
    if int(labels.max()) > 9:
        raise ValueError(
            f"remat.data.read_cifar10_file: {path} has label {int(labels.max())}, expected 0-9; "
            f"is it a CIFAR-10 (not CIFAR-100) binary file?"
        )
    return ImageSet(records[:, 1:].reshape(-1, 3, 32, 32).clone(), labels)


def synthetic_cifar10(size: int = 2048, seed: int = 0) -> ImageSet:
    """Build a deterministic CIFAR-10-shaped data set with a learnable signal.

    Each class owns a smooth random colour pattern; an image is grey noise plus
    its class's pattern, so the classes can be told apart and the loss falls.

    Args:
        size: number of images.
        seed: seed of the generator (same seed, same data, on every machine).

    Returns:
        The images and labels.

    Examples:
        >>> from remat.data import synthetic_cifar10
        >>> bool((synthetic_cifar10(8).images == synthetic_cifar10(8).images).all())
        True
    """
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 4, 4, generator=gen)
    patterns = torch.nn.functional.interpolate(patterns, size=(32, 32), mode="bilinear")
    labels = torch.randint(0, 10, (size,), generator=gen)
    noise = torch.randn(size, 3, 32, 32, generator=gen)
    images = 128 + 48 * patterns[labels] + 32 * noise
    return ImageSet(images.round().clamp(0, 255).to(torch.uint8), labels)


def load_cifar10(
    directory: str | os.PathLike | None = None,
    *,
    train: bool = True,
    size: int = 2048,
    seed: int = 0,
) -> ImageSet:
    """Load CIFAR-10 from its binary files in ``directory``, or synthesise it when None.

    Args:
        directory: a folder holding ``data_batch_1.bin`` ... (``train=True``) or
            ``test_batch.bin`` (``train=False``); None for the synthetic set.
        train: the training files or the test file.
        size: number of synthetic images (ignored with a directory).
        seed: seed of the synthetic set (ignored with a directory).

    Returns:
        The images and labels; from a directory, the files present, concatenated in order.

    Raises:
        FileNotFoundError: ``directory`` holds none of the expected files.
    """
    if directory is None:
        return synthetic_cifar10(size, seed)
    names = TRAIN_FILES if train else TEST_FILES
    paths = [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]
    if not paths:
        raise FileNotFoundError(
            f"remat.data.load_cifar10: found none of {list(names)} in {directory!r}; give the "
            f"folder of the binary release (cifar-10-batches-bin) or None for synthetic data"
        )
    parts = [read_cifar10_file(p) for p in paths]
    return ImageSet(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))
