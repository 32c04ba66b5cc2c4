"""Real pretrained models through Hugging Face transformers: load offline, capture, verify.

`run_model` runs the model's own forward pass (eager attention) and keeps, for the requested layers
only, the per-query-head weights (B, H, L, L) and the hidden states entering each attention block.
Sequences are re-aligned so each sentence's real tokens sit at positions 0..n-1 (right padding),
as the renderers and `attnviz.compute.stats` assume. `verify_layer` recomputes one layer's
weights from that captured input with attnviz's own AttentionLayer slices, read from the
checkpoint files, and positions recomputed from config.json by `attnviz.compute.positions`
(never taken from the model).
transformers is imported lazily: the core install works without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnviz.compute.attention import resolve_device
from attnviz.compute.forward import load_weights
from attnviz.compute.inputs import DEFAULT_MAX_SENTENCES, DEFAULT_MAX_TOKENS, Batch, find_query
from attnviz.compute.positions import SCHEMES, positions_for, recompute_weights
from attnviz.compute.results import AttentionRun, LayerAttention
from attnviz.core.layer import AttentionLayer
from attnviz.errors import (
    CheckFailed,
    CheckpointError,
    UsageError,
    printable,
    printable_path,
    quoted,
)
from attnviz.load import config as hfconfig
from attnviz.load.checkpoint import TensorStore, open_checkpoint
from attnviz.recognize import find_layers
from attnviz.sources import hf_guard as guard

METHOD = "transformers eager attention (output_attentions)"
DTYPES = ("float32", "bfloat16", "float16")
# The model itself computes in its dtype; float32 must agree to rounding, half precision loosely.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def require_transformers() -> None:
    """Fail with the install hint when the Hugging Face extra is missing."""
    # attnviz never downloads: huggingface_hub reads this once, when it is first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    if any(importlib.util.find_spec(name) is None for name in ("transformers", "tokenizers")):
        raise UsageError("--model needs the Hugging Face extra", "pip install 'attnviz[hf]'")


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (AutoModel: the base model, no head)
    tokenizer: Any
    folder: Path  # the local model folder (or hub-cache snapshot) the weights came from
    config: Any  # the transformers config object
    dtype: str
    store: TensorStore  # attnviz's own view of the same files
    layers: list[AttentionLayer] = field(default_factory=list)  # find_layers, in model order
    encoder_only: bool = False  # an encoder-decoder model: its encoder runs, alone
    tower: str | None = None  # a multi-tower model (CLIP): the attribute of its text tower

    @property
    def runner(self) -> Any:
        """The module whose forward pass runs: the model, an encoder-decoder's encoder, or a
        multi-tower model's text tower."""
        if self.tower is not None:
            return getattr(self.model, self.tower)
        return self.model.get_encoder() if self.encoder_only else self.model

    @property
    def embeddings(self) -> Any:
        """The token embedding of the part that runs."""
        for owner in (self.runner, self.model):
            getter = getattr(owner, "get_input_embeddings", None)
            if getter is not None:
                with contextlib.suppress(NotImplementedError, AttributeError):
                    found = getter()
                    if isinstance(found, torch.nn.Embedding):
                        return found
        found = next((m for m in self.runner.modules() if isinstance(m, torch.nn.Embedding)),
                     None)
        if found is None:
            raise CheckpointError("the model has no token embedding", "", str(self.folder))
        return found


def resolve_folder(spec: str) -> Path:
    """A model folder, or a hub id found in the local Hugging Face cache (never downloaded)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UsageError("--model takes a model folder or a hub id, not a file",
                         "pass the folder holding config.json", printable(spec))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UsageError("no such model folder", "check the path", printable(spec))
    require_transformers()
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(spec, "config.json")
    except ValueError:  # HFValidationError: not a valid repo id
        raise UsageError("not a model folder nor a valid hub id", "check --model",
                         printable(spec)) from None
    if not isinstance(found, str):
        raise CheckpointError(f"model {quoted(spec)} is not in the local Hugging Face cache",
                              f"download it once with 'hf download {printable(spec)}' (attnviz "
                              "never downloads), or pass a model folder")
    return Path(found).parent


def load_model(spec: str, device: str = "cpu", dtype: str = "float32",
               device_map: str | None = None) -> LoadedModel:
    """Model + tokenizer from a folder or the local hub cache, with eager attention."""
    require_transformers()
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}", "--dtype")
    if device_map is not None:
        if device_map != "auto":
            raise UsageError(f"unknown device map {device_map!r}", "use auto", "--device-map")
        if importlib.util.find_spec("accelerate") is None:
            raise UsageError("--device-map auto needs accelerate", "pip install accelerate")
    target = None if device_map else resolve_device(device)
    folder = resolve_folder(spec)
    store = open_checkpoint(folder)
    inventory = find_layers(store)
    layers = inventory.layers
    if inventory.unresolved:  # the model's attention modules and attnviz's layers must pair up
        item = inventory.unresolved[0]
        raise CheckpointError(item.what, item.fix, printable_path(folder))
    if not layers:
        raise CheckpointError("no attention layer recognized in the model",
                              "run 'attnviz inspect' on the folder", printable_path(folder))
    where = printable_path(folder)
    guard.check_folder(folder, store)  # config.json and its layer counts: before transformers
    import transformers

    # Only local files, never repository code; eager attention is the one that returns weights.
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    dtype_key = "dtype" if _major() >= 5 else "torch_dtype"  # renamed in transformers 5
    fix = "check that the folder holds config.json, the weights and the tokenizer files"
    with guard.quiet():
        with guard.contained("transformers cannot read the model's config.json", fix, where):
            config = transformers.AutoConfig.from_pretrained(folder, **common)
            meta = guard.meta_model(transformers, config)  # shapes only, on the meta device
        tower = guard.text_runner(meta, config)
        guard.check_tokenizer_files(folder)
        guard.check_sizes(meta, store, where)
        del meta
        with guard.contained("transformers cannot load the model", fix, where):
            model, info = transformers.AutoModel.from_pretrained(
                folder, attn_implementation="eager", device_map=device_map,
                output_loading_info=True, **{dtype_key: getattr(torch, dtype)}, **common)
        with guard.contained("the model's tokenizer cannot be loaded", "check or replace its "
                             "tokenizer files", where):
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **common)
    model.eval()
    if target is not None:
        model.to(target)
    loaded = LoadedModel(model, tokenizer, folder, config, dtype, store, layers)
    loaded.tower = tower
    # The decoder of an encoder-decoder model needs target text, which --model does not take:
    # its encoder runs alone. A multi-tower model (CLIP) runs its text tower alone. Either way
    # the layers are those inside the part that runs, numbered from 0.
    loaded.encoder_only = tower is None and bool(getattr(config, "is_encoder_decoder", False))
    runner_params = {id(p) for p in loaded.runner.parameters()}
    guard.check_loaded(info, {name for name, p in model.named_parameters()
                              if id(p) in runner_params}, where)
    if loaded.encoder_only or tower is not None:
        inside = {id(m) for m in loaded.runner.modules()}
        pairs = zip(layers, _attention_modules(loaded), strict=True)
        loaded.layers = [layer for layer, (_, module) in pairs if id(module) in inside]
    return loaded


def model_index(loaded: LoadedModel, layer: AttentionLayer) -> int:
    """Where a checkpoint layer (numbered as `inspect` numbers them) runs in the model's own
    order; a decoder layer of an encoder-decoder model does not run at all."""
    names = [candidate.name for candidate in loaded.layers]
    if layer.name not in names:
        shown = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
        raise UsageError(f"layer {quoted(layer.name)} is in the decoder of an "
                         "encoder-decoder model, which --model runs only the encoder of",
                         f"choose an encoder layer, by name: {printable(shown)}", "--layer")
    return names.index(layer.name)


def run_model(loaded: LoadedModel, sentences: list[str], layers: list[int] | None = None,
              max_tokens: int = DEFAULT_MAX_TOKENS, allow_stream: bool = False,
              query: tuple[int, str] | None = None) -> AttentionRun:
    """The model's own attention weights and attention inputs for the requested layers.

    With allow_stream, when the requested layers' full maps would exceed the streaming budget,
    each layer's maps are reduced inside the forward pass to display views and statistics
    (`attnviz.compute.streaming.MapReducer`) and dropped, keeping only the last layer's inputs
    and, for query = (sentence, token spec), that query's row of every head of the last layer.
    """
    from attnviz.compute import streaming

    indices = _layer_indices(len(loaded.layers), layers)
    ids = _encode(loaded, sentences, max_tokens)
    with guard.quiet(), guard.contained("the model's tokenizer failed", "check or replace its "
                                        "tokenizer files", printable_path(loaded.folder)):
        tokens = [[str(t) for t in loaded.tokenizer.convert_ids_to_tokens(row["input_ids"])]
                  for row in ids]
    batch = Batch(list(sentences), tokens)
    query_row = None
    if query is not None:  # resolved before the model runs: a typo costs nothing
        query_row = query[0], find_query(tokens[query[0]], query[1])
    heads = max(loaded.layers[i].num_heads or 0 for i in indices)
    stream = allow_stream and streaming.full_maps_bytes(batch, heads, layers=len(indices)) > \
        streaming.MAP_BUDGET_BYTES
    feed, mask = _pad(loaded, ids)
    real = [row.nonzero().flatten() for row in mask.cpu()]  # where each sentence's tokens sit
    reducers = {i: streaming.MapReducer(i, tokens, query_row if i == indices[-1] else None)
                for i in indices} if stream else None
    captured = _capture(loaded, indices, feed, mask, real, reducers)
    results = []
    for i in indices:
        weights, inputs = captured[i]
        inputs = None if inputs is None else _realign(inputs, real, (1,))
        if reducers is not None:
            results.append(reducers[i].finish(loaded.layers[i], inputs,
                                              f"{METHOD}, streamed ({streaming.STREAMED})"))
        else:
            results.append(LayerAttention(i, loaded.layers[i], _realign(weights, real, (2, 3)),
                                          inputs, METHOD))
    described = ("the model's own hidden states entering each attention block (token and "
                 "position embeddings, earlier layers and the block's own norm, if any)")
    causal = all(result.layer.causal for result in results)
    notes = ["long input: each layer's maps reduced to display size inside the forward pass, "
             f"{streaming.STREAMED} (≤ {streaming.DISPLAY_CELLS} per side); --export keeps the "
             "full maps"] if stream else []
    if loaded.encoder_only:
        notes.append("encoder-decoder model: its encoder's self-attention layers, numbered from "
                     "0 (the decoder's layers need target text, which --model does not take)")
    return AttentionRun(batch, results, printable_path(loaded.folder), described,
                        str(_input_device(loaded)), causal, loaded.store, notes,
                        TOLERANCE[loaded.dtype])


def _layer_indices(count: int, layers: list[int] | None) -> list[int]:
    if layers is None:
        return list(range(count))
    out = []
    for index in layers:
        if not -count <= index < count:
            raise UsageError(f"layer index {index} is out of range", f"choose 0..{count - 1}",
                             "--layer")
        out.append(index % count)
    return sorted(set(out))


def _encode(loaded: LoadedModel, sentences: list[str], max_tokens: int) -> list[dict[str, list]]:
    """Each sentence tokenized alone, special tokens included; limits checked before any run."""
    if not sentences:
        raise UsageError("no sentence given", "pass one or more sentences, or --file FILE")
    if len(sentences) > DEFAULT_MAX_SENTENCES:
        raise UsageError(f"{len(sentences)} sentences exceed {DEFAULT_MAX_SENTENCES}",
                         "pass fewer sentences")
    limit = getattr(getattr(loaded.runner, "config", loaded.config), "max_position_embeddings",
                    None)
    rows = loaded.embeddings.num_embeddings
    where = printable_path(loaded.folder)
    out = []
    for i, sentence in enumerate(sentences, 1):
        with guard.quiet(), guard.contained(f"the model's tokenizer failed on sentence {i}",
                                            "check or replace its tokenizer files", where):
            row = dict(loaded.tokenizer(sentence, add_special_tokens=True))
            ids = row.get("input_ids")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise CheckpointError(f"the model's tokenizer gave no token ids for sentence "
                                      f"{i}", "check its tokenizer files", where)
        if ids and not all(0 <= t < rows for t in ids):
            raise CheckpointError(f"the model's tokenizer gives token id "
                                  f"{max(ids) if max(ids) >= rows else min(ids)}, but the "
                                  f"model's embedding has {rows} rows",
                                  "the tokenizer files belong to another model", where)
        n = len(row["input_ids"])
        if n == 0:
            raise UsageError(f"sentence {i} gives no tokens", "give it some text")
        if n > max_tokens:
            raise UsageError(f"sentence {i} has {n} tokens, more than --max-tokens {max_tokens} "
                             "(attention costs O(L²) per head)",
                             "raise --max-tokens or shorten the sentence")
        if isinstance(limit, int) and n > limit:
            raise UsageError(f"sentence {i} has {n} tokens; the model takes at most {limit}",
                             "shorten the sentence")
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
                              "unknown token", "check that the tokenizer files belong to the "
                              "model", printable_path(loaded.folder))


def _pad(loaded: LoadedModel, rows: list[dict[str, list]]) -> tuple[dict[str, Any], Any]:
    """Padded model inputs on the tokenizer's padding side, and the (B, L) attention mask.

    Padding is done here rather than by the tokenizer so that tokenizers without a pad token
    (GPT-2, LLaMA) need no change: any id the embedding table has will do at masked positions.
    """
    tok = loaded.tokenizer
    vocab = loaded.embeddings.num_embeddings
    filler = next((i for i in (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id)
                   if isinstance(i, int) and 0 <= i < vocab), 0)
    left = getattr(tok, "padding_side", "right") == "left"
    length = max(len(row["input_ids"]) for row in rows)
    rows = [{**row, "attention_mask": [1] * len(row["input_ids"])} for row in rows]
    fills = {"input_ids": filler}  # attention_mask and token_type_ids pad with 0
    # Tokenizers may return inputs the model does not take (token_type_ids for LLaMA in 4.x).
    accepts = inspect.signature(loaded.runner.forward).parameters
    feed = {}
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        if name not in rows[0] or name not in accepts:
            continue
        padded = []
        for row in rows:
            pad = [fills.get(name, 0)] * (length - len(row[name]))
            padded.append(pad + row[name] if left else row[name] + pad)
        feed[name] = torch.tensor(padded)
    mask = feed["attention_mask"]
    if left and "position_ids" in accepts:
        # As generate() does: real tokens count from 0 after left padding, so learned absolute
        # positions (GPT-2) match a sentence run alone. Right padding keeps the model's default.
        feed["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    device = _input_device(loaded)
    return {k: v.to(device) for k, v in feed.items()}, mask


def _major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _input_device(loaded: LoadedModel) -> torch.device:
    return loaded.embeddings.weight.device


class _Done(Exception):
    """Raised by the last requested layer's hook: later layers need not run."""


def _capture(loaded: LoadedModel, indices: list[int], feed: dict[str, Any], mask: Any,
             real: list[torch.Tensor], reducers: dict[int, Any] | None = None,
             ) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(weights (B, H, L, L), inputs (B, L, E)) per requested layer, float32 on the CPU; with
    reducers, each layer's weights go to its MapReducer instead (weights None), and only the
    last layer's inputs are kept."""
    modules = _attention_modules(loaded)
    wanted, last = set(indices), max(indices)
    shape = (mask.shape[0], mask.shape[1])
    inputs: dict[int, torch.Tensor | None] = {}
    weights: dict[int, torch.Tensor | None] = {}

    def pre_hook(i: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            keep = reducers is None or i == last
            inputs[i] = x.detach().float().cpu() if keep else None
        return hook

    def post_hook(i: int) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> Any:
            pos = _weights_slot(output, shape, loaded.layers[i].num_heads)
            if i in wanted:
                if pos is None:
                    raise CheckFailed(f"the model's attention module {modules[i][0]!r} returned "
                                      "no attention weights", "report this (eager attention "
                                      "was requested)")
                if reducers is None:
                    weights[i] = output[pos].detach().float().cpu()
                else:
                    weights[i] = None
                    _reduce(reducers[i], output[pos].detach(), real)
            if i == last:
                raise _Done
            # Unrequested layers' weights (and, with output_attentions, the model's own copies)
            # are dropped here, so only the requested layers' maps are ever held.
            return None if pos is None else (*output[:pos], None, *output[pos + 1 :])
        return hook

    handles = [module.register_forward_hook(post_hook(i)) for i, (_, module) in enumerate(modules)]
    handles += [modules[i][1].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
                for i in wanted]
    # transformers 4 returns weights from attention modules only when asked; 5 always does.
    extra = {"output_attentions": True} if _major() < 5 else {}
    if "use_cache" in inspect.signature(loaded.runner.forward).parameters:
        extra["use_cache"] = False
    try:
        with guard.quiet(), guard.contained("the model's forward pass failed", "report this "
                                            "with the model", printable_path(loaded.folder)):
            try:
                with torch.no_grad():
                    loaded.runner(**feed, **extra)
            except _Done:
                pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in indices if i not in weights or i not in inputs]
    if missing:
        raise CheckFailed(f"layers {missing} did not run in the model's forward pass",
                          "they may be cross-attention layers, which --model does not run")
    return {i: (weights[i], inputs[i]) for i in indices}


def _reduce(reducer: Any, maps: torch.Tensor, real: list[torch.Tensor]) -> None:
    """One layer's maps (B, H, L, L), wherever the model put them, into its reducer: one head
    of one sentence at a time, real tokens only, so the CPU never holds more than n × n."""
    for b, idx in enumerate(real):
        idx = idx.to(maps.device)
        for h in range(maps.shape[1]):
            block = maps[b, h].index_select(0, idx).index_select(1, idx)  # (n, n)
            reducer.add(b, h, block.float().cpu()[None])


def _attention_modules(loaded: LoadedModel) -> list[tuple[str, Any]]:
    """The model's module for each attnviz layer, matched by name (prefixes such as `model.`
    differ between checkpoint keys and AutoModel's base model)."""
    modules = [(name, m) for name, m in loaded.model.named_modules() if name]
    out = []
    for layer in loaded.layers:
        found = [(n, m) for n, m in modules if n == layer.name or layer.name.endswith("." + n)
                 or n.endswith("." + layer.name)]
        exact = [(n, m) for n, m in found if n == layer.name]
        if len(exact or found) != 1:
            raise CheckpointError(f"attention layer {layer.name!r} matches {len(found)} modules "
                                  "of the loaded model", "report this", str(loaded.folder))
        out.append((exact or found)[0])
    return out


def _weights_slot(output: Any, shape: tuple[int, int], heads: int | None) -> int | None:
    """Where in an attention module's output tuple the (B, H, L, L) weights are: the last such
    tensor, since T5 returns (output, position_bias, weights) and its position bias, mask
    included, has the same shape."""
    if not isinstance(output, tuple):
        return None
    found = None
    for pos, item in enumerate(output):
        if isinstance(item, torch.Tensor) and item.dim() == 4 and item.shape[0] == shape[0] \
                and item.shape[-1] == item.shape[-2] == shape[1] and item.shape[1] == heads:
            found = pos
    return found


def _realign(t: torch.Tensor, real: list[torch.Tensor], dims: tuple[int, ...]) -> torch.Tensor:
    """Move each sentence's real positions (along `dims`) to 0..n-1; zeros elsewhere."""
    out = torch.zeros_like(t)
    for b, idx in enumerate(real):
        block = t[b]
        for dim in dims:
            block = block.index_select(dim - 1, idx)
        target = out[b]
        for dim in dims:
            target = target.narrow(dim - 1, 0, len(idx))
        target.copy_(block)
    return out


@dataclass(frozen=True)
class VerifyResult:
    layer_index: int
    layer: AttentionLayer
    per_head: list[float]  # max |Δ| per query head, over real query rows and all key columns
    tolerance: float
    positions: str  # how positions entered the recomputation
    notes: list[str] = field(default_factory=list)

    @property
    def max_diff(self) -> float:
        return max(self.per_head)

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.tolerance


def verify_layer(loaded: LoadedModel, layer_index: int, sentences: list[str], *,
                 layer: AttentionLayer | None = None, run: AttentionRun | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> VerifyResult:
    """Recompute one layer's weights from its captured input with attnviz's slices; compare.

    `layer` replaces attnviz's own description (tests use it to prove a wrong slicing fails);
    `run` reuses a run that captured this layer instead of running the model again.
    """
    config = loaded.store.config
    kind = hfconfig.model_type(config)
    if kind not in SCHEMES:  # before the model runs: refusing is cheap
        raise UsageError(f"verification does not support model_type {kind!r}",
                         f"supported: {', '.join(sorted(SCHEMES))}")
    index = _layer_indices(len(loaded.layers), [layer_index])[0]
    if run is None or all(c.index != index for c in run.layers):
        run = run_model(loaded, sentences, [index], max_tokens)
    captured = run.layer(index)
    layer = layer or captured.layer
    positions = positions_for(config, layer, index, captured.inputs.shape[1])
    recomputed = recompute_weights(layer, load_weights(layer, loaded.store), captured.inputs,
                                   run.batch.lengths, positions)
    per_head = torch.zeros(recomputed.shape[1])
    for b, n in enumerate(run.batch.lengths):
        diff = (recomputed[b, :, :n] - captured.weights[b, :, :n]).abs()  # (H, n, L)
        per_head = torch.maximum(per_head, diff.flatten(1).amax(1))
    notes = []
    if positions.rope is not None and not layer.positions.startswith("rope"):
        notes.append(f"attnviz describes this layer's positions as {layer.positions!r}")
    return VerifyResult(index, layer, per_head.tolist(), TOLERANCE[loaded.dtype],
                        positions.described, notes)
