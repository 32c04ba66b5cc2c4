"""Where a heatmap's attention comes from, as one small protocol: a `HeatmapSource` checks a
request (every limit and option, the panel count where it can be known, before any weight is
read) and then runs it. The four sources implement it: the bundled model (`bundled`), one layer
of a checkpoint (`weights`) and a random nn.MultiheadAttention (`random`) in
`attnviz.app.source_layers`, a Hugging Face model (`model`) in `attnviz.app.source_model`; the
table that picks one by `request.source.kind` is `attnviz.app.source_table.SOURCES`. Here: the
protocol and the checks every source shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from attnviz.core.request import HeatmapRequest
from attnviz.errors import UsageError, option

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.inputs import TokenLimit
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.compute.measures.ablation_measures import AblationReport
    from attnviz.load.store import TensorStore

State = TypeVar("State")


@dataclass
class Checked(Generic[State]):
    """What a source learned checking a request, before any weight was read."""

    sentences: int  # how many sentences run
    panels: tuple[int, int] | None  # (layers shown, heads per layer) when known before the run
    state: State  # the source's own: what its run starts from
    warnings: list[str] = field(default_factory=list)  # for stderr: the run goes on


@dataclass
class Ran:
    """A source's finished run, and the causal scorecard when the request measured one."""

    run: AttentionRun
    ablation: AblationReport | None = None
    panels: tuple[int, int] | None = None  # (layers, heads) the source checked in its run


class HeatmapSource(Protocol[State]):
    """One place attention comes from. `check` reads headers, config and tokenizer only;
    `run` loads weights and computes. A new source is one module with a class like this,
    registered in `attnviz.app.source_table.SOURCES` under its `SourceSpec.kind`."""

    def check(self, request: HeatmapRequest) -> Checked[State]: ...

    def run(self, request: HeatmapRequest, checked: Checked[State],
            report: Callable[[str], None]) -> Ran: ...


def request_sentences(request: HeatmapRequest, limit: TokenLimit | None) -> list[str]:
    """The sentences given, then --file's, read within the request's limits (and the
    source's own `limit`)."""
    given = list(request.inputs.sentences)
    if request.inputs.file is None:
        return given
    from attnviz.app.sentence_file import read_sentences

    return given + read_sentences(request.inputs.file, request.limits.max_tokens,
                                  request.limits.max_sentences, len(given), limit)


def check_sentence(request: HeatmapRequest, count: int) -> None:
    """The sentence --query refers to exists."""
    number = request.selection.sentence
    if not 1 <= number <= count:
        raise UsageError(f"sentence {number} is out of range",
                         fix=f"choose 1..{count}", option="sentence")


MEMORY_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
                "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}
MIN_MEMORY_BUDGET = 2**20


def parse_size(text: str, what: str, field: str) -> int:
    """A size in bytes: '512MB', '2GB', '1.5G', '300000000' (K/M/G are powers of 1024)."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in MEMORY_UNITS:
        raise UsageError(f"cannot read the {what} {text!r}",
                         fix="write a size such as 512MB or 2GB", option=field)
    return int(float(match.group(1)) * MEMORY_UNITS[unit])


def parse_max_memory(text: str | None) -> int | None:
    """--max-memory: the most bytes of a model's weights kept in memory (the rest offloaded)."""
    if text is None:
        return None
    size = parse_size(text, "weight memory limit", "max_memory")
    if size <= 0:
        raise UsageError("a weight memory limit must be positive", fix="give a size such as 2GB",
                         option="max_memory")
    return size


def parse_memory_budget(text: str | None) -> int | None:
    """--memory-budget: '512MB', '2GB', '1.5G', '300000000' (K/M/G are powers of 1024)."""
    if text is None:
        return None
    budget = parse_size(text, "memory budget", "memory_budget")
    if budget < MIN_MEMORY_BUDGET:
        raise UsageError(f"a memory budget of {budget} bytes is too small to hold a block of "
                         "attention rows", fix="give at least 1MB", option="memory_budget")
    available = available_memory()
    if available is not None and budget > available:
        raise UsageError(f"a memory budget of {budget / 2**30:.1f} GB is more than the "
                         f"{available / 2**30:.1f} GB this machine has available",
                         fix=f"give at most {available // 2**20}MB", option="memory_budget")
    return budget


def available_memory() -> int | None:
    """Bytes the process can still allocate: the system's available memory (MemAvailable), or
    less under an address-space limit; None where neither can be read."""
    import os
    import resource

    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        found.append(soft)
    return min(found) if found else None


def check_panels(request: HeatmapRequest, sentences: int, layers: int, heads: int) -> None:
    """Refuse a figure of more panels than the request's limit: once per run, as soon as the
    counts are known (from the headers or config.json before the run, else from the run's
    own layers after it)."""
    limit = request.limits.max_panels
    if limit is None or request.outputs.figure is None:
        return
    panels = sentences * layers * (1 if request.selection.one_per_layer else heads)
    if panels > limit:
        raise UsageError(f"the figure would have {panels} panels, more than "
                         f"{option('max_panels')} {limit}", fix=f"raise {option('max_panels')}, "
                         f"or pick {option('layer')}/{option('head')}")


def source_limit(store: TensorStore, weights: Path | None) -> TokenLimit | None:
    """The bound the source itself sets on a sentence's tokens (an attnviz-tiny model's learned
    positions), checked beside --max-tokens before any work; None when it sets none."""
    from attnviz.sources import bundled

    if not bundled.is_tiny_model(store):
        return None
    return bundled.token_limit(store, "the bundled model" if weights is None else "the model")


