"""`attnviz heatmap --json`: the run, its statistics and the --query breakdown as one document."""

from __future__ import annotations

from typing import Any


def run_json(run: Any, head_stats: list[Any], breakdown: Any) -> dict[str, Any]:
    from dataclasses import asdict

    doc: dict[str, Any] = {
        "source": run.source,
        "device": run.device,
        "causal": run.causal,
        "inputs": run.inputs_described,
        "sentences": run.batch.sentences,
        "tokens": run.batch.tokens,
        "layers": [{"index": c.index, "label": c.label, "kind": c.kind,
                    "name": c.name, "num_heads": c.heads, "method": c.method}
                   for c in run.layers],
        "head_stats": [s.to_json() for s in head_stats],
    }
    if run.target is not None:
        doc["targets"] = run.target.sentences
        doc["target_tokens"] = run.target.tokens
    if run.path is not None:
        doc["path"] = run.path
    if breakdown is not None:
        doc["query"] = asdict(breakdown)
    return doc
