"""`attnviz ablate` (the API's `ablate=`): the causal head scorecard of a heatmap run — which
shown heads matter to the output (attnviz.compute.measures.ablation_measures says what is measured),
beside the pattern statistics."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnviz.compute.measures.ablation_measures import AblationReport
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.sources.hf.layers import Plan
    from attnviz.sources.hf.load import LoadedModel


def ablate_standalone(run: AttentionRun, mode: str, head: int | None,
                      report: Callable[[str], None],
                      memory_budget: int | None = None) -> AblationReport:
    """The bundled model's or a standalone layer's scorecard of the run's shown heads, as many
    copies per forward as `memory_budget` holds (None: the default)."""
    import torch

    from attnviz.sources.head_ablation import ablate_run

    heads = []
    for captured in run.layers:
        if captured.layer is None:
            raise UsageError("the scorecard needs the layers' weights",
                             fix=f"drop {option('ablate')}")
        heads += [(captured.index, captured.label, captured.layer, h)
                  for h in range(captured.heads) if head is None or h == head]
    return ablate_run(run, heads, mode, torch.device(run.device), report, memory_budget)


def ablate_hf(loaded: LoadedModel, plan: Plan, run: AttentionRun, mode: str, head: int | None,
              report: Callable[[str], None]) -> AblationReport:
    """A Hugging Face model's scorecard of the run's shown heads (copies per forward within
    the plan's memory budget)."""
    from attnviz.sources.hf.ablation import ablate_model

    shown = plan.shown if plan.shown is not None else []
    by_index = {layer.index: layer for layer in shown}
    calls = [by_index[c.index] for c in run.layers if c.index in by_index]
    heads = [(c.index, c.label, h) for c in run.layers for h in range(c.heads)
             if head is None or h == head]
    return ablate_model(loaded, plan, calls, heads, mode, report)
