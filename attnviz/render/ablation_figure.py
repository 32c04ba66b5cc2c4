"""The causal head scorecard as a figure: one layers × heads heatmap per measure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnviz.compute.measures.ablation_measures import CAUSAL_LOSS, AblationReport
from attnviz.compute.measures.stats import HeadStats
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLES = {"hidden_change": "hidden change ‖h′−h‖/‖h‖", "loss_change": "loss change",
          "repeat_loss_change": "loss change on repeated tokens"}


NAME_BYTES = 255  # the longest file name Linux and macOS file systems take


def figure_path(figure: Path) -> Path:
    """out.png → out.ablation.png, beside the maps' figure; the stem is shortened when a legal
    name of the maps' figure would otherwise give one too long for the file system."""
    stem, tail = figure.stem, f".ablation{figure.suffix}"
    while stem and len(os.fsencode(stem + tail)) > NAME_BYTES:
        stem = stem[:-1]
    return figure.with_name(stem + tail)


def _grid(report: AblationReport, field: str) -> tuple[np.ndarray, list[str], int]:
    labels = list(dict.fromkeys(e.label for e in report.effects))
    heads = 1 + max(e.head for e in report.effects)
    grid = np.full((len(labels), heads), np.nan)
    for e in report.effects:
        value = getattr(e, field)
        if value is not None and np.isfinite(value):  # undefined cells stay blank
            grid[labels.index(e.label), e.head] = value
    return grid, labels, heads


@isolated
def ablation_figure(report: AblationReport, stats: list[HeadStats] | None, title: str
                    ) -> Figure:
    """A panel per measure the report holds; each cell annotated with its value."""
    fields = [f for f in TITLES if any(getattr(e, f) is not None for e in report.effects)
              or (f == "loss_change" and f in report.undefined)]
    _, labels, heads = _grid(report, fields[0])
    fig = new_figure(1.2 + 0.9 * max(heads, 2) * len(fields), 1.4 + 0.5 * len(labels))
    titles = dict(TITLES)
    if report.loss_kind is not None and report.loss_kind != CAUSAL_LOSS:
        titles["loss_change"] = "KL of the outputs"
    for i, field in enumerate(fields):
        grid, _, _ = _grid(report, field)
        ax = fig.add_subplot(1, len(fields), i + 1)
        image = ax.imshow(grid, cmap="magma", aspect="auto")
        why = report.undefined.get(field) if np.isnan(grid).all() else None
        ax.set_title(titles[field] + (f"\nn/a: {why}" if why else ""), fontsize=9,
                     wrap=True)
        ax.set_xticks(range(heads))
        ax.set_yticks(range(len(labels)), [label(t, 16) for t in labels])
        ax.set_xlabel("head")
        if i == 0:
            ax.set_ylabel("layer")
        for (r, c), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if value < np.nanmax(grid) * 0.6 else "black")
        if why is None:  # no scale for a panel with no value
            fig.colorbar(image, ax=ax, shrink=0.8)
    mode = "zeroed" if report.mode == "zero" else "mean-replaced"
    fig.suptitle(label(f"{title} · heads removed ({mode})"), fontsize=10, parse_math=False)
    return fig
