"""The one writer of benchmark rows: CSV files and fixed-width tables,
the machine line, and chapter 9's figure."""

import csv
import os
import platform
from typing import NamedTuple

import numpy as np

FIELDS = ("device", "impl", "pass", "causal", "B", "H", "N", "d", "ms",
          "tflops", "vs_torch")  # bench.csv, tensor.csv, decode.csv


class Column(NamedTuple):
    """How a table shows one key: its title, width, format and side."""

    title: str
    width: int
    fmt: str = "{}"
    align: str = ">"


COLUMNS = {
    "device": Column("device", 8, align="<"),
    "pass": Column("pass", 8, align="<"),
    "impl": Column("impl", 19, align="<"),
    "causal": Column("causal", 6, align="<"),
    "dtype": Column("dtype", 8, align="<"),
    "B": Column("B", 3),
    "H": Column("H", 3),
    "H_kv": Column("Hkv", 3),
    "d": Column("d", 4),
    "N": Column("N", 6),
    "C": Column("C", 5),
    "layers": Column("layers", 6),
    "calls": Column("calls", 5),
    "ms": Column("ms", 10, "{:.3f}"),
    "us": Column("us/call", 9, "{:.1f}"),
    "tflops": Column("TFLOP/s", 8, "{:.2f}"),
    "vs_torch": Column("vs torch", 8, "{:.2f}x"),
    "loss_diff": Column("max|dloss|", 10, "{:.2e}"),
    # ring attention (ring.json)
    "world": Column("GPUs", 4),
    "n": Column("N", 7),
    "layout": Column("layout", 10, align="<"),
    "speedup": Column("x 1 GPU", 7, "{:.2f}x"),
    "sent_mb": Column("sent MB", 8, "{:.1f}"),
    "predicted_mb": Column("predicted", 9, "{:.1f}"),
    "flashlab_ms": Column("no ring ms", 10, "{:.2f}"),
    "torch_flash_ms": Column("torch flash", 11, "{:.2f}"),
}
SHOWN = ("device", "pass", "impl", "causal", "d", "N", "ms", "tflops",
         "vs_torch")  # the table of bench.csv, tensor.csv, decode.csv


def _cell(key, value, text=None):
    """`value` formatted and padded as column `key` shows it (or `text`,
    a title, padded alike); a missing value is blank."""
    col = COLUMNS[key]
    if text is None:
        text = "" if value is None else col.fmt.format(value)
    return f"{text:{col.align}{col.width}}"


def table(rows, shown=SHOWN):
    """The rows as a fixed-width text table of the keys in `shown`."""
    head = " ".join(_cell(k, None, COLUMNS[k].title) for k in shown)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(_cell(k, r.get(k)) for k in shown).rstrip())
    return "\n".join(lines)


def write_csv(rows, path, fields=FIELDS):
    """The rows as a CSV file with a header of `fields`."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows):
    """Figure: forward TFLOP/s against N per GPU implementation (torch
    dashed), full and causal side by side. Chapter 9 draws it too."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        sel = [r for r in rows if r["device"] == "gpu"
               and r["pass"] == "forward" and r["causal"] == causal]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = [(r["N"], r["tflops"]) for r in sel if r["impl"] == impl]
            style = "o--" if impl.startswith("torch") else "o-"
            ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_title("causal" if causal else "full attention")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward TFLOP/s, float32")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def machine():
    """One line naming the machine and the library versions."""
    parts = [platform.processor() or platform.machine(),
             f"{os.cpu_count()} cpus", f"python {platform.python_version()}",
             f"numpy {np.__version__}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.insert(0, torch.cuda.get_device_name())
    except ImportError:
        pass
    import numba

    parts.append(f"numba {numba.__version__}")
    return ", ".join(parts)
