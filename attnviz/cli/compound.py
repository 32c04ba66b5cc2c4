"""Options that hold several settings as KEY=VALUE pairs (`--spec`, `--budget`, `--figure`) or
one of two kinds of value (`--head N|mean`, `--query TOKEN@SENTENCE`), so that `heatmap`,
`generate` and `ablate` stay near 30 options each; how those commands spell the request's fields
in their messages; and the old spellings each replaces, refused with one error line naming the
new one (`-E 32` → `--spec E=32`).

Each parser returns the request's keywords (`embed_dim`, `max_tokens`, ...), so what the
commands build from them, and what the Python API is given, is unchanged."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

from attnviz.core import choices
from attnviz.core.request import MAX_SEED
from attnviz.errors import UsageError

# --- the options --------------------------------------------------------------------------

Spec = Annotated[list[str] | None, typer.Option("--spec", metavar="KEY=VALUE,…", help=(
    "The single layer run on its own (--random, --weights), as KEY=VALUE pairs joined by "
    "commas. --random: E (its width, default 64), kdim, vdim (key and value input widths, "
    "default E), seed (of the random init, default 0). A checkpoint layer: kv (key/value "
    "heads, for grouped-query layers) and d (the head dimension, where H·d ≠ E), which win "
    "over config and metadata. Both: positions=sinusoidal adds position encodings to the "
    "inputs. Heads: -H."))]
LayerSpec = Annotated[list[str] | None, typer.Option("--spec", metavar="KEY=VALUE,…", help=(
    "The layer's sizes, as KEY=VALUE pairs joined by commas. Random init: E (its width, "
    "default 64), kdim, vdim (key and value input widths, default E), seed (default 0). A "
    "checkpoint layer: kv (key/value heads, for grouped-query layers) and d (the head "
    "dimension, where H·d ≠ E), which win over config and metadata. Heads: -H."))]
HeadSpec = Annotated[list[str] | None, typer.Option("--spec", metavar="KEY=VALUE,…", help=(
    "The layers' head geometry where the checkpoint does not say it, as KEY=VALUE pairs "
    "joined by commas: kv (key/value heads, for grouped-query layers), d (the head dimension, "
    "where H·d ≠ E); they win over config and metadata. Heads: -H."))]
Budget = Annotated[list[str] | None, typer.Option("--budget", metavar="KEY=VALUE,…", help=(
    "Bounds checked before any work, as KEY=VALUE pairs joined by commas: tokens (the longest "
    "sentence, default 256; attention costs O(L²) per head), sentences (in one batch, default "
    "64), panels (in one --out figure, default 256), memory (for attention maps, e.g. 512MB "
    "or 2GB, default 256MB: inputs whose full maps fit are computed whole, longer ones in "
    "blocks of query rows sized to fit it; with --model, the shown layers' own eager blocks "
    "take at most a quarter of it)."))]
Figure = Annotated[list[str] | None, typer.Option("--figure", metavar="KEY=VALUE,…", help=(
    "How --out draws its figure, as KEY=VALUE pairs joined by commas: size (the side of each "
    "heatmap panel in inches, 0.5 to 20; default: room for every token's label, 2.5 to 6, "
    "smaller in big grids), dpi (dots per inch of a .png, 20 to 1200, default 100)."))]
HeadOrMean = Annotated[str | None, typer.Option("--head", metavar="N|mean", help=(
    "Show only head N, or 'mean': the mean over heads."))]
QueryAt = Annotated[str | None, typer.Option("--query", "-q", metavar="TOKEN[@S]", help=(
    "Break one query token down head by head: its q_h, each key's k_h, scores, weights. "
    "TOKEN: an index or a word; @S picks sentence S (1-based, default 1)."))]


# --- KEY=VALUE pairs ----------------------------------------------------------------------

def _positive(flag: str, key: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) <= 0:
            raise UsageError(f"{flag} {key}= must be a positive integer, not {text!r}",
                             option=flag.lstrip("-"))
        return int(text)
    return parse


def _seed(text: str) -> int:
    if not text.strip().isdigit() or int(text) > MAX_SEED:
        raise UsageError(f"--spec seed= must be an integer 0..{MAX_SEED}, not {text!r}",
                         option="spec")
    return int(text)


def _number(flag: str, key: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise UsageError(f"{flag} {key}= must be a number, not {text!r}",
                             option=flag.lstrip("-")) from None
    return parse


def _positions(text: str) -> choices.Positions:
    return choices.Positions.parse(text, "positions")


@dataclass(frozen=True)
class Key:
    """One key of a compound option: the request keyword it sets, and how its text is read."""

    keyword: str
    read: Callable[[str], Any]


SPEC_KEYS = {"E": Key("embed_dim", _positive("--spec", "E")),
             "kdim": Key("kdim", _positive("--spec", "kdim")),
             "vdim": Key("vdim", _positive("--spec", "vdim")),
             "seed": Key("seed", _seed),
             "kv": Key("num_kv_heads", _positive("--spec", "kv")),
             "d": Key("head_dim", _positive("--spec", "d")),
             "positions": Key("positions", _positions)}
BUDGET_KEYS = {"tokens": Key("max_tokens", _positive("--budget", "tokens")),
              "sentences": Key("max_sentences", _positive("--budget", "sentences")),
              "panels": Key("max_panels", _positive("--budget", "panels")),
              "memory": Key("memory_budget", str)}  # a size, read where the request is built
FIGURE_KEYS = {"size": Key("size", _number("--figure", "size")),
               "dpi": Key("dpi", _positive("--figure", "dpi"))}


def key_values(flag: str, given: Iterable[str] | None, keys: dict[str, Key]) -> dict[str, Any]:
    """`KEY=VALUE` pairs, joined by commas or in repeated options, as request keywords; an
    unknown key, a pair without '=' or a key given twice is a usage error naming `flag`."""
    found: dict[str, Any] = {}
    named = ", ".join(keys)
    for text in given or ():
        for pair in text.split(","):
            key, equals, value = pair.strip().partition("=")
            key = key.strip()
            if not equals or not value.strip():
                raise UsageError(f"{flag} takes KEY=VALUE pairs, not {pair.strip()!r}",
                                 fix=f"use one of {named}, e.g. {flag} "
                                 f"{next(iter(keys))}=…", option=flag.lstrip("-"))
            if key not in keys:
                raise UsageError(f"unknown {flag} key {key!r}", fix=f"use {named}",
                                 option=flag.lstrip("-"))
            target = keys[key]
            if target.keyword in found:
                raise UsageError(f"{flag} {key}= is given twice", fix="give it once",
                                 option=flag.lstrip("-"))
            found[target.keyword] = target.read(value.strip())
    return found


def head_or_mean(text: str | None) -> dict[str, Any]:
    """--head N → head=N; --head mean → average=True."""
    if text is None:
        return {}
    if text.strip().lower() == "mean":
        return {"average": True}
    try:
        return {"head": int(text)}
    except ValueError:
        raise UsageError(f"--head takes a head number or 'mean', not {text!r}",
                         fix="e.g. --head 0, or --head mean", option="head") from None


def query_at(text: str | None) -> dict[str, Any]:
    """--query TOKEN@S → query=TOKEN, sentence=S; a TOKEN alone is sentence 1's. A token is a
    word or a punctuation mark, so '@' ends the token only before a sentence number."""
    if text is None:
        return {}
    token, at, number = text.rpartition("@")
    if at and token and number.isdigit():
        if int(number) < 1:
            raise UsageError(f"--query {text!r}: sentences are numbered from 1",
                             option="query")
        return {"query": token, "sentence": int(number)}
    return {"query": text}


# --- how the commands spell the request's fields in their messages -------------------------

# request field → what `heatmap`, `ablate` (and `generate`, where it has the field) call it
COMPOUND_FLAGS = {
    **{target.keyword: f"--spec {key}" for key, target in SPEC_KEYS.items()},
    **{target.keyword: f"--budget {key}" for key, target in BUDGET_KEYS.items()},
    **{target.keyword: f"--figure {key}" for key, target in FIGURE_KEYS.items()},
    "average": "--head mean", "sentence": "--query TOKEN@S",
}
GENERATE_FLAGS = {name: shown for name, shown in COMPOUND_FLAGS.items() if name != "seed"}
# `ablate`'s library messages say "drop ‹ablate›" where a model cannot be scored: in the command
# that is the scorecard, the way out is the maps alone
ABLATE_FLAGS = {**COMPOUND_FLAGS,
                "ablate": "'attnviz ablate' (run 'attnviz heatmap' for the maps alone)"}
# `split` and `circuits` take the layer's sizes as `--spec` (no positions: they run no inputs)
LAYER_SPEC_KEYS = {key: target for key, target in SPEC_KEYS.items() if key != "positions"}
LAYER_SPEC_FLAGS = {target.keyword: f"--spec {key}" for key, target in LAYER_SPEC_KEYS.items()}
# `inspect` and `compare` read checkpoints' layers as they are: --spec gives the head geometry
HEAD_SPEC_KEYS = {key: SPEC_KEYS[key] for key in ("kv", "d")}
HEAD_SPEC_FLAGS = {target.keyword: f"--spec {key}" for key, target in HEAD_SPEC_KEYS.items()}
COMMAND_FLAGS = {"heatmap": COMPOUND_FLAGS, "ablate": ABLATE_FLAGS, "generate": GENERATE_FLAGS,
                 "split": LAYER_SPEC_FLAGS, "circuits": LAYER_SPEC_FLAGS,
                 "inspect": HEAD_SPEC_FLAGS, "compare": HEAD_SPEC_FLAGS}

_spelled: ContextVar[dict[str, str] | None] = ContextVar("attnviz_spelled", default=None)


def command_of(argv: list[str]) -> str | None:
    """The command an argument list runs: its first word after the global options."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def spell_as(command: str | None, token: Token[dict[str, str] | None] | None = None
             ) -> Token[dict[str, str] | None]:
    """Set the running command, whose own spellings of request fields (`--budget tokens` for
    `max_tokens`; any other command: `--max-tokens`) `attnviz.cli.options.flag_of` reads when
    an error or a note names an option; with `token` (what an earlier call returned), restore
    what was set before it."""
    if token is not None:
        _spelled.reset(token)
        return token
    return _spelled.set(COMMAND_FLAGS.get(command or ""))


def spelled(name: str) -> str | None:
    """The running command's spelling of a request field, if it spells it its own way."""
    flags = _spelled.get()
    return None if flags is None else flags.get(name)


# --- old spellings: still accepted, as the new ones ----------------------------------------

@dataclass(frozen=True)
class Renamed:
    """An option a command now spells another way: its old flags, and the spelling that
    replaces it (`--spec E={}`: `{}` is the value given). The old flags are hidden from --help but
    still work, so scripts written for them keep running: each is rewritten into the new
    option before the command sees it, and an old and a new spelling of one setting together
    are 'given twice'."""

    name: str
    flags: tuple[str, ...]
    now: str  # '--spec E={}'
    flag: bool = False  # takes no value

    @property
    def param(self) -> str:
        """The new option's parameter name (`spec`, `budget`, `figure`, `head`, `query`)."""
        return self.now.split()[0].lstrip("-")

    def rewrite(self, value: object, current: Any) -> Any:
        """The new option's value with this old one folded in."""
        shown = "/".join(self.flags)
        if self.param in ("spec", "budget", "figure"):  # a KEY=VALUE pair more
            return [*(current or []), self.now.split()[1].format(value)]
        if self.param == "head":  # --average → --head mean
            if current is not None:
                raise UsageError(f"{shown} and --head {current} exclude each other",
                                 fix="give one of them (--head mean is the mean over heads)",
                                 option="head")
            return "mean"
        # --sentence S → --query TOKEN@S
        if current is None:
            raise UsageError(f"{shown} picks the sentence of --query's token",
                             fix="add --query TOKEN (or write --query TOKEN@S)", option="query")
        if "@" in str(current).rpartition("@")[0] or str(current).rpartition("@")[2].isdigit():
            raise UsageError(f"{shown} and --query {current} both give the sentence",
                             fix="give it once", option="query")
        return f"{current}@{value}"


SPEC_RENAMED = (
    Renamed("embed_dim", ("--embed-dim", "-E"), "--spec E={}"),
    Renamed("kdim", ("--kdim",), "--spec kdim={}"),
    Renamed("vdim", ("--vdim",), "--spec vdim={}"),
    Renamed("seed", ("--seed",), "--spec seed={}"),
    Renamed("num_kv_heads", ("--num-kv-heads",), "--spec kv={}"),
    Renamed("head_dim", ("--head-dim",), "--spec d={}"),
    Renamed("positions", ("--positions",), "--spec positions={}"),
)
LAYER_SPEC_RENAMED = tuple(old for old in SPEC_RENAMED if old.name != "positions")
HEAD_SPEC_RENAMED = tuple(old for old in SPEC_RENAMED if old.name in ("num_kv_heads", "head_dim"))
BUDGET_RENAMED = (
    Renamed("max_tokens", ("--max-tokens",), "--budget tokens={}"),
    Renamed("max_sentences", ("--max-sentences",), "--budget sentences={}"),
    Renamed("max_panels", ("--max-panels",), "--budget panels={}"),
    Renamed("memory_budget", ("--memory-budget",), "--budget memory={}"),
)
FIGURE_RENAMED = (
    Renamed("size", ("--size",), "--figure size={}"),
    Renamed("dpi", ("--dpi",), "--figure dpi={}"),
)
AVERAGE_RENAMED = Renamed("average", ("--average",), "--head mean", flag=True)
SENTENCE_RENAMED = Renamed("sentence", ("--sentence",), "--query TOKEN@{}")


F = TypeVar("F", bound=Callable[..., None])


def old_spellings(*renamed: Renamed) -> Callable[[F], F]:
    """Add each renamed option to a command as a hidden parameter (`old_<name>`) whose value is
    folded into the new option (`--max-tokens 512` → `--budget tokens=512`); the command itself
    never sees them."""
    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        extra = [inspect.Parameter(
            f"old_{old.name}", inspect.Parameter.KEYWORD_ONLY, default=False if old.flag else None,
            annotation=Annotated[bool if old.flag else str | None, typer.Option(
                *old.flags, hidden=True)])
            for old in renamed]
        by_name = {f"old_{old.name}": old for old in renamed}

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> None:
            for name, old in by_name.items():
                value = kwargs.pop(name, None)
                if value is None or value is False:
                    continue
                kwargs[old.param] = old.rewrite(value, kwargs.get(old.param))
            command(*args, **kwargs)

        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*signature.parameters.values(), *extra])
        return run  # type: ignore[return-value]
    return decorate
