"""--weighting norm for any run: each layer's maps become the normalized rows of α_ij ·
‖W_O^h v_j‖ (attnviz.compute.measures.value_norms); the attention maps stay beside them for
--export."""

from __future__ import annotations

from dataclasses import replace

from attnviz.compute.forward_pass.results import AttentionRun, ValueWeighting
from attnviz.compute.measures.value_norms import norm_maps, normalized_rows
from attnviz.errors import CheckpointError, UsageError, option

NOTE = ("weighting norm: each cell is ‖α_ij · W_O^h (W_V x_j + b_V)‖, what head h writes from "
        "key j into query i's output; rows normalized to sum to 1; statistics, "
        f"{option('overview')} and {option('rank')} read these maps; {option('export')} holds "
        "the raw norms as norm.{layer}")


def weigh_run(run: AttentionRun) -> AttentionRun:
    """The run with every layer's maps replaced by its value-weighted maps."""
    from attnviz.compute.forward_pass.forward import load_weights
    from attnviz.compute.measures.value_norms import key_norms

    weighed = []
    for captured in run.layers:
        if captured.weights is None:
            raise UsageError(f"{option('weighting')} norm needs every head's full map, and this "
                             "input streams (its maps exceed the memory budget)",
                             fix=f"raise {option('memory_budget')}, or use shorter inputs",
                             option="weighting")
        norms = None if captured.weighting is None else captured.weighting.value_norms
        if norms is None:
            value_in = captured.value_inputs if captured.value_inputs is not None \
                else captured.inputs
            if captured.layer is None or run.store is None or value_in is None:
                raise CheckpointError(f"layer {captured.label}'s value inputs were not "
                                      "captured", fix="report this")
            weights = load_weights(captured.layer, run.store)
            norms = key_norms(captured.layer, weights, value_in.float()).cpu()
        weighed.append(replace(captured,
                               weights=normalized_rows(norm_maps(captured.weights, norms)),
                               weighting=ValueWeighting(norms, captured.weights)))
    return replace(run, layers=tuple(weighed), weighting="norm", notes=(*run.notes, NOTE))

