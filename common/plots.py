"""Attention heatmaps for `rosetta parity --plot DIR`: one PNG per attention kind, with the oracle
and every framework side by side on one colour scale, and under each framework its difference
from the oracle on a scale of its own (printed on the colour bar)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.parity import ParityReport

KINDS = {
    "encoder.layers.{}.self_attention": ("encoder self-attention", "source", "source"),
    "decoder.layers.{}.self_attention": ("decoder self-attention", "target", "target"),
    "decoder.layers.{}.cross_attention": ("cross-attention", "target (query)", "source (key)"),
}


def plot_attention(
    report: ParityReport, folder: str | Path, layer: int, head: int, row: int
) -> list[Path]:
    """Write one PNG per attention kind for (layer, head) of batch row `row`; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    oracle = report.oracle
    src_tokens = [str(t) for t in report.src[row]]
    tgt_tokens = [str(t) for t in report.tgt_in[row]]
    written = []
    for pattern, (title, ylabel, xlabel) in KINDS.items():
        key = pattern.format(layer)
        if key not in oracle:
            continue
        want = oracle[key][row, head]
        maps = [("oracle (numpy float64)", want)] + [
            (f"{r.label} ({r.version})", r.outputs[key][row, head]) for r in report.runs
        ]
        n = len(maps)
        fig, axes = plt.subplots(
            2, n, figsize=(3.3 * n + 1.2, 6.6), squeeze=False, layout="constrained"
        )
        yt = tgt_tokens if ylabel.startswith("target") else src_tokens
        xt = src_tokens if xlabel.startswith("source") else tgt_tokens
        for i, (label, probs) in enumerate(maps):
            ax = axes[0, i]
            im = ax.imshow(probs, vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_title(label, fontsize=9)
            _ticks(ax, xt, yt)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            diff_ax = axes[1, i]
            if i == 0:
                diff_ax.axis("off")
                diff_ax.text(
                    0.5,
                    0.5,
                    "row below: |framework - oracle|\n(each on its own scale)\n\n"
                    f"{report.dtype}, layer {layer}, head {head}, batch row {row}\n"
                    "masked keys are exactly 0 in every map",
                    ha="center",
                    va="center",
                    fontsize=9,
                    transform=diff_ax.transAxes,
                )
                continue
            diff = np.abs(np.asarray(probs, np.float64) - want)
            top = float(diff.max()) or 1e-300
            dim = diff_ax.imshow(diff, vmin=0.0, vmax=top, cmap="magma")
            diff_ax.set_title(f"max |diff| = {diff.max():.2e}", fontsize=9)
            _ticks(diff_ax, xt, yt)
            fig.colorbar(dim, ax=diff_ax, fraction=0.046, format="%.1e")
        fig.colorbar(im, ax=axes[0, :].tolist(), fraction=0.03, label="probability")
        fig.suptitle(f"{title}, layer {layer}, head {head}: every framework against the oracle")
        path = folder / f"{key.replace('.', '_')}_head{head}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _ticks(ax: object, xt: list[str], yt: list[str]) -> None:
    ax.set_xticks(range(len(xt)), xt, fontsize=7)
    ax.set_yticks(range(len(yt)), yt, fontsize=7)
