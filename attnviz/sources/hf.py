"""Real pretrained models through Hugging Face transformers: load offline, capture, verify.

`run_model` runs the model's own forward pass once through `attnviz.sources.capture`: the layers
shown go through their module's own eager attention (in blocks of query rows under a memory
budget), the others through sdpa; models whose modeling file does not use transformers'
attention interface return their maps through `output_attentions` instead. Nothing here depends
on attnviz's layout registry: layers, their names and head counts come from the attention calls
of the forward pass itself (a 1-token probe run first numbers them), so any model transformers
loads without remote code works, recognized by `attnviz inspect` or not.

Sequences are re-aligned so each sentence's real tokens sit at positions 0..n-1 (right padding),
as the renderers and `attnviz.compute.stats` assume. Encoder-decoder models run their encoder
alone, or, given a target per sentence, the decoder too: decoder self-attention (target × target)
and cross-attention (target × source).

`verify_layer` (the recompute proof) recomputes one layer's weights from its captured input with
attnviz's own AttentionLayer slices, read from the checkpoint files, and positions recomputed
from config.json by `attnviz.compute.positions` (never taken from the model); the ablation proof,
which needs no per-family math, is `attnviz.sources.ablation`.
transformers is imported lazily: the core install works without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from attnviz.compute.attention import resolve_device
from attnviz.compute.inputs import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS, Batch, find_query
from attnviz.compute.results import AttentionRun, CapturedScores, LayerAttention
from attnviz.core.layer import AttentionLayer
from attnviz.core.selection import parse_stack_layers
from attnviz.errors import (
    CheckFailed,
    CheckpointError,
    UsageError,
    printable,
    printable_path,
    quoted,
)
from attnviz.load.checkpoint import TensorStore, open_checkpoint
from attnviz.recognize import find_layers
from attnviz.sources import capture as cap
from attnviz.sources import hf_guard as guard

DTYPES = ("float32", "bfloat16", "float16")
# The model itself computes in its dtype; float32 must agree to rounding, half precision loosely.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
# The most one block of one shown layer's float32 maps (B, H, rows, S) may take in eager.
BLOCK_BUDGET_BYTES = 32 * 2**20
STACK_OF = {cap.LayerKind.SELF: "enc", cap.LayerKind.DECODER_SELF: "dec",
            cap.LayerKind.CROSS: "cross"}
PATHS = {
    cap.CapturePath.INTERFACE: (
        "transformers attention interface: attnviz's attention function runs the layers shown "
        "through their module's own eager attention, the others through sdpa"),
    cap.CapturePath.OUTPUT_ATTENTIONS: (
        "output_attentions (eager): this model's modeling file does not use the attention "
        "interface, so the maps are the ones it returns when asked"),
}


def require_transformers() -> None:
    """Fail with the install hint when the Hugging Face extra is missing."""
    # attnviz never downloads: huggingface_hub reads this once, when it is first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    if any(importlib.util.find_spec(name) is None for name in ("transformers", "tokenizers")):
        raise UsageError("--model needs the Hugging Face extra", fix="pip install 'attnviz[hf]'")


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (AutoModel: the base model, no head)
    tokenizer: Any
    folder: Path  # the local model folder (or hub-cache snapshot) the weights came from
    config: Any  # the transformers config object
    dtype: str
    path: cap.CapturePath  # how its maps are captured
    _store: TensorStore | None = field(default=None, repr=False)
    tower: str | None = None  # a multi-tower model (CLIP): the attribute of its text tower

    @property
    def encoder_decoder(self) -> bool:
        return bool(getattr(self.config, "is_encoder_decoder", False))

    @property
    def store(self) -> TensorStore:
        """attnviz's own view of the same files (for the proofs, which read attnviz's slices)."""
        if self._store is None:
            self._store = open_checkpoint(self.folder)
        return self._store

    @property
    def embeddings(self) -> Any:
        """The token embedding of the part that runs."""
        runner = getattr(self.model, self.tower) if self.tower is not None else self.model
        for owner in (runner, self.model):
            getter = getattr(owner, "get_input_embeddings", None)
            if getter is not None:
                with contextlib.suppress(NotImplementedError, AttributeError):
                    found = getter()
                    if isinstance(found, torch.nn.Embedding):
                        return found
        found = next((m for m in runner.modules() if isinstance(m, torch.nn.Embedding)), None)
        if found is None:
            raise CheckpointError("the model has no token embedding", where=str(self.folder))
        return found


def resolve_folder(spec: str) -> Path:
    """A model folder, or a hub id found in the local Hugging Face cache (never downloaded)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UsageError("--model takes a model folder or a hub id, not a file",
                         fix="pass the folder holding config.json", where=printable(spec))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UsageError("no such model folder", fix="check the path", where=printable(spec))
    require_transformers()
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except ValueError:  # HFValidationError: not a valid repo id
        raise UsageError("not a model folder nor a valid hub id", fix="check --model",
                         where=printable(spec)) from None
    if not isinstance(found, str):
        raise CheckpointError(f"model {quoted(spec)} is not in the local Hugging Face cache",
                              fix=f"download it once with 'hf download {printable(spec)}' (attnviz "
                              "never downloads), or pass a model folder")
    return Path(found).parent


def load_model(spec: str, device: str = "cpu", dtype: str = "float32",
               device_map: str | None = None, tokenizer: Any = None) -> LoadedModel:
    """Model + tokenizer from a folder or the local hub cache, ready for `capture`.

    The model is loaded with eager attention, then switched to attnviz's attention function
    when its modeling file uses transformers' attention interface. `tokenizer` replaces the
    folder's own (the Python API; AutoTokenizer otherwise).
    """
    require_transformers()
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", fix=f"use one of {', '.join(DTYPES)}",
                         option="--dtype")
    if device_map is not None:
        if device_map != "auto":
            raise UsageError(f"unknown device map {device_map!r}", fix="use auto",
                             option="--device-map")
        if importlib.util.find_spec("accelerate") is None:
            raise UsageError("--device-map auto needs accelerate", fix="pip install accelerate")
    target = None if device_map else resolve_device(device)
    folder = resolve_folder(spec)
    where = printable_path(folder)
    store = open_checkpoint(folder)  # headers only
    guard.check_folder(folder, store)  # config.json and its layer counts: before transformers
    # config.json's fields read in attnviz's words (a list where a count belongs, 'yes' for a
    # flag) before transformers' own validation answers in its; the run does not use the result.
    find_layers(store)
    import transformers

    # Only local files, never repository code; eager attention is the one that returns weights.
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    dtype_key = "dtype" if _major() >= 5 else "torch_dtype"  # renamed in transformers 5
    fix = "check that the folder holds config.json, the weights and the tokenizer files"
    with guard.quiet():  # transformers' reports and warnings are attnviz's to word
        with guard.contained("transformers cannot read the model's config.json", fix, where):
            config = transformers.AutoConfig.from_pretrained(folder, **common)
            meta = guard.meta_model(transformers, config)  # shapes only, on the meta device
        tower = guard.text_runner(meta, config)
        if tokenizer is None:
            guard.check_tokenizer_files(folder)
        guard.check_sizes(meta, store, where)
        del meta
        with guard.contained("transformers cannot load the model", fix, where):
            model, info = transformers.AutoModel.from_pretrained(
                folder, attn_implementation="eager", device_map=device_map,
                output_loading_info=True, **{dtype_key: getattr(torch, dtype)}, **common)
        if tokenizer is None:
            with guard.contained("the model's tokenizer cannot be loaded",
                                 "check or replace its tokenizer files", where):
                tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **common)
    model.eval()
    if target is not None:
        model.to(target)
    runner = getattr(model, tower) if tower is not None else model
    runner_params = {id(p) for p in runner.parameters()}
    guard.check_loaded(info, {name for name, p in model.named_parameters()
                              if id(p) in runner_params}, where)
    cap.register()
    path = cap.CapturePath.OUTPUT_ATTENTIONS
    if cap.uses_interface(model):
        model.set_attn_implementation(cap.NAME)
        path = cap.CapturePath.INTERFACE
    return LoadedModel(model, tokenizer, folder, config, dtype, path, _store=store, tower=tower)


# --- inputs ------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """A padded batch ready for the model, and where each sentence's real tokens sit in it."""

    runner: Any  # the module whose forward runs: the model, or an encoder-decoder's encoder
    runner_name: str  # its name in the model ("" for the model itself, "encoder")
    feed: dict[str, torch.Tensor]
    batch: Batch  # source sentences and their tokens
    offsets: list[int]  # per sentence: the padded index of its first real token
    target: Batch | None = None  # decoder inputs (target text and decoder tokens)
    target_offsets: list[int] | None = None  # always 0: targets are right-padded

    def tiny(self) -> dict[str, torch.Tensor]:
        """The first sentence's first real token (and the decoder's start token): a probe."""
        first = self.offsets[0]
        out = {}
        for name, value in self.feed.items():
            start = 0 if name.startswith("decoder_") else first
            out[name] = value[:1, start:start + 1]
        return out


def prepare(loaded: LoadedModel, sentences: list[str], targets: list[str] | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    """Each sentence tokenized alone (special tokens included), limits checked, then padded on
    the tokenizer's side with the model's attention mask. With targets (encoder-decoder models
    only), the decoder input of sentence i is the decoder start token followed by target i's
    tokens, right-padded."""
    if targets is not None and not loaded.encoder_decoder:
        raise UsageError("--target applies to encoder-decoder models only",
                         fix="drop --target", option="--target")
    if targets is not None and len(targets) != len(sentences):
        raise UsageError(f"{len(targets)} --target texts for {len(sentences)} sentences",
                         fix="give one --target per sentence, in order", option="--target")
    rows = _encode(loaded, sentences, max_tokens)
    tokens = [loaded.tokenizer.convert_ids_to_tokens(row["input_ids"]) for row in rows]
    runner, runner_name = loaded.model, ""
    if loaded.tower is not None:  # a multi-tower model (CLIP): its text tower runs alone
        runner, runner_name = getattr(loaded.model, loaded.tower), loaded.tower
    elif loaded.encoder_decoder and targets is None:
        runner = loaded.model.get_encoder()
        runner_name = next((n for n, m in loaded.model.named_modules() if m is runner), "")
    feed, offsets = _pad(loaded, runner, rows)
    prepared = Prepared(runner, runner_name, feed, Batch(list(sentences), tokens), offsets)
    if targets is not None:
        _add_targets(loaded, prepared, targets, max_tokens)
    return prepared


def _encode(loaded: LoadedModel, sentences: list[str], max_tokens: int,
            what: str = "sentence", target: bool = False) -> list[dict[str, list]]:
    """Each text tokenized alone, special tokens included; limits checked before any run."""
    if not sentences:
        raise UsageError("no sentence given", fix="pass one or more sentences, or --file FILE")
    if len(sentences) > DEFAULT_MAX_SENTENCES:
        raise UsageError(f"{len(sentences)} sentences exceed {DEFAULT_MAX_SENTENCES}",
                         fix="pass fewer sentences")
    limit = getattr(loaded.config, "max_position_embeddings", None)
    embedding_rows = loaded.embeddings.num_embeddings
    where = printable_path(loaded.folder)
    out = []
    for i, sentence in enumerate(sentences, 1):
        # A tokenizer can fail in Rust (a panic surfaces as a BaseException): contained.
        with guard.quiet(), guard.contained(f"the model's tokenizer failed on {what} {i}",
                                            "check or replace its tokenizer files", where):
            if target:
                row = dict(loaded.tokenizer(text_target=sentence, add_special_tokens=True))
            else:
                row = dict(loaded.tokenizer(sentence, add_special_tokens=True))
            ids = row.get("input_ids")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise CheckpointError(f"the model's tokenizer gave no token ids for {what} {i}",
                                      fix="check its tokenizer files", where=where)
        if ids and not all(0 <= t < embedding_rows for t in ids):
            raise CheckpointError(f"the model's tokenizer gives token id "
                                  f"{max(ids) if max(ids) >= embedding_rows else min(ids)}, "
                                  f"but the model's embedding has {embedding_rows} rows",
                                  fix="the tokenizer files belong to another model", where=where)
        n = len(row["input_ids"]) + (1 if target else 0)  # the decoder start token
        if n == 0 or not sentence.strip():
            raise UsageError(f"{what} {i} gives no tokens", fix="give it some text")
        if n > max_tokens:
            raise UsageError(f"{what} {i} has {n} tokens, more than --max-tokens {max_tokens} "
                             "(attention costs O(L²) per head)",
                             fix="raise --max-tokens or shorten it")
        if isinstance(limit, int) and n > limit:
            raise UsageError(f"{what} {i} has {n} tokens; the model takes at most {limit}",
                             fix="shorten it")
        out.append(row)
    _check_not_all_unknown(loaded, out)
    return out


def _check_not_all_unknown(loaded: LoadedModel, rows: list[dict[str, list]]) -> None:
    """A tokenizer that maps every word to its unknown token (a vocabulary that does not belong
    to the model, or none) would show maps of [UNK] tokens: refuse instead."""
    tok = loaded.tokenizer
    unk = getattr(tok, "unk_token_id", None)
    special = set(getattr(tok, "all_special_ids", None) or []) - {unk}
    words = [t for row in rows for t in row["input_ids"] if t not in special]
    if isinstance(unk, int) and words and all(t == unk for t in words):
        raise CheckpointError("the model's tokenizer maps every word of the sentences to its "
                              "unknown token", fix="check that the tokenizer files belong to the "
                              "model", where=printable_path(loaded.folder))


def _filler(loaded: LoadedModel) -> int:
    """An id for padded positions: any id the embedding table has will do, they are masked."""
    tok = loaded.tokenizer
    vocab = loaded.embeddings.num_embeddings
    return next((i for i in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id)
                 if isinstance(i, int) and 0 <= i < vocab), 0)


def _pad(loaded: LoadedModel, runner: Any, rows: list[dict[str, list]]
         ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Padded model inputs on the tokenizer's padding side, and each sentence's offset.

    Padding is done here rather than by the tokenizer so that tokenizers without a pad token
    (GPT-2, LLaMA) need no change.
    """
    left = getattr(loaded.tokenizer, "padding_side", "right") == "left"
    length = max(len(row["input_ids"]) for row in rows)
    rows = [{**row, "attention_mask": [1] * len(row["input_ids"])} for row in rows]
    fills = {"input_ids": _filler(loaded)}  # attention_mask and token_type_ids pad with 0
    # Tokenizers may return inputs the model does not take (token_type_ids for LLaMA in 4.x).
    accepts = inspect.signature(runner.forward).parameters
    feed: dict[str, torch.Tensor] = {}
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        if name not in rows[0] or name not in accepts:
            continue
        padded = []
        for row in rows:
            pad = [fills.get(name, 0)] * (length - len(row[name]))
            padded.append(pad + row[name] if left else row[name] + pad)
        feed[name] = torch.tensor(padded)
    if "attention_mask" not in feed:
        raise CheckpointError("the model's forward takes no attention_mask",
                              fix="report this model to attnviz")
    mask = feed["attention_mask"]
    if left and "position_ids" in accepts:
        # As generate() does: real tokens count from 0 after left padding, so learned absolute
        # positions (GPT-2) match a sentence run alone. Right padding keeps the model's default.
        feed["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    offsets = [length - len(row["input_ids"]) if left else 0 for row in rows]
    device = _input_device(loaded.model)
    return {k: v.to(device) for k, v in feed.items()}, offsets


def _add_targets(loaded: LoadedModel, prepared: Prepared, targets: list[str],
                 max_tokens: int) -> None:
    start = getattr(loaded.config, "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise CheckpointError("the model's config has no decoder_start_token_id",
                              fix="add it to config.json", where=printable(str(loaded.folder)))
    rows = _encode(loaded, targets, max_tokens, "--target", target=True)
    ids = [[start, *row["input_ids"]] for row in rows]
    length = max(len(row) for row in ids)
    filler = _filler(loaded)
    device = _input_device(loaded.model)
    prepared.feed["decoder_input_ids"] = torch.tensor(
        [row + [filler] * (length - len(row)) for row in ids], device=device)
    if "decoder_attention_mask" in inspect.signature(loaded.model.forward).parameters:
        prepared.feed["decoder_attention_mask"] = torch.tensor(
            [[1] * len(row) + [0] * (length - len(row)) for row in ids], device=device)
    tokens = [loaded.tokenizer.convert_ids_to_tokens(row) for row in ids]
    prepared.target = Batch(list(targets), tokens)
    prepared.target_offsets = [0] * len(ids)


# --- layers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelLayer:
    """One attention call of the model's forward pass, as the probe saw it."""

    index: int  # call order (capture's numbering)
    name: str  # the calling module's name in the runner
    display_name: str  # … in the whole model
    kind: cap.LayerKind
    stack: str  # "" (single-stack model), "enc", "dec" or "cross"
    stack_index: int  # its number within the stack
    num_heads: int | None
    num_kv_heads: int | None
    occurrence: int  # how many earlier calls the same module made (ALBERT shares one)

    @property
    def label(self) -> str:
        return f"{self.stack} {self.stack_index}" if self.stack else str(self.stack_index)


def probe(loaded: LoadedModel, prepared: Prepared) -> list[ModelLayer]:
    """Every attention call of the forward pass, from one run on a single token (all sdpa)."""
    try:
        result = cap.capture(prepared.runner, prepared.tiny(), shown_layers=[])
    except (RuntimeError, ValueError, IndexError) as exc:  # a model that cannot run at all
        raise CheckpointError(f"the model's forward pass failed: {printable(str(exc), 200)}",
                              fix="check that the model runs in transformers",
                              where=printable(str(loaded.folder))) from None
    if not result.layers:
        raise CheckpointError("the model's forward pass made no attention call",
                              fix="report this model to attnviz",
                              where=printable(str(loaded.folder)))
    return model_layers(loaded, prepared, result.layers)


def model_layers(loaded: LoadedModel, prepared: Prepared,
                 calls: list[cap.CapturedLayer]) -> list[ModelLayer]:
    """The attention calls of a forward pass, labelled per stack."""
    counts: Counter[str] = Counter()
    seen: Counter[tuple[str, str]] = Counter()
    layers = []
    prefix = prepared.runner_name + "." if prepared.runner_name else ""
    for call in calls:
        stack = STACK_OF[call.kind] if loaded.encoder_decoder else ""
        layers.append(ModelLayer(call.index, call.name, prefix + call.name, call.kind, stack,
                                 counts[stack], call.num_heads, call.num_kv_heads,
                                 seen[(stack, call.name)]))
        counts[stack] += 1
        seen[(stack, call.name)] += 1
    return layers


def select(layers: list[ModelLayer], spec: str | None) -> list[ModelLayer]:
    """The layers --layer names (see `attnviz.core.selection.parse_stack_layers`)."""
    stacks: dict[str, int] = {}
    for layer in layers:
        stacks[layer.stack] = stacks.get(layer.stack, 0) + 1
    try:
        chosen = parse_stack_layers(spec, stacks)
    except UsageError as error:
        if list(stacks) == ["enc"] and "this run has no" in error.what:
            error.fix = "pass --target 'text' (one per sentence) to run the decoder too"
        raise
    if chosen is None:
        return list(layers)
    by_stack = {(layer.stack, layer.stack_index): layer for layer in layers}
    return sorted((by_stack[pair] for pair in chosen), key=lambda layer: layer.index)


@dataclass
class Plan:
    """What one heatmap run will do: its inputs, the model's layers, the ones shown.

    When the input is short and --layer names call indices directly (all, N, A:B), no probe
    runs: `layers` and `shown` stay None until the run itself numbers the calls, and `indices`
    says which to show (None: every call).
    """

    prepared: Prepared
    layers: list[ModelLayer] | None
    shown: list[ModelLayer] | None
    indices: list[int] | None = None
    spec: str | None = None


def plan_run(loaded: LoadedModel, sentences: list[str], layer: str | None = None,
             targets: list[str] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
             need_layers: bool = False, query: bool = False) -> Plan:
    """Inputs encoded and, where the run needs them before it starts, the layers numbered by a
    1-token probe: --layer forms that need the layer count or the stacks (-1, 'cross 0'), long
    inputs (the streaming decision needs the heads), need_layers (a figure's panel limit), and
    --query on a decoder run (its rows may be target tokens)."""
    prepared = prepare(loaded, sentences, targets, max_tokens)
    direct = _direct_indices(layer)
    if not need_layers and direct is not False and not (query and targets is not None) \
            and _surely_small(loaded, prepared):
        return Plan(prepared, None, None, cast(Any, direct), layer)
    layers = probe(loaded, prepared)
    return Plan(prepared, layers, select(layers, layer), None, layer)


def _direct_indices(spec: str | None) -> list[int] | None | bool:
    """Call indices a --layer names without knowing the layers: None (all), N, A:B with A < B;
    False for every other form."""
    if spec is None or spec.strip() == "all":
        return None
    text = spec.strip()
    if re.fullmatch(r"\d+", text):
        return [int(text)]
    match = re.fullmatch(r"(\d+):(\d+)", text)
    if match and int(match[1]) < int(match[2]):
        return list(range(int(match[1]), int(match[2])))
    return False


def _surely_small(loaded: LoadedModel, prepared: Prepared) -> bool:
    """Whether every layer's full maps fit well within the streaming budget, by the config's
    head and layer counts (or the attention modules counted): then nothing can stream."""
    from attnviz.compute import streaming

    config = loaded.config
    heads = max((value for name in ("num_attention_heads", "encoder_attention_heads",
                                    "decoder_attention_heads", "num_heads", "n_head")
                 if isinstance(value := getattr(config, name, None), int)), default=0)
    layers = max((value for name in ("num_hidden_layers", "encoder_layers", "decoder_layers",
                                     "num_layers", "num_decoder_layers", "n_layer")
                  if isinstance(value := getattr(config, name, None), int)), default=0)
    modules = sum(1 for module in prepared.runner.modules() if _attention_like(module))
    if not heads or not (layers or modules):
        return False
    calls = max(modules, layers * (3 if prepared.target is not None else 1))
    length = prepared.batch.max_len
    if prepared.target is not None:
        length = max(length, prepared.target.max_len)
    size = len(prepared.batch.tokens) * heads * calls * length * length * 4
    return size <= streaming.MAP_BUDGET_BYTES // 2


def _attention_like(module: Any) -> bool:
    """A module that calls the attention interface, or is named like an attention module."""
    return (cap._calls_interface(type(module))  # type: ignore[arg-type]
            or "Attention" in type(module).__name__)


# --- the run -----------------------------------------------------------------------------------

class _RowsToAdd:
    """For cross-attention layers: copies each sentence's rows of every head into one (H, n, S)
    buffer and hands the sentence to `MapReducer.add` once its last real row is in (so one
    layer's maps of one sentence are held at a time, not all)."""

    def __init__(self, reducer: Any, lengths: list[int]) -> None:
        self.reducer = reducer
        self.lengths = lengths
        self.buffers: dict[int, tuple[torch.Tensor, int]] = {}  # sentence: (maps, rows filled)

    def add_rows(self, sentence: int, first_head: int, row_start: int, attn_block: torch.Tensor,
                 scores_block: torch.Tensor | None = None) -> None:
        heads, rows, keys = attn_block.shape
        buffer, filled = self.buffers.get(sentence) or (
            torch.empty(heads, self.lengths[sentence], keys), 0)
        buffer[:, row_start:row_start + rows] = attn_block
        filled += rows
        if filled < self.lengths[sentence]:
            self.buffers[sentence] = buffer, filled
            return
        self.buffers.pop(sentence, None)
        for head in range(heads):  # one head at a time: add's temporaries are one map's
            self.reducer.add(sentence, first_head + head, buffer[head:head + 1])
        del buffer
        _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim), so that a long input's
    layer after layer of freed maps does not add up in the process's resident memory."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


class _Collector:
    """The on_block of one run: each shown layer's blocks, realigned to real tokens at once,
    into a full (B, H, n, m) map or, when streaming, into the layer's MapReducer."""

    def __init__(self, plan: Plan, reducers: dict[int, Any]) -> None:
        self.plan = plan
        self.by_index = {layer.index: layer for layer in plan.shown or []}
        # blocks of layers not numbered before the run (no probe): realigned by replay()
        self.raw: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.reducers = reducers
        self.feeders: dict[int, Any] = {}
        for index, reducer in reducers.items():
            layer = self.by_index[index]
            if layer.kind != cap.LayerKind.CROSS:
                # self-attention: each block of query rows is reduced at once (memory per head
                # O(block × S), never a whole map)
                self.feeders[index] = reducer
                continue
            # cross-attention: a sentence's target rows against its source keys are gathered
            # into one map per sentence first (MapReducer's statistics compare positions of
            # one sequence; cross maps have their own)
            lengths = [len(t) for t in _rows_tokens(plan, layer)]
            self.feeders[index] = _RowsToAdd(reducer, lengths)
        self.maps: dict[int, torch.Tensor] = {}
        self.causal: dict[int, bool] = {}

    def replay(self, shown: list[ModelLayer]) -> None:
        """Realign the blocks kept raw, now that the run has numbered its layers."""
        self.by_index = {layer.index: layer for layer in shown}
        for index, blocks in self.raw.items():
            for row_start, weights in blocks:
                self(index, row_start, weights)
        self.raw = {}

    def __call__(self, index: int, row_start: int, weights: torch.Tensor) -> None:
        layer = self.by_index.get(index)
        if layer is None:  # short input, no probe: kept as the model made it, realigned later
            self.raw.setdefault(index, []).append((row_start, weights.float().cpu()))
            return
        rows_tokens = _rows_tokens(self.plan, layer)
        cols_tokens = _cols_tokens(self.plan, layer)
        q_offsets, k_offsets = _offsets(self.plan, layer)
        count = weights.shape[2]
        if index not in self.reducers and index not in self.maps:
            self.maps[index] = torch.zeros(
                weights.shape[0], weights.shape[1], max(map(len, rows_tokens)),
                max(map(len, cols_tokens)))
        causal = self.causal.get(index, layer.kind != cap.LayerKind.CROSS)
        for b, (rows, cols) in enumerate(zip(rows_tokens, cols_tokens, strict=True)):
            n, m, q0, k0 = len(rows), len(cols), q_offsets[b], k_offsets[b]
            lo, hi = max(row_start, q0), min(row_start + count, q0 + n)
            if lo >= hi:
                continue
            block = weights[b, :, lo - row_start:hi - row_start, k0:k0 + m].float()  # (H, r, m)
            if causal and bool(block.triu(lo - q0 + 1).any()):
                causal = False
            if index in self.reducers:
                self.feeders[index].add_rows(b, 0, lo - q0, block.cpu(), None)
            else:
                self.maps[index][b, :, lo - q0:hi - q0, :m] = block.cpu()
        self.causal[index] = causal


def _rows_tokens(plan: Plan, layer: ModelLayer) -> list[list[str]]:
    if layer.kind == cap.LayerKind.SELF:
        return plan.prepared.batch.tokens
    assert plan.prepared.target is not None
    return plan.prepared.target.tokens


def _cols_tokens(plan: Plan, layer: ModelLayer) -> list[list[str]]:
    if layer.kind == cap.LayerKind.DECODER_SELF:
        assert plan.prepared.target is not None
        return plan.prepared.target.tokens
    return plan.prepared.batch.tokens


def _offsets(plan: Plan, layer: ModelLayer) -> tuple[list[int], list[int]]:
    source = plan.prepared.offsets
    target = plan.prepared.target_offsets or [0] * len(source)
    if layer.kind == cap.LayerKind.SELF:
        return source, source
    if layer.kind == cap.LayerKind.CROSS:
        return target, source
    return target, target


def _input_hooks(plan: Plan, keep: set[int] | None
                 ) -> tuple[list[Any], dict[tuple[str, int], torch.Tensor]]:
    """Forward pre-hooks that keep the hidden states entering the attention modules, by (module
    name, call of that module): of the calls `keep` when the layers are known, else of every
    attention-like module (short inputs only)."""
    runner = plan.prepared.runner
    modules = dict(runner.named_modules())
    if plan.shown is not None:
        names = [layer.name for layer in plan.shown if keep is None or layer.index in keep]
        wanted: set[tuple[str, int]] | None = {
            (layer.name, layer.occurrence) for layer in plan.shown
            if keep is None or layer.index in keep}
    else:
        names = [name for name, module in modules.items() if name and _attention_like(module)]
        wanted = None
    calls: Counter[str] = Counter()
    inputs: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    batch = len(plan.prepared.batch.tokens)

    def hook_for(name: str) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            key = name, calls[name]
            calls[name] += 1
            x = args[0] if args else kwargs.get("hidden_states")
            if (wanted is None or key in wanted) and isinstance(x, torch.Tensor) \
                    and x.ndim == 3 and x.shape[0] == batch:
                inputs[key] = x.detach().float().cpu()
        return hook

    for name in dict.fromkeys(names):
        if name in modules:
            handles.append(modules[name].register_forward_pre_hook(hook_for(name),
                                                                   with_kwargs=True))
    return handles, inputs


def run_model(loaded: LoadedModel, plan: Plan, allow_stream: bool = False,
              query: tuple[int, str] | None = None) -> AttentionRun:
    """The model's own attention weights (and attention inputs) of the layers the plan shows.

    With allow_stream, when the full maps of the source layers shown would exceed the streaming
    budget, each is reduced block by block to display views and statistics
    (`attnviz.compute.streaming.MapReducer`) and dropped, keeping only the last layer's inputs
    and, for query = (sentence, token spec), that query's row of every head of the last layer.
    Decoder and cross-attention maps (rows are target tokens) are always kept whole.
    With query, the last layer's query, key and mask are kept for the breakdown.
    """
    from attnviz.compute import streaming

    prepared = plan.prepared
    batch = prepared.batch
    if query is not None and loaded.path != cap.CapturePath.INTERFACE:
        raise UsageError("--query needs the q and k the model's attention receives, which "
                         "only models using transformers' attention interface hand out; "
                         f"{type(loaded.model).__name__} returns its maps through "
                         "output_attentions", fix="drop --query", option="--query")
    shown = plan.shown
    query_row = None
    reducers: dict[int, Any] = {}
    stream = False
    if shown is not None:
        last = shown[-1]
        if query is not None:  # resolved before the model runs: a typo costs nothing
            query_row = query[0], find_query(_rows_tokens(plan, last)[query[0]], query[1])
        source_layers = [layer for layer in shown if layer.kind == cap.LayerKind.SELF]
        heads = max((layer.num_heads or 0 for layer in source_layers), default=0)
        stream = allow_stream and bool(source_layers) and streaming.full_maps_bytes(
            batch, heads, layers=len(source_layers)) > streaming.MAP_BUDGET_BYTES
        reducers = {layer.index: streaming.MapReducer(
            layer.index, batch.tokens, query_row if layer is last else None)
            for layer in source_layers} if stream else {}
        indices: list[int] | None = [layer.index for layer in shown]
        keep_qk: bool | list[int] = [last.index] if query is not None else False
    else:  # short input, layers numbered by the run itself: every source row is a sentence's
        if query is not None:
            find_query(batch.tokens[query[0]], query[1])
        indices = plan.indices
        keep_qk = query is not None and (indices is None or [max(indices)])
    collector = _Collector(plan, reducers)
    handles, inputs = _input_hooks(plan, None if not stream or shown is None
                                   else {shown[-1].index})
    try:
        result = cap.capture(prepared.runner, prepared.feed, indices, BLOCK_BUDGET_BYTES,
                             collector, keep_qk=keep_qk)
    except UsageError as error:
        if not error.what.startswith("no attention layer"):
            raise
        count = error.what.split("ran ")[-1].split(" ")[0]
        fix = f"use all, 0..{int(count) - 1}, -1 or A:B"
        if loaded.encoder_decoder:
            fix = "a bare number is an encoder layer; name the decoder's: 'dec N', 'cross N'"
        raise UsageError(f"--layer {plan.spec!r} is not a layer of this model", fix=fix,
                         option="--layer") from None
    finally:
        for handle in handles:
            handle.remove()
    if shown is None:
        layers = model_layers(loaded, prepared, result.layers)
        if not layers:
            raise CheckpointError("the model's forward pass made no attention call",
                                  fix="report this model to attnviz",
                                  where=printable(str(loaded.folder)))
        shown = layers if indices is None else [layers[i] for i in indices]
        if any(layer.stack not in ("", "enc") for layer in shown) and plan.spec not in (
                None, "all"):
            encoder = sum(layer.stack == "enc" for layer in layers)
            raise UsageError(f"--layer {plan.spec!r}: a bare number is an encoder layer, and the "
                             f"encoder has {encoder}", fix=f"use 0..{encoder - 1}, or name the "
                             "stack: 'dec N', 'cross N'", option="--layer")
        last = shown[-1]
        collector.replay(shown)
        if query is not None:
            query_row = query[0], find_query(_rows_tokens(plan, last)[query[0]], query[1])
    calls = {call.index: call for call in result.layers}
    results = []
    for layer in shown:
        call = calls[layer.index]
        method = _method(loaded, prepared, call)
        x = inputs.get((layer.name, layer.occurrence))
        q_offsets, _ = _offsets(plan, layer)
        if x is not None:
            x = _realign_rows(x, q_offsets, [len(t) for t in _rows_tokens(plan, layer)])
        common: dict[str, Any] = dict(
            name=layer.display_name, num_heads=call.num_heads, kind=layer.kind.value,
            label=layer.label if layer.stack else None,
            causal=collector.causal.get(layer.index),
            query_tokens=None if layer.kind == cap.LayerKind.SELF else _rows_tokens(plan, layer),
            key_tokens=None if layer.kind != cap.LayerKind.DECODER_SELF
            else _cols_tokens(plan, layer))
        if layer.index in reducers:
            finished = reducers[layer.index].finish(
                cast(Any, None), x, f"{method}, streamed ({streaming.STREAMED})")
            for key, value in common.items():
                setattr(finished, key, value)
            if query is not None and layer is last:
                finished.scores = _scores(call, plan, layer)
            if layer.stack:
                finished.views = [_labelled(v, layer.label) for v in finished.views or []]
                finished.stats = [_labelled_stats(s, layer.label) for s in finished.stats or []]
            results.append(finished)
            continue
        scores = _scores(call, plan, layer) if query is not None and layer is last else None
        results.append(LayerAttention(layer.index, None, collector.maps[layer.index], x, method,
                                      scores=scores, **common))
    notes = []
    if stream:
        notes.append("long input: each source layer's maps reduced to display size block by "
                     f"block, {streaming.STREAMED} (≤ {streaming.DISPLAY_CELLS} per side); "
                     "--export keeps the full maps")
    if loaded.encoder_decoder and prepared.target is None:
        notes.append("encoder-decoder model: its encoder ran alone (--target 'text', one per "
                     "sentence, runs the decoder too: 'dec N' and 'cross N' layers)")
    described = ("the model's own hidden states entering each attention module (token and "
                 "position embeddings, earlier layers and the block's own norm, if any)")
    causal = all(r.causal for r in results if r.kind != cap.LayerKind.CROSS.value)
    return AttentionRun(batch, results, printable(str(loaded.folder)), described,
                        str(_input_device(loaded.model)), causal, None, notes,
                        TOLERANCE[loaded.dtype], target=prepared.target,
                        path=PATHS[result.path])


def _method(loaded: LoadedModel, prepared: Prepared, call: cap.CapturedLayer) -> str:
    if call.computed_with == "output_attentions":
        return "output_attentions (eager)"
    module = dict(prepared.runner.named_modules()).get(call.name)
    owner = type(module).__name__ if module is not None else "its module"
    function = cap.eager_function(module) if module is not None else None
    where = "attnviz's generic eager" if function is cap.generic_eager else \
        f"{owner}'s own eager_attention_forward"
    return f"{where}, in blocks of query rows"


def _labelled(view: Any, label: str) -> Any:
    from dataclasses import replace

    return replace(view, label=label)


def _labelled_stats(stats: Any, label: str) -> Any:
    from dataclasses import replace

    return replace(stats, layer_label=label)


def _scores(call: cap.CapturedLayer, plan: Plan, layer: ModelLayer) -> CapturedScores | None:
    if call.query is None or call.key is None:
        return None
    kwargs = call.score_kwargs
    scaling = kwargs.get("scaling")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    q_offsets, k_offsets = _offsets(plan, layer)
    return CapturedScores(
        call.query, call.key, float(scaling) if scaling is not None else
        call.query.shape[-1] ** -0.5, call.mask, kwargs.get("position_bias"),
        None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
        None if sinks is None else sinks.detach(), tuple(q_offsets), tuple(k_offsets))


def _realign_rows(x: torch.Tensor, offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """(B, L, E) with each sentence's real rows moved to 0..n-1, zeros after."""
    out = torch.zeros(x.shape[0], max(lengths), x.shape[2], dtype=x.dtype)
    for b, (offset, n) in enumerate(zip(offsets, lengths, strict=True)):
        out[b, :n] = x[b, offset:offset + n]
    return out


def _major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _input_device(model: Any) -> torch.device:
    """Where the inputs go: the token embedding's device (under --device-map, the first)."""
    import contextlib

    with contextlib.suppress(NotImplementedError, AttributeError):
        return model.get_input_embeddings().weight.device
    return next(model.parameters()).device


# --- finding attnviz's layer in the model ------------------------------------------------------

def parameter_of(model: Any, key: str) -> tuple[str, torch.nn.Parameter]:
    """The model's parameter holding checkpoint tensor `key` (prefixes such as `model.` differ
    between checkpoint keys and AutoModel's base model)."""
    params = dict(model.named_parameters())
    if key in params:
        return key, params[key]
    found = [(name, p) for name, p in params.items()
             if key.endswith("." + name) or name.endswith("." + key)]
    if len(found) != 1:
        raise CheckpointError(f"checkpoint tensor {printable(key)!r} matches {len(found)} "
                              "parameters of the loaded model",
                              fix="report this model to attnviz")
    return found[0]


def module_of(model: Any, parameter_name: str) -> tuple[str, Any]:
    """The module owning a parameter (its name without the last part)."""
    name = parameter_name.rsplit(".", 1)[0] if "." in parameter_name else ""
    return name, model.get_submodule(name)


def call_of(layers: list[ModelLayer] | None, model: Any, layer: AttentionLayer) -> ModelLayer:
    """The attention call that runs attnviz's `layer`: the call whose module holds its W_q (the
    innermost such module; its first call when the module runs several times)."""
    if layers is None:  # a plan made with need_layers numbers them; without, nothing to match
        raise CheckFailed("the run did not number the model's attention layers",
                          fix="report this")
    q_name, _ = parameter_of(model, layer.q_weight.key)
    owners = [call for call in layers if q_name.startswith(call.display_name + ".")]
    if not owners:
        raise CheckpointError(f"no attention call of the model's forward pass holds "
                              f"{printable(layer.q_weight.key)!r}",
                              fix="report this model to attnviz")
    longest = max(len(call.display_name) for call in owners)
    return next(call for call in owners if len(call.display_name) == longest)


# --- the recompute proof -----------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyResult:
    layer_index: int
    layer: AttentionLayer
    per_head: list[float]  # max |Δ| per query head, over real query rows and all key columns
    tolerance: float
    positions: str  # how positions entered the recomputation
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def max_diff(self) -> float:
        return max(self.per_head)

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.tolerance


def recompute_supported(loaded: LoadedModel, call: ModelLayer) -> str | None:
    """Why the recompute proof cannot run on this layer, or None when it can."""
    from attnviz.compute.positions import SCHEMES
    from attnviz.load import config as hfconfig

    kind = hfconfig.model_type(loaded.store.config)
    if kind not in SCHEMES:
        return (f"attnviz does not recompute the positions of model_type {kind!r} (supported: "
                f"{', '.join(sorted(SCHEMES))})")
    if call.kind != cap.LayerKind.SELF:
        return "the recompute proof covers self-attention over the source only"
    return None


def verify_layer(loaded: LoadedModel, layer: AttentionLayer, sentences: list[str], *,
                 described: AttentionLayer | None = None, plan: Plan | None = None,
                 run: AttentionRun | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> VerifyResult:
    """Recompute one layer's weights from its captured input with attnviz's slices; compare.

    `described` replaces attnviz's own description in the recomputation (tests use it to prove a
    wrong slicing fails); `plan`/`run` reuse a run that captured this layer.
    """
    from attnviz.compute.forward import load_weights
    from attnviz.compute.positions import positions_for, recompute_weights

    plan = plan or plan_run(loaded, sentences, None, None, max_tokens, need_layers=True)
    call = call_of(plan.layers, loaded.model, layer)
    reason = recompute_supported(loaded, call)
    if reason is not None:
        raise UsageError(f"the recompute proof does not apply: {reason}",
                         fix="the ablation proof (split --verify) needs no per-family math")
    if run is None or all(c.index != call.index for c in run.layers):
        run = run_model(loaded, Plan(plan.prepared, plan.layers, [call]))
    captured = run.layer(call.index)
    if captured.inputs is None or captured.weights is None:
        raise CheckFailed(f"the input of {printable(call.display_name)!r} was not captured",
                          fix="report this model to attnviz")
    used = described or layer
    positions = positions_for(loaded.store.config, used, call.stack_index,
                              captured.inputs.shape[1])
    recomputed = recompute_weights(used, load_weights(used, loaded.store), captured.inputs,
                                   run.batch.lengths, positions)
    per_head = torch.zeros(recomputed.shape[1])
    for b, n in enumerate(run.batch.lengths):
        diff = (recomputed[b, :, :n] - captured.weights[b, :, :n]).abs()  # (H, n, L)
        per_head = torch.maximum(per_head, diff.flatten(1).amax(1))
    notes = []
    if positions.rope is not None and not used.positions.startswith("rope"):
        notes.append(f"attnviz describes this layer's positions as {used.positions!r}")
    return VerifyResult(call.index, used, per_head.tolist(), TOLERANCE[loaded.dtype],
                        positions.described, notes, call.label)
