"""A corpus run in the terminal: the layers × heads overview, each cell a head's type and its
bootstrap stability (`prev 97`: previous-token in 97 % of resamples), or one statistic's mean
and the half-width of its 95 % interval (`.53±.02`); then the heads whose type is uncertain,
what was counted, and a key. Words carry everything; colour only repeats the type."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from attnviz.render.head_grid import Row, grid_lines, heads_per_block, short_number
from attnviz.render.maps_terminal import colour_off
from attnviz.render.overview_terminal import TYPES

if TYPE_CHECKING:
    from attnviz.compute.corpus.corpus_result import CorpusResult
    from attnviz.compute.corpus.corpus_summary import CorpusHead

UNSTABLE = 0.9  # a type given by fewer resamples than this is listed as uncertain
MAX_LISTED = 12


def _cell(head: CorpusHead, statistic: str | None, short: bool) -> str:
    if statistic is None:
        word = TYPES.get(head.type, (head.type or "?", head.type[:3] or "?", "", ""))
        return f"{word[1 if short else 0]} {round(100 * head.stability)}"
    s = head.statistics[statistic]
    if s.mean is None:
        return "–"
    if s.low is None or s.high is None:
        return short_number(s.mean)
    return f"{short_number(s.mean)}±{short_number((s.high - s.low) / 2)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


def overview_lines(result: CorpusResult, width: int, statistic: str | None,
                   colour: bool) -> list[Text]:
    """The grid, wrapped into blocks of heads that fit `width`."""
    rows: dict[tuple[int, str], list[CorpusHead]] = {}
    for head in result.summary.heads:
        rows.setdefault((head.layer, head.label), []).append(head)
    heads = max((len(row) for row in rows.values()), default=0)
    grid: list[Row] = []
    for short in (False, True):
        grid = [(label, [(_cell(h, statistic, short),
                          TYPES.get(h.type, ("", "", "", ""))[3]
                          if colour and statistic is None else "") for h in row])
                for (_, label), row in rows.items()]
        if heads_per_block(grid, width) >= heads:
            break
    return grid_lines(grid, width)


def print_corpus(console: Console, result: CorpusResult, statistic: str | None = None) -> None:
    summary = result.summary
    counts = result.counts
    console.print(Text(f"{result.source} over {summary.examples} examples "
                       f"({summary.tokens} tokens) of {result.corpus}"
                       + (f", {result.world} processes" if result.world > 1 else "")
                       + (" · value-weighted ‖α·W_O v‖" if result.weighting == "norm" else "")))
    shows = "head type and its stability (% of bootstrap resamples)" if statistic is None \
        else f"{statistic}: mean ± half its 95% interval over examples"
    console.print(Text(f"cells: {shows}"))
    for line in overview_lines(result, console.width, statistic, not colour_off(console)):
        console.print(line, soft_wrap=True)
    uncertain = sorted((h for h in summary.heads if h.stability < UNSTABLE),
                       key=lambda h: h.stability)
    if uncertain:
        console.print(Text(f"\nuncertain types ({len(uncertain)} heads below "
                           f"{UNSTABLE:.0%} of resamples):"))
        for head in uncertain[:MAX_LISTED]:
            settled = "not settled" if head.settled_at is None else \
                f"settled after {head.settled_at} examples"
            console.print(Text(f"  {head.label}.{head.head}  {head.type or 'none'}  "
                               f"{head.stability:.0%}  ({settled})"))
        if len(uncertain) > MAX_LISTED:
            console.print(Text(f"  … {len(uncertain) - MAX_LISTED} more (--json lists all)"))
    said = [_count(counts.used, "example") + " used", _count(counts.batches, "batch")]
    if counts.skipped_empty:
        said.append(f"{counts.skipped_empty} without a token skipped")
    console.print(Text("\n" + ", ".join(said)))
    longer = counts.truncated if result.long == "truncate" else counts.skipped_long
    console.print(Text(f"longer than {result.max_tokens} tokens: {longer}, "
                       f"{'truncated' if result.long == 'truncate' else 'skipped'}; bootstrap: "
                       f"{summary.resamples} resamples, seed {result.seed}"))
    present = {head.type for head in summary.heads}
    key = ", ".join(f"{word} = {meaning}" for word, _, meaning, _ in
                    (TYPES[t] for t in TYPES if t in present)) if statistic is None else ""
    if key:
        console.print(Text(f"key: {key}"), soft_wrap=False)
