"""Shared fixtures, and the CUDA simulator on machines without a GPU.

numba reads NUMBA_ENABLE_CUDASIM once, at its first import, so the choice
is made here, before any test module imports flashlab.gpu. On a machine
with an NVIDIA driver the real GPU is used; run `pytest -m gpu` there.
"""

import numpy as np
import pytest

from flashlab import cuda_target

SIMULATOR = cuda_target.choose() == "simulator"


@pytest.fixture
def rng(request):
    """A generator with a fresh seed, printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"{request.node.nodeid}: rng seed {seed}")
    return np.random.default_rng(seed)
