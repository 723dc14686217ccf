"""flashlab: exact attention without the N x N matrix, step by step."""

from flashlab import costs, dense, io, masks, merge, online, reference, tiled

__all__ = [
    "costs", "dense", "io", "masks", "merge", "online", "reference", "tiled",
]
__version__ = "0.2.0"
