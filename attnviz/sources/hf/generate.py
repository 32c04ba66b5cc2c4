"""Attention while a Hugging Face model writes: the model's own `generate`, with attnviz's
capture active, one query row per generated token.

The model is loaded with its language-model head (`AutoModelForCausalLM`, or
`AutoModelForSeq2SeqLM` for encoder-decoders) and `model.generate` runs as it would anywhere
(its own KV cache, its own generation_config's logits processors, its end-of-sequence token),
greedy unless sampling is asked for. attnviz's attention function is active throughout, so every
attention call of every step goes through the module's own eager attention and its weights come
out: the prefill's rows (the prompt, or the decoder start token), then one row per step. The row
of a generated token is the one the model computes when that token is fed back in; generate
feeds back every token but the last, so one more forward pass over the model's own cache computes
the last token's row. Decoder prompts are left-padded, as generate needs; an encoder-decoder's
encoder runs once, captured, and its output is handed to generate.

Models outside the attention interface (BLOOM, Falcon, ...) run `generate(output_attentions=True)`
and their returned maps are used instead. `assemble` (in `generate_maps`) turns the per-step rows
into full maps over prompt + generated tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnviz.core.choices import LayerKind
from attnviz.core.request import GenerateSpec
from attnviz.errors import CheckpointError, printable, printable_path
from attnviz.load.paths import library_path
from attnviz.sources.hf import capture, guard
from attnviz.sources.hf.capture_eager import ACTIVE, Session
from attnviz.sources.hf.generate_returned import (
    add_forward_attentions,
    add_generate_attentions,
    add_returned,
)
from attnviz.sources.hf.generate_settings import (
    generation_config_of,
    settings,
    settle_loaded_generation,
)
from attnviz.sources.hf.load import (
    COMMON,
    FILES_FIX,
    LoadedModel,
    OpenedModel,
    capture_path,
    check_load_options,
    dtype_keyword,
    input_device,
)

METHOD = ("model.generate (its own KV cache and generation settings) with attnviz's attention "
          "function active: every step's rows from the module's own eager attention; the last "
          "token's row from one more forward over the same cache")
METHOD_OUTPUT_ATTENTIONS = ("model.generate(output_attentions=True) with eager attention: the "
                            "maps this model returns per step; the last token's row from one "
                            "more forward over the same cache")


@dataclass
class Steps:
    """What a generation captured: per attention module (by name), its blocks in call order."""

    sequences: torch.Tensor  # (B, L + T) decoder-only, (B, 1 + T) encoder-decoder
    prompt_width: int  # L: the padded prompt's width (1 for an encoder-decoder: start token)
    kinds: dict[str, LayerKind] = field(default_factory=dict)  # module name: kind, in order
    heads: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # (B, H, rows, K)
    method: str = METHOD
    calls: dict[str, int] = field(default_factory=dict)  # name: its call index in a forward
    set_aside: list[str] = field(default_factory=list)  # generation_config fields overridden

    def add(self, name: str, kind: LayerKind, weights: torch.Tensor,
            call: int | None = None) -> None:
        self.kinds.setdefault(name, kind)
        if call is not None:
            self.calls.setdefault(name, call)
        self.heads.setdefault(name, int(weights.shape[1]))
        self.blocks.setdefault(name, []).append(weights.detach().float().cpu())


def load_lm(opened: OpenedModel, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """The model with its language-model head, for generation; refused when the checkpoint has
    no head of its own (a base model: transformers would fill the head with random numbers)."""
    check_load_options(device, dtype, None)
    import transformers

    from attnviz.compute.forward_pass.device import resolve_device

    folder, where = opened.folder, printable_path(opened.folder)
    auto: Any = transformers.AutoModelForSeq2SeqLM if opened.encoder_decoder \
        else transformers.AutoModelForCausalLM
    if not _has_head_class(auto, opened.config):
        kind = getattr(opened.config, "model_type", "this")
        raise CheckpointError(f"{kind} models cannot generate: transformers has no "
                              f"{auto.__name__} class for them (an encoder writes no text)",
                              fix="use a decoder (…ForCausalLM) or an encoder-decoder "
                              "(…ForConditionalGeneration)", where=where)
    dtype_key = dtype_keyword()
    # generation_config.json without the fields attnviz sets at each call (generate_settings)
    generation_config, file_fields = generation_config_of(Path(folder), where)
    given = {} if generation_config is None else {"generation_config": generation_config}
    with guard.silenced(stderr=True), \
            guard.contained("transformers cannot load the model with a language-model head",
                               FILES_FIX, where):
        model, info = auto.from_pretrained(library_path(folder), attn_implementation="eager",
                                           output_loading_info=True, **given,
                                           **{dtype_key: getattr(torch, dtype)}, **COMMON)
    settle_loaded_generation(model, file_fields)
    model.eval().to(resolve_device(device))
    missing = [str(k) for k in info.get("missing_keys") or [] if "final_logits_bias" not in k]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {missing[0]!r}"
                              f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: "
                              "it is a base model without a language-model head, which cannot "
                              "generate", fix="use a checkpoint saved with its head "
                              "(…ForCausalLM, …ForConditionalGeneration)", where=where)
    guard.check_loaded(info, set(), where)
    return LoadedModel(model, opened.tokenizer, folder, opened.config, dtype,
                       capture_path(model), _store=opened.store,
                       position_limit=opened.position_limit)


def _has_head_class(auto: Any, config: Any) -> bool:
    """Whether transformers' Auto class maps this config to a model class."""
    try:
        return type(config) in auto._model_mapping
    except (AttributeError, TypeError, KeyError):  # another transformers: let loading decide
        return True


def pad_left(rows: list[list[int]], filler: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, L), the prompts right-aligned as generate needs."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[filler] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def pad_right(rows: list[list[int]], filler: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, S), right-padded (an encoder's source)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [filler] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    return ids, mask


def generate(loaded: LoadedModel, prompts: list[list[int]], spec: GenerateSpec,
             keep: bool = True, block_bytes: int | None = None,
             shown: set[int] | None = None) -> Steps:
    """Generate from each prompt (token ids, special tokens included) and capture every
    attention row of every step; see the module docstring. With keep=False nothing is kept
    (only `sequences`): the capture still runs every attention call through the module's own
    eager attention, in blocks of query rows of at most `block_bytes` (long prompts in bounded
    memory), and the last token's row is not computed. `shown` (a decoder-only model's layer
    numbers; None: all): only those layers' rows are captured, the others run through sdpa."""
    spec.check()
    model = loaded.model
    device = input_device(model)
    filler = pad_id(loaded)
    interface = loaded.path == capture.CapturePath.INTERFACE
    # one sequence per prompt through the cache, whatever generation_config.json asks
    kwargs, aside = settings(model, spec, filler,
                             output_attentions=not interface and keep)
    if loaded.encoder_decoder:
        ids, mask = pad_right(prompts, filler, device)
        steps = Steps(torch.empty(0), 1, set_aside=aside)
        with _capturing(model, steps, interface, keep, block_bytes, shown), _contained(loaded), \
                torch.no_grad():
            encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask,
                                                  **({} if interface or not keep else
                                                     {"output_attentions": True}))
        if not interface and keep:
            add_returned(steps, encoder_outputs.attentions, LayerKind.SELF, "enc")
        kwargs.update(attention_mask=mask, encoder_outputs=encoder_outputs)
    else:
        ids, mask = pad_left(prompts, filler, device)
        steps = Steps(torch.empty(0), ids.shape[1], set_aside=aside)
        kwargs.update(input_ids=ids, attention_mask=mask)
    with _seeded(spec.seed), _capturing(model, steps, interface, keep, block_bytes, shown), \
            guard.silenced(), _contained(loaded):
        out = model.generate(**kwargs)
    steps.sequences = out.sequences.cpu()
    if not keep:
        return steps
    if not interface:
        steps.method = METHOD_OUTPUT_ATTENTIONS
        add_generate_attentions(steps, out)
    _last_row(loaded, steps, out, (mask, kwargs.get("encoder_outputs")), interface, shown)
    return steps


def pad_id(loaded: LoadedModel) -> int:
    """The id generate pads finished sentences with: the pad token, else end-of-sequence."""
    for owner in (loaded.model.generation_config, loaded.config, loaded.tokenizer):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(owner, name, None)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int):
                return value
    return 0


def eos_ids(loaded: LoadedModel) -> set[int]:
    """The model's end-of-sequence ids (generation_config's, else config.json's)."""
    for owner in (loaded.model.generation_config, loaded.config):
        value = getattr(owner, "eos_token_id", None)
        if value is not None:
            return set(value) if isinstance(value, list) else {int(value)}
    return set()


@contextlib.contextmanager
def _contained(loaded: LoadedModel) -> Iterator[None]:
    """The model failing on its input (a forward pass or generate raising) is a data error."""
    try:
        yield
    except (RuntimeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"the model failed while generating: {printable(str(exc), 200)}",
                              fix="check that the model generates in transformers",
                              where=printable(str(loaded.folder))) from None


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's global generator seeded for one generate call, its state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _capturing(model: Any, steps: Steps, interface: bool, keep: bool = True,
               block_bytes: int | None = None, shown: set[int] | None = None
               ) -> Iterator[None]:
    """attnviz's attention function active for every forward pass inside: each call's weights
    go to `steps` under its module's name (keep=False: nowhere; see `generate`). With `shown`,
    calls are numbered per forward pass (a decoder-only model's layer numbers) and only those
    are captured."""
    if not interface:
        yield
        return
    names = {id(module): name for name, module in model.named_modules()}
    session = Session(model, names, shown, block_bytes, lambda *_: None, False)

    def sink(index: int, start: int, weights: torch.Tensor) -> None:
        if keep:
            layer = session.layers[index]
            steps.add(layer.name, layer.kind, weights, index)

    session.sink = sink
    token = ACTIVE.set(session)
    hook = None if shown is None else model.register_forward_pre_hook(
        lambda *_: session.layers.clear())  # each forward numbers its calls from 0
    try:
        with torch.no_grad():
            yield
    finally:
        ACTIVE.reset(token)
        if hook is not None:
            hook.remove()


def _last_row(loaded: LoadedModel, steps: Steps, out: Any, fed: tuple[torch.Tensor, Any],
              interface: bool, shown: set[int] | None = None) -> None:
    """The last generated token fed back once through the model's own cache: its row. fed:
    (the attention mask generate got, its encoder outputs or None)."""
    mask, encoder_outputs = fed
    model = loaded.model
    sequences = out.sequences  # (B, L + T)
    last = sequences[:, -1:]
    # renamed `cache` in transformers 5.2x; the old name still answers, with a warning
    with guard.silenced():
        cache = out["cache"] if "cache" in out.keys() else out.get("past_key_values")
    if cache is None:
        raise CheckpointError("the model's generate returned no cache to continue from",
                              fix="report this model to attnviz")
    # transformers 5.2x names the cache argument `cache` (past_key_values before)
    cache_name = "cache" if "cache" in _forward_parameters(model) else "past_key_values"
    feed: dict[str, Any] = {cache_name: cache, "use_cache": True}
    if loaded.encoder_decoder:
        feed.update(encoder_outputs=encoder_outputs, attention_mask=mask,
                    decoder_input_ids=last)
    else:
        width = sequences.shape[1]
        full = torch.cat([mask, torch.ones(mask.shape[0], width - mask.shape[1],
                                           dtype=mask.dtype, device=mask.device)], dim=1)
        feed.update(input_ids=last, attention_mask=full)
        if "position_ids" in _forward_parameters(model):
            feed["position_ids"] = (full.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    if "cache_position" in _forward_parameters(model):  # the last token's own position
        feed["cache_position"] = torch.tensor([sequences.shape[1] - 1], device=last.device)
    with _capturing(model, steps, interface, True, None, shown), guard.silenced(), \
            torch.no_grad(), _contained(loaded):
        result = model(**feed, **({} if interface else {"output_attentions": True}))
    if not interface:
        add_forward_attentions(steps, result)


def _forward_parameters(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
