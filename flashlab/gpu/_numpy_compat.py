"""The one workaround flashlab.gpu needs for its toolchain.

numpy 2.5 removed `np.row_stack`, which numba-cuda 0.30 still calls while
it compiles a kernel. requirements.txt pins numpy 2.4 for the course
machines; GPU runtimes that ship numpy 2.5 with numba-cuda 0.30 get the
alias back here, before the first kernel is compiled.
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
