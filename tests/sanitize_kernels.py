"""Run every CUDA kernel once at a small, ragged size: a target for
compute-sanitizer on a GPU machine, e.g.

    compute-sanitizer --tool memcheck python tests/sanitize_kernels.py
    compute-sanitizer --tool racecheck python tests/sanitize_kernels.py

It checks the results too, so a clean sanitizer run is also a right one.
"""

import numpy as np

from flashlab import gpu, reference


def main():
    rng = np.random.default_rng(0)
    for d in (16, 64, 128):
        q, k, v = (rng.standard_normal((2, 77, d)).astype(np.float32)
                   for _ in range(3))
        do = rng.standard_normal((2, 77, d)).astype(np.float32)
        for causal in (False, True):
            want = reference.attention(q, k, v, causal=causal)
            for version in gpu.VERSIONS:
                o, lse = gpu.attention(q, k, v, version=version,
                                       causal=causal, return_lse=True)
                assert np.max(np.abs(o - want)) < 1e-4, (d, version)
            grads = gpu.attention_backward(q, k, v, o, lse, do,
                                           causal=causal)
            assert all(np.isfinite(g).all() for g in grads)
        print(f"d={d}: forward versions {gpu.VERSIONS} and backward ran")
    # masks, padding to no key at all, and non-finite input: the finishing
    # kernels of flashlab.nonfinite run with empty rows and bad columns
    q, k, v = (rng.standard_normal((2, 77, 64)).astype(np.float32)
               for _ in range(3))
    v[1, 3, 5] = np.nan
    opts = dict(kv_lengths=np.array([0, 60]), window=(9, 2), causal=True)
    want = reference.attention(q, k, v, **opts)
    for version in gpu.VERSIONS:
        o = gpu.attention(q, k, v, version=version, **opts)
        assert np.array_equal(np.isnan(o), np.isnan(want)), version
        ok = ~np.isnan(want)
        assert np.max(np.abs(o[ok] - want[ok])) < 1e-4, version
    print("masked, padded and non-finite cases ran")


if __name__ == "__main__":
    main()
