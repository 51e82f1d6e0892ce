"""The vocabulary (layer 1, no torch import): errors' checks, policies, region options.

The engine and everything above it import these; they import nothing of remat's but
each other.
"""
