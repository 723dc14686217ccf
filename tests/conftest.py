"""Shared fixtures, and the CUDA simulator on machines without a GPU.

numba reads NUMBA_ENABLE_CUDASIM once, at its first import, so the choice
is made here, before any test module imports flashlab.gpu. On a machine
with an NVIDIA driver the real GPU is used; run `pytest -m gpu` there.
"""

import os
import shutil

import numpy as np
import pytest

HAS_GPU = (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
           or shutil.which("nvidia-smi") is not None)
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def rng(request):
    """A generator with a fresh seed, printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"{request.node.nodeid}: rng seed {seed}")
    return np.random.default_rng(seed)
