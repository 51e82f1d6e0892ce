"""Data sets for the demo and the benchmark (layer 4: tools).

Examples:
    >>> from remat.data import load_cifar10
    >>> len(load_cifar10(None, size=16))
    16
"""

from remat.data.cifar import ImageSet, load_cifar10, read_cifar10_file, synthetic_cifar10

__all__ = ["ImageSet", "load_cifar10", "read_cifar10_file", "synthetic_cifar10"]
