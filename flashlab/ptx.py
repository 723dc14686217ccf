"""What the GPU kernels compile to, read on a machine without a GPU.

    python -m flashlab.ptx              # JSON: float64 ops, shared memory
    python -m flashlab.ptx --only forward_v5,forward_v6   # some kernels
    python -m flashlab.ptx --resources  # on a GPU: registers, local memory

`report` compiles every flashlab.gpu kernel to PTX for compute capability
9.0 and counts float64 instructions, static shared memory, fast exps,
tensor-core mmas and local memory; `assemble` then runs ptxas (from the
nvidia-cuda-nvcc wheel of requirements.txt) on that PTX for the registers
per thread and the bytes ptxas spills, as a GPU's driver would, and
`sass` and `spill_sites` (nvdisasm, from the nvidia-cuda-nvdisasm wheel)
say where in the machine code the spills sit.
`literal_demo` compiles one small device computation twice, with a Python
float literal and with float32 constants, to show where float64 creeps
in. numba reads NUMBA_ENABLE_CUDASIM once per process and the simulator
cannot compile, so callers that may run on the simulator call `run_report`,
which asks a fresh process. See chapter 9.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from numba import float32

HEAD_DIMS = ((16, 16), (64, 64), (128, 128))
ASSEMBLED = ("regs", "stack", "spill")  # what `assemble` counts
HOPPER = (9, 0, "a")  # the target of `report`: the H200's own


def float64_ops(ptx):
    """Number of instruction lines that touch float64 (.f64) values."""
    return sum(bool(re.search(r"\.f64\b", line))
               for line in ptx.splitlines()
               if not line.lstrip().startswith("//"))


def shared_bytes(ptx):
    """Bytes of statically declared shared memory."""
    return sum(int(n) for n in re.findall(
        r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx))


def fast_exps(ptx):
    """Number of ex2.approx instructions (how float32 exp is lowered)."""
    return len(re.findall(r"ex2\.approx", ptx))


def tensor_ops(ptx):
    """Number of mma.sync instructions (tensor-core products)."""
    return len(re.findall(r"\bmma\.sync\b", ptx))


def wide_loads(ptx):
    """Number of 16-byte loads from global memory (ld.global...v4)."""
    return len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.", ptx))


def local_bytes(ptx):
    """Bytes of local memory (register arrays the compiler could not keep
    in registers) that the PTX declares, before ptxas adds spills."""
    return sum(int(n) for n in re.findall(
        r"\.local \.align \d+ \.b8 \S+\[(\d+)\]", ptx))


def ptxas():
    """Path of ptxas: the nvidia-cuda-nvcc wheel's, else one on PATH, else
    None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob("cu*/bin/ptxas")):
            return str(found)
    return shutil.which("ptxas")


def nvdisasm():
    """Path of nvdisasm: the nvidia-cuda-nvdisasm wheel's (beside the
    nvidia-cuda-nvcc wheel's ptxas), else one on PATH, else None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(found)
    return shutil.which("nvdisasm")


def sass(ptx, cc=(9, 0), max_registers=None):
    """The machine code ptxas makes of PTX text (`cubin`), as nvdisasm
    prints it: one instruction a line, each after its /*address*/."""
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install -r "
                           "requirements.txt (nvidia-cuda-nvdisasm) or put "
                           "CUDA's bin on PATH")
    code = cubin(ptx, cc, max_registers)[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(code)
        done = subprocess.run([tool, "-c", str(path)], capture_output=True,
                              text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed:\n{done.stderr[-2000:]}")
    return done.stdout


# opcodes by which a spill's neighbourhood says where in a kernel it sits:
# tensor-core products, mbarriers and named barriers, exponentials (a
# softmax), TMA copies, shared and global memory (staging, epilogues)
LANDMARKS = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "MUFU.EX2", "UTMALDG",
             "UBLKCP", "STS", "LDS", "STG", "LDG")
_INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def instructions(sass_text):
    """[(address, opcode)] of every instruction in nvdisasm's text, in
    order (opcode with its modifiers: LDL.LU, SYNCS.ARRIVE.TRANS64...)."""
    return [(int(m.group(1), 16), m.group(2))
            for m in map(_INSTRUCTION.search, sass_text.splitlines()) if m]


def spill_sites(sass_text, window=12):
    """[(address, opcode, landmarks)] of each local-memory store or load
    (STL, LDL: registers ptxas spilled) in SASS text, with the LANDMARKS
    found within `window` instructions of it, which tell a spill in a
    loop's products or softmax from one at a kernel's start or end."""
    ops = instructions(sass_text)
    out = []
    for i, (address, op) in enumerate(ops):
        if op.split(".")[0] in ("STL", "LDL"):
            near = {x for _, x in ops[max(0, i - window):i + window + 1]
                    for mark in LANDMARKS if x.startswith(mark)}
            out.append((address, op, tuple(sorted(near))))
    return out


def cubin(ptx, cc=(9, 0), max_registers=None):
    """(cubin bytes, ptxas's -v report) of PTX text assembled whole by
    `ptxas()` for compute capability cc, registers capped at
    max_registers."""
    tool = ptxas()
    if tool is None:
        raise RuntimeError("ptxas not found: pip install -r requirements.txt"
                           " (nvidia-cuda-nvcc) or put CUDA's bin on PATH")
    cap = [] if max_registers is None else [
        f"--maxrregcount={max_registers}"]
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        source.write_text(ptx)
        done = subprocess.run(
            [tool, f"-arch={arch_name(cc)}", "-v", *cap, str(source), "-o",
             str(out)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed:\n{done.stderr[-2000:]}")
        return out.read_bytes(), done.stderr


def assemble(ptx, cc=(9, 0), max_registers=None):
    """{"regs", "stack", "spill", "serialized"}: registers per thread,
    stack frame and spill-store bytes per thread of PTX text, assembled
    by `ptxas()` for compute capability cc (the same assembler a driver
    runs), and whether ptxas had to wait for each wgmma at once."""
    log = cubin(ptx, cc, max_registers)[1]
    regs = re.search(r"Used (\d+) registers", log)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores",
                      log)
    return {"regs": int(regs.group(1)), "stack": int(stack.group(1)),
            "spill": int(stack.group(2)),
            # ptxas could not keep the wgmma products asynchronous
            "serialized": "instructions are serialized" in log}


def arch_name(cc):
    """sm_80, sm_90a, ... for a compute capability (or (9, 0, "a"))."""
    return "sm_" + "".join(str(c) for c in cc)


def report(head_dims=HEAD_DIMS, only=()):
    """{"kernel d dv": {"f64", "shared", "exp", "mma", "wgmma", "wide",
    "local", "regs", "stack", "spill"}} for every GPU kernel (or those
    whose names start with one of `only`); the last three from
    `assemble`, None where no ptxas is installed."""
    from flashlab import gpu

    tool = ptxas()
    out = {}
    for name in gpu.kernel_names():
        if only and not name.startswith(tuple(only)):
            continue
        for d, dv in head_dims:
            if not gpu.supports(name, d, dv):
                continue
            # Hopper's own target, as the launch path loads on an H200
            ptx = gpu.compile_ptx(name, d, dv, HOPPER)
            out[f"{name} {d} {dv}"] = {"abi": abi_matches(name, ptx),
                                       "f64": float64_ops(ptx),
                                       "shared": shared_bytes(ptx),
                                       "exp": fast_exps(ptx),
                                       "mma": tensor_ops(ptx),
                                       "wgmma": ptx.count("wgmma.mma_async"),
                                       "wide": wide_loads(ptx),
                                       "local": local_bytes(ptx),
                                       **(assemble(ptx, HOPPER) if tool else
                                          dict.fromkeys(ASSEMBLED))}
    out.update(literal_demo())
    return out


def abi_matches(name, ptx):
    """Whether launch.Layout packs kernel `name`'s parameters as its PTX
    declares them (same count, widths and float/int kinds, in order)."""
    from flashlab.gpu import build, launch

    layout = launch.Layout.of(build.signature(name))
    return launch.code_kinds(layout.codes) == launch.ptx_params(ptx)


def arch_table(d=64, d_v=64):
    """{kernel: {"7.5": bool, ...}}: whether ptxas assembles the kernel
    for each compute capability of registry.ARCHITECTURES, from PTX
    compiled for that target (sm_90a for Hopper), every kernel and
    helper the registry holds."""
    from flashlab.gpu import build, launch, registry

    table = {}
    for spec in registry.KERNELS:
        row = {}
        for cc, _ in registry.ARCHITECTURES:
            target = launch.target(cc)
            try:
                assemble(build.compile_ptx(spec.name, d, d_v, target),
                         target)
                row[f"{cc[0]}.{cc[1]}"] = True
            except RuntimeError as error:
                if "ptxas failed" not in str(error):
                    raise
                row[f"{cc[0]}.{cc[1]}"] = False
        table[spec.name] = row
    return table


def _with_literal(x, m):
    # 0.0 and 1.0 are Python floats, so numba types them float64
    return max(x - m, 0.0) + 1.0


def _with_float32(x, m):
    return max(x - m, float32(0.0)) + float32(1.0)


def literal_demo():
    """float64 op counts of a float32 kernel with and without literals."""
    from numba import cuda

    from flashlab.gpu.build import compiling_without_gpu

    def kernel_for(body):
        dev = cuda.jit(device=True)(body)

        def kernel(x, out):
            i = cuda.grid(1)
            if i < x.size:
                out[i] = dev(x[i], x[0])

        return kernel

    counts = {}
    for name, body in (("literal 0.0", _with_literal),
                       ("float32(0.0)", _with_float32)):
        kernel = kernel_for(body)
        with compiling_without_gpu((9, 0)):
            ptx, _ = cuda.compile_ptx(kernel, (float32[::1], float32[::1]),
                                      cc=(9, 0))
        counts[f"demo {name}"] = {"f64": float64_ops(ptx),
                                  "shared": shared_bytes(ptx),
                                  "exp": fast_exps(ptx), "mma": 0,
                                  "local": local_bytes(ptx)}
    return counts


def resources(head_dims=HEAD_DIMS):
    """{"kernel d dv": {"regs", "local", "shared"}} per thread / per block,
    from the kernels as compiled for the GPU present (needs a GPU).

    Local memory is where registers spill: a hot kernel should have none.
    """
    from flashlab import gpu
    from flashlab.gpu import build

    out = {}
    for name in gpu.kernel_names():
        for d, dv in head_dims:
            if not gpu.supports(name, d, dv):
                continue
            out[f"{name} {d} {dv}"] = build.kernel(name, d, dv).resources()
    return out


def run_report(timeout=900, only=(), what=None):
    """`report(only=only)` computed in a fresh process without the
    simulator (or, with what="--arch", `arch_table()`)."""
    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    args = ["--only", ",".join(only)] if only else []
    args += [what] if what else []
    done = subprocess.run([sys.executable, "-m", "flashlab.ptx", *args],
                          env=env,
                          capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"PTX report failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


if __name__ == "__main__":
    only = (sys.argv[sys.argv.index("--only") + 1].split(",")
            if "--only" in sys.argv else ())
    if "--resources" in sys.argv:
        print(json.dumps(resources()))
    elif "--arch" in sys.argv:
        print(json.dumps(arch_table()))
    else:
        print(json.dumps(report(only=only)))
