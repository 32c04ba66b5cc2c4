"""`attnviz compare` in the terminal: a layers × heads grid of the weights (`=` a head whose
slices are byte-identical in both models, else its relative distance ‖B − A‖ / ‖A‖), then, with
a corpus, a grid of one statistic's difference B − A per head with the half-width of its 95 %
interval (`+.12±.03*`: the star marks an interval that excludes 0), the heads that changed most,
those whose type changed, what was counted, and a key. Words carry everything; colour only
repeats them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from attnviz.render.head_grid import Row, grid_lines, short_number
from attnviz.render.maps_terminal import colour_off
from attnviz.render.overview_terminal import TYPES

if TYPE_CHECKING:
    from attnviz.compute.comparison.compare_result import CompareResult, CorpusComparison
    from attnviz.compute.comparison.head_weights import WeightComparison

MAX_LISTED = 12  # heads listed under the difference grid
def _distance(value: float) -> str:
    if value == 0:
        return "0"
    if value == float("inf"):
        return "inf"
    return f"{value:.0e}" if value < 0.01 else f"{value:.2f}"


def weights_rows(weights: WeightComparison, colour: bool) -> list[Row]:
    return [(str(layer.index),
             [("=", "green" if colour else "") if h.identical else
              (_distance(h.distance), "bold" if colour and h.distance >= 0.01 else "")
              for h in layer.heads])
            for layer in weights.layers]


def difference_rows(corpus: CorpusComparison, statistic: str, colour: bool) -> list[Row]:
    d = corpus.difference
    s = corpus.statistics.index(statistic)
    rows: list[Row] = []
    for l, info in enumerate(corpus.layers):  # noqa: E741
        cells = []
        for h in range(info.heads):
            diff, low, high = (float(t[l, h, s]) for t in (d.diff, d.low, d.high))
            if diff != diff:
                cells.append(("–", ""))
                continue
            if diff == 0 and low == 0 and high == 0:  # every example the same in both
                cells.append(("0", "dim" if colour else ""))
                continue
            if low != low:  # one example: no interval
                cells.append((short_number(diff, True), ""))
                continue
            changed = low > 0 or high < 0
            text = (f"{short_number(diff, True)}±{short_number((high - low) / 2)}"
                    + ("*" if changed else ""))
            style = ("red" if diff > 0 else "cyan") if colour and changed else ""
            cells.append((text, style))
        rows.append((info.label, cells))
    return rows


def _weights_summary(weights: WeightComparison) -> str:
    heads, same = len(weights.heads), len(weights.identical_heads)
    if weights.all_identical:
        return (f"weights: all {heads} heads byte-identical (and every shared tensor): "
                "the same attention weights")
    dtypes = weights.dtypes[0] if weights.dtypes[0] == weights.dtypes[1] \
        else " vs ".join(weights.dtypes)
    return f"weights: {same} of {heads} heads byte-identical ({dtypes})"


def print_compare(console: Console, result: CompareResult, statistic: str = "entropy") -> None:
    colour = not colour_off(console)
    width = min(console.width, 160)
    console.print(Text(f"model {result.source_a}  against {result.source_b}"), soft_wrap=True)
    console.print(Text(_weights_summary(result.weights)))
    for line in grid_lines(weights_rows(result.weights, colour), width):
        console.print(line, soft_wrap=True)
    console.print(Text("= : the head's slices of W_q, W_k, W_v, W_o (and biases) are "
                       "byte-identical; a number: ‖B − A‖ / ‖A‖ over them"), soft_wrap=True)
    for note in result.weights.notes:
        console.print(Text(f"note: {note}"), soft_wrap=True)
    if result.corpus is not None:
        console.print()
        print_corpus_difference(console, result.corpus, statistic, colour, width)
    for note in result.notes:
        console.print(Text(f"note: {note}"), soft_wrap=True)


def type_rows(corpus: CorpusComparison, colour: bool) -> list[Row]:
    """Each head's type in both models: one word when they agree, `prv>ind` when not."""
    types = [{(h.layer, h.head): h.type for h in s.heads} for s in corpus.summaries]
    rows: list[Row] = []
    for info in corpus.layers:
        cells = []
        for h in range(info.heads):
            a, b = (t.get((info.index, h), "") for t in types)
            if a == b:
                cells.append((_type(a), TYPES.get(a, ("", "", "", ""))[3] if colour else ""))
            else:
                cells.append((f"{_code(a)}>{_code(b)}", "bold" if colour else ""))
        rows.append((info.label, cells))
    return rows


def print_corpus_difference(console: Console, corpus: CorpusComparison, statistic: str,
                            colour: bool, width: int) -> None:
    """The corpus part: `statistic`'s difference grid, or with "label" each head's type."""
    c = corpus.counts
    d = corpus.difference
    if statistic == "label":
        console.print(Text(f"head types over {c.used} examples: model > against where they "
                           "differ"), soft_wrap=True)
        for line in grid_lines(type_rows(corpus, colour), width):
            console.print(line, soft_wrap=True)
        for line in changed_lines(corpus, None):
            console.print(line, soft_wrap=True)
    else:
        console.print(Text(f"{statistic}: against − model over {c.used} examples "
                           f"({d.level:.0%} interval over examples, paired)"), soft_wrap=True)
        for line in grid_lines(difference_rows(corpus, statistic, colour), width):
            console.print(line, soft_wrap=True)
        console.print(Text("cell: B − A ± half the interval; * the interval excludes 0; 0: the "
                           "same value on every example"), soft_wrap=True)
        console.print(Text(mean_line(corpus, statistic)), soft_wrap=True)
        for line in changed_lines(corpus, statistic):
            console.print(line, soft_wrap=True)
    counted = (f"{c.used} examples through both models in {c.batches} "
               f"batch{'es' if c.batches != 1 else ''}")
    if c.truncated:
        counted += f", {c.truncated} truncated"
    if c.skipped:
        counted += f", {c.skipped} skipped (empty or too long in either model)"
    if corpus.world > 1:
        counted += f", {corpus.world} processes"
    console.print(Text(counted), soft_wrap=True)


def mean_line(corpus: CorpusComparison, statistic: str) -> str:
    """The statistic in each model, averaged over every head (NaN heads left out)."""
    d = corpus.difference
    s = corpus.statistics.index(statistic)
    values = []
    for side in (d.mean_a, d.mean_b):
        cells = [float(side[l, h, s]) for l, info in enumerate(corpus.layers)  # noqa: E741
                 for h in range(info.heads)]
        kept = [v for v in cells if v == v]
        values.append(f"{sum(kept) / len(kept):.6g}" if kept else "–")
    return f"{statistic} averaged over heads: model {values[0]}, against {values[1]}"


def changed_lines(corpus: CorpusComparison, statistic: str | None) -> list[Text]:
    """The heads whose interval of `statistic` excludes 0, largest change first (None: none
    listed); then the heads whose type changed."""
    lines = [] if statistic is None else _changed_values(corpus, statistic)
    types = [{(h.layer, h.head): h for h in s_.heads} for s_ in corpus.summaries]
    moved = [(key, a.type, types[1][key].type) for key, a in types[0].items()
             if key in types[1] and a.type != types[1][key].type]
    if moved:
        labels = {info.index: info.label for info in corpus.layers}
        shown = ", ".join(f"{labels.get(layer, layer)}.{head} {_type(a)} → {_type(b)}"
                          for (layer, head), a, b in moved[:MAX_LISTED])
        more = f" and {len(moved) - MAX_LISTED} more" if len(moved) > MAX_LISTED else ""
        lines.append(Text(f"type changed ({_heads(len(moved))}): {shown}{more}"))
    elif statistic is None:
        lines.append(Text("no head's type changed"))
    return lines


def _changed_values(corpus: CorpusComparison, statistic: str) -> list[Text]:
    d = corpus.difference
    s = corpus.statistics.index(statistic)
    found = []
    for l, info in enumerate(corpus.layers):  # noqa: E741
        for h in range(info.heads):
            low, high = float(d.low[l, h, s]), float(d.high[l, h, s])
            if low > 0 or high < 0:
                found.append((abs(float(d.diff[l, h, s])), info.label, h, l))
    lines = []
    if found:
        found.sort(reverse=True)
        shown = ", ".join(f"{label}.{h} {short_number(float(d.diff[l, h, s]), True)} "
                          f"[{short_number(float(d.low[l, h, s]), True)}, "
                          f"{short_number(float(d.high[l, h, s]), True)}]"
                          for _, label, h, l in found[:MAX_LISTED])  # noqa: E741
        more = f" and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
        lines.append(Text(f"changed ({_heads(len(found))}): {shown}{more}"))
    else:
        lines.append(Text(f"no head's {statistic} changed beyond its interval"))
    return lines


def _heads(count: int) -> str:
    return f"{count} head" + ("s" if count != 1 else "")


def _type(name: str) -> str:
    return TYPES.get(name, (name or "?",))[0]


def _code(name: str) -> str:
    return TYPES.get(name, (name, (name or "?")[:3]))[1]
