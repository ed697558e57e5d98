"""The peer section's PNG plots (matplotlib, the `bench` extra), written to docs/img/.

Each function takes the figures measured (medians over rounds; ``None`` where a side was not
measured) and writes one PNG; matplotlib is imported when called, with the Agg backend, so
the bench runs on a machine with no display and a missing matplotlib is a skip reason.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _points(xs: list[int], ys: list[float | None]) -> tuple[list[int], list[float]]:
    kept = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def plot_decode_by_concurrency(levels: list[int], series: dict[str, list[float | None]],
                               path: Path, title: str) -> Path:
    """Aggregate decode tok/s by number of concurrent streams, one line per side."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for (name, ys), marker in zip(series.items(), "osD^v"):
        xs, vs = _points(levels, ys)
        ax.plot(xs, vs, marker=marker, label=name, linestyle="-" if len(xs) > 1 else "none")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(level) for level in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_ttft_by_prompt(lengths: list[int], series: dict[str, list[float | None]], path: Path,
                        title: str) -> Path:
    """TTFT (ms, log scale) by prompt length, a line per side and outcome (miss / hit)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, ys in series.items():
        xs, vs = _points(lengths, ys)
        ax.plot(xs, vs, marker="o" if "miss" in name else "s",
                linestyle="-" if "daemon" in name else "--", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_prefill_by_prompt(lengths: list[int], series: dict[str, list[float | None]], path: Path,
                           title: str) -> Path:
    """Prefill tokens/s (a miss: prompt tokens over time to the first token) by prompt
    length, a line per side; a side measured at one length is a lone marker."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for (name, ys), marker in zip(series.items(), "osD^vP"):
        xs, vs = _points(lengths, ys)
        ax.plot(xs, vs, marker=marker, label=name,
                linestyle="none" if len(xs) < 2 else ("-" if "daemon" in name else "--"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
