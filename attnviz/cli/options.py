"""Options shared by several commands, declared once (same flags, defaults and help everywhere),
and the consoles the commands print to."""

from __future__ import annotations

from typing import Annotated, Any

import typer
import typer.core


def _hide_flag_types() -> None:
    """--help shows a type beside each option (<path>, <int>); for an on/off flag `<bool>` only
    suggests it takes a value, so flags show none (typer has no setting for this)."""
    option = typer.core.TyperOption
    shown = option.display_type_rich

    def display_type_rich(self: typer.core.TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


_hide_flag_types()

NumHeads = Annotated[int | None, typer.Option("--num-heads", "-H", help=(
    "Query heads (default 8 for random init; for checkpoints, overrides config/metadata)."))]
NumKvHeads = Annotated[int | None, typer.Option("--num-kv-heads", help=(
    "Key/value heads, for grouped-query layers (default: from the config, else = H)."))]
HeadDim = Annotated[int | None, typer.Option("--head-dim", help=(
    "Head dimension d, for layouts where H·d ≠ E (default: from the config, else rows / H)."))]
Model = Annotated[str | None, typer.Option("--model", "-m", help=(
    "A Hugging Face model folder or a hub id in the local cache (needs attnviz\\[hf])."))]
EmbedDim = Annotated[int | None, typer.Option("--embed-dim", "-E", help=(
    "Random init: embed_dim E (default 64)."))]
KDim = Annotated[int | None, typer.Option("--kdim", help=(
    "Random init: key input width (default E)."))]
VDim = Annotated[int | None, typer.Option("--vdim", help=(
    "Random init: value input width (default E)."))]
Seed = Annotated[int | None, typer.Option("--seed", help=(
    "Seed of the random init and of split's proof batch (default 0)."))]
Json = Annotated[bool, typer.Option("--json", help=(
    "Print one JSON document instead of tables."))]


def console() -> Any:
    """stdout, with no highlighting of numbers or paths and no soft wrapping."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def plain(text: str) -> Any:
    """A rich Text holding `text` as it is: markup in tokens or paths is never parsed."""
    from rich.text import Text

    return Text(text)
