"""The `lens --out` figure: per prompt, the answer's probability per layer × position (rows:
the embeddings, then each layer; the last is the model's own output), each cell's top token
written in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.logit.lens_result import LensResult
from attnviz.render.figure_io import isolated, label, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_PROMPTS = 4
MAX_COLUMNS = 48  # the last positions drawn
MAX_TEXT_CELLS = 400


@isolated
def lens_figure(result: LensResult) -> Figure:
    import numpy as np

    prompts = result.prompts[:MAX_PROMPTS]
    width = min(MAX_COLUMNS, max(len(p.positions) for p in prompts))
    fig = new_figure(max(5.0, 0.7 * width + 2.0),
                     sum(0.35 * len(p.rows) + 1.2 for p in prompts) + 0.5)
    axes = fig.subplots(len(prompts), 1, squeeze=False)[:, 0]
    for ax, prompt in zip(axes, prompts, strict=True):
        columns = list(range(len(prompt.positions)))[-MAX_COLUMNS:]
        values = np.array([[row[c].answer_prob or 0.0 for c in columns]
                           for row in prompt.cells])  # (R, P)
        image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_yticks(range(len(prompt.rows)), prompt.rows, fontsize=7)
        ax.set_xticks(range(len(columns)),
                      [label(prompt.tokens[prompt.positions[c]], 12) for c in columns],
                      fontsize=7, rotation=60)
        answer = "" if prompt.answer is None else prompt.answer[1]
        ax.set_title(label(f"p({answer}) per layer × position: {prompt.prompt}", 90),
                     fontsize=8, parse_math=False)
        if values.size <= MAX_TEXT_CELLS:
            for r, row in enumerate(prompt.cells):
                for x, c in enumerate(columns):
                    ax.text(x, r, label(row[c].top[0][0], 8), ha="center", va="center",
                            fontsize=5, color="white" if values[r, x] < 0.5 else "black")
        fig.colorbar(image, ax=ax, fraction=0.03)
    fig.suptitle(label(f"logit lens of {result.model}; {result.norm}, each row's own "
                       "statistics", 110), fontsize=9)
    return fig
