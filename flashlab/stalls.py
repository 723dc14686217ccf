"""Where a kernel's warps spend their time, from Nsight Compute's
source-level stall samples.

`ncu --section SourceCounters` samples each warp of a kernel at a fixed
interval and notes the SASS instruction it is at and why it is not
issuing (or that it is: "selected"). Exported with
`ncu --import r.ncu-rep --page source --csv --print-source sass`, that is
one row per instruction per kernel; `reduce` sums it per opcode, which is
small enough to store (hopper_stalls_h200.csv), and `by_class` sums the
opcodes into the classes of work a FlashAttention kernel does. See
chapter 12. The stored file, from two such exports:

    python -m flashlab.stalls out.csv before=old.csv after=new.csv
"""

import csv
import io

# sampled stall reasons kept per opcode: ncu's column "stall_<reason>"
REASONS = ("selected", "not_selected", "wait", "long_sb", "short_sb",
           "mio", "math", "barrier", "dispatch", "no_inst",
           "branch_resolving")
CLASSES = ("tensor cores", "exponentials", "other float",
           "integer and control", "tile handover")
_TENSOR = ("HGMMA", "QGMMA", "WARPGROUP")
_HANDOVER = ("SYNCS", "UTMALDG", "BAR", "UBLKCP", "WAIT_BRA")


def opcode(sass):
    """The opcode of one SASS line: 'FFMA R1, ...' and '@P0 BRA ...' give
    FFMA and BRA (a predicate and the modifiers after the dot dropped)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        raise ValueError(f"sass: expected an instruction, got {sass!r}")
    return words[0].split(".")[0]


def instruction_class(op):
    """The class of work of opcode `op` (one of CLASSES): the products
    (wgmma and its fences), ex2 on the special-function unit, the rest
    of the float32 softmax, integer and branch bookkeeping, and the
    mbarrier and TMA work that hands tiles over."""
    if op in _TENSOR:
        return "tensor cores"
    if op == "MUFU":
        return "exponentials"
    if op in _HANDOVER:
        return "tile handover"
    if op.startswith("F") or op in ("HADD2", "HMUL2"):
        return "other float"
    return "integer and control"


def _renamed(op, before):
    """WAIT_BRA for the branch that follows an mbarrier's try-wait (it
    loops until the phase completes: the samples of a wait for a tile
    land on it), else op."""
    return "WAIT_BRA" if op == "BRA" and before == "SYNCS" else op


def _kernel_kind(name):
    """'e4m3' or 'bf16' from a forward_v8 kernel's mangled name."""
    return "e4m3" if "_e4m3" in name else "bf16"


def reduce(text, build):
    """ncu's source-page CSV `text` -> rows {build, kernel, opcode,
    samples, executed, <REASONS>} summed per opcode of each kernel (a
    branch after a try-wait as WAIT_BRA)."""
    sums = {}
    kernel = header = before = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernel, header = _kernel_kind(row[1]), None
            continue
        if row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
            continue
        if header is None or kernel is None:
            continue
        op = opcode(row[header["Source"]])
        key, before = (kernel, _renamed(op, before)), op
        got = sums.setdefault(key, dict.fromkeys(
            ("samples", "executed", *REASONS), 0))
        got["samples"] += int(
            row[header["Warp Stall Sampling (All Samples)"]] or 0)
        got["executed"] += int(row[header["Instructions Executed"]] or 0)
        for reason in REASONS:
            got[reason] += int(row[header[f"stall_{reason}"]] or 0)
    if not sums:
        raise ValueError("text: expected ncu's source page (--page source "
                         "--csv --print-source sass), found no rows")
    return [dict(build=build, kernel=k, opcode=op, **v)
            for (k, op), v in sorted(sums.items())]


def by_class(rows, build, kernel):
    """{class: (share of the stall samples, share of the instructions
    executed)} of one build and kernel of `reduce`'s rows."""
    mine = [r for r in rows if r["build"] == build and r["kernel"] == kernel]
    if not mine:
        raise ValueError(f"build, kernel: no rows of {build!r}, {kernel!r}")
    samples = sum(r["samples"] for r in mine)
    executed = sum(r["executed"] for r in mine)
    out = {c: [0.0, 0.0] for c in CLASSES}
    for r in mine:
        share = out[instruction_class(r["opcode"])]
        share[0] += r["samples"] / samples
        share[1] += r["executed"] / executed
    return {c: tuple(v) for c, v in out.items()}


def reason_shares(rows, build, kernel):
    """{reason: share of all stall samples} of one build and kernel."""
    mine = [r for r in rows if r["build"] == build and r["kernel"] == kernel]
    samples = sum(r["samples"] for r in mine)
    return {reason: sum(r[reason] for r in mine) / samples
            for reason in REASONS}


def stored(name="hopper_stalls_h200.csv"):
    """The stored rows of `reduce` (flashlab.measured), counts as int."""
    from flashlab import measured

    counts = ("samples", "executed", *REASONS)
    return [{k: int(v) if k in counts else v for k, v in r.items()}
            for r in csv.DictReader(io.StringIO(measured.text(name)))]


def write(rows, path):
    """`reduce`'s rows as a CSV file."""
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows(rows)


def main(argv):
    """out.csv build=source.csv ...: the rows of each build's export,
    reduced, into one file."""
    if len(argv) < 2 or not all("=" in a for a in argv[1:]):
        raise SystemExit("usage: python -m flashlab.stalls out.csv "
                         "build=source.csv [build=source.csv ...]")
    rows = []
    for arg in argv[1:]:
        build, path = arg.split("=", 1)
        with open(path) as f:
            rows += reduce(f.read(), build)
    write(rows, argv[0])
    return rows


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
