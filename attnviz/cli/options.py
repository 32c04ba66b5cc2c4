"""Options shared by several commands, declared once (same flags, defaults and help everywhere),
and the consoles the commands print to."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

from attnviz.core.request import MAX_SEED

if TYPE_CHECKING:
    from rich.text import Text

    from attnviz.core.choices import Choice
    from attnviz.render.safe import SafeConsole


def _hide_flag_types() -> None:
    """--help shows a type beside each option (<path>, <int>); for an on/off flag `<bool>` only
    suggests it takes a value, so flags show none (typer has no setting for this). Typer before
    display_type_rich already left a flag's BOOLEAN out of --help, so there is nothing to hide."""
    option = typer.core.TyperOption
    if not hasattr(option, "display_type_rich"):
        return
    shown = option.display_type_rich

    def display_type_rich(self: typer.core.TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


_hide_flag_types()

def path_arg(param: typer.CallbackParam, value: str | Path | None) -> str | Path | None:
    """Paths (and --model ids) no file system can hold are usage errors, before any use."""
    if value is not None:
        from attnviz.load.paths import check_path_text

        name = (param.opts or [param.name or "path"])[0]
        check_path_text(value, name if name.startswith("-") else name.upper())
    return value


def positive(param: typer.CallbackParam, value: int | None) -> int | None:
    """Counts and sizes given on the command line are positive: -H 0 is a mistake, not 'unset'."""
    if value is not None and value <= 0:
        from attnviz.errors import UsageError

        name = (param.opts or [param.name or "the value"])[0]
        field = param.name or name.lstrip("-").replace("-", "_")
        raise UsageError(f"{name} must be a positive integer, got {value}", option=field)
    return value


def choice_option(enum: type[Choice], *flags: str, **settings: Any) -> Any:
    """A Typer option taking one of `enum`'s values (attnviz.core.choices): --help lists them,
    and any other value is `Choice.parse`'s one usage error (`unknown --scale 'sqrt' — use
    max, fixed, log`), the text the Python API gives for its keyword, not click's own."""
    name = flags[0].lstrip("-").replace("-", "_")

    def parse(value: object) -> Choice:
        return enum.parse(value, name)

    return typer.Option(*flags, parser=parse, **settings)


NumHeads = Annotated[int | None, typer.Option("--num-heads", "-H", callback=positive, help=(
    "Query heads (default 8 for random init; for checkpoints, overrides config/metadata)."))]
NumKvHeads = Annotated[int | None, typer.Option("--num-kv-heads", callback=positive, help=(
    "Key/value heads, for grouped-query layers (default: from the config, else = H)."))]
HeadDim = Annotated[int | None, typer.Option("--head-dim", callback=positive, help=(
    "Head dimension d, for layouts where H·d ≠ E (default: from the config, else rows / H)."))]
Model = Annotated[str | None, typer.Option("--model", "-m", callback=path_arg, help=(
    "A Hugging Face model folder or a hub id in the local cache (needs attnviz\\[hf])."))]
EmbedDim = Annotated[int | None, typer.Option("--embed-dim", "-E", callback=positive, help=(
    "Width E, the embed_dim (default 64)."))]
KDim = Annotated[int | None, typer.Option("--kdim", callback=positive, help=(
    "Key input width (default E)."))]
VDim = Annotated[int | None, typer.Option("--vdim", callback=positive, help=(
    "Value input width (default E)."))]
Seed = Annotated[int | None, typer.Option("--seed", min=0, max=MAX_SEED, help=(
    "Seed of the random init (default 0)."))]
SplitSeed = Annotated[int | None, typer.Option("--seed", min=0, max=MAX_SEED, help=(
    "Seed of the random init and of the proof batch (default 0)."))]
Json = Annotated[bool, typer.Option("--json", help=(
    "Print one JSON document instead of tables."))]


# request fields whose flag is spelled otherwise (the request keeps the API's keywords,
# generate= and ablate=): the token count of `attnviz generate`; the scorecard is a command of its
# own, so the library's "drop ‹ablate›" (a model the scorecard cannot edit) reads as the command
FLAG_NAMES = {"generate": "--max-new-tokens", "ablate": "'attnviz ablate'"}


def flag_of(name: str) -> str:
    """The command-line flag of a request field the library's errors refer to (`max_tokens` →
    `--max-tokens`): every option of every command is named so, unless the running command
    spells it its own way (`heatmap`'s `--budget tokens=`, attnviz.cli.compound)."""
    from attnviz.cli.compound import spelled

    return spelled(name) or FLAG_NAMES.get(name) or "--" + name.replace("_", "-")


def with_flags(text: str) -> str:
    """Library text (a run's notes) with each neutral option reference (`‹max_tokens›`, see
    attnviz.errors.option) shown as its flag (`--max-tokens`), as errors are shown."""
    from attnviz.errors import with_options

    return with_options(text, flag_of)


def notes_with_flags(document: Any) -> Any:
    """A JSON document with every `notes` list's text `with_flags`, at any depth (the run's,
    the scorecard's, the generation's): --json shows flags where the terminal does."""
    if isinstance(document, dict):
        return {key: [with_flags(note) if isinstance(note, str) else note for note in value]
                if key == "notes" and isinstance(value, list) else notes_with_flags(value)
                for key, value in document.items()}
    if isinstance(document, list):
        return [notes_with_flags(value) for value in document]
    return document


def console() -> SafeConsole:
    """stdout through attnviz's safe console: no markup or emoji codes parsed in strings, and
    every control sequence a string from a file or the user could carry escaped."""
    from attnviz.render.safe import console as safe_console

    return safe_console(False)


def plain(text: str) -> Text:
    """A rich Text holding `text` as it is: markup in tokens or paths is never parsed and
    control characters are escaped."""
    from attnviz.render.safe import safe_text

    return safe_text(text)


def strict_json(doc: dict[str, Any]) -> str:
    """--json output: strict JSON (non-finite numbers become null and are listed), every note's
    option references shown as flags."""
    from attnviz.render.json_out import strict_json as dumps

    return dumps(notes_with_flags(doc))


def refuse_random_options(given: dict[str, Any], where: str, fix: str) -> None:
    """Random-init options (-E, --kdim, --vdim, --seed) given where they do not apply: one usage
    error naming every such flag."""
    from attnviz.errors import UsageError

    flags = [flag for flag, value in given.items() if value is not None]
    if flags:
        verb = "apply" if len(flags) > 1 else "applies"
        raise UsageError(f"{', '.join(flags)} {verb} to {where}", fix=fix)
