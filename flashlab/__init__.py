"""flashlab: exact attention without the N x N matrix, step by step."""

from flashlab import costs, masks, merge, online, reference, tiled

__all__ = ["costs", "masks", "merge", "online", "reference", "tiled"]
__version__ = "0.1.0"
