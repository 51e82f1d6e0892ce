"""The front ends (layer 3): torch-compatible checkpoint, marks, recompute, blocks, Hugging Face.

Each module here is private; remat/__init__.py re-exports the public names.
"""
