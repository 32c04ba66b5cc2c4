"""`attnviz tokens` in the terminal: per sentence the input tokens in rows, each method's share
of the output position in a column (shaded on the column's own scale, with the erasure effect
beside them), the top tokens each method names, and each method's rank correlation with erasure;
over several sentences, each method's mean and spread of that correlation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.core.choices import TokenMethod
from attnviz.errors import printable, with_options
from attnviz.render.maps_terminal import colour_off, ramp, shade

if TYPE_CHECKING:
    from attnviz.compute.tokenflow.token_result import SentenceTokens, TokensResult

SENTENCES_SHOWN = 3  # tables printed in full; the rest only enter the summary
ROWS_SHOWN = 64  # token rows per table (the rest elided, the top tokens still named)


def _cell(value: float, top: float, colour: bool) -> Text:
    if not math.isfinite(value):
        return Text("–", style="dim")
    scaled = abs(value) / top if top > 0 else 0.0
    text = f"{value:6.3f}"
    if colour:
        return Text(text, style=f"black on {ramp(scaled)}" if scaled > 0.5 else
                    f"white on {ramp(scaled)}")
    return Text(f"{text} {shade(scaled)}")


def _named(s: SentenceTokens, j: int) -> str:
    return f"{printable(s.tokens[j])}@{j}"


def sentence_table(result: TokensResult, s: SentenceTokens, colour: bool) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    table.add_column("#", justify="right", style="dim")
    table.add_column("token")
    columns = [(str(m), s.chains[m][0].tolist()) for m in result.methods]
    if s.effects is not None:
        columns.append(("erasure", s.effects.tolist()))
    for name, _ in columns:
        table.add_column(name, justify="right")
    tops = [max((abs(v) for v in values if math.isfinite(v)), default=0.0)
            for _, values in columns]
    for j in range(min(s.reached(result.causal), ROWS_SHOWN)):
        own = s.output_is_input and j == s.position
        label = Text(printable(s.tokens[j]), style="bold" if own else "")
        table.add_row(str(j), label, *[_cell(values[j], top, colour)
                                       for (_, values), top in zip(columns, tops, strict=True)])
    return table


def print_tokens(console: Console, result: TokensResult) -> None:
    colour = not colour_off(console)
    console.print(Text(f"which input tokens reach the output, through all layers — "
                       f"{printable(result.source)}", style="bold"), overflow="fold")
    about = {"rollout": f"rollout: heads' {result.heads}, mixed with the identity at "
                        f"{result.residual_weight:g} for the residual",
             "flow": "flow: exact max flow over the same graph",
             "norms": "norms: ‖per-source term‖ (Kobayashi et al. 2021)",
             "alti": "alti: L1 proximity of each term to the block's output (Ferrando et al. "
                     "2022)"}
    console.print(Text("; ".join(about[str(m)] for m in result.methods)
                       + "; each composed down the layers", style="dim"), overflow="fold")
    if result.measure is not None:
        console.print(Text(f"erasure: each token {result.erased_how}; effect = {result.measure}",
                           style="dim"), overflow="fold")
    for number, s in enumerate(result.sentences[:SENTENCES_SHOWN], 1):
        where = f"sentence {number}: " if len(result.sentences) > 1 else ""
        tokens = s.tokens if s.output_tokens is None else s.output_tokens
        what = "output position" if s.output_is_input else "decoder position"
        console.print(Text(f"{where}{what} {s.position} ({printable(tokens[s.position])})",
                           style="bold"), overflow="fold")
        console.print(sentence_table(result, s, colour))
        hidden = s.reached(result.causal) - ROWS_SHOWN
        if hidden > 0:
            console.print(Text(f"… {hidden} more tokens (--json holds every value)",
                               style="dim"))
        for m in result.methods:
            rho = s.correlations.get(m)
            agree = "" if s.effects is None else \
                f"   ρ with erasure {'n/a' if rho is None else f'{rho:+.2f}'}"
            top = ", ".join(_named(s, j) for j in s.top(m, reach=s.reached(result.causal)))
            console.print(Text(f"{m!s:>8}: top {top}{agree}"), overflow="fold")
        for m, share in s.decoder_shares.items():
            if m is TokenMethod.FLOW:  # max flows, not shares of one unit
                continue
            kept = float(share.sum())
            console.print(Text(f"   {m} left {kept:.3f} of the output on the decoder's own "
                               f"tokens and passed {1 - kept:.3f} to the source", style="dim"),
                          overflow="fold")
        effects = s.effects
        if effects is not None:
            order = sorted(s.erasures.erased if s.erasures else [],
                           key=lambda j: -float(effects[j]))[:3]
            named = ", ".join(_named(s, j) for j in order) if order else \
                "– (no token the output sees could be erased)"
            console.print(Text(f" erasure: top {named}"), overflow="fold")
    if len(result.sentences) > SENTENCES_SHOWN:
        console.print(Text(f"… {len(result.sentences) - SENTENCES_SHOWN} more sentences in the "
                           "summary below (--json holds each)", style="dim"))
    if result.measure is not None:
        _summary(console, result)
    for note in result.notes:
        shown = with_options(note, lambda name: "--" + name.replace("_", "-"))
        console.print(Text(f"note: {shown}", style="dim"), overflow="fold")


def _summary(console: Console, result: TokensResult) -> None:
    parts = []
    for m in result.methods:
        mean, spread, count = result.summary[m]
        if mean is None:
            parts.append(f"{m} n/a")
            continue
        spread_text = "" if spread is None else f" ± {spread:.2f}"
        parts.append(f"{m} {mean:+.2f}{spread_text}")
    count = max((s[2] for s in result.summary.values()), default=0)
    best = result.best()
    over = f" over {count} sentences (mean ± sd)" if len(result.sentences) > 1 else ""
    console.print(Text(f"agreement with erasure (Spearman ρ){over}: " + "; ".join(parts),
                       style="bold"), overflow="fold")
    if best:
        tied = " (tied)" if len(best) > 1 else ""
        console.print(Text(f"closest to erasure here: {', '.join(map(str, best))}{tied}"),
                      overflow="fold")
