"""Attention heatmaps for `rosetta parity --plot DIR`: one PNG per attention kind, with the oracle
and every framework side by side on one colour scale, and under each framework its difference
from the oracle on a scale of its own (printed on the colour bar)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer_rosetta.app.parity import ParityReport
from transformer_rosetta.files.outputs import atomic_write, make_folder
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.results import ATTENTION_OUTPUTS, attention_layers

if TYPE_CHECKING:
    from matplotlib.axes import Axes

KINDS = {
    "encoder.layers.{}.self_attention": ("encoder self-attention", "source", "source"),
    "decoder.layers.{}.self_attention": ("decoder self-attention", "target", "target"),
    "decoder.layers.{}.cross_attention": ("cross-attention", "target (query)", "source (key)"),
}


# What one PNG here may take on disk, for checking the free space before the work: they measure
# 30 to 300 KB at 110 dpi; 1 MiB each leaves room for long inputs and many heads.
PNG_BYTES_BOUND = 1 << 20


def attention_plot_names(config: TransformerConfig, layer: int, head: int) -> list[str]:
    """The file names plot_attention writes for (layer, head), so a caller can check them first:
    one per attention kind the model has at that layer (a decoder-only model has no encoder and
    no cross-attention, an encoder-only one only the encoder's)."""
    return [
        attention_plot_name(pattern.format(layer), head)
        for pattern, field, _ in ATTENTION_OUTPUTS
        if layer < attention_layers(config, field)
    ]


def attention_plot_name(key: str, head: int) -> str:
    return f"{key.replace('.', '_')}_head{head}.png"


def plot_attention(
    report: ParityReport, folder: str | Path, layer: int, head: int, row: int
) -> list[Path]:
    """Write one PNG per attention kind the model has, for (layer, head) of batch row `row`;
    return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    make_folder(folder, "--plot")
    oracle = report.oracle
    # A half of the family has one of the two inputs; only its maps are in the outputs.
    src_tokens = [] if report.src is None else [str(t) for t in report.src[row]]
    tgt_tokens = [] if report.tgt_in is None else [str(t) for t in report.tgt_in[row]]
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
        path = folder / attention_plot_name(key, head)
        atomic_write(path, functools.partial(fig.savefig, dpi=110, format="png"))
        plt.close(fig)
        written.append(path)
    return written


def _ticks(ax: Axes, xt: list[str], yt: list[str]) -> None:
    ax.set_xticks(range(len(xt)), xt, fontsize=7)
    ax.set_yticks(range(len(yt)), yt, fontsize=7)


def _pyplot():  # noqa: ANN202 - matplotlib's module; imported only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(losses: list[float], path: str | Path, title: str) -> Path:
    """The training loss per step (light) and its 50-step running mean (dark), one PNG, written
    through a temp file so that a failure leaves no partial PNG."""
    plt = _pyplot()
    steps = np.arange(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="per step")
    window = min(50, len(losses))
    if window > 1:
        mean = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], mean, color="tab:blue", label=f"{window}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("label-smoothed cross-entropy")
    ax.set_title(title, fontsize=10)
    ax.legend()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def plot_cross_attention(
    probs: np.ndarray, src_tokens: list[str], tgt_tokens: list[str], path: str | Path, title: str
) -> Path:
    """One cross-attention map per head, side by side: probs (h, T, S), rows are the decoder's
    input tokens (the query), columns the source tokens (the key)."""
    plt = _pyplot()
    heads = probs.shape[0]
    fig, axes = plt.subplots(
        1,
        heads,
        figsize=(1.2 + 0.45 * len(src_tokens) * heads + heads, 0.45 * len(tgt_tokens) + 1.6),
        squeeze=False,
        layout="constrained",
    )
    for i in range(heads):
        ax = axes[0, i]
        im = ax.imshow(probs[i], vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {i}", fontsize=9)
        _ticks(ax, src_tokens, tgt_tokens if i == 0 else [""] * len(tgt_tokens))
        ax.set_xlabel("source (key)", fontsize=8)
    axes[0, 0].set_ylabel("target so far (query)", fontsize=8)
    fig.colorbar(im, ax=axes[0, :].tolist(), fraction=0.03, label="probability")
    fig.suptitle(title, fontsize=10)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
