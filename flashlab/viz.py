"""Step-through figures that work in the static book, with no kernel.

Each function runs flashlab's own computation, keeps its trace, and turns
every step into one frame of a matplotlib animation rendered as HTML with
First / Previous / Next / Play buttons (`to_jshtml`): the frames are the
computation's states, never a separate drawing of it.

- `online_steps`: the running (m, l, a) of one query as chunks arrive
  (`online.stream`, chapter 3);
- `merge_steps`: two block summaries and their merge (`merge`, chapter 4);
- `tile_walk`: the Q/K/V tile walk with each row's rescale factor
  (`tiled.trace`, chapter 5);
- `traffic_steps`: HBM traffic of the dense and tiled schedules, transfer
  by transfer (`io.ledger(record=True)`, chapter 6);
- `causal_map`: the tiles causal attention visits and skips (chapter 7).
"""

import numpy as np

from flashlab import io, merge, online, tiled


def animate(frames, draw, figsize=(8, 3.4)):
    """HTML of an animation: draw(fig, frame) for each frame in frames."""
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


def online_steps(scores, values, chunk):
    """Chapter 3: scores seen so far and the running (m, l, a) per chunk."""
    scores = np.asarray(scores, dtype=np.float64)
    states = online.stream(scores, values, chunk)
    frames = [(k, min((k + 1) * chunk, len(scores)), st)
              for k, st in enumerate(states)]

    def draw(fig, frame):
        k, seen, st = frame
        ax = fig.add_subplot(1, 1, 1)
        colors = ["C0" if j < seen else "0.85" for j in range(len(scores))]
        ax.bar(range(len(scores)), scores, color=colors)
        ax.axhline(st.m, color="C3", ls="--", label=f"m = {st.m:.3f}")
        ax.set_xlabel("key j (grey: not arrived yet)")
        ax.set_ylabel("score s_j")
        a = np.array2string(np.asarray(st.u), precision=3)
        ax.set_title(f"after chunk {k + 1}: l = {st.l:.3f}, a = {a}, "
                     f"a / l = {np.array2string(st.output(), precision=3)}")
        ax.legend(loc="upper left")

    return animate(frames, draw)


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

    def draw(fig, frame):
        name, st, keys = frame
        ax = fig.add_subplot(1, 1, 1)
        colors = ["C1" if j in keys else "0.85" for j in range(len(scores))]
        ax.bar(range(len(scores)), scores, color=colors)
        ax.axhline(st.m, color="C3", ls="--", label=f"m = {st.m:.4g}")
        ax.set_xlabel("key j")
        ax.set_ylabel("score s_j")
        ax.set_title(f"{name}: l = {st.l:.4f}, u = "
                     f"{np.array2string(np.asarray(st.u), precision=4)}")
        ax.legend(loc="upper left")

    return animate(frames, draw)


def tile_walk(q, k, v, **options):
    """Chapter 5: each visited tile, and the rescale factor of every row.

    options are those of tiled.trace (block_q, block_k, causal, ...).
    """
    tiles = tiled.trace(q, k, v, **options)
    nq, nk = np.shape(q)[-2], np.shape(k)[-2]

    def draw(fig, tile):
        ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
        grid = np.zeros((nq, nk))
        for t in tiles[:tiles.index(tile) + 1]:  # visited so far
            grid[t.rows.start:t.rows.stop, t.cols.start:t.cols.stop] = 1
        grid[tile.rows.start:tile.rows.stop,
             tile.cols.start:tile.cols.stop] = 2
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=2.5)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(f"tile ({tile.rows.start}:{tile.rows.stop}, "
                     f"{tile.cols.start}:{tile.cols.stop})")
        alpha = merge.rescale(tile.before.m, tile.after.m)  # per row
        rows = list(tile.rows)
        bx.barh(rows, np.ravel(alpha)[:len(rows)], color="C2")
        bx.set_xlim(0, 1.05)
        bx.set_ylim(nq - 0.5, -0.5)
        bx.set_xlabel("alpha = exp(m_old - m_new)")
        bx.set_title("rescale of the rows' state")

    return animate(tiles, draw)


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

    def draw(fig, upto):
        ax = fig.add_subplot(1, 1, 1)
        x = np.arange(len(tensors))
        for off, (name, book) in zip((-0.2, 0.2), runs.items()):
            got = totals(book, upto)
            done = min(upto, len(book.events))
            ax.bar(x + off, [got[t] for t in tensors], width=0.4,
                   label=f"{name}: {sum(got.values()):,} elements "
                   f"({done}/{len(book.events)} transfers)")
        ax.set_xticks(x, tensors)
        ax.set_ylim(0, top / 2)
        ax.set_ylabel("elements moved so far")
        ax.legend(loc="upper right", fontsize=8)

    return animate(list(cuts), draw)


def causal_map(nq, nk, *, block_q, block_k, causal=True, window=None):
    """Chapter 7: the tiles visited in loop order; skipped ones stay grey."""
    x = np.zeros((nq, 1))
    tiles = tiled.trace(x, np.zeros((nk, 1)), np.zeros((nk, 1)),
                        block_q=block_q, block_k=block_k, causal=causal,
                        window=window)
    all_tiles = -(-nq // block_q) * -(-nk // block_k)

    def draw(fig, upto):
        ax = fig.add_subplot(1, 1, 1)
        grid = np.zeros((nq, nk))
        for t in tiles[:upto]:
            grid[t.rows.start:t.rows.stop, t.cols.start:t.cols.stop] = 1
        ax.imshow(grid, cmap="Greens", vmin=0, vmax=1.3)
        for j in range(0, nk + 1, block_k):
            ax.axvline(j - 0.5, color="w", lw=1)
        for i in range(0, nq + 1, block_q):
            ax.axhline(i - 0.5, color="w", lw=1)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(f"{upto} of {len(tiles)} tiles visited; "
                     f"{all_tiles - len(tiles)} of {all_tiles} skipped")

    return animate(list(range(1, len(tiles) + 1)), draw, figsize=(5, 4.5))
