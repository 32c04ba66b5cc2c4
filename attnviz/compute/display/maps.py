"""Display-ready attention maps of a run: real tokens only, the selected heads (display views
and their downsampling: `attnviz.compute.display.views`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnviz.compute.display.views import MapView
from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    import torch

# A streamed layer keeps display views of its first heads only (a figure holds at most
# --max-panels, 256 by default, and the terminal fewer), so a layer of 40,000 heads keeps
# O(256 · B · c²), not O(H · B · c²); every head still enters the statistics and the mean.
MAX_VIEW_HEADS = 256


def check_head(head: int | None, num_heads: int) -> None:
    if head is not None and not 0 <= head < num_heads:
        raise UsageError(f"head {head} is out of range", fix=f"choose 0..{num_heads - 1}",
                         option="head")


def select_maps(run: AttentionRun, head: int | None, average: bool) -> list[MapView]:
    """One view per (sentence, layer, head) in that order; padding cut away."""
    import torch

    views = []
    for b in range(len(run.batch.tokens)):
        for captured in run.layers:
            if captured.weights is None:  # streamed: display-sized views were kept instead
                _check_kept(captured, head, average)
                kept = [] if captured.streamed is None else captured.streamed.views
                views += [v for v in kept if v.sentence == b and (
                    v.head is None if average else
                    v.head is not None and (head is None or v.head == head))]
                continue
            rows, cols = captured.rows_of(run.batch)[b], captured.columns_of(run.batch)[b]
            width = max(len(t) for t in captured.columns_of(run.batch))
            maps = captured.weights[b, :, :len(rows), :]  # (H, n, S)
            extra = maps.shape[-1] - width  # bias_k columns sit after the padding
            # real keys, then the bias_k columns: a view when there are none (no copy of H maps)
            maps = maps[:, :, :len(cols)] if extra == 0 else \
                torch.cat([maps[:, :, :len(cols)], maps[:, :, width:]], -1)
            col_labels = cols + ["<bias_k>"] * extra
            chosen: list[tuple[int | None, torch.Tensor]]
            if average:
                chosen = [(None, maps.mean(0))]
            elif head is not None:
                chosen = [(head, maps[head])]
            else:
                chosen = list(enumerate(maps))
            views += [MapView(b, captured.index, h, m.numpy(), list(rows), col_labels, False,
                              label=captured.stack_label()) for h, m in chosen]
    return views


def _check_kept(captured: LayerAttention, head: int | None, average: bool) -> None:
    """A streamed layer keeps display views of its first heads only (MAX_VIEW_HEADS)."""
    if head is not None and not average and head >= MAX_VIEW_HEADS:
        raise UsageError(f"a long input is streamed, and only the maps of heads "
                         f"0..{MAX_VIEW_HEADS - 1} are kept for display; head {head} is not",
                         fix=f"shorten the input, or pass {option('export')} FILE for every "
                             "full map",
                         option="head")
