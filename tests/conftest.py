"""Shared fixtures: fresh random generators whose seed is reported."""

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A generator with a fresh seed, printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"{request.node.nodeid}: rng seed {seed}")
    return np.random.default_rng(seed)
