"""The `tokens --out` figure: per sentence (the first SENTENCES_DRAWN), the methods side by side
as bars over the input tokens (each scaled to its own largest value, the erasure effect beside
them), then one layers × tokens panel per method: how much each token's representation entering
layer k reaches the output position (row 0: the inputs, the top row: the output itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.errors import elide_at_boundaries
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from attnviz.compute.tokenflow.token_result import TokensResult

SENTENCES_DRAWN = 3
LABELLED_TOKENS = 48  # token names along the x axis up to this many


@isolated
def tokens_figure(result: TokensResult, dpi: int = 100) -> Figure:
    import math

    sentences = result.sentences[:SENTENCES_DRAWN]
    columns = 1 + len(result.methods)
    width = max(len(s.tokens) for s in sentences)
    panel = min(6.0, max(3.0, 0.16 * width))
    fig = new_figure(panel * columns, 3.2 * len(sentences) + 0.6, dpi=dpi)
    axes = fig.subplots(len(sentences), columns, squeeze=False)
    for row, s in zip(axes, sentences, strict=True):
        L = len(s.tokens)
        names = [label(t, 10) for t in s.tokens] if L <= LABELLED_TOKENS else None
        bars = row[0]
        series = [(str(m), s.chains[m][0].tolist()) for m in result.methods]
        if s.effects is not None:
            series.append(("erasure", [v if math.isfinite(v) else 0.0
                                       for v in s.effects.tolist()]))
        step = 0.8 / len(series)
        for k, (name, values) in enumerate(series):
            top = max((abs(v) for v in values), default=0.0) or 1.0
            bars.bar([j - 0.4 + step * (k + 0.5) for j in range(L)], [v / top for v in values],
                     width=step, label=name)
        bars.set_title(label(f"output {s.output_name()}: each method / "
                             "its max", 60), fontsize=9, parse_math=False)
        bars.legend(fontsize=7)
        _ticks(bars, names, L)
        for ax, m in zip(row[1:], result.methods, strict=True):
            chain = s.chains[m].numpy()
            image = ax.imshow(chain, cmap="viridis", aspect="auto", origin="lower",
                              interpolation="nearest", vmin=0)
            rho = s.correlations.get(m)
            extra = "" if rho is None else f" (ρ {rho:+.2f})"
            if str(m) == "flow":
                extra += ", inputs only"
            ax.set_title(label(f"{m}{extra}: layers × tokens", 60), fontsize=9,
                         parse_math=False)
            ax.set_ylabel("entering layer (0: inputs)", fontsize=8)
            ax.set_yticks(range(chain.shape[0]))
            _ticks(ax, names, L)
            fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(label(elide_at_boundaries(f"which input tokens reach the output — "
                                           f"{result.source}", 200)), fontsize=11,
                 parse_math=False)
    return fig


def _ticks(ax: object, names: list[str] | None, length: int) -> None:
    if names is not None:
        ax.set_xticks(range(length), names, rotation=90, fontsize=7)  # type: ignore[attr-defined]
