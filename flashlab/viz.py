"""Figures and step-throughs that work in the static book, with no kernel.

Each function runs flashlab's own computation and draws its trace or its
counts. A step-through turns every step into one frame of a matplotlib
animation rendered as HTML with First / Previous / Next / Play buttons
(`to_jshtml`), with every frame's numbers also listed as text: the frames
are the computation's states, never a separate drawing of it.

- `online_steps`: one query's rescale-then-add, chunk by chunk, with the
  numbers of `rescale_add` (`online.stream`, chapter 3);
- `merge_steps`: two block summaries and their merge (`merge`, chapter 4);
- `tile_walk`: Q, K^T, V^T and the per-row accumulators, tile by tile,
  numbers in the cells (`tiled.trace`, chapter 5);
- `traffic_steps`: HBM traffic of the dense and tiled schedules, transfer
  by transfer (`io.ledger(record=True)`, chapter 6);
- `explorer`: seed 001's dense and tiled lanes for a chosen query, as HTML
  with a small script (chapter 5);
- `hbm_sram`: each schedule's HBM <-> on-chip movement with the ledger's
  counts (chapter 6);
- `tile_map`: one static panel of the tiles a mask computes in full, masks
  element by element, or skips (chapter 7);
- `gpu_hierarchy`, `access_patterns` (with `sectors`, `bank_conflicts`):
  the execution model and memory rules of the primer before chapter 9;
- `kernel_version` (with `kernel_counts` and the owner maps): the one
  idea of each forward version of chapter 9, from the kernels' layouts.
"""

import types
from typing import NamedTuple

import numpy as np

from flashlab import io, masks, merge, online, tiled


def animate(frames, draw, figsize=(8, 3.4), text=None):
    """HTML of an animation: draw(fig, frame) for each frame in frames.

    text(frame), if given, is the frame's numbers as text: listed under the
    player in a folded block, for readers who cannot see the images and for
    the browser test, which checks that every frame carries numbers.
    """
    import html as html_text

    import matplotlib.pyplot as plt
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation

    fig = plt.figure(figsize=figsize)

    def update(k):
        fig.clear()
        draw(fig, frames[k])

    anim = FuncAnimation(fig, update, frames=len(frames), interval=1200)
    html = anim.to_jshtml(default_mode="once")
    plt.close(fig)
    if text is not None:
        items = "".join(f"<li><pre>{html_text.escape(text(f))}</pre></li>"
                        for f in frames)
        html += ('<details class="frame-text"><summary>The frames as text'
                 f"</summary><ol>{items}</ol></details>")
    return HTML(_offline(html))


# matplotlib's player draws its buttons with Font Awesome from a CDN; the
# book must work offline, so the buttons get Unicode symbols that common
# fonts (DejaVu) carry: arrows to the ends, triangles to step and play.
_ICONS = {"fa fa-minus": "\u2212", "fa fa-fast-backward": "\u21e4",
          "fa fa-step-backward": "\u25c1", "fa fa-play fa-flip-horizontal":
          "\u25c0", "fa fa-pause": "\u2016", "fa fa-play": "\u25b6",
          "fa fa-step-forward": "\u25b7", "fa fa-fast-forward": "\u21e5",
          "fa fa-plus": "+"}


def _offline(html):
    """The player's HTML without external stylesheets or icon fonts."""
    import re

    html = re.sub(r"<link[^>]*font-awesome[^>]*>", "", html)
    for cls, symbol in _ICONS.items():
        html = html.replace(f'<i class="{cls}"></i>', symbol)
    return html


class RescaleAdd(NamedTuple):
    """One chunk of the online update, split into its rescale and its add."""

    keys: range  # the chunk's keys
    top: np.ndarray  # the chunk's own maximum
    old: merge.Summary  # running state before the chunk
    alpha: np.ndarray  # exp(m_old - m'), 0 for the empty starting state
    rescaled: merge.Summary  # the old state moved onto m'
    added: merge.Summary  # the chunk's own terms on m'
    new: merge.Summary  # rescaled + added = merge(old, chunk)


def rescale_add(scores, values, chunk):
    """Chapter 3: each chunk's (old, alpha, rescaled, added, new) states.

    scores (..., N), values (N, d_v). Both halves are `merge.merge` with an
    empty summary sitting on the new maximum m' (l = 0, u = 0): merging
    the old state with it is the rescale, merging it with the chunk is the
    chunk's contribution. `new` is the state `online.stream` returns.
    """
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    states = online.stream(scores, values, chunk)
    old = merge.empty(scores.shape[:-1], values.shape[-1], np.float64)
    steps = []
    for k, new in enumerate(states):
        j0 = k * chunk
        keys = range(j0, min(j0 + chunk, scores.shape[-1]))
        block = merge.summarize(scores[..., keys.start:keys.stop],
                                values[keys.start:keys.stop])
        steps.append(RescaleAdd(keys, block.m, old,
                                merge.rescale(old.m, new.m),
                                *_rescale_and_add(old, block, new), new))
        old = new
    return steps


def _rescale_and_add(old, block, new):
    """(old state on new.m, block's terms on new.m), both by merge.merge."""
    on_new = merge.Summary(new.m, np.zeros_like(new.l),
                           np.zeros_like(new.u))  # empty, sitting at m'
    return merge.merge(old, on_new), merge.merge(on_new, block)


def _vec(x, places=3):
    """A vector as [0.591, 0.786]."""
    return "[" + ", ".join(f"{e:.{places}f}" for e in np.ravel(x)) + "]"


def rescale_lines(step):
    """Text lines of one chunk's arithmetic (one query row), rounded."""
    old, res, add, new = step.old, step.rescaled, step.added, step.new
    a = float(step.alpha)
    m_old = "-inf" if old.l == 0 else f"{float(old.m):g}"
    return [
        f"m' = max({m_old}, {float(step.top):g}) = {float(new.m):g},   "
        + (f"alpha = exp({m_old} - {float(new.m):g}) = {a:.3f}"
           if old.l else "alpha = 0 (nothing summed yet)"),
        f"l: {float(old.l):.3f} x {a:.3f} = {float(res.l):.3f} "
        f"+ {float(add.l):.3f} = {float(new.l):.3f}",
        f"u: {_vec(old.u)} x {a:.3f} = {_vec(res.u)} "
        f"+ {_vec(add.u)} = {_vec(new.u)}",
        f"u / l = {_vec(new.output())}",
    ]


def online_steps(scores, values, chunk):
    """Chapter 3: one query's rescale-then-add, one frame per chunk."""
    scores = np.asarray(scores, dtype=np.float64)
    steps = rescale_add(scores, values, chunk)

    def title(step):
        return (f"chunk {step.keys.start // chunk + 1}: keys "
                f"{step.keys.start}-{step.keys.stop - 1}, scores "
                + ", ".join(f"{scores[j]:g}" for j in step.keys))

    def text(step):
        return "\n".join([title(step), *rescale_lines(step)])

    def draw(fig, step):
        ax = fig.add_axes((0.09, 0.42, 0.88, 0.5))
        colors = ["C1" if j in step.keys else
                  "C0" if j < step.keys.start else "0.85"
                  for j in range(len(scores))]
        bars = ax.bar(range(len(scores)), scores, color=colors)
        ax.bar_label(bars, fmt="%g", fontsize=8)
        ax.set_ylim(min(0, scores.min()) - 0.2, scores.max() * 1.25 + 0.2)
        ax.axhline(float(step.new.m), color="C3", ls="--",
                   label=f"m' = {float(step.new.m):g}")
        ax.set_xticks(range(len(scores)))
        ax.set_xlabel("key j (orange: this chunk, blue: earlier, "
                      "grey: not arrived yet)")
        ax.set_ylabel("score s_j")
        ax.set_title(title(step))
        ax.legend(loc="upper left")
        fig.text(0.03, 0.25, "\n".join(rescale_lines(step)), va="top",
                 family="monospace", fontsize=9)

    return animate(steps, draw, figsize=(8, 4.6), text=text)


def merge_steps(scores, values, split):
    """Chapter 4: block A's summary, block B's, then their merge."""
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    a = merge.summarize(scores[:split], values[:split])
    b = merge.summarize(scores[split:], values[split:])
    both = merge.merge(a, b)
    frames = [("block A", a, range(split)),
              ("block B", b, range(split, len(scores))),
              ("merged: A and B on the common maximum", both,
               range(len(scores)))]

    def text(frame):
        name, st, _ = frame
        return (f"{name}: m = {st.m:.4g}, l = {st.l:.4f}, u = "
                f"{np.array2string(np.asarray(st.u), precision=4)}")

    low, high = scores.min(), scores.max()
    pad = max(high - low, 1.0)

    def draw(fig, frame):
        name, st, keys = frame
        ax = fig.add_axes((0.1, 0.17, 0.86, 0.7))
        colors = ["C1" if j in keys else "0.85" for j in range(len(scores))]
        # bars from just below the lowest score: near 1000 they differ by 1
        bars = ax.bar(range(len(scores)), scores - (low - pad), color=colors,
                      bottom=low - pad)
        ax.bar_label(bars, labels=[f"{x:g}" for x in scores], fontsize=8)
        ax.set_ylim(low - pad, high + pad / 2)
        ax.set_xticks(range(len(scores)))
        ax.axhline(st.m, color="C3", ls="--", label=f"m = {st.m:.4g}")
        ax.set_xlabel("key j")
        ax.set_ylabel("score s_j")
        ax.set_title(text(frame))
        ax.legend(loc="upper left")

    return animate(frames, draw, text=text)


def _cell(ax, x, y, text="", color="white", size=8, hatch=None):
    """One unit cell of a tile diagram, top-left corner at (x, y)."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor="0.4",
                           lw=0.6, hatch=hatch))
    if text:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center",
                fontsize=size)


def tile_walk(q, k, v, **options):
    """Chapter 5: Q, K^T, V^T, the score tiles and each row's (m, l, u).

    One frame before the first tile, one per tile that tiled.trace visits
    and one for the final division. q (Nq, d), k (Nk, d), v (Nk, d_v);
    options are those of tiled.trace (block_q, block_k, scale, ...).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    tiles = tiled.trace(q, k, v, **options)
    (nq, d), nk, dv = q.shape, k.shape[0], v.shape[1]
    states = [merge.empty((nq,), dv, np.float64)]  # all rows, per frame
    for t in tiles:  # a tile's state holds only its own rows
        st = merge.Summary(*(x.copy() for x in states[-1]))
        for whole, part in zip(st, t.after):
            whole[t.rows.start:t.rows.stop] = part
        states.append(st)
    frames = [("start", None, states[0])] + [
        ("tile", t, st) for t, st in zip(tiles, states[1:])] + [
        ("end", None, states[-1])]
    xs, xa = d + 1, d + nk + 2  # first score column, first state column
    ys, yv = d + 1, d + nq + 2  # first query row, first V^T row

    def draw(fig, frame):
        kind, tile, state = frame
        n = tiles.index(tile) if kind == "tile" else (
            -1 if kind == "start" else len(tiles))
        ax = fig.add_axes((0, 0, 1, 0.94))
        cur_r = tile.rows if tile else range(0)
        cur_c = tile.cols if tile else range(0)
        for r in range(d):  # K^T on top, one column per key
            for j in range(nk):
                _cell(ax, xs + j, r, f"{k[j, r]:g}",
                      "#fdd9b5" if j in cur_c else "0.95")
        for r in range(dv):  # V^T below, aligned with the keys
            for j in range(nk):
                _cell(ax, xs + j, yv + r, f"{v[j, r]:g}",
                      "#fdd9b5" if j in cur_c else "0.95")
        for i in range(nq):  # Q on the left, one row per query
            for c in range(d):
                _cell(ax, c, ys + i, f"{q[i, c]:g}",
                      "#c6dbef" if i in cur_r else "0.95")
        for i in range(nq):  # the score grid: where tiles will be
            for j in range(nk):
                _cell(ax, xs + j, ys + i)
        for t in tiles[:max(n, 0)]:  # tiles already merged: consumed
            for i in t.rows:
                for j in t.cols:
                    _cell(ax, xs + j, ys + i, "used", "0.85", 7, "//")
        if tile is not None:  # this tile: score, then exp(s - m')
            for a, i in enumerate(tile.rows):
                for b, j in enumerate(tile.cols):
                    sc = tile.scores[a, b]
                    p = np.exp(sc - tile.after.m[a])
                    _cell(ax, xs + j, ys + i, f"s={sc:.3g}\np={p:.3f}",
                          "#fdae6b", 7)
        heads = ["m", "alpha", "l"] + [f"u[{c}]" for c in range(dv)]
        if kind == "end":
            heads = ["m", "alpha", "l"] + [f"O[{c}]" for c in range(dv)]
        for c, h in enumerate(heads):
            ax.text(xa + c + 0.5, ys - 0.3, h, ha="center", fontsize=8)
        alpha = np.full(nq, np.nan)  # per row, shown for this tile's rows
        if tile is not None:
            alpha[cur_r.start:cur_r.stop] = merge.rescale(tile.before.m,
                                                          tile.after.m)
        for i in range(nq):
            vec = state.output()[i] if kind == "end" else state.u[i]
            row = ["-inf" if state.l[i] == 0 else f"{state.m[i]:g}",
                   "-" if np.isnan(alpha[i]) else f"{alpha[i]:.3f}",
                   f"{state.l[i]:.3f}", *(f"{x:.3f}" for x in vec)]
            color = "#c6dbef" if i in cur_r or kind == "end" else "white"
            for c, text in enumerate(row):
                _cell(ax, xa + c, ys + i, text, color)
        for j in range(nk):
            ax.text(xs + j + 0.5, -0.3, f"K{j}", ha="center", fontsize=8)
            ax.text(xs + j + 0.5, yv + dv + 0.6, f"V{j}", ha="center",
                    fontsize=8)
        for i in range(nq):
            ax.text(-0.2, ys + i + 0.5, f"Q{i}", ha="right", va="center",
                    fontsize=8)
        if tile is not None:  # each row's l: rescale, then add the tile
            block = merge.summarize(tile.scores, v[cur_c.start:cur_c.stop])
            _, add = _rescale_and_add(tile.before, block, tile.after)
            lines = [f"Q{i}: l = {tile.before.l[a]:.3f} x {alpha[i]:.3f}"
                     f" + {add.l[a]:.3f} = {tile.after.l[a]:.3f}"
                     for a, i in enumerate(cur_r)]
            ax.text(xa, yv + 0.2, "\n".join(lines), va="top",
                    family="monospace", fontsize=8)
        ax.text(xs - 0.2, d / 2, "K^T", ha="right", va="center")
        ax.text(xs - 0.2, yv + dv / 2, "V^T", ha="right", va="center")
        ax.set_xlim(-1.2, xa + len(heads) + 0.2)
        ax.set_ylim(yv + dv + 1, -0.8)
        ax.set_aspect("equal")
        ax.axis("off")
        if kind == "start":
            title = "start: every row's state is empty (m = -inf, l = 0)"
        elif kind == "end":
            title = "after the last tile: O = u / l, row by row"
        else:
            title = (f"tile {n + 1} of {len(tiles)}: queries "
                     f"{tile.rows.start}-{tile.rows.stop - 1}, keys "
                     f"{tile.cols.start}-{tile.cols.stop - 1}; state "
                     f"rescaled by alpha, then the tile added")
        ax.set_title(title, fontsize=9)

    def text(frame):
        kind, tile, state = frame
        rows = [f"Q{i}: m = {state.m[i]:g}, l = {state.l[i]:.3f}, u = "
                f"{_vec(state.u[i])}" for i in range(nq)]
        if kind == "end":
            rows = [f"O{i} = u / l = {_vec(o)}"
                    for i, o in enumerate(state.output())]
        head = kind if tile is None else (
            f"tile: queries {tile.rows.start}-{tile.rows.stop - 1}, keys "
            f"{tile.cols.start}-{tile.cols.stop - 1}")
        return "\n".join([head, *rows])

    return animate(frames, draw, figsize=(8, 5.4), text=text)


def traffic_steps(n, d, *, block_q, block_k, steps=12):
    """Chapter 6: cumulative HBM transfers of dense and FA2, step by step."""
    runs = {s: io.ledger(s, n, d, block_q=block_q, block_k=block_k,
                         record=True) for s in ("dense", "fa2")}
    tensors = [t for t in io.TENSORS
               if any(b.reads[t] or b.writes[t] for b in runs.values())]
    longest = max(len(b.events) for b in runs.values())
    cuts = np.unique(np.linspace(1, longest, steps).astype(int))

    def totals(book, upto):
        out = dict.fromkeys(tensors, 0)
        for _, tensor, elements in book.events[:upto]:
            out[tensor] += elements
        return out

    top = max(b.total for b in runs.values())

    def label(name, upto):
        book = runs[name]
        return (f"{name}: {sum(totals(book, upto).values()):,} elements "
                f"({min(upto, len(book.events))}/{len(book.events)} "
                "transfers)")

    def text(upto):
        return "\n".join(label(name, upto) for name in runs)

    def draw(fig, upto):
        ax = fig.add_subplot(1, 1, 1)
        x = np.arange(len(tensors))
        for off, (name, book) in zip((-0.2, 0.2), runs.items()):
            got = totals(book, upto)
            ax.bar(x + off, [got[t] for t in tensors], width=0.4,
                   label=label(name, upto))
        ax.set_xticks(x, tensors)
        ax.set_ylim(0, top / 2)
        ax.set_ylabel("elements moved so far")
        ax.legend(loc="upper right", fontsize=8)

    return animate(list(cuts), draw, text=text)


def tile_map(ax, nq, nk, *, block_q, block_k, kv_lengths=None,
             **rules):
    """Chapter 7: draw on ax which tiles run in full, masked, or skipped.

    rules are tiled.trace's causal, window and align. Returns the counts
    {"full": ..., "masked": ..., "skipped": ...}.
    """
    rule = masks.rules(rules.get("causal", False), rules.get("window"),
                       kv_lengths, None, (), nq, nk, rules.get("align"))
    x = np.zeros((nq, 1))
    visited = tiled.trace(x, np.zeros((nk, 1)), np.zeros((nk, 1)),
                          block_q=block_q, block_k=block_k,
                          kv_lengths=kv_lengths, **rules)
    rows, cols = -(-nq // block_q), -(-nk // block_k)
    kind = np.zeros((rows, cols))  # 0 skipped, 1 masked, 2 full
    for t in visited:
        allowed = rule.allowed(t.rows, t.cols)  # None: all pairs allowed
        kind[t.rows.start // block_q, t.cols.start // block_k] = (
            2 if allowed is None or np.all(allowed) else 1)
    ax.imshow(kind, cmap="Blues", vmin=0, vmax=2.6)
    names = {0: "skip", 1: "mask", 2: "full"}
    for (i, j), c in np.ndenumerate(kind):
        ax.text(j, i, names[c], ha="center", va="center", fontsize=7,
                color="white" if c == 2 else "black")
    ax.set_xticks(range(cols), [f"K{j}" for j in range(cols)], fontsize=7)
    ax.set_yticks(range(rows), [f"Q{i}" for i in range(rows)], fontsize=7)
    return {name: int(np.sum(kind == c)) for c, name in
            ((2, "full"), (1, "masked"), (0, "skipped"))}


def hbm_sram(n, d, *, block_q, block_k, schedules=("dense", "fa2")):
    """Chapter 6: each schedule's data movement between HBM and SRAM.

    One panel per schedule, from `io.ledger`'s counts: every tensor in HBM
    on the left, the on-chip memory on the right, an arrow right for the
    elements read to the chip and one left for those written back. A
    matplotlib figure; the counts are returned beside it.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    books = {s: io.ledger(s, n, d, block_q=block_q, block_k=block_k)
             for s in schedules}
    tensors = [t for t in io.TENSORS
               if any(b.reads[t] or b.writes[t] for b in books.values())]
    fig, axes = plt.subplots(1, len(schedules),
                             figsize=(4.6 * len(schedules), 3.9))
    for ax, (name, book) in zip(np.atleast_1d(axes), books.items()):
        rows = len(tensors)
        ax.add_patch(Rectangle((0, 0), 2.2, rows, facecolor="#dbe9f6",
                               edgecolor="0.3"))
        ax.add_patch(Rectangle((7.2, 0), 2.6, rows, facecolor="#fde0c5",
                               edgecolor="0.3"))
        ax.text(1.1, rows + 0.25, "HBM", ha="center", weight="bold")
        ax.text(8.5, rows + 0.25, "SRAM (on chip)", ha="center",
                weight="bold")
        for k, t in enumerate(tensors):
            y = rows - k - 0.5
            read, wrote = book.reads[t], book.writes[t]
            ax.text(1.1, y, t if read or wrote else f"({t})", ha="center",
                    va="center", color="black" if read or wrote else "0.6")
            for count, y0, x0, x1, word in (
                    (read, y + 0.17, 2.3, 7.1, "read"),
                    (wrote, y - 0.17, 7.1, 2.3, "written")):
                if count:
                    ax.add_patch(FancyArrowPatch(
                        (x0, y0), (x1, y0), arrowstyle="-|>",
                        mutation_scale=10,
                        color="C0" if word == "read" else "C3"))
                    ax.text(4.7, y0 + 0.05, f"{word} {count:,}",
                            ha="center", va="bottom", fontsize=8)
            if not (read or wrote):
                ax.text(8.5, y, f"{t} tiles stay here", ha="center",
                        va="center", fontsize=8)
        ax.set_title(f"{name}: {book.total:,} elements moved", fontsize=10)
        ax.set_xlim(-0.2, 10)
        ax.set_ylim(-0.2, rows + 0.7)
        ax.axis("off")
    fig.tight_layout()
    return fig, {s: b.total for s, b in books.items()}


def explorer(q, k, v, *, block_k, scale=None):
    """Seed 001's explorer: pick a query, step a dense and a tiled lane.

    q (Nq, d), k (Nk, d), v (Nk, d_v). The dense lane keeps every score
    of the row until it has them all, then normalizes; the tiled lane
    merges one key tile at a time into (m, l, u) with `merge.merge`. Both
    end in the same output. All numbers are computed here and rounded to
    three places; the page only shows them (HTML with a small script, no
    kernel needed).
    """
    import json
    import uuid

    from IPython.display import HTML

    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    tau = 1 / np.sqrt(q.shape[1]) if scale is None else scale
    s = tau * q @ k.T  # (Nq, Nk): the dense lane's whole rows
    tiles = [range(j, min(j + block_k, len(k)))
             for j in range(0, len(k), block_k)]
    data = []
    for i in range(len(q)):
        dense_out = merge.summarize(s[i], v).output()
        state, steps = None, []
        for cols in tiles:
            block = merge.summarize(s[i, cols.start:cols.stop],
                                    v[cols.start:cols.stop])
            alpha = (0.0 if state is None else
                     float(merge.rescale(state.m, max(state.m, block.m))))
            state = block if state is None else merge.merge(state, block)
            steps.append({
                "keys": f"{cols.start}-{cols.stop - 1}",
                "dense": "kept scores " + _vec(s[i, :cols.stop]),
                "tiled": (f"tile scores {_vec(s[i, cols.start:cols.stop])}"
                          f"\nalpha = {alpha:.3f}\nm = {state.m:.3f}, "
                          f"l = {state.l:.3f}\nu = {_vec(state.u)}")})
        p = np.exp(s[i] - s[i].max())
        steps.append({
            "keys": "all",
            "dense": (f"m = {s[i].max():.3f}, l = {p.sum():.3f}\n"
                      f"P = {_vec(p / p.sum())}\nO = {_vec(dense_out)}"),
            "tiled": f"O = u / l = {_vec(state.output())}",
            "diff": f"{np.max(np.abs(dense_out - state.output())):.1e}"})
        data.append(steps)
    uid = uuid.uuid4().hex[:8]
    # JSON inside <script>: only "</" could end the element early
    script_data = json.dumps(data).replace("</", "<\\/")
    options = "".join(f'<option value="{i}">Q{i}</option>'
                      for i in range(len(q)))
    page = f"""<div class="flashlab-explorer" id="ex{uid}">
<p>Query <select id="ex{uid}-q">{options}</select>
<button id="ex{uid}-prev" title="Previous step">&#9665;</button>
<button id="ex{uid}-next" title="Next step">&#9655;</button>
<span id="ex{uid}-step"></span></p>
<table style="table-layout: fixed; width: 100%">
<tr><th>dense lane: every score kept</th>
<th>tiled lane: one tile at a time</th></tr>
<tr><td><pre id="ex{uid}-dense" style="white-space: pre-wrap"></pre></td>
<td><pre id="ex{uid}-tiled" style="white-space: pre-wrap"></pre></td>
</tr></table>
<p id="ex{uid}-end"></p></div>
<script>(function () {{
const data = {script_data};
const $ = (x) => document.getElementById("ex{uid}-" + x);
let step = 0;
function show() {{
  const steps = data[+$("q").value], st = steps[step];
  $("step").textContent = "step " + (step + 1) + " of " + steps.length
    + ", keys " + st.keys;
  $("dense").textContent = st.dense;
  $("tiled").textContent = st.tiled;
  $("end").textContent = st.diff === undefined ? "" :
    "Both lanes end in the same output: max |difference| = " + st.diff;
}}
$("q").onchange = () => {{ step = 0; show(); }};
$("prev").onclick = () => {{ step = Math.max(0, step - 1); show(); }};
$("next").onclick = () => {{
  step = Math.min(data[+$("q").value].length - 1, step + 1); show(); }};
show();
}})();</script>"""
    return HTML(page)


def gpu_hierarchy(grid=(4, 3), warps=4, lanes=32):
    """Primer: a grid of thread blocks, one block's warps, one warp's lanes.

    A diagram (matplotlib figure) with the sizes given: grid (x, y) blocks,
    `warps` warps per block, `lanes` threads per warp.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, (ga, ba, wa) = plt.subplots(
        1, 3, figsize=(10, 3.2), gridspec_kw={"width_ratios": [3, 2, 3]})
    gx, gy = grid
    for x in range(gx):
        for y in range(gy):
            ga.add_patch(Rectangle((x, gy - 1 - y), 0.9, 0.9,
                                   facecolor="C1" if (x, y) == (1, 0)
                                   else "#fdd9b5", edgecolor="0.3"))
            ga.text(x + 0.45, gy - 1 - y + 0.45, f"({x}, {y})",
                    ha="center", va="center", fontsize=7)
    ga.set_title(f"grid: {gx} x {gy} blocks\n(one per query block, "
                 "batch x head)", fontsize=9)
    ga.set_xlim(-0.1, gx)
    ga.set_ylim(-0.1, gy)
    for w in range(warps):
        ba.add_patch(Rectangle((0, warps - 1 - w), 3, 0.85,
                               facecolor="C0" if w == 0 else "#c6dbef",
                               edgecolor="0.3"))
        ba.text(1.5, warps - 1 - w + 0.42, f"warp {w}", ha="center",
                va="center", fontsize=8)
    ba.set_title(f"block (1, 0): {warps} warps,\n{warps * lanes} threads, "
                 "shared memory", fontsize=9)
    ba.set_xlim(-0.1, 3.1)
    ba.set_ylim(-0.1, warps)
    per_row = 8
    for lane in range(lanes):
        x, y = lane % per_row, lane // per_row
        wa.add_patch(Rectangle((x, lanes // per_row - 1 - y), 0.9, 0.9,
                               facecolor="#c6dbef", edgecolor="0.3"))
        wa.text(x + 0.45, lanes // per_row - 1 - y + 0.45, str(lane),
                ha="center", va="center", fontsize=7)
    wa.set_title(f"warp 0: {lanes} lanes, one instruction at a time,\n"
                 "each lane its own registers", fontsize=9)
    wa.set_xlim(-0.1, per_row)
    wa.set_ylim(-0.1, lanes // per_row)
    for ax in (ga, ba, wa):
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def sectors(byte_addresses, sector=32):
    """The distinct `sector`-byte memory segments a warp's load touches."""
    return np.unique(np.asarray(byte_addresses) // sector)


def bank_conflicts(byte_addresses):
    """Most distinct 4-byte words one shared-memory bank must serve.

    1 is conflict-free; k means the access is replayed k times. Lanes
    reading the very same word share it (a broadcast), so words, not lanes,
    are counted per bank.
    """
    from flashlab import fragments

    words = np.unique(np.asarray(byte_addresses) // 4)
    return int(np.bincount(fragments.banks(words * 4), minlength=32).max())


def access_patterns(patterns, kind):
    """Primer: lane -> memory sector (kind "global") or bank ("shared").

    patterns: {title: byte addresses of the 32 lanes}. One panel each,
    the count (sectors touched, or the conflict degree) in its title.
    """
    import matplotlib.pyplot as plt

    from flashlab import fragments

    fig, axes = plt.subplots(1, len(patterns),
                             figsize=(4.2 * len(patterns), 3.0),
                             sharey=kind == "shared")
    for ax, (title, addr) in zip(np.atleast_1d(axes), patterns.items()):
        addr = np.asarray(addr)
        if kind == "global":
            where = addr // 32 - (addr // 32).min()
            count = f"{len(sectors(addr))} sectors of 32 bytes"
            ax.set_ylabel("32-byte sector (from the first)")
        else:
            where = fragments.banks(addr)
            count = f"{bank_conflicts(addr)}-way"
            ax.set_ylabel("shared-memory bank")
        ax.scatter(np.arange(len(addr)), where, s=14, color="C0")
        ax.set_xlabel("lane")
        ax.set_title(f"{title}\n{count}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# Chapter 12: Hopper's warpgroup MMA, drawn from the models in
# flashlab.fragments, the order of forward_v7's loop and the stored H200
# runs (flashlab.measured).


def core_matrices(rows=16, per_row=4, k_step=1):
    """Chapter 12: a tile of rows x 8 per_row 16-bit values stored as core
    matrices (fragments.core_offset), and what k-step `k_step` of its
    K-major descriptor reads, found by fragments.wgmma_operand."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from flashlab import fragments as fr

    cols = 8 * per_row
    shared = np.empty(rows * cols, np.int64)  # a tile element's index
    for r in range(rows):
        for c in range(per_row):
            at = fr.core_offset(r, c, per_row) // 2
            shared[at:at + 8] = r * cols + 8 * c + np.arange(8)
    lbo, sbo, step = fr.k_major(per_row)
    desc = fr.descriptor(k_step * step, lbo, sbo)
    read = fr.wgmma_operand(shared, desc, rows, transposed=False)
    core = np.empty(rows * cols, np.int64)  # element -> its core matrix
    core[shared] = np.arange(shared.size) * 2 // fr.CORE_BYTES
    core = core.reshape(rows, cols)
    hit = np.isin(np.arange(rows * cols), read).reshape(rows, cols)
    fig, (ta, ma) = plt.subplots(
        1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [cols, 40]})
    ta.imshow(core % 10, cmap="Pastel1", vmin=0, vmax=9, aspect="auto")
    for (r, c), n in np.ndenumerate(core[::8, ::8]):
        ta.text(8 * c + 3.5, 8 * r + 3.5, str(n), ha="center",
                va="center", fontsize=10)
    rr, cc = np.nonzero(hit)
    ta.add_patch(Rectangle((cc.min() - 0.5, rr.min() - 0.5),
                           cc.max() - cc.min() + 1, rr.max() - rr.min() + 1,
                           fill=False, lw=2.5, ec="black"))
    ta.set_xticks(np.arange(0, cols + 1, 8) - 0.5, np.arange(0, cols + 1, 8))
    ta.set_yticks(np.arange(0, rows + 1, 8) - 0.5, np.arange(0, rows + 1, 8))
    ta.set_xlabel("column (16-bit values)")
    ta.set_ylabel("row")
    ta.set_title(f"the tile: core matrix of each value; k-step {k_step} "
                 "outlined", fontsize=9)
    n_cores = rows * cols * 2 // fr.CORE_BYTES
    read_cores = set(core[hit].tolist())
    for n in range(n_cores):
        ma.add_patch(Rectangle((n * fr.CORE_BYTES, 0), fr.CORE_BYTES, 1,
                               fc=plt.get_cmap("Pastel1")(n % 10),
                               ec="black", lw=0.8,
                               hatch="///" if n in read_cores else None))
        ma.text((n + 0.5) * fr.CORE_BYTES, 0.5, str(n), ha="center",
                va="center", fontsize=10)
    ma.set_xlim(0, n_cores * fr.CORE_BYTES)
    ma.set_ylim(0, 1)
    ma.set_yticks([])
    ma.set_xticks(np.arange(0, n_cores + 1, 2) * fr.CORE_BYTES)
    ma.set_xlabel("byte address in shared memory")
    ma.set_title(f"shared memory: 128 bytes a core matrix; LBO {lbo}, "
                 f"SBO {sbo}; k-step {k_step} reads the hatched ones",
                 fontsize=9)
    fig.tight_layout()
    return fig


def wgmma_owners(n=None):
    """Chapter 12: (64, n) thread of a warpgroup holding each element of
    the m64nN accumulator (fragments.wgmma_c_places), or with n None
    (64, 16) of the register A operand (fragments.wgmma_a_places)."""
    from flashlab import fragments as fr

    if n is None:
        places, owner = fr.wgmma_a_places(), np.empty((64, 16), np.int64)
    else:
        places, owner = fr.wgmma_c_places(n), np.empty((64, n), np.int64)
    threads = np.arange(128).reshape((128,) + (1,) * (places.ndim - 2))
    owner[places[..., 0], places[..., 1]] = np.broadcast_to(
        threads, places.shape[:-1])
    return owner


def wgmma_registers(n=32):
    """Chapter 12: who holds the m64nN accumulator (warp of each element),
    and rows 0-15 of its first 16 columns beside the A operand of P V's
    first k-step, thread by thread: the same threads, the same places."""
    import matplotlib.pyplot as plt

    acc, a = wgmma_owners(n), wgmma_owners()
    fig, axes = plt.subplots(1, 3, figsize=(10, 4.2),
                             gridspec_kw={"width_ratios": [n, 24, 24]})
    axes[0].imshow(acc // 32, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for w in range(4):
        axes[0].text(n / 2 - 0.5, 16 * w + 7.5, f"warp {w}", ha="center",
                     va="center", fontsize=9)
    axes[0].set_xticks(np.arange(0, n + 1, 8) - 0.5, np.arange(0, n + 1, 8))
    axes[0].set_yticks(np.arange(0, 65, 16) - 0.5, np.arange(0, 65, 16))
    axes[0].set_title(f"accumulator, 64 x {n}", fontsize=9)
    for ax, owner, title in (
            (axes[1], acc, "accumulator (S), rows 0-15,\ncolumns 0-15: "
             "thread"),
            (axes[2], a, "A operand of P V, k-step 0,\nrows 0-15: thread")):
        part = owner[:16, :16]
        ax.imshow(part // 4, cmap="tab20", vmin=0, vmax=19, aspect="auto")
        for (r, c), t in np.ndenumerate(part):
            ax.text(c, r, str(t), ha="center", va="center", fontsize=5.5)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def swizzle_slots(rows=8, chunks=8):
    """Chapter 12: (rows, chunks) 16-byte slot of its 128-byte row where
    chunk c of row r lies under the 128-byte swizzle
    (fragments.swizzle_address)."""
    from flashlab import fragments as fr

    r, c = np.meshgrid(np.arange(rows), np.arange(chunks), indexing="ij")
    return fr.swizzle_address(128 * r + 16 * c) % 128 // 16


def swizzle_pattern(chunk=2):
    """Chapter 12: 8 rows of 128 bytes, plain and 128-byte swizzled, each
    slot colored by the chunk it holds; the 8 pieces of `chunk` that one
    core matrix of a k-step reads are outlined, with the banks they hit
    (bank_conflicts)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    r = np.arange(8)
    plain = np.tile(np.arange(8), (8, 1))  # slot of chunk c is c
    slots = swizzle_slots()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.9))
    for ax, slot, name in ((axes[0], plain, "unswizzled"),
                           (axes[1], slots, "128-byte swizzle")):
        held = np.empty((8, 8), np.int64)  # the chunk in each slot
        held[r[:, None], slot] = np.arange(8)[None, :]
        ax.imshow(held, cmap="Set3", vmin=0, vmax=11)
        for (y, x), c in np.ndenumerate(held):
            ax.text(x, y, str(c), ha="center", va="center", fontsize=9)
        for y in range(8):
            ax.add_patch(Rectangle((slot[y, chunk] - 0.5, y - 0.5), 1, 1,
                                   fill=False, lw=2.5, ec="black"))
        degree = bank_conflicts(128 * r + 16 * slot[:, chunk])
        ax.set_xticks(range(8), [f"{4 * s}-{4 * s + 3}" for s in range(8)],
                      fontsize=7)
        ax.set_yticks(range(8))
        ax.set_xlabel("slot of the row (its 4 banks)")
        ax.set_ylabel("row")
        ax.set_title(f"{name}: chunk {chunk} of rows 0-7, "
                     f"{degree}-way", fontsize=9)
    fig.tight_layout()
    return fig


# forward_v7's steps, by the name its kernel calls them: the tile's
# barrier, the two products issued, their waits, and the lanes' own work
V7_STEPS = {"handed_over": "barrier", "s_issue": "issue S",
            "o_issue": "issue PV", "s_wait": "wait S", "s_wait_one": "wait S",
            "o_wait": "wait PV", "tile_softmax": "softmax",
            "rescale": "rescale", "to_a": "to_a"}


def v7_program():
    """Chapter 12: (prologue, loop, epilogue) of forward_v7's kernel as
    lists of V7_STEPS, read from its source in the order it makes them:
    before the loop over K/V tiles, one pass of it, after it."""
    import ast
    import inspect
    import textwrap

    from flashlab.gpu import forward_v7

    tree = ast.parse(textwrap.dedent(inspect.getsource(forward_v7.make)))
    kernel = next(f for f in ast.walk(tree)
                  if isinstance(f, ast.FunctionDef)
                  and f.name == "forward_v7")
    loops = [k for k, s in enumerate(kernel.body)
             if isinstance(s, ast.For) and s.target.id == "jt"]
    if len(loops) != 1:
        raise ValueError("forward_v7: expected one loop over tiles `jt`")

    def steps(statements):
        calls = sorted((c for s in statements for c in ast.walk(s)
                        if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Name)
                        and c.func.id in V7_STEPS),
                       key=lambda c: (c.lineno, c.col_offset))
        return [V7_STEPS[c.func.id] for c in calls]

    k = loops[0]
    return (steps(kernel.body[:k]), steps([kernel.body[k]]),
            steps(kernel.body[k + 1:]))


class Span(NamedTuple):
    """One interval of the timeline model: `who` ran `what` of `tile`."""

    who: str  # "tensor cores", "warpgroup w" (its lanes), "barrier"
    what: str  # "S", "PV", "softmax", "rescale"
    group: int  # the warpgroup whose work it is
    tile: int
    start: float
    end: float


def v7_timeline(program, tiles=4, groups=2, costs=None):
    """Chapter 12: the spans of `groups` warpgroups running `program`
    (v7_program) over `tiles` K/V tiles, sharing one tensor-core queue.

    A model, not a measurement: costs (in units of one S_ij product) are
    {"S", "PV", "softmax", "rescale"}; copies are taken to have landed by
    each barrier. Products run in the order they are issued; a wait holds
    a warpgroup until its product is done; the barrier holds every
    warpgroup until all reach it.
    """
    costs = {"S": 1.0, "PV": 1.0, "softmax": 0.75, "rescale": 0.15,
             **(costs or {})}
    prologue, loop, epilogue = program
    code = prologue + loop * (tiles - 1) + epilogue
    now, pc = [0.0] * groups, [0] * groups
    done = [{} for _ in range(groups)]  # product -> when it ends
    s_tile, p_tile = [-1] * groups, [-1] * groups
    queue_free, spans = 0.0, []
    while min(pc) < len(code):
        g = min((x for x in range(groups) if pc[x] < len(code)
                 and not (code[pc[x]] == "barrier"
                          and min(pc) < pc[x])),
                key=lambda x: (now[x], x))
        step = code[pc[g]]
        if step == "barrier":  # every warpgroup is here: all go on
            if any(code[pc[x]] != "barrier" or pc[x] != pc[g]
                   for x in range(groups)):
                raise ValueError("program: warpgroups out of step")
            now = [max(now)] * groups
            pc = [p + 1 for p in pc]
            spans.append(Span("barrier", "barrier", -1, -1, now[0], now[0]))
            continue
        if step in ("issue S", "issue PV"):
            what = step.split()[1]
            if what == "S":
                s_tile[g] += 1
            tile = s_tile[g] if what == "S" else p_tile[g]
            start = max(now[g], queue_free)
            queue_free = start + costs[what]
            done[g][what] = queue_free
            spans.append(Span("tensor cores", what, g, tile, start,
                              queue_free))
        elif step.startswith("wait"):
            now[g] = max(now[g], done[g][step.split()[1]])
        elif step == "to_a":  # P of the tile just softmaxed is A of P V
            p_tile[g] = s_tile[g]
        else:  # the lanes' own work: softmax, rescale
            spans.append(Span(f"warpgroup {g}", step, g, s_tile[g],
                              now[g], now[g] + costs[step]))
            now[g] += costs[step]
        pc[g] += 1
    return spans


def timeline_figure(spans, groups=2):
    """Chapter 12: the spans of v7_timeline as bars, one row per unit,
    the barriers as dotted lines."""
    import matplotlib.pyplot as plt

    units = ["tensor cores"] + [f"warpgroup {g}" for g in range(groups)]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    colors = {("S", 0): "#4c72b0", ("PV", 0): "#8fa8d6",
              ("S", 1): "#c44e52", ("PV", 1): "#e39a9c"}
    for s in spans:
        if s.who == "barrier":  # the block's barrier: every warp meets
            ax.axvline(s.start, color="black", ls=":", lw=1)
            continue
        y = len(units) - 1 - units.index(s.who)
        color = colors.get((s.what, s.group % 2),
                           "#55a868" if s.what == "softmax" else "#bbbbbb")
        ax.barh(y, s.end - s.start, left=s.start, height=0.7, color=color,
                edgecolor="white")
        if s.what != "rescale":
            label = f"{'P V' if s.what == 'PV' else s.what} {s.tile}"
            ax.text((s.start + s.end) / 2, y, label, ha="center",
                    va="center", fontsize=7)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=f"{w} of warpgroup {g}")
                       for (w, g), c in colors.items()]
              + [Patch(color="#55a868", label="softmax"),
                 Patch(color="#bbbbbb", label="rescale O")],
              fontsize=7, ncol=3, loc="upper center",
              bbox_to_anchor=(0.5, -0.35))
    ax.set_yticks(range(len(units)), units[::-1])
    ax.set_xlabel("time, in units of one S_ij product (a model); dotted: "
                  "the block's barrier")
    ax.set_xlim(0, max(s.end for s in spans))
    fig.tight_layout()
    return fig


def ncu_sections(text):
    """Chapter 12: {kernel: {metric: value}} of an Nsight Compute text
    report whose sections begin "== <kernel>" (hopper_profile_h200.txt)."""
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("== "):
            name = line[3:].strip()
            out[name] = {}
            continue
        parts = line.split()
        if name is None or len(parts) != 3 or "__" not in parts[0]:
            continue
        try:
            out[name][parts[0]] = float(parts[2].replace(",", ""))
        except ValueError:
            continue
    return out


def stall_reasons(metrics):
    """Chapter 12: {reason: warps stalled per issued instruction} from
    one kernel's ncu_sections metrics ("selected" is the issuing warp
    itself, not a stall)."""
    import re

    out = {}
    for key, value in metrics.items():
        m = re.fullmatch(r"smsp__average_warps_issue_stalled_(\w+)"
                         r"_per_issue_active\.ratio", key)
        if m and m.group(1) != "selected":
            out[m.group(1)] = value
    return out


def stall_figure(profile, least=0.05):
    """Chapter 12: the stall reasons of each kernel of `profile`
    (ncu_sections), side by side, those of at least `least` in one."""
    import matplotlib.pyplot as plt

    stalls = {k: stall_reasons(m) for k, m in profile.items()}
    reasons = sorted({r for s in stalls.values() for r, v in s.items()
                      if v >= least},
                     key=lambda r: -max(s.get(r, 0) for s in
                                        stalls.values()))
    fig, ax = plt.subplots(figsize=(9, 3.2))
    width = 0.8 / len(stalls)
    cases = {name.partition(" ")[2] for name in stalls}
    for k, (name, s) in enumerate(stalls.items()):
        # "v5 B2 H8 ..." as "v5" where every kernel ran the same case
        label = name.partition(" ")[0] if len(cases) == 1 else name
        ax.bar(np.arange(len(reasons)) + k * width,
               [s.get(r, 0) for r in reasons], width, label=label)
    if len(cases) == 1:
        ax.set_title(cases.pop(), fontsize=9)
    ax.set_xticks(np.arange(len(reasons)) + 0.4 - width / 2,
                  [r.replace("_", " ") for r in reasons], rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("warps stalled per issue")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def hopper_bench(rows, impls, sizes):
    """Chapter 12: forward TFLOP/s by N of `impls` (measured.rows of
    hopper_h200.csv), one panel per head dim and mask."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(11, 3.2), sharey=True)
    cases = [(d, causal) for d in (64, 128) for causal in (False, True)]
    for ax, (d, causal) in zip(axes, cases):
        for impl in impls:
            pts = [next(r["tflops"] for r in rows if r["impl"] == impl
                        and int(r["d"]) == d and r["causal"] == causal
                        and r["N"] == n) for n in sizes]
            ax.plot(sizes, pts, "o--" if impl.startswith("torch") else "s-",
                    label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_title(f"d={d}, {'causal' if causal else 'full'}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward TFLOP/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def ladder_figure(ladder):
    """Chapter 12: TFLOP/s of each step of a stored ladder record
    ({"shape", "steps": [{"step", "d", "causal", "tflops"}, ...]}), one
    bar per head dim."""
    import matplotlib.pyplot as plt

    steps = list(dict.fromkeys(s["step"] for s in ladder["steps"]))
    dims = sorted({s["d"] for s in ladder["steps"]})
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(steps)))
    height = 0.8 / len(dims)
    for k, d in enumerate(dims):
        for y, step in enumerate(steps[::-1]):
            t = next(s["tflops"] for s in ladder["steps"]
                     if s["step"] == step and s["d"] == d)
            ax.barh(y + k * height, t, height, color=f"C{k}",
                    label=f"d={d}" if y == 0 else None)
            ax.text(t + 3, y + k * height, f"{t:.0f}", va="center",
                    fontsize=8)
    ax.set_yticks(np.arange(len(steps)) + 0.4 - height / 2, steps[::-1],
                  fontsize=8)
    ax.set_xlim(0, 1.25 * max(s["tflops"] for s in ladder["steps"]))
    ax.set_xlabel(f"forward TFLOP/s ({ladder['shape']})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# forward_v8's producer and consumers, read from its kernel's source by a
# small interpreter (`v8_program`) and run on a model of its mbarriers
# (`MBarrier`, `v8_timeline`).


class MBarrier:
    """Chapter 12: a model of one mbarrier (flashlab.gpu.tma): a phase
    completes once `count` arrivals and every expected byte are in; a
    wait on parity p passes once the last phase of parity p has completed
    (a fresh barrier's phase "before 0", parity 1, counts as completed)."""

    def __init__(self, count):
        self.count = count  # arrivals that complete a phase
        self.phase = 0  # phases completed so far; the running one's number
        self.arrivals = 0  # arrivals in the running phase
        self.tx = 0  # bytes expected in the running phase, not yet landed
        self.latest = (0.0, None)  # (when, by whom) its last event was
        self.ends = []  # (when, by whom) each completed phase ended

    def arrive(self, at=0.0, who=None, arrivals=1, expect_tx=0):
        """`arrivals` arrivals at time `at` (mbarrier.arrive); expect_tx
        bytes more to land first (mbarrier.arrive.expect_tx)."""
        self.tx += expect_tx
        self.arrivals += arrivals
        self._event(at, who)

    def complete_tx(self, nbytes, at=0.0, who=None):
        """nbytes of a copy landed at time `at` (a TMA copy's complete_tx)."""
        self.tx -= nbytes
        self._event(at, who)

    def _event(self, at, who):
        if self.arrivals > self.count:
            raise ValueError(f"mbarrier: {self.arrivals} arrivals in a "
                             f"phase that expects {self.count}")
        if at >= self.latest[0]:
            self.latest = (at, who)
        if self.arrivals == self.count and self.tx == 0:
            self.ends.append(self.latest)
            self.phase += 1
            self.arrivals, self.latest = 0, (0.0, None)

    def try_wait(self, parity):
        """mbarrier.try_wait.parity: has the last phase of this parity
        completed (the running phase has the other parity)?"""
        return self.phase % 2 != parity

    def ready(self, parity):
        """(when, by whom) a wait on `parity` passes, or None while the
        running phase has that parity."""
        if not self.try_wait(parity):
            return None
        return self.ends[-1] if self.ends else (0.0, None)


class Step(NamedTuple):
    """One step of a role of forward_v8 (v8_program): `what` ("init",
    "expect", "load", "wait", "arrive", "barrier", "issue S", ...), the
    mbarrier it names (its number, or None) and its operand."""

    what: str
    bar: object = None
    value: object = None


# forward_v8's calls by name, and the step each is
V8_CALLS = {"mbarrier_init": "init", "arrive_expect_tx": "expect",
            "load_3d": "load", "wait": "wait", "arrive": "arrive",
            "syncthreads": "barrier", "s_issue": "issue S",
            "o_issue": "issue PV", "s_wait": "wait S",
            "s_wait_one": "wait S", "o_wait": "wait PV",
            "tile_softmax": "softmax", "plain_softmax": "softmax",
            "rescale": "rescale", "to_a": "to_a",
            # ping-pong: a consumer waits for its turn on a named barrier
            # and passes it on (bar_arrive: consumer 0's first turn)
            "my_turn": "turn", "next_turn": "pass", "bar_arrive": "pass"}


def v8_barrier_names():
    """Chapter 12: {mbarrier number: name} of forward_v8's barriers
    ("Q full", "K full 0", ..., "V empty 1"), from its constants."""
    from flashlab.gpu import forward_v8 as v8

    bases = sorted((getattr(v8, n), n) for n in
                   ("Q_FULL", "K_FULL", "V_FULL", "K_EMPTY", "V_EMPTY"))
    out = {}
    for k, (base, name) in enumerate(bases):
        end = bases[k + 1][0] if k + 1 < len(bases) else base + 2
        tensor, kind = name.split("_")
        for x in range(base, end):
            stage = "" if end - base == 1 else f" {x - base}"
            out[x] = f"{tensor} {kind.lower()}{stage}"
    return out


def v8_program(tiles=4, d=64, d_v=None, stops=None, empty=False):
    """Chapter 12: {role: [Step, ...]} of forward_v8 over `tiles` K/V
    tiles at head dims d, d_v: what thread 0 of the producer warpgroup
    and each consumer warpgroup do, in order, read from the kernel's
    source by running its control flow and its integer arithmetic (the
    barrier numbers, stages and parities) on the host; products, waits
    and the softmax appear by name. A load's bytes are its box's (64
    columns of Br rows for Q, Bc rows for K and V; forward_v8.tensor_maps).
    stops: {warpgroup: the last tile its rows reach} (the kernel's
    own_last, as under a causal mask), every tile where not given.
    empty: the block visits none of the `tiles` (masks.tile_range's
    (tiles, tiles - 1), rows a bottom-right mask leaves without keys).
    """
    import ast
    import inspect
    import textwrap

    from flashlab.gpu import forward_v8 as v8

    d_v = d if d_v is None else d_v
    tree = ast.parse(textwrap.dedent(inspect.getsource(v8.make)))
    make = tree.body[0]
    kernel = next(f for f in ast.walk(make)  # the body the kernel runs
                  if isinstance(f, ast.FunctionDef) and f.name == "run")
    ints = {k: x for k, x in vars(v8).items()
            if isinstance(x, int) or k in ("BLOCK_K", "BYTES", "K_STEP",
                                            "GROUPS", "REGISTERS")}
    names = {**ints, "D": d, "D_V": d_v, "kind": "bf16", "uint32": int,
             "uint64": int, "int32": int, "range": range, "min": min,
             "max": max, "block_rows": v8.block_rows, "groups": v8.groups}
    box_rows = (v8.block_rows(d, d_v), v8.BLOCK_K[d], v8.BLOCK_K[d])

    def value(node, ns):
        return eval(compile(ast.Expression(node), "forward_v8", "eval"),
                    {"__builtins__": {}}, ns)

    def bind(target, x, ns):
        if isinstance(target, ast.Name):
            ns[target.id] = x
        elif isinstance(target, ast.Tuple):
            for t, y in zip(target.elts, x):
                bind(t, y, ns)

    def assign(st, ns):
        try:
            x = value(st.value, ns)
        except Exception:  # not the host's arithmetic: a device value
            return
        for target in st.targets:
            bind(target, x, ns)

    def constants(statements):  # make's constants: BC, KD, Q_B, ...
        for st in statements:
            if isinstance(st, ast.Assign):
                assign(st, names)
            elif isinstance(st, ast.If):  # the 16-bit kinds' branch
                constants(st.body if value(st.test, names) else st.orelse)

    constants(make.body)

    def called(node):
        f = getattr(node, "func", None)
        return f.attr if isinstance(f, ast.Attribute) else getattr(
            f, "id", None)

    def step(call, ns):
        what = V8_CALLS.get(called(call))
        if what is None:
            return None
        args = call.args
        if what in ("init", "expect", "wait"):
            return Step(what, value(args[0], ns) // 8, value(args[1], ns))
        if what == "arrive":
            return Step(what, value(args[0], ns) // 8)
        if what == "load":  # (tensor, bytes) of one box
            tensor = value(args[1], ns) // 128  # 0, 1, 2: Q, K, V maps
            return Step(what, value(args[5], ns) // 8,
                        ("QKV"[tensor], 2 * v8.PANEL * box_rows[tensor]))
        if what == "turn":  # my_turn(wg): named barrier TURN + wg
            return Step(what, v8.TURN + value(args[0], ns)) \
                if v8.PING_PONG else None
        if what == "pass":  # next_turn(wg), or bar_arrive(barrier, count)
            if called(call) == "bar_arrive":
                return Step(what, value(args[0], ns))
            nxt = (value(args[0], ns) + 1) % v8.groups(d, d_v)
            return Step(what, v8.TURN + nxt) if v8.PING_PONG else None
        if what.startswith("issue"):  # the stage its descriptor reads:
            # (its address - stage 0's) / one stage's step
            step_ = ns["k_next" if what == "issue S" else "v_next"]
            return Step(what, None, value(args[2], ns) // step_)
        return Step(what)

    def run(statements, ns, out):
        """Append the steps of `statements`; True once a return is met."""
        for st in statements:
            if isinstance(st, ast.Return):
                return True
            if isinstance(st, ast.Assign):
                assign(st, ns)
            elif isinstance(st, ast.If):
                try:
                    taken = value(st.test, ns)
                except Exception:  # a test of device values: the first
                    taken = True  # branch, a tile with every pair allowed
                branch = st.body if taken else st.orelse
                if run(branch, ns, out):
                    return True
            elif isinstance(st, ast.For):
                try:
                    over = value(st.iter, ns)
                except Exception:  # a loop over registers: no steps
                    if any(called(c) in V8_CALLS for c in ast.walk(st)):
                        raise ValueError(
                            "v8_program: cannot count the loop "
                            f"`{ast.unparse(st.iter)}`") from None
                    continue
                for x in over:
                    bind(st.target, x, ns)
                    if run(st.body, ns, out):
                        return True
            elif isinstance(st, ast.Expr) and isinstance(st.value,
                                                         ast.Call):
                s = step(st.value, ns)
                if s is not None:
                    out.append(s)
        return False

    roles = {"producer": 0}
    roles.update({f"warpgroup {g}": 128 * (g + 1)
                  for g in range(v8.groups(d, d_v))})
    out = {}
    for role, t in roles.items():
        own = (stops or {}).get(t // 128 - 1, -1 if empty else tiles - 1)
        ns = {**names, "t": t, "w": t // 32, "lane": 0,
              "first": tiles if empty else 0, "last": tiles - 1,
              "own_last": own, "bars": 0, "wg": t // 128 - 1,
              "maps_at": 0, "q_desc": 0,
              "k_desc": 0, "v_desc": 0, "k_next": 1, "v_next": 1,
              # the block placed at head 0, rank 0 of one head
              "block_place": lambda *grid: (0, 0), "cuda": _BLOCK,
              "q": _HEAD}
        out[role] = []
        run(kernel.body, ns, out[role])
    return out


# v8_program's block: (0, 0, 0) of a grid of one, over one head
_BLOCK = types.SimpleNamespace(
    blockIdx=types.SimpleNamespace(x=0, y=0, z=0),
    gridDim=types.SimpleNamespace(x=1, y=1, z=1))
_HEAD = types.SimpleNamespace(shape=(1,))


class Handoff(NamedTuple):
    """One passed mbarrier wait of v8_timeline: `waiter` went on at
    `resumed` past phase-end `ready` of barrier `bar`, completed by
    `source` (None for a fresh barrier)."""

    bar: str
    parity: int
    tile: int
    source: object
    waiter: str
    ready: float
    resumed: float


def v8_timeline(program, costs=None):
    """Chapter 12: (spans, handoffs) of forward_v8's roles running
    `program` (v8_program) together: one TMA unit copying boxes in issue
    order, one tensor-core queue, and the mbarriers as MBarrier models
    (a consumer warpgroup arrives with its 128 threads).

    A model, not a measurement: costs (in units of one S_ij product) are
    {"S", "PV", "softmax", "rescale", "box"} ("box": one 16 KiB TMA box).
    A wait on an mbarrier holds its role until the phase completes; a
    role that waits on a phase nobody completes raises ValueError."""
    costs = {"S": 1.0, "PV": 1.0, "softmax": 0.75, "rescale": 0.15,
             "box": 0.5, **(costs or {})}
    names = v8_barrier_names()
    roles = list(program)
    pc, now = dict.fromkeys(roles, 0), dict.fromkeys(roles, 0.0)
    bars, done, spans, handoffs = {}, {}, [], []
    turns = {}  # named barrier -> [the time a pass arrived], until taken
    s_tile, p_tile = dict.fromkeys(roles, -1), dict.fromkeys(roles, -1)
    filled = {}  # tensor -> tiles whose bytes were expected so far
    tma_free = queue_free = 0.0

    def next_step(r):
        return program[r][pc[r]] if pc[r] < len(program[r]) else None

    while any(next_step(r) for r in roles):
        live = [r for r in roles if next_step(r)]
        if all(next_step(r).what == "barrier" for r in live):
            at = max(now[r] for r in live)  # the block barrier: all meet
            for r in live:
                now[r] = at
                pc[r] += 1
            spans.append(Span("barrier", "barrier", -1, -1, at, at))
            continue
        ready = {}  # role -> when its next step can run
        for r in live:
            s = next_step(r)
            if s.what == "barrier":
                continue
            if s.what == "wait":
                passed = bars[s.bar].ready(s.value)
                if passed is None:
                    continue
                ready[r] = max(now[r], passed[0])
            elif s.what == "turn":  # another's pass completes the phase
                if not turns.get(s.bar):
                    continue
                ready[r] = max(now[r], turns[s.bar][0])
            else:
                ready[r] = now[r]
        if not ready:
            stuck = "; ".join(
                f"{r} waits on {names.get(next_step(r).bar)} parity "
                f"{next_step(r).value}" if next_step(r).what == "wait"
                else f"{r} waits for turn {next_step(r).bar}"
                for r in live if next_step(r).what in ("wait", "turn"))
            raise ValueError(f"v8 model: no role can go on ({stuck})")
        r = min(ready, key=lambda x: (ready[x], roles.index(x)))
        s, group = next_step(r), roles.index(r) - 1
        if s.what == "init":
            bars[s.bar] = MBarrier(s.value)
        elif s.what == "expect":
            tensor = names[s.bar][0]
            filled[tensor] = filled.get(tensor, 0) + 1
            bars[s.bar].arrive(now[r], r, expect_tx=s.value)
        elif s.what == "load":
            tensor, nbytes = s.value
            start = max(now[r], tma_free)
            tma_free = start + costs["box"] * nbytes / (2 * 64 * 128)
            bars[s.bar].complete_tx(nbytes, tma_free, "TMA")
            spans.append(Span("TMA", tensor, -1, filled[tensor] - 1, start,
                              tma_free))
        elif s.what == "wait":
            at, source = bars[s.bar].ready(s.value)
            if r == "producer":  # the tile it is about to copy
                tile = filled.get(names[s.bar][0], 0)
            else:  # the tile its next product reads
                tile = p_tile[r] if names[s.bar][0] == "V" else s_tile[r] + 1
            handoffs.append(Handoff(names[s.bar], s.value, tile, source, r,
                                    at, ready[r]))
            if ready[r] > now[r]:
                spans.append(Span(r, "wait", group, tile, now[r],
                                  ready[r]))
            now[r] = ready[r]
        elif s.what == "arrive":
            bars[s.bar].arrive(now[r], r, arrivals=128)
        elif s.what == "pass":  # 128 of the 256 threads of a phase
            if turns.get(s.bar):
                raise ValueError(f"v8 model: turn {s.bar} passed twice "
                                 "in one phase (its 256 threads would "
                                 "complete it with nobody waiting)")
            turns[s.bar] = [now[r]]
        elif s.what == "turn":
            turns[s.bar].pop()
            if ready[r] > now[r]:
                spans.append(Span(r, "wait", group, s_tile[r] + 1, now[r],
                                  ready[r]))
            now[r] = ready[r]
        elif s.what.startswith("issue"):
            what = s.what.split()[1]
            if what == "S":
                s_tile[r] += 1
            tile = s_tile[r] if what == "S" else p_tile[r]
            start = max(now[r], queue_free)
            queue_free = start + costs[what]
            done[r, what] = queue_free
            spans.append(Span("tensor cores", what, group, tile, start,
                              queue_free))
        elif s.what.startswith("wait "):
            now[r] = max(now[r], done[r, s.what.split()[1]])
        elif s.what == "to_a":  # P of the tile just softmaxed is A of P V
            p_tile[r] = s_tile[r]
        else:  # the lanes' own work: softmax, rescale
            spans.append(Span(r, s.what, group, s_tile[r], now[r],
                              now[r] + costs[s.what]))
            now[r] += costs[s.what]
        pc[r] += 1
    return spans, handoffs


def v8_figure(spans, handoffs):
    """Chapter 12: v8_timeline's spans as bars, one row per unit, and its
    mbarrier handoffs as arrows at the moment a phase completed: "full"
    from the TMA copy that completed it to each consumer waiting on it,
    "empty" from the warpgroup whose arrival freed a stage to the
    producer."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    units = ["producer", "TMA", "tensor cores"] + sorted(
        {s.who for s in spans if str(s.who).startswith("warpgroup")})
    y_of = {u: len(units) - 1 - k for k, u in enumerate(units)}
    fig, ax = plt.subplots(figsize=(10, 4.2))
    colors = {("S", 0): "#4c72b0", ("PV", 0): "#8fa8d6",
              ("S", 1): "#c44e52", ("PV", 1): "#e39a9c",
              ("S", 2): "#8172b2", ("PV", 2): "#b8b0d8",
              "Q": "#dddd88", "K": "#e8b04c", "V": "#f3d49b",
              "softmax": "#55a868", "rescale": "#bbbbbb"}
    boxes = {}  # a tile's TMA boxes (one per 64 columns) as one bar
    for s in spans:
        if s.who == "TMA":
            a, b = boxes.get((s.what, s.tile), (s.start, s.end))
            boxes[s.what, s.tile] = (min(a, s.start), max(b, s.end))
    spans = [s for s in spans if s.who != "TMA"] + [
        Span("TMA", what, -1, tile, a, b)
        for (what, tile), (a, b) in boxes.items()]
    for s in spans:
        if s.who == "barrier":
            ax.axvline(s.start, color="black", ls=":", lw=1)
            continue
        y = y_of[s.who]
        if s.what == "wait":
            ax.barh(y, s.end - s.start, left=s.start, height=0.35,
                    color="white", edgecolor="#999999", hatch="///",
                    lw=0.5)
            continue
        color = colors.get((s.what, s.group % 3), colors.get(s.what))
        ax.barh(y, s.end - s.start, left=s.start, height=0.7, color=color,
                edgecolor="white")
        if s.what != "rescale" and s.end - s.start >= 0.4:
            label = f"{'P V' if s.what == 'PV' else s.what} {s.tile}"
            ax.text((s.start + s.end) / 2, y, label, ha="center",
                    va="center", fontsize=6.5)
    for h in handoffs:
        if h.source is None:  # a fresh barrier: nothing was handed over
            continue
        full = "full" in h.bar  # drawn when the phase completed
        ax.annotate("", xy=(h.ready, y_of[h.waiter]),
                    xytext=(h.ready, y_of[h.source]),
                    arrowprops=dict(arrowstyle="->", lw=0.7,
                                    color="#1f5fa8" if full else "#b22222",
                                    shrinkA=2, shrinkB=4))
    ax.legend(handles=[Patch(color=colors[k], label=label) for k, label in (
        (("S", 0), "S of warpgroup 0"), (("PV", 0), "P V of warpgroup 0"),
        (("S", 1), "S of warpgroup 1"), (("PV", 1), "P V of warpgroup 1"),
        ("softmax", "softmax"), ("K", "TMA copy of K"),
        ("V", "TMA copy of V"))]
        + [Patch(facecolor="white", edgecolor="#999999", hatch="///",
                 label="waiting on an mbarrier"),
           Patch(color="#1f5fa8", label="full: a tile landed"),
           Patch(color="#b22222", label="empty: a stage is free")],
        fontsize=7, ncol=5, loc="upper center",
        bbox_to_anchor=(0.5, -0.2))
    ax.set_yticks([y_of[u] for u in units], units)
    ax.set_xlabel("time, in units of one S_ij product (a model); dotted: "
                  "the block's one barrier")
    ax.set_xlim(0, max(s.end for s in spans))
    fig.tight_layout()
    return fig


# Chapter 9: one figure per forward version, each drawing the one idea
# that version adds, from the kernels' own layout constants.


class KernelCounts(NamedTuple):
    """What one block of a chapter 9 forward version does per K/V tile."""

    rows: int  # query rows per block (B_r)
    keys: int  # keys per tile (B_c; v1 takes one key at a time)
    threads: int  # threads per block
    hbm_reads: float  # HBM reads of each K/V element per query row
    loads_s: float  # memory loads per multiply-add of S = Q K^T
    loads_pv: float  # memory loads per multiply-add of P V
    softmax_threads: int  # threads busy with the tile's max, exp and sum
    exps: int  # exponentials per busy thread per tile (alphas included)


def kernel_counts(version, d=64, d_v=64):
    """KernelCounts of forward v1-v4 at head dims d, d_v (chapter 9).

    From each version's `shape` and `device.tiles`; the loads per
    multiply-add of v3 and v4 are those of `device.score_piece` and
    `device.output_piece` (the tests count them by running both).
    """
    from flashlab import gpu
    from flashlab.gpu import device

    rows, keys, threads = gpu.FORWARDS[version].shape(d, d_v)
    if version == 1:  # each thread its own row, each key from HBM
        return KernelCounts(rows, 1, threads, 1.0, 1.0, 1.0, threads, 2)
    once = 1 / rows  # K_j, V_j staged once per block of rows
    if version == 2:  # q and u in registers, K_j and V_j in SRAM
        return KernelCounts(rows, keys, threads, once, 1.0, 1.0, threads,
                            keys + 1)
    tl = device.tiles(d, d_v)
    loads_s = (tl.RM + tl.CN) / (tl.RM * tl.CN)  # RM of Q, CN of K
    loads_pv = (tl.RM + tl.OC) / (tl.RM * tl.OC)  # RM of P, OC of V
    if version == 3:  # one thread per row runs the row's softmax
        return KernelCounts(rows, keys, threads, once, loads_s, loads_pv,
                            tl.BR, tl.BC + 1)
    return KernelCounts(rows, keys, threads, once, loads_s, loads_pv,
                        threads, tl.RM * tl.CN + tl.RM)


def _bars(ax, title, pairs, now, log=False):
    """Horizontal bars of (label, value) pairs, values written on them;
    labels starting with `now` in colour, the version before in grey."""
    labels = [label for label, _ in pairs][::-1]  # first pair on top
    values = [value for _, value in pairs][::-1]
    ax.barh(labels, values, color=["C0" if label.startswith(now) else "0.6"
                                   for label in labels])
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.3g}", va="center", fontsize=8)
    if log:
        ax.set_xscale("log")
    ax.set_xlim(right=max(values) * (8 if log else 1.35))
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=8)


def _owner_map(ax, owner, title, xlabel, ylabel, label_every=None):
    """An image of which thread owns each cell (tab20 colours by id)."""
    import matplotlib.pyplot as plt

    shown = np.ma.masked_less(owner, 0)  # -1: no thread (drawn white)
    ax.imshow(shown % 20, cmap=plt.cm.tab20, vmin=0, vmax=19,
              interpolation="nearest", aspect="auto")
    for t in label_every or ():  # at the thread's first cell
        r, c = np.argwhere(owner == t)[0]
        ax.text(c, r, str(t), fontsize=6, va="top", ha="left")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def score_owners(version, d=64, d_v=64):
    """(B_r, B_c) thread that computes each score of a tile (v2-v4)."""
    rows, keys = kernel_counts(version, d, d_v)[:2]
    if version == 2:  # thread t: the whole row t
        return np.repeat(np.arange(rows)[:, None], keys, 1)
    from flashlab.gpu import device

    tl = device.tiles(d, d_v)
    r, c = np.indices((tl.BR, tl.BC))
    return (r // tl.RM) * tl.TX + c // tl.CN  # t = ty TX + tx


def output_owners(d=64, d_v=64):
    """(B_r, d_v) thread that accumulates each output element (v3, v4)."""
    from flashlab.gpu import device

    tl = device.tiles(d, d_v)
    r, c = np.indices((tl.BR, d_v))
    return (r // tl.RM) * tl.TX + c % tl.TX  # columns tx, tx + TX, ...


def softmax_owners(version, d=64, d_v=64):
    """(B_r, B_c) thread that exponentiates each score (v3, v4)."""
    if version == 4:  # every thread its own piece
        return score_owners(4, d, d_v)
    rows, keys = kernel_counts(3, d, d_v)[:2]
    return np.repeat(np.arange(rows)[:, None], keys, 1)  # thread r: row r


def stage_owners(rows, cols, threads):
    """(rows, cols) thread that copies each element in `device.stage`."""
    return np.arange(rows * cols).reshape(rows, cols) % threads


def kernel_version(version, d=64, d_v=64):
    """Chapter 9: the idea of forward v<version> as a figure.

    v1: a thread per query row, every thread reading every key from HBM;
    v2: a K/V tile staged into SRAM once per block; v3: each thread an
    RM x CN piece of S and RM rows of O; v4: the softmax on every
    thread's own piece. The right panel compares the counts the version
    changes with the version before (`kernel_counts`).
    """
    import matplotlib.pyplot as plt

    now = kernel_counts(version, d, d_v)
    before = kernel_counts(version - 1, d, d_v) if version > 1 else None
    ratios = [3, 2] if version in (1, 2) else [2, 2, 2]
    fig, axes = plt.subplots(1, len(ratios), figsize=(10, 3.4),
                             gridspec_kw={"width_ratios": ratios})
    v, w = f"v{version}", f"v{version - 1}"
    if version == 1:
        shown = 32  # the first 32 of the block's rows and keys
        owner = np.repeat(np.arange(shown)[:, None], shown, 1)
        _owner_map(axes[0], owner, f"{now.threads} threads: thread i "
                   "owns query row i;\nevery (row, key) cell is a read "
                   "of k_j, v_j from HBM", "key j (first 32)",
                   "query row = thread (first 32)")
        _bars(axes[1], "what thread i keeps in registers (floats)",
              [(f"{v}: q_i", d), (f"{v}: u_i", d_v), (f"{v}: m_i, l_i", 2)],
              v)
    elif version == 2:
        owner = stage_owners(now.keys, d, now.threads)
        _owner_map(axes[0], owner, f"K_j in SRAM ({now.keys} keys x {d}):"
                   f" element (j, x) copied by\nthread (j {d} + x) mod "
                   f"{now.threads}, consecutive threads on consecutive "
                   "x", "x (head dimension)", "key in tile",
                   label_every={0, 1, now.threads - 1})
        _bars(axes[1], "HBM reads of each K/V element per query row\n"
              "(log scale)", [(w, before.hbm_reads),
                              (v, now.hbm_reads)], v, log=True)
    elif version == 3:
        from flashlab.gpu import device

        tiles = device.tiles(d, d_v)
        _owner_map(axes[0], score_owners(3, d, d_v),
                   f"S_ij ({now.rows} x {now.keys}): thread t computes a "
                   "piece", "key in tile", "query row in block",
                   label_every={0, 1, 8, 127})
        _owner_map(axes[1], output_owners(d, d_v),
                   f"O_i ({now.rows} x {d_v}): the same thread's rows, "
                   f"every\n{tiles.TX}th column (strided)", "output column",
                   "",
                   label_every={0, 1})
        _bars(axes[2], "SRAM loads per multiply-add",
              [(f"{w}, S", before.loads_s), (f"{v}, S", now.loads_s),
               (f"{w}, PV", before.loads_pv), (f"{v}, PV", now.loads_pv)],
              v)
    else:
        for ax, ver in zip(axes[:2], (3, 4)):
            owner = softmax_owners(ver, d, d_v)
            busy = len(np.unique(owner))
            _owner_map(ax, owner, f"v{ver}: who exponentiates S_ij\n"
                       f"({busy} of {now.threads} threads busy)",
                       "key in tile", "query row in block" if ver == 3
                       else "", label_every={0, 1, 8, busy - 1})
        _bars(axes[2], "softmax of one tile",
              [(f"{w}: busy threads", before.softmax_threads),
               (f"{v}: busy threads", now.softmax_threads),
               (f"{w}: exps per thread", before.exps),
               (f"{v}: exps per thread", now.exps)], v)
    fig.tight_layout()
    return fig
