"""remat's benchmarks: scripts and the ``remat bench`` harness, kept out of the installed package.

``remat bench`` (and ``make bench``) load :mod:`benchmarks.bench` from this folder of a
clone; the other modules here are scripts (``python benchmarks/plan_sweep.py``).
"""
