"""Which `--help` panel each option of each command belongs to: one table, so the panels read as
the map of a request (what to run on, which weights, what to look at, what to write, how much
work is allowed) and every command groups the same thing the same way.

A parameter the table does not name stays in Typer's default panel, and
tests/test_cli_help.py fails on it: a new option is placed here when it is added.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

ARGUMENTS = "Arguments"  # Typer's own first panel: positional arguments stay there
INPUT = "Input"
GENERATION = "Generation"
SOURCE = "Source"
RANDOM = "Source: a random layer"
CHECKPOINT_LAYER = "Source: a layer's heads and inputs"
HF_MODEL = "Source: a Hugging Face model"
SELECTION = "Selection"
OUTPUTS = "Outputs"
LIMITS = "Limits"
PROOF = "Proof"
MEASURES = "What to measure"
RESUME = "Resume"
HELP = "Help"  # --help closes the list instead of standing between the arguments and the rest
PANEL_ORDER = (ARGUMENTS, INPUT, GENERATION, SOURCE, RANDOM, CHECKPOINT_LAYER, HF_MODEL,
               SELECTION, MEASURES, OUTPUTS, PROOF, LIMITS, RESUME, HELP)

# (command, parameter name) → panel; a parameter shared by several commands is named once per
# command, since what it means may differ (split's --layer selects a layer of a checkpoint).
_SHARED_SOURCE = {
    **{name: SOURCE for name in ("weights", "model", "random", "device")},
    **{name: RANDOM for name in ("embed_dim", "kdim", "vdim", "seed", "bias")},
    **{name: CHECKPOINT_LAYER for name in ("num_heads", "num_kv_heads", "head_dim", "causal",
                                           "positions", "spec")},
    **{name: HF_MODEL for name in ("dtype", "device_map", "max_memory")},
}
PANELS: dict[str, dict[str, str]] = {
    "heatmap": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("file", "probe", "target")},
        **_SHARED_SOURCE,
        **{name: SELECTION for name in ("layer", "head", "query")},
        "weighting": MEASURES,
        **{name: OUTPUTS for name in ("out", "export", "html", "as_json", "stats", "maps",
                                      "overview", "rank", "quiet", "scale", "figure")},
        "budget": LIMITS,
    },
    "generate": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("file", "probe")},
        **{name: SOURCE for name in ("model", "device")},
        "dtype": HF_MODEL,
        **{name: GENERATION for name in ("max_new_tokens", "sample", "temperature", "top_p",
                                         "seed")},
        **{name: SELECTION for name in ("layer", "head")},
        **{name: OUTPUTS for name in ("out", "export", "html", "as_json", "stats", "maps",
                                      "overview", "rank", "quiet", "scale", "figure")},
        "budget": LIMITS,
    },
    "ablate": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("file", "probe")},
        **_SHARED_SOURCE,
        **{name: SELECTION for name in ("layer", "head")},
        "mode": MEASURES,
        **{name: OUTPUTS for name in ("out", "as_json", "stats", "maps", "overview", "rank",
                                      "quiet", "figure")},
        "budget": LIMITS,
    },
    "split": {
        **_SHARED_SOURCE,
        "layer": SELECTION,
        **{name: OUTPUTS for name in ("out", "png", "as_json")},
        "verify": PROOF,
    },
    "circuits": {
        **_SHARED_SOURCE,
        "layer": SELECTION,
        "composition": MEASURES,
        **{name: OUTPUTS for name in ("out", "as_json")},
    },
    "tokens": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("file", "target")},
        **{name: SOURCE for name in ("model", "device")},
        "dtype": HF_MODEL,
        "position": SELECTION,
        **{name: MEASURES for name in ("method", "heads", "residual_weight", "check", "erase",
                                       "baseline")},
        **{name: OUTPUTS for name in ("out", "html", "export", "as_json", "dpi")},
        **{name: LIMITS for name in ("max_tokens", "max_sentences", "memory_budget")},
    },
    "corpus": {
        "corpus": ARGUMENTS,
        **{name: INPUT for name in ("field", "limit", "sample", "seed", "long")},
        **{name: SOURCE for name in ("model", "device")},
        **{name: HF_MODEL for name in ("dtype", "device_map", "max_memory")},
        **{name: MEASURES for name in ("weighting", "resamples")},
        **{name: OUTPUTS for name in ("overview", "out", "as_json", "csv", "html")},
        **{name: LIMITS for name in ("max_tokens", "memory_budget")},
        **{name: RESUME for name in ("state", "resume", "save_every")},
    },
    "compare": {
        "corpus": ARGUMENTS,
        **{name: SOURCE for name in ("model", "against", "weights", "device")},
        **{name: CHECKPOINT_LAYER for name in ("num_heads", "spec")},
        "dtype": HF_MODEL,
        **{name: INPUT for name in ("field", "limit", "sample", "seed", "long")},
        "weighting": MEASURES,
        **{name: OUTPUTS for name in ("overview", "out", "as_json", "csv", "html")},
        **{name: LIMITS for name in ("max_tokens", "memory_budget")},
    },
    "attribute": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("answer", "wrong", "corrupt", "pairs", "target")},
        **{name: SOURCE for name in ("model", "device")},
        "dtype": HF_MODEL,
        **{name: SELECTION for name in ("position", "top")},
        **{name: OUTPUTS for name in ("out", "export", "html", "as_json")},
    },
    "lens": {
        "sentences": ARGUMENTS,
        **{name: INPUT for name in ("answer", "target")},
        **{name: SOURCE for name in ("model", "device")},
        "dtype": HF_MODEL,
        **{name: SELECTION for name in ("position", "top")},
        **{name: OUTPUTS for name in ("out", "export", "html", "as_json")},
    },
    "patch": {
        "clean": ARGUMENTS,
        **{name: INPUT for name in ("corrupt", "answer", "wrong", "pairs", "target")},
        **{name: SOURCE for name in ("model", "device")},
        "dtype": HF_MODEL,
        **{name: MEASURES for name in ("metric", "direction", "site", "per_position",
                                       "receivers", "receiver_input")},
        **{name: OUTPUTS for name in ("out", "export", "html", "as_json")},
        "memory_budget": LIMITS,
    },
    "inspect": {
        "checkpoint": ARGUMENTS,
        **{name: CHECKPOINT_LAYER for name in ("num_heads", "spec")},
        "layer": SELECTION,
        **{name: OUTPUTS for name in ("scan", "as_json")},
    },
}


def unplaced(command_name: str, command: Any) -> list[str]:
    """The visible parameters of a built click command that no panel claims."""
    table = PANELS.get(command_name, {})
    return [param.name for param in command.params
            if not getattr(param, "hidden", False) and param.name not in table
            and param.name != "help"]


def assign_panels(command_name: str, command: Any) -> None:
    """Set `rich_help_panel` on a built command's parameters from the table (Typer reads it
    when it draws `--help`)."""
    table = PANELS.get(command_name, {})
    for param in command.params:
        panel = table.get(param.name or "")
        if panel is not None and panel != ARGUMENTS:
            param.rich_help_panel = panel
    # --help draws panels in the order their first option appears: order the options by panel
    # (a stable sort; positional arguments keep their places and their order).
    options = sorted((p for p in command.params if p.param_type_name != "argument"),
                     key=lambda p: PANEL_ORDER.index(table.get(p.name or "", HELP)))
    it = iter(options)
    command.params = [p if p.param_type_name == "argument" else next(it)
                      for p in command.params]


class PanelledCommand(TyperCommand):
    """A Typer command whose --help option sits in the last panel."""

    # Typer vendors click in newer releases and re-exports it in older ones: the types stay open.
    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.rich_help_panel = HELP
        return option
