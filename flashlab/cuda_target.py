"""Where flashlab.gpu's kernels run: a real GPU, or numba's CUDA simulator.

numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so the
choice has to be made before that: the tests' conftest and chapter 9 both
call `choose()` first. The simulator runs every kernel thread as Python:
correct, slow, and only for small sizes. See chapter 9.
"""

import os
import shutil
import sys


def has_gpu():
    """Whether an NVIDIA driver and device are visible on this machine."""
    return (os.path.exists("/dev/nvidiactl")
            or os.path.exists("/dev/nvidia0")
            or shutil.which("nvidia-smi") is not None)


def choose():
    """Use the simulator where there is no GPU; return "gpu" or "simulator".

    Must run before numba is first imported in this process.
    """
    if not has_gpu() and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        if "numba" in sys.modules:
            raise RuntimeError(
                "flashlab.cuda_target.choose() must run before numba is "
                "imported: numba reads NUMBA_ENABLE_CUDASIM only once")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return ("simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
            else "gpu")
