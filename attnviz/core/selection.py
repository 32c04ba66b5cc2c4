"""The --layer grammar for models: which layers of a model a run shows."""

from __future__ import annotations

from attnviz.errors import UsageError, option


def parse_layers(spec: str | None, available: int) -> list[int] | None:
    """--layer for a model: None (all), "all", "N", "-1" or "A:B" (B exclusive)."""
    if spec is None or spec == "all":
        return None
    try:
        if len(spec) > 40:  # 5000 digits are past what int() converts
            raise ValueError
        if ":" in spec:
            start_text, stop_text = spec.split(":", 1)
            start = int(start_text) if start_text else 0
            stop = int(stop_text) if stop_text else available
            chosen = list(range(available))[start:stop]
        else:
            index = int(spec)
            if not -available <= index < available:
                raise IndexError
            chosen = [index % available]
    except (ValueError, IndexError):
        raise UsageError(f"{option('layer')} {spec!r} is not a layer of this model",
                         fix=f"use all, 0..{available - 1}, -1 or A:B", option="layer") from None
    if not chosen:
        raise UsageError(f"{option('layer')} {spec!r} selects no layer",
                         fix=f"the model has {available}",
                         option="layer")
    return chosen


# The stacks of an encoder-decoder model, as --layer names them.
STACKS = ("enc", "dec", "cross")
STACK_GRAMMAR = ("N, -1, A:B or all; encoder-decoder models: 'enc N', 'dec N' (decoder "
                 "self-attention), 'cross N' (cross-attention), each with N, -1, A:B or all, "
                 "joined by commas; a bare N is the encoder's")


def parse_stack_layers(spec: str | None, stacks: dict[str, int]) -> list[tuple[str, int]] | None:
    """--layer for a model whose layers are numbered per stack.

    `stacks` maps each stack that ran to its layer count: {"": n} for a single-stack model,
    {"enc": n} or {"enc": n, "dec": m, "cross": m} for an encoder-decoder one. The grammar is
    ITEM[,ITEM…], ITEM = [STACK] SELECTION, SELECTION = all | N | -N | A:B; a bare SELECTION is
    the first stack's (the encoder's), a bare STACK all of its layers, and a bare `all` every
    layer. Returns (stack, index) pairs in stack order, or None for every layer.
    """
    if spec is None or spec.strip() == "all":
        return None
    first = next(iter(stacks))
    chosen: set[tuple[str, int]] = set()
    for item in spec.split(","):
        words = item.split()
        if len(words) == 2 or (len(words) == 1 and words[0] in STACKS):
            stack, selection = words[0], (words[1] if len(words) == 2 else "all")
            if stack not in STACKS:
                raise UsageError(f"{option('layer')} {spec!r}: unknown stack {stack!r}",
                                 fix="use enc, dec or cross", option="layer")
            if stack not in stacks:
                ran = ", ".join(s for s in stacks if s) or "one stack"
                raise UsageError(f"{option('layer')} {spec!r}: this run has no {stack!r} layers "
                                 f"(it ran {ran})", fix=_stack_fix(stacks), option="layer")
        elif len(words) == 1:
            stack, selection = first, words[0]
        else:
            raise UsageError(f"{option('layer')} {spec!r} is not a layer selection",
                             fix=_stack_fix(stacks), option="layer")
        count = stacks[stack]
        indices = list(range(count)) if selection == "all" else parse_layers(selection, count)
        chosen.update((stack, i) for i in indices or [])
    order = list(stacks)
    return sorted(chosen, key=lambda pair: (order.index(pair[0]), pair[1]))


def _stack_fix(stacks: dict[str, int]) -> str:
    if list(stacks) == [""]:
        return f"use all, 0..{stacks[''] - 1}, -1 or A:B"
    return "use " + "; ".join(f"'{s} 0..{n - 1}'" for s, n in stacks.items()) + \
        ", -1, A:B or all, joined by commas"
