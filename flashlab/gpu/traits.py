"""Every kernel's tile constants at one (d, d_v), worked out in one place.

A kernel's `make(D, D_V)` fixes its tiles from the head dims; `traits`
states the same numbers as a record (FlashAttention-2's kernel traits):
rows and keys per tile, threads and warps per block, the mma k-steps and
8-column groups of its fragments, shared memory and the register cap, and
the arguments it writes. The host code launches from it; the tests check
it against each module's own `shape()`, the locals its `make()` computes
and the shared memory of its compiled PTX. See chapters 9 and 10.
"""

import functools
import sys
from typing import NamedTuple

from flashlab import order
from flashlab.gpu import device, registry, warp


class Traits(NamedTuple):
    """The constants of kernel `name` built for head dims (d, d_v)."""

    name: str
    d: int
    d_v: int
    br: int  # rows a block owns: queries (forward, dQ) or keys (dK, dV)
    bc: int  # rows of the other side per tile (keys, or queries for dK)
    threads: int  # per block
    warps: int  # threads // 32
    k_steps: int  # mma k-steps of the first product (S = Q K^T), over d
    n_tiles: int  # 8-column groups of S (of one slice) a warp holds
    o_tiles: int  # 8-column groups of its (first) output accumulator
    shared: int  # static shared memory per block, bytes
    dynamic_shared: int  # dynamic shared memory per block, bytes
    max_registers: int  # the assembler's cap per thread (None: no cap)
    returns: tuple  # the arguments it writes, in order
    placed: bool  # its grid is flashlab.order.grid's (registry.Kernel)

    @property
    def tile(self):
        """(Br, Bc)."""
        return self.br, self.bc

    @property
    def blocks_per_sm(self):
        """Blocks of it an SM of compute capability 9.0 holds at once, by
        shared memory, threads and registers (255 a thread where the cap
        is left to the assembler: the fewest blocks it may hold)."""
        shared = self.shared + self.dynamic_shared + BLOCK_RESERVED
        registers = self.threads * (self.max_registers or 255)
        return max(1, min(SM_SHARED // shared, SM_THREADS // self.threads,
                          SM_REGISTERS // registers))

    def grid(self, n, heads, together=1):
        """The launch grid over n own rows (queries, or keys for dK and
        dV) of `heads` batch elements: (ranks, heads), or for a placed
        kernel order.grid's, `together` heads started at once."""
        ranks = -(-n // self.br)
        if not self.placed:
            return ranks, heads
        return order.grid(ranks, heads, together)


# what each argument list (registry.Kernel.args) writes
RETURNS = {"forward": ("o", "lse"), "forward_bad": ("o", "lse"),
           "forward16": ("o", "lse"), "forward16_tma": ("o", "lse"),
           "forward8_tma": ("o", "lse"),
           "transpose8": ("v_t",),
           "backward_kv": ("dk", "dv"), "backward_q": ("dq",),
           "backward16_dq": ("dq",), "backward16_dkv": ("dk", "dv"),
           "backward16_dq_pairs": ("dq",),
           "backward16_dkv_pairs": ("dk", "dv"),
           "backward16_dkv_tma": ("dk", "dv"),
           "backward16_fused_pairs": ("dk", "dv", "dq"),
           "backward16_fused_tma": ("dk", "dv", "dq"),
           "backward16_ordered_tma": ("dk", "dv", "dq"),
           "combine": ("o", "m_out", "l_out"), "row_dot": ("delta",),
           "merge_halves": ("o", "lse"),
           "norms": ("stats",), "sums": ("m", "l"),
           "row_dot16": ("delta",), "find_bad": ("bad",),
           "find_parts": ("parts",),
           "finish": ("o", "lse"), "row_statistics": ("stats",),
           "row_statistics16": ("stats",),
           "prepare16": ("delta", "stats", "counts")}
F32, B16 = 4, 2  # bytes of a float32 and of a 16-bit value
# what one SM of compute capability 9.0 holds: shared memory (bytes, 1 KB
# of it kept by the hardware per block), 32-bit registers, threads
SM_SHARED, BLOCK_RESERVED, SM_REGISTERS, SM_THREADS = 228 * 1024, 1024, \
    65536, 2048
STATS = 3  # per-query values the float32 backward keeps: shift, norm, D
TERMS = 3  # the 16-bit backward's: backward_v5.row_terms


def _scalar(br, bc, threads, shared_floats):
    """A float32 kernel without tensor cores: no fragments."""
    return dict(br=br, bc=bc, threads=threads, k_steps=0, n_tiles=0,
                o_tiles=0, shared=F32 * shared_floats)


def _v1(m, d, d_v):
    """One thread per query row, one key at a time, no SRAM."""
    return _scalar(m.ROWS, 1, m.ROWS, 0)


def _v2(m, d, d_v):
    """One thread per row; K_j, V_j tiles of BC keys in SRAM."""
    return _scalar(m.ROWS, m.BC, m.ROWS, m.BC * (d + d_v))


def _v3(m, d, d_v):
    """Register-blocked tiles: Q, K (padded), V, P (padded), m, l, alpha."""
    t = device.tiles(d, d_v)
    return _scalar(t.BR, t.BC, device.THREADS, t.BR * t.DP + t.BC * t.DP
                   + t.BC * d_v + t.BR * t.BCP + 3 * t.BR)


def _v4(m, d, d_v):
    """v3's tiles; partial row maxima and sums (BR x TX) for m, l, alpha."""
    t = device.tiles(d, d_v)
    return _scalar(t.BR, t.BC, device.THREADS, t.BR * t.DP + t.BC * t.DP
                   + t.BC * d_v + t.BR * t.BCP + t.BR * t.TX)


def _mma(br, bc, threads, k_steps, n_tiles, o_tiles, shared):
    """A tensor-core kernel: fragments of mma k-steps and 8-column groups."""
    return dict(br=br, bc=bc, threads=threads, k_steps=k_steps,
                n_tiles=n_tiles, o_tiles=o_tiles, shared=shared)


def _v5(m, d, d_v):
    """Four warps of 16 rows; Q_i, K_j, V_j in SRAM (m16n8k16)."""
    br = warp.BR
    return _mma(br, m.BC, warp.THREADS, d // 16, m.BC // 8, d_v // 8,
                B16 * (br * d + m.BC * d + m.BC * d_v))


def _v6(m, d, d_v):
    """v5's warps on float32 (m16n8k8): padded K_j, V_j, each warp's P."""
    sk, sv, sp = m.strides(d, d_v)
    return _mma(warp.BR, m.BC, warp.THREADS, d // 8, m.BC // 8, d_v // 8,
                F32 * (m.BC * sk + m.BC * sv + warp.WARPS * 16 * sp))


def _wgmma(m, d, d_v):
    """Warpgroups of 64 rows on wgmma; all tiles in dynamic SRAM."""
    br, bc, threads = m.shape(d, d_v)
    return _mma(br, bc, threads, d // 16, bc // 8, d_v // 8, 0)


def _wgmma8(m, d, d_v):
    """_wgmma on e4m3: k-steps of 32."""
    return dict(_wgmma(m, d, d_v), k_steps=d // 32)


def _backward(m, d, d_v, keys):
    """One thread per own row (a key, or a query), the other side staged
    in chunks of CH rows: own rows padded, chunk rows not (and the chunk's
    row statistics, for dK/dV)."""
    nt, ch = m.sizes(d, d_v)
    floats = nt * (d + 1) + nt * (d_v + 1) + ch * d + ch * d_v
    return _scalar(nt, ch, nt, floats + (STATS * ch if keys else 0))


def _blocked(m, d, d_v, keys):
    """Register-blocked backward, BLOCK_BWD rows a side: Q, dO, K, V
    padded; (P Z)^T and dS^T for dK/dV, dS for dQ; row statistics."""
    n = m.BLOCK_BWD
    floats = 2 * n * (d + 1) + 2 * n * (d_v + 1) + STATS * n
    scores = (2 if keys else 1) * n * (n + 1)  # padded rows of n + 1
    return _scalar(n, n, device.THREADS, floats + scores)


def _backward16(m, d, d_v, keys):
    """Four warps of 16 rows; two SRAM tiles reused (own rows first, then
    the other side's), and row statistics per query for dK/dV."""
    part = "dkv" if keys else "dq"
    rows = m.BR if keys else m.BC  # of the tiles staged in SRAM
    n_tiles = rows // 8 // m.parts(part, d, d_v)
    shared = B16 * rows * (d + d_v) + (TERMS * F32 * m.ROWS if keys
                                       else 0)
    return _mma(m.BC if keys else m.BR, rows, warp.THREADS, d // 16,
                n_tiles, d // 8, shared)


def _backward_wgmma(m, d, d_v, keys):
    """Two warpgroups of 64 own rows on wgmma, the other side streamed in
    two stages of dynamic SRAM; dK/dV keeps each stage's row terms."""
    part = "dkv" if keys else "dq"
    shared = TERMS * F32 * 2 * m.STREAMED if keys else 0
    return _mma(m.own(part), m.STREAMED, m.threads(part), d // 16,
                m.STREAMED // 8, d // 8, shared)


def _backward_ws(m, d, d_v, keys, fused=False):
    """_backward_wgmma's consumer warpgroups and a producer's (backward_v8):
    its threads, the same tiles, its own static shared memory (the fused
    kernel's stages by head dim)."""
    from flashlab.gpu import backward_v7

    return dict(_backward_wgmma(backward_v7, d, d_v, keys),
                threads=m.threads(d, d_v),
                shared=m.static_bytes(d, d_v, fused))


def _helper(spec):
    """An element-wise kernel: no tiles; find_bad_parts keeps a word per
    column of V's words, and the chunk's QUADS words, in SRAM."""
    finds_parts = spec.make(0, 0) in (device.find_bad_parts32,
                                      device.find_bad_parts16,
                                      device.find_bad_parts8)
    return dict(br=0, bc=0, threads=spec.threads, k_steps=0, n_tiles=0,
                o_tiles=0,
                shared=4 * (device.PART_COLUMNS + device.QUADS)
                if finds_parts else 0)


# a kernel's factory (module.function) -> how its tiles follow from d, d_v
LAYOUTS = {
    "forward_v1.make": _v1,
    "forward_v2.make": _v2,
    "forward_v3.make": _v3,
    "forward_v4.make": _v4,
    "forward_v5.make": _v5,
    "forward_v6.make": _v6,
    "forward_v7.make": _wgmma,
    "forward_v8.make": _wgmma,
    "forward_v8.make_e4m3": _wgmma8,
    "backward.make_kv": functools.partial(_backward, keys=True),
    "backward.make_q": functools.partial(_backward, keys=False),
    "backward.make_kv_blocked": functools.partial(_blocked, keys=True),
    "backward.make_q_blocked": functools.partial(_blocked, keys=False),
    "backward_v5.make_dkv": functools.partial(_backward16, keys=True),
    "backward_v5.make_dq": functools.partial(_backward16, keys=False),
    "backward_v7.make_dkv": functools.partial(_backward_wgmma, keys=True),
    "backward_v7.make_dq": functools.partial(_backward_wgmma, keys=False),
    "backward_v7.make_fused": functools.partial(_backward_wgmma, keys=True),
    "backward_v8.make_dkv": functools.partial(_backward_ws, keys=True),
    "backward_v8.make_fused": functools.partial(_backward_ws, keys=True,
                                                fused=True),
    "backward_v8.make_ordered": functools.partial(_backward_ws, keys=True,
                                                  fused=True),
}


def factory(spec):
    """The function behind a registry.Kernel's `make` (a partial's own)."""
    return getattr(spec.make, "func", spec.make)


def module_of(spec):
    """The module that defines a kernel (None for a helper)."""
    if spec.helper:
        return None
    return sys.modules[factory(spec).__module__]


@functools.cache
def traits(name, d, d_v):
    """The Traits of registered kernel `name` at head dims d, d_v."""
    spec = registry.get(name)
    if spec.helper:
        layout = _helper(spec)
    else:
        if not spec.takes(d, d_v):
            raise ValueError(
                f"d, d_v: {name} is built for head dims {spec.head_dims} "
                f"(at most {spec.max_dim}), got {d}, {d_v}")
        fn = factory(spec)
        key = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
        if key not in LAYOUTS:
            raise ValueError(f"name: {name} (made by {key}) has no layout "
                             f"in flashlab.gpu.traits.LAYOUTS")
        layout = LAYOUTS[key](module_of(spec), d, d_v)
    if spec.args not in RETURNS:
        raise ValueError(f"name: {name}'s argument list {spec.args!r} has "
                         f"no entry in flashlab.gpu.traits.RETURNS")
    return Traits(name=name, d=d, d_v=d_v, warps=layout["threads"] // 32,
                  dynamic_shared=0 if spec.shared is None
                  else spec.shared(d, d_v),
                  max_registers=spec.registers(d, d_v),
                  returns=RETURNS[spec.args], placed=spec.placed,
                  **layout)


def forward(version, d, d_v):
    """The Traits of forward `version` (its first kernel: the dtypes and
    precisions of one version share their tiles)."""
    kernels = registry.forwards(version)
    if isinstance(version, bool) or not kernels:
        raise ValueError(f"version: expected one of {registry.versions()}, "
                         f"got {version!r}")
    return traits(kernels[0].name, d, d_v)

