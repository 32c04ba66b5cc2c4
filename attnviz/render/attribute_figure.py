"""The `attribute --out` figure: per prompt, the layers × heads grid of direct contributions
(diverging colours around 0, values written in), and a bar per layer part (embeddings, each
layer's attention and MLP, the final norm's and the unembedding's biases); with a corrupted
prompt, the clean − corrupted grid beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.logit.attribute_result import AttributeResult, Parts
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_PROMPTS = 4  # prompts drawn; --json has every one
MAX_TEXT_CELLS = 256  # values written into the grid up to this many cells


@isolated
def attribute_figure(result: AttributeResult) -> Figure:
    prompts = result.prompts[:MAX_PROMPTS]
    panels = [(p, p.parts, "direct contribution") for p in prompts]
    if any(p.difference is not None for p in prompts):
        panels = [(p, parts, what) for p in prompts for parts, what in
                  ((p.parts, "clean"), (p.difference, "clean − corrupted")) if parts is not None]
    fig = new_figure(9.0, 3.2 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 2, squeeze=False, width_ratios=[3, 2])
    for (prompt, parts, what), (grid_ax, bar_ax) in zip(panels, axes, strict=True):
        _grid(grid_ax, parts, f"{what}: {prompt.prompt}")
        _bars(bar_ax, parts)
    fig.suptitle(label(f"direct logit attribution: {result.metric}; {result.norm}, scale "
                       "frozen", 110), fontsize=9)
    return fig


def _grid(ax: Axes, parts: Parts, title: str) -> None:
    import numpy as np

    heads = parts.heads or [[v] for v in parts.attn]
    values = np.array(heads, dtype=float)  # (N, H)
    bound = float(np.abs(values).max()) or 1.0
    image = ax.imshow(values, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    ax.set_xlabel("head" if parts.heads is not None else "attention", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.set_title(label(title, 70), fontsize=8, parse_math=False)
    if values.size <= MAX_TEXT_CELLS:
        for (r, c), v in np.ndenumerate(values):
            ax.text(c, r, f"{v:+.2f}", ha="center", va="center", fontsize=6)
    ax.figure.colorbar(image, ax=ax, fraction=0.05)


def _bars(ax: Axes, parts: Parts) -> None:
    names = ["embed"]
    values = [parts.embed]
    for layer, value in enumerate(parts.attn):
        names.append(f"L{layer} attn")
        values.append(value)
        if parts.cross is not None:
            names.append(f"L{layer} cross")
            values.append(parts.cross[layer])
        if parts.mlp is not None:
            names.append(f"L{layer} MLP")
            values.append(parts.mlp[layer])
    names += ["norm b", "unembed b"]
    values += [parts.norm_bias, parts.head_bias]
    ax.barh(range(len(values)), values, color=["#c44" if v < 0 else "#48c" for v in values])
    ax.set_yticks(range(len(values)), [label(n, 20) for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.5)
    ax.set_title(label(f"sum {parts.total:+.3f}, model {parts.target:+.3f}", 50), fontsize=8,
                 parse_math=False)
