"""One heatmap request: everything `attnviz heatmap` (or `attnviz.api.run_heatmap` /
`run_model`) was asked for, frozen, and grouped as the user thinks of it.

    HeatmapRequest
    ├── inputs     Inputs     the sentences, --file, --target
    ├── source     SourceSpec bundled | --weights + layer | --random spec | --model + dtype, …
    ├── selection  Selection  --layer, --head (N or mean), --query (TOKEN@SENTENCE)
    ├── measure    Measure    --weighting; attnviz ablate --mode; attnviz generate
    ├── outputs    Outputs    the files asked for (--out, --html, --export), full maps kept
    └── limits     Limits     --budget tokens=, sentences=, panels=, memory=

The CLI builds it once from its options, the Python API from its keywords, and the same object
goes down to the use case (`attnviz.app.heatmap.run_heatmap`) and to the source that runs it
(`attnviz.app.heatmap_sources`); every layer below reads what it needs from it or from one of
its groups, so `layer`, `max_tokens` or `memory_budget` are each given once. Field names are the
neutral option names errors use (`‹max_tokens›`, see `attnviz.errors.option`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from attnviz.core.choices import AblationMode, Dtype, Positions, Weighting
from attnviz.errors import UsageError, option

DEFAULT_MAX_TOKENS = 256  # attention costs O(L²) per head
DEFAULT_MAX_SENTENCES = 64
DEFAULT_EMBED_DIM = 64  # a random layer's size, unless given
DEFAULT_NUM_HEADS = 8
MAX_NEW_TOKENS = 4096  # --generate's bound


@dataclass(frozen=True)
class HeadHints:
    """Head counts given on the command line; they win over config and metadata."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class RandomSpec:
    """A randomly initialized nn.MultiheadAttention: its sizes and seed."""

    embed_dim: int = DEFAULT_EMBED_DIM
    num_heads: int = DEFAULT_NUM_HEADS
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    add_bias_kv: bool = False
    seed: int = 0


@dataclass(frozen=True)
class LayerOptions:
    """The options that size a random layer or give a checkpoint layer's head counts, as the
    caller got them (None: not given). `build` turns them into the random layer and the head
    hints, the one place every command and the Python API do so."""

    embed_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    seed: int | None = None

    def build(self, random: bool, only: str, fix: str, seed_is_random: bool = True
              ) -> tuple[RandomSpec | None, HeadHints]:
        """(the random layer, the head hints). With `random`, the number of heads sizes the
        layer and the defaults fill the rest; without it, it is a hint for a checkpoint's layer,
        and the random layer's own sizes (and its `seed`, unless `seed_is_random` is False:
        split's seed also draws its proof batch) are one usage error naming each given:
        '‹kdim› applies to `only` — `fix`' (`{them}` in `fix`: it or them)."""
        if random:
            return RandomSpec(
                DEFAULT_EMBED_DIM if self.embed_dim is None else self.embed_dim,
                DEFAULT_NUM_HEADS if self.num_heads is None else self.num_heads,
                self.kdim, self.vdim, self.bias, seed=self.seed or 0), \
                HeadHints(None, self.num_kv_heads, self.head_dim)
        names = ("embed_dim", "kdim", "vdim", "seed") if seed_is_random else \
            ("embed_dim", "kdim", "vdim")
        given = [name for name in names if getattr(self, name) is not None]
        if given:
            one = len(given) == 1
            raise UsageError(f"{', '.join(option(name) for name in given)} "
                             f"{'applies' if one else 'apply'} to {only}",
                             fix=fix.format(them="it" if one else "them"))
        return None, HeadHints(self.num_heads, self.num_kv_heads, self.head_dim)


# --temperature's range. Sampling divides the logits by T in float32 (transformers casts them):
# below ~1e-38 a logit of 5 overflows to inf, and a T past float32's 3.4e38 is inf itself
# (-inf / inf: NaN), and the draw fails inside the model. Far inside those limits: at 1e-4 a
# logit gap of 0.001 already weighs e^10, so the draw is greedy decoding (drop --sample for
# that); at 1e4 logits within ±100 are equally likely (uniform); logits up to 3e34 stay finite.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
# every seed (--seed, seed=) is 0..MAX_SEED: torch.manual_seed and Generator.manual_seed take
# 0..2**64 - 1 (a negative one wraps around), so the CLI and the API check this one bound
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class GenerateSpec:
    """How to generate: at most `max_new` tokens, greedy unless `sample`."""

    max_new: int  # tokens generated at most per prompt (stops earlier at end-of-sequence)
    sample: bool = False  # draw from the distribution instead of taking the most likely token
    temperature: float = 1.0  # divides the logits before sampling
    top_p: float = 1.0  # nucleus: sample from the smallest set of tokens holding this mass
    seed: int = 0  # the random generator's seed when sampling

    def check(self) -> None:
        """Each value within what generation can take: an extreme one is the caller's misuse
        (a usage error naming its option), not a model failing later."""
        if not _integer(self.max_new) or not 1 <= self.max_new <= MAX_NEW_TOKENS:
            raise UsageError(f"{option('generate')} must be 1..{MAX_NEW_TOKENS}, not "
                             f"{self.max_new!r}", option="generate")
        if not isinstance(self.sample, bool):
            raise UsageError(f"{option('sample')} must be True or False, not {self.sample!r}",
                             option="sample")
        if not _real(self.temperature) or not _real(self.top_p):
            bad, value = ("temperature", self.temperature) if not _real(self.temperature) \
                else ("top_p", self.top_p)
            raise UsageError(f"{option(bad)} must be a number, not {value!r}", option=bad)
        if not self.sample and (self.temperature != 1.0 or self.top_p != 1.0):
            raise UsageError(f"{option('temperature')} and {option('top_p')} apply to sampling "
                             "only", fix=f"add {option('sample')}, or drop them", option="sample")
        if not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise UsageError(
                f"{option('temperature')} must be between {MIN_TEMPERATURE:g} and "
                f"{MAX_TEMPERATURE:g}, not {self.temperature:g}: the logits divided by it "
                "would overflow, or the draw would be greedy or uniform all the same",
                fix=f"drop {option('sample')} for the most likely token at each step, or "
                f"give a temperature in that range", option="temperature")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"{option('top_p')} must be in (0, 1], not {self.top_p:g}",
                             option="top_p")
        if not _integer(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"{option('seed')} must be 0..{MAX_SEED}, not {self.seed!r}",
                             option="seed")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Inputs:
    """What to run on."""

    sentences: tuple[str, ...] = ()
    file: Path | None = None  # more sentences, one per line ('-': stdin)
    targets: tuple[str, ...] | None = None  # an encoder-decoder's decoder text, per sentence


SOURCE_KINDS = ("bundled", "weights", "random", "model")


@dataclass(frozen=True)
class SourceSpec:
    """Where the attention comes from: the bundled model unless `weights`, `random` or `model`
    is given (more than one is a usage error, see `attnviz.app.heatmap.check_applicable`)."""

    weights: Path | None = None  # a checkpoint: one of its layers, on synthetic inputs
    model: str | None = None  # a Hugging Face folder or cached hub id: its own forward pass
    random: RandomSpec | None = None  # a random nn.MultiheadAttention
    hints: HeadHints = HeadHints()  # head counts for a checkpoint layer
    causal: bool = False
    positions: Positions = Positions.NONE  # standalone layers: encodings added to the inputs
    device: str = "auto"
    dtype: Dtype = Dtype.FLOAT32  # model only ("auto": the checkpoint's own)
    device_map: str | None = None  # model only
    max_memory: int | None = None  # model only: bytes of weights in memory, the rest offloaded

    @property
    def kind(self) -> str:
        """One of SOURCE_KINDS: the key of the source that runs the request."""
        if self.model is not None:
            return "model"
        if self.weights is not None:
            return "weights"
        return "random" if self.random is not None else "bundled"


@dataclass(frozen=True)
class Selection:
    """Which maps are shown."""

    layer: str | None = None  # a layer spec (attnviz.core.selection); None: all
    head: int | None = None
    average: bool = False
    query: str | None = None  # a token (index or word) broken down head by head
    sentence: int = 1  # which sentence `query` refers to, 1-based

    @property
    def one_per_layer(self) -> bool:
        """One panel per layer and sentence (a single head, or their mean)."""
        return self.head is not None or self.average


@dataclass(frozen=True)
class Measure:
    """What is measured beyond the attention maps."""

    weighting: Weighting = Weighting.ATTENTION  # NORM: value-weighted (attnviz.app.weighting)
    ablate: AblationMode | None = None  # the causal head scorecard (attnviz.app.ablate)
    generate: GenerateSpec | None = None  # continue each sentence first (attnviz.app.generate)


@dataclass(frozen=True)
class Outputs:
    """The files asked for (the CLI writes them; the run needs to know of some in advance)."""

    figure: Path | None = None  # the panel limit applies to a figure
    html: Path | None = None
    export: Path | None = None  # long inputs are written block by block, as the maps stream
    keep_full_maps: bool = False  # every head's full map kept in memory (the API's choice)
    # display views kept: terminal maps, a figure, the page, the API. False (the CLI, when no
    # output shows a map): statistics, the overview and --query alone, and a long input's
    # blocks are not reduced to display cells
    views: bool = True

    @property
    def full_maps(self) -> bool:
        """Whether the run must produce every head's full map (the export needs them)."""
        return self.keep_full_maps or self.export is not None


@dataclass(frozen=True)
class Limits:
    """Bounds checked before any work is done."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    max_sentences: int = DEFAULT_MAX_SENTENCES
    max_panels: int | None = None  # a figure's panels (applies when `outputs.figure` is set)
    memory_budget: int | None = None  # bytes for attention maps (None: the default budget)


@dataclass(frozen=True)
class HeatmapRequest:
    """One `attnviz heatmap` request (see the module's docstring)."""

    inputs: Inputs = Inputs()
    source: SourceSpec = SourceSpec()
    selection: Selection = Selection()
    measure: Measure = Measure()
    outputs: Outputs = Outputs()
    limits: Limits = Limits()

    @classmethod
    def build(cls, **given: Any) -> HeatmapRequest:
        """A request from flat keywords, each routed to the group that declares it
        (`HeatmapRequest.build(sentences=("a b",), random=RandomSpec(), max_tokens=64)`)."""
        groups: dict[str, dict[str, Any]] = {f.name: {} for f in fields(cls) if f.name in GROUPS}
        for name, value in given.items():
            group = OWNER.get(name)
            if group is None:
                raise TypeError(f"HeatmapRequest has no field {name!r}")
            groups[group][name] = value
        return cls(**{name: GROUPS[name](**values) for name, values in groups.items()})


GROUPS: dict[str, type] = {"inputs": Inputs, "source": SourceSpec, "selection": Selection,
                           "measure": Measure, "outputs": Outputs, "limits": Limits}
OWNER = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
assert len(OWNER) == sum(len(fields(cls)) for cls in GROUPS.values()), "a field name repeats"
