"""`attnviz corpus --out`: every statistic per head with its 95 % interval as error bars (heads
in layer order, layers marked), and the settle curve (share of heads whose type after the first
k examples is already their final type)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.corpus.corpus_sums import STATISTICS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.compute.corpus.corpus_result import CorpusResult


def corpus_figure(result: CorpusResult) -> Figure:
    from matplotlib.figure import Figure

    summary = result.summary
    panels = len(STATISTICS) + 1
    columns = 4
    rows = -(-panels // columns)
    fig = Figure(figsize=(4 * columns, 2.6 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    xs = list(range(len(summary.heads)))
    bounds = [i for i in range(1, len(summary.heads))
              if summary.heads[i].label != summary.heads[i - 1].label]
    for ax, name in zip(axes, STATISTICS, strict=False):
        means: list[float] = []
        kept: list[int] = []
        errors: list[list[float]] = [[], []]
        for x, head in zip(xs, summary.heads, strict=True):
            s = head.statistics[name]
            if s.mean is None:
                continue
            kept.append(x)
            means.append(s.mean)
            errors[0].append(0.0 if s.low is None else s.mean - s.low)
            errors[1].append(0.0 if s.high is None else s.high - s.mean)
        ax.errorbar(kept, means, yerr=errors, fmt="o", markersize=2, elinewidth=0.8)
        for b in bounds:
            ax.axvline(b - 0.5, color="0.85", linewidth=0.6)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
    ax = axes[len(STATISTICS)]
    curve = summary.settle_curve()
    ax.plot([k for k, _ in curve], [s for _, s in curve], marker="o", markersize=3)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_title("types settled (share of heads)", fontsize=9)
    ax.set_xlabel("examples", fontsize=8)
    ax.tick_params(labelsize=7)
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.suptitle(f"{result.source} over {summary.examples} examples: mean per head "
                 "(layer by layer) with 95% intervals over examples", fontsize=10)
    return fig
