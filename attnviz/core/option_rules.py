"""One rule for options: every option of `attnviz heatmap`, `attnviz generate` and `attnviz ablate`
(and of the API's `run_heatmap` / `run_model`) either applies to the run or is refused, exit 2,
naming it. Never ignored. The three commands build one kind of request (the generate and ablate
commands set its measure), so one table serves them.

Which option applies where is this one table, `RULES`, checked in one place (`check_rules`):
the use case checks the request-level rules on the `HeatmapRequest` the CLI and the API both
build (`check_request`, from `attnviz.app.heatmap.check_applicable`); the CLI checks the
rules on what no request holds (what the terminal, `--json` and the files show).

A rule names the options it concerns (request field names, as `attnviz.errors.option` names
them) and the facts of the run under which they do not apply: `never` (refused where one of these
holds) or `only` (refused unless one of these holds). A fact is a source kind (`bundled`,
`weights`, `random`, `model`) or the name of another option given (`query`, `head`, `generate`);
at CLI level also `json`, `quiet`, `out` and `draws_maps` (a map is drawn: the terminal's, or
the `--out` figure). tests/test_option_rule.py walks every option of every command on every source
and fails on one that is neither applied nor refused.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.core.request import HeatmapRequest

REQUEST, CLI = "request", "cli"


@dataclass(frozen=True)
class Rule:
    """Where `options` do not apply, and what the refusal says. Names are space-separated. In
    `what` and `fix`, `{listed}` is the options given (as `option` references, joined by
    `joined`), `{does}` / `{applies}` the verb agreeing with their number."""

    options: str
    what: str
    fix: str
    never: str = ""  # refused where one of these facts holds
    only: str = ""  # refused unless one of these facts holds
    level: str = REQUEST  # REQUEST: on the request (CLI and API); CLI: flags no request holds
    joined: str = ", "
    name_it: bool = True  # the error's `option` is the first option given (shown as context)

    def refuses(self, facts: Collection[str]) -> bool:
        only = self.only.split()
        return any(fact in facts for fact in self.never.split()) or (
            bool(only) and not any(fact in facts for fact in only))


_DRAW = (f"draw one ({option('out')} FILE.png, or the terminal maps without {option('json')} "
         f"or {option('quiet')})")

RULES: tuple[Rule, ...] = (
    # --- the source ------------------------------------------------------------------------
    Rule("causal positions num_heads num_kv_heads head_dim",
         f"{{listed}} {{does}} not apply to {option('model')}: the model's own config decides",
         "drop {listed}", never="model", name_it=False),
    Rule("dtype device_map max_memory",
         f"{option('dtype')}, {option('device_map')} and {option('max_memory')} apply to "
         f"{option('model')} only", f"drop them, or pass {option('model')}", only="model",
         name_it=False),
    Rule("num_heads num_kv_heads head_dim memory_budget",
         "{listed} {does} not apply to the bundled model: it has its own 2 heads per layer and "
         "runs whole",
         f"drop {{listed}}, or pass {option('weights')}, {option('random')} or {option('model')}",
         never="bundled", name_it=False),
    Rule("causal", f"{option('causal')} does not apply to the bundled model: it is causal "
         "already", f"drop {option('causal')}", never="bundled"),
    Rule("num_kv_heads head_dim",
         f"{{listed}} {{does}} not apply to {option('random')}: an nn.MultiheadAttention has "
         f"as many key/value heads as heads, each {option('embed_dim')} / "
         f"{option('num_heads')} wide", f"drop {{listed}}, or set {option('embed_dim')} and "
         f"{option('num_heads')}", never="random"),
    Rule("target", f"{option('target')} applies to {option('model')} (an encoder-decoder "
         "model) only", f"drop {option('target')}, or pass {option('model')}", only="model"),
    # --- the selection ---------------------------------------------------------------------
    Rule("average", f"{option('head')} and {option('average')} exclude each other: "
         f"{option('head')} shows one head, {option('average')} the mean over heads",
         "choose one", never="head"),
    Rule("sentence", f"{option('sentence')} picks the sentence {option('query')} breaks down, "
         f"and no {option('query')} is given", f"add {option('query')} TOKEN, or drop "
         f"{option('sentence')}", only="query"),
    # --- what is measured ------------------------------------------------------------------
    Rule("query", f"{option('query')} breaks down the attention weights α, and "
         f"{option('weighting')} norm shows ‖α·W_O v‖ in their place",
         f"drop {option('query')} or {option('weighting')}", never="weighting"),
    # --- the command line's own flags (facts the request does not hold) --------------------
    Rule("maps stats quiet",
         f"{{listed}} {{does}} not apply to {option('json')}: it prints one JSON document "
         "(the head statistics always in it) instead of maps and tables",
         f"drop {{listed}}, or {option('json')}", never="json", level=CLI),
    Rule("average scale",
         "{listed} {applies} to drawn maps, and this run draws none",
         f"{_DRAW}, or drop {{listed}}", only="draws_maps", level=CLI),
    Rule("size dpi max_panels", f"{{listed}} shape the {option('out')} figure",
         f"add {option('out')} FILE.png, or drop them", only="out", level=CLI,
         joined=" and ", name_it=False),
)


def check_rules(level: str, given: Collection[str], facts: Collection[str]) -> None:
    """Refuse the first rule of `level` that a given option breaks; `facts` hold the source
    kind and whatever else the rules read (the given options count as facts too)."""
    known = set(facts) | set(given)
    for rule in RULES:
        if rule.level != level:
            continue
        hit = [name for name in rule.options.split() if name in given]
        if hit and rule.refuses(known):
            listed = rule.joined.join(option(name) for name in hit)
            one = len(hit) == 1
            words = {"listed": listed, "does": "does" if one else "do",
                     "applies": "applies" if one else "apply"}
            raise UsageError(rule.what.format(**words), fix=rule.fix.format(**words),
                             option=hit[0] if rule.name_it else "")


# request fields whose option is named otherwise (one --target per sentence: `targets`)
FIELD_OPTIONS = {"targets": "target"}


def given_fields(request: HeatmapRequest) -> set[str]:
    """The options given: the request's fields that differ from their defaults, named as the
    options are (`target`, not `targets`; the head hints' own fields, not `hints`)."""
    given: set[str] = set()
    for group in fields(request):
        part = getattr(request, group.name)
        for f in fields(part):
            value = getattr(part, f.name)
            default = f.default
            if is_dataclass(value) and not isinstance(value, type) and f.name == "hints":
                given |= {h.name for h in fields(value) if getattr(value, h.name) is not None}
            elif value != default:
                given.add(FIELD_OPTIONS.get(f.name, f.name))
    return given


def check_request(request: HeatmapRequest) -> None:
    """The request-level rules, on a request the CLI or the API built."""
    given = given_fields(request)
    check_rules(REQUEST, given, {request.source.kind})


def display_facts(as_json: bool, quiet: bool, out: bool, draws_maps: bool) -> set[str]:
    """The facts the CLI-level rules read, named as the table names them."""
    return {name for name, holds in (("json", as_json), ("quiet", quiet), ("out", out),
                                     ("draws_maps", draws_maps)) if holds}


def given_options(values: dict[str, Any], defaults: dict[str, Any]) -> set[str]:
    """The names in `values` whose value is not their default."""
    return {name for name, value in values.items() if value != defaults.get(name)}
