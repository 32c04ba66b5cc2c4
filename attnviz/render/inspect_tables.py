"""Terminal tables for `inspect`."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from attnviz.core.layer_detail import LayerDetail
from attnviz.errors import elide_at_boundaries, printable
from attnviz.render.elide import MAX_TABLE_ROWS, elided, gap_note
from attnviz.render.safe import safe_text


def _dims(shape: list[int]) -> str:
    return "×".join(map(str, shape))


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


def _params(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _group_key(layer: dict[str, Any]) -> tuple[str, ...]:
    pattern = re.sub(r"\d+", "{i}", layer["name"])
    return (pattern, layer["family"], layer["storage"], layer["dtype"], ",".join(layer["bias"]))


def layer_groups(layers: list[dict[str, Any]]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Layers that share a name pattern, family, storage, dtype and biases, in order."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for layer in layers:
        groups.setdefault(_group_key(layer), []).append(layer)
    return groups


def unresolved_groups(items: list[dict[str, Any]]) -> dict[tuple[str, ...], list[str]]:
    """Names of the unresolved modules that share a name pattern, family and reason."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for item in items:
        key = (re.sub(r"\d+", "{i}", item["name"]), item["family"], item["reason"], item["fix"])
        groups.setdefault(key, []).append(item["name"])
    return groups


def group_title(key: tuple[str, ...], count: int) -> Text:
    pattern, family, storage, dtype, bias = key
    text = Text()
    text.append(printable(pattern or "(top level)", 70), style="bold")
    text.append(printable(f"  {family} · {count} layer{'s' * (count != 1)} · {dtype} · ", None))
    text.append(printable(f"bias {bias.replace(',', ' ') or 'none'}", None) + "\n")
    text.append(printable(f"  stored as {storage}", None), style="dim")
    return text


def layers_table(layers: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    numbered = any("{i}" in _group_key(layer)[0] for layer in layers)
    titles = ["#"] + (["i"] if numbered else []) + ["E", "H", "H_kv", "d", "W_q", "W_k",
                                                     "W_v", "W_o"]
    for title in titles:
        table.add_column(title, justify="right", no_wrap=True)
    for layer in layers:
        shapes = layer["shapes"]
        cells = [str(layer["index"])]
        if numbered:
            cells.append(".".join(re.findall(r"\d+", layer["name"])))
        cells += [str(layer["embed_dim"]), _count(layer["num_heads"]),
                  _count(layer["num_kv_heads"]), _count(layer["head_dim"]),
                  *(_dims(shapes[p]) for p in ("q", "k", "v", "o"))]
        table.add_row(*cells)
    return table


def print_inventory(console: Console, doc: dict[str, Any], non_finite: dict[str, int] | None,
                    data_read: bool = False) -> None:
    # one line: a long path loses whole middle components (--json has it exact)
    kind = printable(f"  ({doc['format']})", None)
    source = elide_at_boundaries(printable(doc["source"], None), console.width - 8 - len(kind))
    console.print(Text.assemble(("source  ", "bold"), source + kind))
    for key, layers in layer_groups(doc["layers"]).items():
        console.print()
        console.print(group_title(key, len(layers)))
        console.print(layers_table(layers))
    if doc["layers"]:
        console.print()
        console.print(Text("shapes are (out, in), as nn.Linear.weight; # is the index for "
                           "--layer", style="dim"))
        notes = dict.fromkeys(n for layer in doc["layers"] for n in layer["notes"])
        for note in notes:
            console.print(safe_text(f"note: {note}", style="yellow"))
    s = doc["summary"]
    console.print()
    families = ", ".join(s["families"]) or ("none resolved" if s["unresolved"]
                                             else "none recognized")
    line = (f"{s['attention_layers']} attention layer{'s' * (s['attention_layers'] != 1)}"
            f" ({families}) · "
            f"{_params(s['attention_params'])} attention parameters · {s['tensors']} tensors "
            "in the checkpoint")
    console.print(Text(line, style="bold"))
    if not s["heads_known"]:
        console.print(Text("heads unknown (?): this checkpoint does not store head counts — "
                           "pass --num-heads H (and --num-kv-heads for grouped-query layers)",
                           style="yellow"))
    for (pattern, family, reason, fix), names in unresolved_groups(doc["unresolved"]).items():
        shown = f"{pattern} × {len(names)}" if len(names) > 1 else names[0]
        console.print(safe_text(f"unresolved: {printable(shown, 70)} ({family}): {reason} — "
                                f"{fix}", style="yellow"))
    for prefix in doc["unclassified"]:
        console.print(Text(f"unclassified: {printable(prefix)} looks like attention but matches "
                           "no known layout", style="yellow"))
    print_skipped(console, doc.get("skipped") or [])
    if non_finite is None and not data_read:
        console.print(Text("tensor data not read (headers only); --scan checks every attention "
                           "tensor for NaN/Inf, --layer L shows per-head slices", style="dim"))
    elif non_finite is not None:
        print_non_finite(console, non_finite)


SKIPPED_SHOWN = 10  # skipped tensors named one per line; the rest are counted


def print_skipped(console: Console, skipped: list[dict[str, str]]) -> None:
    """Tensors of a dtype attnviz computes nothing with: named, the first few one per line."""
    for item in skipped[:SKIPPED_SHOWN]:
        console.print(Text(f"skipped: {printable(item['name'])} (dtype "
                           f"{printable(item['dtype'], 24)}): attnviz computes nothing with it",
                           style="yellow"))
    rest = skipped[SKIPPED_SHOWN:]
    if rest:
        dtypes = ", ".join(sorted({printable(item["dtype"], 24) for item in rest}))
        console.print(Text(f"skipped: {len(rest)} more tensors of dtype {dtypes} (--json "
                           "names them all)", style="yellow"))


def print_non_finite(console: Console, counts: dict[str, int]) -> None:
    bad = {name: n for name, n in counts.items() if n}
    if not bad:
        console.print(Text(f"all values finite in the {len(counts)} attention tensors read",
                           style="green"))
        return
    for name, n in bad.items():
        console.print(Text(f"non-finite: {printable(name)} holds {n} NaN/Inf values",
                           style="bold red"))


def print_detail(console: Console, detail: LayerDetail) -> None:
    layer = detail.layer
    console.print()
    console.print(safe_text(f"layer {layer.name or '(top level)'}: {layer.num_heads} query "
                            f"heads, {layer.num_kv_heads} key/value heads, d = {layer.head_dim}",
                            style="bold"))
    grouped = layer.num_kv_heads != layer.num_heads
    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1),
                  caption_justify="left")
    columns = ["head", "W_q rows", "W_o cols"] + (["kv head"] if grouped else [])
    columns += ["W_k/W_v rows", "‖W_q‖", "‖W_k‖", "‖W_v‖", "‖W_o‖"]
    for title in columns:
        table.add_column(title, justify="right", no_wrap=True)
    for i in elided(len(detail.heads)):
        if i is None:
            table.add_row(*["…"] * len(columns))
            table.caption = gap_note(len(detail.heads), MAX_TABLE_ROWS)
            continue
        h = detail.heads[i]
        cells = [str(h.head), f"{h.q_rows[0]}:{h.q_rows[1]}", f"{h.o_cols[0]}:{h.o_cols[1]}"]
        if grouped:
            cells.append(str(h.kv_head))
        cells.append(f"{h.kv_rows[0]}:{h.kv_rows[1]}")
        cells += [f"{n:.4g}" for n in (h.q_norm, h.k_norm, h.v_norm, h.o_norm)]
        table.add_row(*cells)
    console.print(table)
    console.print(Text("‖·‖ = Frobenius norm of the head's slice (W_k/W_v: of its kv head's "
                       "rows); rows and columns index the (out, in) matrices above", style="dim"))
    print_non_finite(console, detail.non_finite)
