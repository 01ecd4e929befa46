"""Figure-style charts of a bench run (matplotlib, written to a PNG).

Rows, one column per source: (1) speedup over Llama3 CP per setting, like the paper's Figure 5; (2) the
latency breakdown at the largest CP size and head count, like Figure 6; (3) plan quality (imbalance and
all-gather comm saving per strategy). The last column holds the legends and speedup against context
length, like Figure 7.
Titles say whether latency is projected or measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flashcp import __version__
from flashcp.outputs import PNG_SOFTWARE, png_plot, write_output

__all__ = ["BENCH_PLOT", "write_plots"]

BENCH_PLOT = png_plot("a PNG plot that flashcp bench drew")
"""``flashcp bench --plot FILE``: recognised by its ``Software`` text chunk."""

BREAKDOWN = (("attn_fwd", "attention fwd"), ("attn_bwd", "attention bwd"), ("comm", "comm (exposed)"),
             ("other", "other"))


def _figure5(ax, settings: list[dict], source: str) -> None:
    mine = [s for s in settings if s["source"] == source]
    labels = list(mine[0]["systems"])
    width = 0.8 / len(labels)
    x = np.arange(len(mine))
    for i, label in enumerate(labels):
        values = [s["systems"][label]["speedup"] for s in mine]
        ax.bar(x + (i - (len(labels) - 1) / 2) * width, values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(x, [f"cp{s['cp']}\nH={s['num_heads']}" for s in mine])
    ax.set_ylabel("speedup over Llama3 CP")
    ax.set_title(f"{source}: step latency (Fig. 5 style)")


def _figure6(ax, settings: list[dict], source: str) -> None:
    cp, heads = max(s["cp"] for s in settings), max(s["num_heads"] for s in settings)
    setting = next((s for s in settings
                    if s["source"] == source and s["cp"] == cp and s["num_heads"] == heads), None)
    if setting is None:
        ax.set_axis_off()
        return
    labels = list(setting["systems"])
    bottom = np.zeros(len(labels))
    for key, name in BREAKDOWN:
        values = np.array([setting["systems"][label]["breakdown_ms"][key] for label in labels])
        ax.bar(np.arange(len(labels)), values, 0.6, bottom=bottom, label=name)
        bottom += values
    ax.set_xticks(np.arange(len(labels)), [_short(label) for label in labels], rotation=30, ha="right")
    ax.set_ylabel("ms per layer (fwd + bwd)")
    ax.set_title(f"{source} cp{cp} H={heads}: breakdown (Fig. 6 style)")


def _quality(ax, quality: dict, source: str) -> None:
    cp = max(r["cp"] for r in quality["rows"])
    rows = [r for r in quality["rows"] if r["source"] == source and r["cp"] == cp]
    if not rows:
        ax.set_axis_off()
        return
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["imbalance_mean"] for r in rows], 0.4, label="imbalance (mean)")
    ax.set_ylabel("imbalance ratio")
    twin = ax.twinx()
    twin.bar(x + 0.2, [100 * r["ag_saving_mean"] for r in rows], 0.4, color="tab:green",
             label="all-gather comm saving (Eq. 5)")
    twin.set_ylabel("comm saving vs full-KV all-gather (%)")
    ax.set_xticks(x, [r["strategy"] for r in rows], rotation=30, ha="right")
    ax.set_title(f"{source} cp{rows[0]['cp']}: plan quality")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=7, loc="upper right")


def _figure7(ax, sweep: dict) -> None:
    points = sweep["points"]
    for label in points[0]["speedup"]:
        ax.plot([p["context_len"] // 1024 for p in points], [p["speedup"][label] for p in points], marker="o",
                label=_short(label))
    ax.set_xlabel("context length (K tokens)")
    ax.set_ylabel("speedup over Llama3 CP")
    ax.set_title(f"{sweep['source']} cp{sweep['cp']} H={sweep['num_heads']}: vs context (Fig. 7 style)")
    ax.legend(fontsize=7)


def _short(label: str) -> str:
    return label.replace(" + auto comm + overlap (ours)", "\n+a2a/overlap (ours)")


def write_plots(results: dict, path: str | Path) -> None:
    """Draw the charts of ``results`` (a ``run_bench`` dict with a latency scenario) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latency, quality = results.get("latency"), results.get("quality")
    if not latency:
        raise ValueError("the plot needs the latency scenario")
    sources = list(dict.fromkeys(s["source"] for s in latency["settings"]))
    rows = 3
    cols = max(len(sources), 1) + 1
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for j, source in enumerate(sources):
        _figure5(axes[0, j], latency["settings"], source)
        _figure6(axes[1, j], latency["settings"], source)
        if quality is not None:
            _quality(axes[2, j], quality, source)
        else:
            axes[2, j].set_axis_off()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, -1].legend(handles, labels, loc="center", fontsize=8, title="systems")
    axes[0, -1].set_axis_off()
    handles, labels = axes[1, 0].get_legend_handles_labels()
    axes[1, -1].legend(handles, labels, loc="center", fontsize=8, title="breakdown")
    axes[1, -1].set_axis_off()
    if latency["sweep"]["points"]:
        _figure7(axes[2, -1], latency["sweep"])
    else:
        axes[2, -1].set_axis_off()
    kind = "MEASURED attention, projected comm" if latency["measured"] else "PROJECTED"
    fig.suptitle(f"flashcp bench, {kind}: {latency['profile']}", fontsize=11)
    fig.tight_layout()
    try:
        write_output(path, BENCH_PLOT, lambda tmp: fig.savefig(
            tmp, format="png", dpi=110, metadata={"Software": f"{PNG_SOFTWARE} {__version__} bench"}))
    finally:
        plt.close(fig)
