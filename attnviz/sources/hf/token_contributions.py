"""`attnviz tokens --model`: a Hugging Face model's own forward pass, with hooks, for the tokens
command: per layer its attention maps (output_attentions, eager attention), and, for the
families in BLOCKS, what each attention block's per-source terms are made of; leave-one-out
through the model's own attention mask (or a baseline token) on stacked copies of a sentence.

Encoder–decoder models run their encoder (encoder self-attention). A causal LM head (config.json
names …ForCausalLM / …LMHeadModel) gives the measure: log p of the token the unerased model
predicts at the output position; otherwise the measure is the relative change of the final
hidden state there, ‖h′ − h‖ / ‖h‖.

A family's block is data (BLOCKS): where its layers sit, the value projection (GPT-2's fused
c_attn: its last third), the output projection (Conv1D: stored (in, out)), where the block's
own output can be read (the input of the norm after it, or a module's output) and, for post-LN
models, the norm applied after the residual; a family whose block depends on a config flag
(OPT's pre- or post-LN) has one row per layout. Captured per call of a layer (ALBERT's shared
layer runs once per layer): the layer's input (the residual), the value states, and the block's
output, which the tests compare with Σ_j T_ij.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from attnviz.compute.tokenflow.decompose import BlockTerms, PostNorm
from attnviz.compute.tokenflow.trace import Erasures, TokenTrace
from attnviz.errors import CheckpointError, UsageError, option, printable, printable_path
from attnviz.load.paths import library_path
from attnviz.sources.hf import guard
from attnviz.sources.hf.load import COMMON, FILES_FIX, TOLERANCE, OpenedModel, dtype_keyword


@dataclass(frozen=True)
class Block:
    """Where one family's attention block sits, relative to one layer module."""

    layers: str  # the ModuleList of layers, relative to the module that runs
    value: str  # the value projection (its output: the value states, bias included)
    out: str  # the output projection W_O
    read: str  # where the block's output is read
    read_input: bool  # True: the input of `read` (a pre-LN model's next norm); else its output
    residual: str = ""  # the module whose input is the block's residual ("": the layer)
    value_third: bool = False  # a fused [q; k; v] projection: the value is its last third
    # a fused [q (H·d); k (H_kv·d); v (H_kv·d)] projection (Phi-3): the value is its last H_kv·d
    value_stacked: bool = False
    # a fused projection laid out per key-value group as [q per head of the group; k; v], each
    # head_dim wide (GPT-NeoX, BLOOM: one query head per group, [q; k; v] per head; Falcon's
    # grouped and multi-query layouts): the value is each group's last slice
    value_grouped: bool = False
    # parallel blocks (GPT-J, Phi, Cohere, GPT-NeoX, Falcon): `read` is the attention
    # sublayer's output, and the block's output is it plus the residual (the MLP, which reads
    # the same normed input, writes outside the block as in every family)
    plus_residual: bool = False
    conv1d: bool = False  # W_O stored (in, out) (GPT-2's Conv1D)
    post_norm: str | None = None  # post-LN: the norm after the residual sum
    # a norm on the attention sublayer's output, before the residual (Gemma 2/3, OLMo-2)
    out_norm: str | None = None
    rms: bool = False  # the norm (post_norm or out_norm) is an RMSNorm
    norm_offset: float = 0.0  # the norm multiplies by offset + weight (Gemma's 1 + w)
    # a fused projection in this many model-parallel shards, each [q; v; k] of E/shards
    # columns (CodeGen: 4): the value is each shard's middle slice
    value_shards: int = 0
    # a layer attribute scaling the attention sublayer's output before the residual (Granite's
    # residual_multiplier: x + m·attn(…)); folded into W_O and b_O
    out_scale: str = ""
    # the read site sees the batch's tokens flattened, (B·L, E) (OPT's pre-LN layer reshapes
    # before its final_layer_norm)
    read_flat: bool = False


@dataclass(frozen=True)
class Layouts:
    """A family whose block depends on one config flag: the row for each of its values (OPT's
    do_layer_norm_before: pre-LN, or post-LN as opt-350m); a value no row names is refused."""

    flag: str
    default: object  # the flag's value when the config leaves it out
    rows: tuple[tuple[object, Block], ...]


# pre-LN decoders: x + attn(norm(x)), read at the input of the norm before the MLP
_LLAMA = Block("layers", "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
               True)
# pre-LN encoder-decoder encoders and decoders with fairseq names (norm before the fc1 block)
_FAIRSEQ_PRE = Block("layers", "self_attn.v_proj", "self_attn.out_proj", "final_layer_norm",
                     True)
# post-LN: LN(x + attn(x)), read at the output of that norm
_BERT = Block("encoder.layer", "attention.self.value", "attention.output.dense",
              "attention.output", False, post_norm="attention.output.LayerNorm")
_BART = Block("layers", "self_attn.v_proj", "self_attn.out_proj", "self_attn_layer_norm",
              False, post_norm="self_attn_layer_norm")
# parallel attention + MLP: x + attn(norm(x)) + mlp(norm(x)); the block is x + attn(norm(x))
_PARALLEL = Block("layers", "self_attn.v_proj", "self_attn.o_proj", "self_attn", False,
                  plus_residual=True)
# x + N(attn(·)): a norm on the attention output, before the residual
_OUT_NORMED = Block("layers", "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                    False, plus_residual=True, out_norm="post_attention_layernorm", rms=True)
_GEMMA2 = replace(_OUT_NORMED, norm_offset=1.0)
# OPT: pre-LN (x + attn(LN(x)), read before final_layer_norm), or post-LN as opt-350m
# (LN(x + attn(x)), read after self_attn_layer_norm, which the pre-LN layout calls first)
_OPT = Layouts("do_layer_norm_before", True, (
    (True, replace(_FAIRSEQ_PRE, layers="decoder.layers", read_flat=True)),
    (False, replace(_BART, layers="decoder.layers"))))
# model_type → its block (or its layouts); every row is checked at run time (Σ_j T_ij = the
# block's output)
BLOCKS: dict[str, Block | Layouts] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                     "qwen3_moe", "starcoder2", "olmo", "helium", "smollm3", "nemotron",
                     "gemma", "stablelm", "olmoe", "arcee", "glm", "seed_oss", "ministral"),
                    _LLAMA),
    # LLaMA-like with its own norms' names
    "apertus": replace(_LLAMA, read="feedforward_layernorm"),
    "gpt2": Block("h", "attn.c_attn", "attn.c_proj", "ln_2", True, value_third=True,
                  conv1d=True),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra", "roformer",
                     "big_bird"), _BERT),
    "distilbert": Block("transformer.layer", "attention.v_lin", "attention.out_lin",
                        "sa_layer_norm", False, post_norm="sa_layer_norm"),
    "mpnet": Block("encoder.layer", "attention.attn.v", "attention.attn.o", "attention",
                   False, post_norm="attention.LayerNorm"),
    "t5": Block("block", "layer.0.SelfAttention.v", "layer.0.SelfAttention.o", "layer.0",
                False, residual="layer.0"),
    "mt5": Block("block", "layer.0.SelfAttention.v", "layer.0.SelfAttention.o", "layer.0",
                 False, residual="layer.0"),
    **dict.fromkeys(("bart", "marian", "plbart"), _BART),
    **dict.fromkeys(("mbart", "pegasus", "m2m_100", "blenderbot", "biogpt", "xglm"),
                    _FAIRSEQ_PRE),
    # use_parallel_residual or not, the block's output is x + attn(norm(x))
    "gpt_neox": Block("layers", "attention.query_key_value", "attention.dense", "attention",
                      False, value_grouped=True, plus_residual=True),
    "gptj": Block("h", "attn.v_proj", "attn.out_proj", "attn", False, plus_residual=True),
    "phi": Block("layers", "self_attn.v_proj", "self_attn.dense", "self_attn", False,
                 plus_residual=True),
    **dict.fromkeys(("cohere", "cohere2"), _PARALLEL),
    # parallel (new_decoder_architecture, parallel_attn) or sequential: x + attn(norm(x))
    "falcon": Block("h", "self_attention.query_key_value", "self_attention.dense",
                    "self_attention", False, value_grouped=True, plus_residual=True),
    # its attention module adds the residual itself; read before the norm after it
    "bloom": Block("h", "self_attention.query_key_value", "self_attention.dense",
                   "post_attention_layernorm", True, value_grouped=True),
    # [q; k; v] stacked whole (Phi-3), or grouped: per head with multi-head attention and
    # [q; k; v] with one key-value head (GPTBigCode's multi_query: the two layouts agree)
    "phi3": replace(_LLAMA, value="self_attn.qkv_proj", value_stacked=True),
    "gpt_bigcode": Block("h", "attn.c_attn", "attn.c_proj", "ln_2", True, value_grouped=True),
    "persimmon": replace(_LLAMA, value="self_attn.query_key_value", out="self_attn.dense",
                         value_grouped=True),
    "gpt_neo": Block("h", "attn.attention.v_proj", "attn.attention.out_proj", "ln_2", True),
    # gemma3_text: Gemma 3's text-only models (the multimodal ones are refused as towers)
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text"), _GEMMA2),
    **dict.fromkeys(("olmo2", "olmo3", "exaone4"), _OUT_NORMED),
    # GLM-4: x + N(attn(norm(x))), N its post_self_attn_layernorm
    "glm4": replace(_OUT_NORMED, read="post_self_attn_layernorm",
                    out_norm="post_self_attn_layernorm"),
    "opt": _OPT,
    # parallel: attn + mlp + x; qkv_proj in 4 model-parallel shards, each [q; v; k]
    "codegen": Block("h", "attn.qkv_proj", "attn.out_proj", "attn", False, value_shards=4,
                     plus_residual=True),
    # x + m·attn(norm(x)) (its attention_multiplier scales the scores: in the maps already)
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared"),
                    replace(_LLAMA, out_scale="residual_multiplier")),
    # one layer module (per group) run num_hidden_layers times: one block per call;
    # LN(x + dense(attn(x))) inside the attention module
    "albert": Block("encoder.albert_layer_groups.*.albert_layers", "attention.value",
                    "attention.dense", "attention", False,
                    post_norm="attention.LayerNorm"),
}


def block_of(config: Any) -> Block | None:
    """The config's block: its model type's row, or its layout's (None: attnviz knows none)."""
    row = BLOCKS.get(str(getattr(config, "model_type", "")))
    if isinstance(row, Layouts):
        flag = getattr(config, row.flag, row.default)
        return next((block for value, block in row.rows if value == flag), None)
    return row


@dataclass(frozen=True)
class EraseSpec:
    """How leave-one-out erases and within what memory: `baseline` None masks the token."""

    baseline: int | None
    name: str  # the baseline token as the messages name it
    budget: int  # bytes for the stacked copies of one forward


@dataclass
class ModelRunner:
    """The loaded model, the module that runs on the text, and the LM head if any."""

    model: Any
    runner: Any  # the base model, or an encoder-decoder's encoder
    tokenizer: Any
    config: Any
    causal_lm: bool
    device: torch.device
    block: Block | None
    source: str
    causal: bool = False  # set from the maps once they are seen (`seen_causal`)
    seq2seq_lm: bool = False  # an encoder-decoder loaded with its LM head


def load_runner(opened: OpenedModel, device: str, dtype: str) -> ModelRunner:
    import transformers

    from attnviz.compute.forward_pass.device import resolve_device
    from attnviz.sources.hf.ablation import lm_class

    if opened.tower is not None:
        raise UsageError("'attnviz tokens' runs text-only models and encoder-decoders; this "
                         "model's text is one tower of several", fix="choose another model")
    arch, kind = lm_class(opened.config)
    where = printable_path(opened.folder)
    headed = arch is not None and kind in ("causal", "seq2seq")
    cls = getattr(transformers, arch) if headed and arch else transformers.AutoModel
    target = resolve_device(device)
    with guard.silenced(stderr=True), \
            guard.contained("transformers cannot load the model", FILES_FIX, where):
        model = cls.from_pretrained(
            library_path(opened.folder), attn_implementation="eager",
            **{dtype_keyword(): dtype if dtype == "auto" else getattr(torch, dtype)}, **COMMON)
    model = model.eval().to(target)
    encoder_decoder = bool(getattr(opened.config, "is_encoder_decoder", False))
    base = model.base_model if kind == "causal" and arch else model
    runner = base.get_encoder() if encoder_decoder else base
    causal_lm = kind == "causal" and arch is not None
    return ModelRunner(model, runner, opened.tokenizer, opened.config, causal_lm, target,
                       block_of(opened.config), str(opened.folder), causal_lm,
                       kind == "seq2seq" and arch is not None)


def _module(root: Any, path: str) -> Any:
    return root.get_submodule(path) if path else root


def padded_batch(runner: ModelRunner, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the model's attention mask (1 real, 0 padding)."""
    L = max(len(r) for r in rows)
    filler = next((i for i in (runner.tokenizer.pad_token_id, runner.tokenizer.eos_token_id,
                               runner.tokenizer.unk_token_id) if isinstance(i, int)), 0)
    ids = torch.full((len(rows), L), filler, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        mask[b, :len(row)] = 1
    return ids.to(runner.device), mask.to(runner.device)


def layer_modules(root: Any, pattern: str) -> list[Any]:
    """The layer modules at `pattern`: a ModuleList's path, where `*` stands for each entry
    of a ModuleList on the way (ALBERT's encoder.albert_layer_groups.*.albert_layers)."""
    found = [root]
    for part in pattern.split("."):
        found = [child for module in found
                 for child in (list(module) if part == "*" else [_module(module, part)])]
    return [layer for listed in found for layer in listed]


class _Hooks:
    """Per call of a layer module: the residual (the block's input), the value states and the
    block's output, each the first seen within that call. A family whose layers run once each
    gives one call per layer; ALBERT's shared layer runs num_hidden_layers times, one block
    per call, as its attention maps are one per call."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.block is not None
        self.block = runner.block
        self.layers = layer_modules(runner.runner, self.block.layers)
        self.calls: list[int] = []  # per call: the index of the layer module that ran
        self.residual: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.outputs: list[torch.Tensor | None] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _Hooks:
        for i, layer in enumerate(self.layers):
            # registered first: it runs before any other pre-hook on the layer itself
            self.handles.append(layer.register_forward_pre_hook(self._called(i)))
            self.handles += [
                _module(layer, self.block.residual).register_forward_pre_hook(
                    self._keep(self.residual, "input"), with_kwargs=True),
                _module(layer, self.block.value).register_forward_hook(
                    self._keep(self.values, "output"), with_kwargs=True),
            ]
            site = _module(layer, self.block.read)
            if self.block.read_input:
                self.handles.append(site.register_forward_pre_hook(
                    self._keep(self.outputs, "input"), with_kwargs=True))
            else:
                self.handles.append(site.register_forward_hook(
                    self._keep(self.outputs, "output"), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _called(self, i: int) -> Any:
        def hook(module: Any, args: tuple) -> None:
            self.calls.append(i)
            for store in (self.residual, self.values, self.outputs):
                store.append(None)
        return hook

    @staticmethod
    def _keep(store: list[torch.Tensor | None], what: str) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, *output: Any) -> None:
            if what == "input":
                value = args[0] if args else kwargs.get("hidden_states")
            else:
                value = output[0]
                if isinstance(value, tuple):
                    value = value[0]
            # the first capture within the layer's current call
            if store and store[-1] is None and isinstance(value, torch.Tensor):
                store[-1] = value.detach()
        return hook


def _value_states(block: Block, v: torch.Tensor, H: int, d: int) -> torch.Tensor:
    """(n, H_kv·d): the value states out of the captured projection output (n, width)."""
    if block.value_third:  # GPT-2's [q; k; v]
        return v[:, 2 * v.shape[-1] // 3:]
    if block.value_shards:  # CodeGen: per shard [q; v; k], the shards' values side by side
        shards, n = block.value_shards, v.shape[0]
        if v.shape[-1] != 3 * H * d or (H * d) % shards:
            raise CheckpointError(f"the fused projection's width {v.shape[-1]} does not fit "
                                  f"{shards} shards of [q; v; k] for {H} heads of {d}",
                                  fix=f"choose rollout or flow with {option('method')}")
        return v.reshape(n, shards, 3, H * d // shards)[:, :, 1].reshape(n, H * d)
    if not (block.value_grouped or block.value_stacked):
        return v
    # width = (H + 2·H_kv)·d
    groups = (v.shape[-1] // d - H) // 2
    n = v.shape[0]
    if groups < 1 or H % groups or v.shape[-1] != (H + 2 * groups) * d:
        raise CheckpointError(f"the fused projection's width {v.shape[-1]} does not fit "
                              f"{H} heads of {d}", fix=f"choose rollout or flow with "
                              f"{option('method')}")
    if block.value_stacked:
        return v[:, -groups * d:]
    # each of H_kv groups holds H / H_kv query heads, a key, a value
    return v.reshape(n, groups, H // groups + 2, d)[:, :, -1].reshape(n, groups * d)


def _out_weight(runner: ModelRunner, layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W_O (E, H·d) and b_O of one layer, in (out, in) orientation, times the layer's scale on
    its attention output where the row names one (Granite's residual_multiplier)."""
    block = runner.block
    assert block is not None
    module = _module(layer, block.out)
    weight = module.weight.detach().float()
    if block.conv1d:
        weight = weight.T
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if block.out_scale:
        scale = getattr(layer, block.out_scale, None)
        if not isinstance(scale, (int, float)):
            raise CheckpointError(f"the layer has no number {block.out_scale!r} scaling its "
                                  "attention output", fix=f"choose rollout or flow with "
                                  f"{option('method')}", where=printable(runner.source))
        weight = weight * float(scale)
        bias = None if bias is None else bias * float(scale)
    return weight, bias


def _norm(runner: ModelRunner, layer: Any, path: str | None) -> PostNorm | None:
    """The norm at `path` under the layer, frozen (None where the row names none)."""
    block = runner.block
    if block is None or path is None:
        return None
    norm = _module(layer, path)
    bias = getattr(norm, "bias", None)
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or 1e-12
    weight = getattr(norm, "weight", None)
    if weight is None:  # no elementwise affine (OPT's layer_norm_elementwise_affine=False)
        size = getattr(norm, "normalized_shape", None)
        weight = torch.ones(size[-1] if isinstance(size, tuple) else runner.config.hidden_size)
    return PostNorm(weight.detach().float() + block.norm_offset,
                    None if bias is None else bias.detach().float(), float(eps), block.rms)


def traces(runner: ModelRunner, rows: list[list[int]], tokens: list[list[str]]
           ) -> list[TokenTrace]:
    """Each sentence's maps and, where BLOCKS knows the family, its blocks' terms."""
    ids, mask = padded_batch(runner, rows)
    hooks = _Hooks(runner) if runner.block is not None else None
    with torch.no_grad(), guard.silenced():
        if hooks is not None:
            with hooks:
                out = runner.runner(input_ids=ids, attention_mask=mask, output_attentions=True)
        else:
            out = runner.runner(input_ids=ids, attention_mask=mask, output_attentions=True)
    maps = [a.float() for a in (out.attentions or ()) if a is not None]
    if not maps:
        raise CheckpointError("the model returned no attention maps", fix="report this model",
                              where=printable(runner.source))
    result = []
    for b, row in enumerate(rows):
        n = len(row)
        own = [m[b, :, :n, :n].cpu() for m in maps]
        blocks, outputs = None, None
        if hooks is not None:
            blocks, outputs = _blocks(runner, hooks, own, b, n)
        result.append(TokenTrace(tokens[b], own, blocks, outputs,
                                 [f"layer {i}" for i in range(len(own))]))
    return result


def _blocks(runner: ModelRunner, hooks: _Hooks, maps: list[torch.Tensor], b: int, n: int
            ) -> tuple[list[BlockTerms], list[torch.Tensor]]:
    block = runner.block
    assert block is not None
    if len(hooks.calls) != len(maps):
        raise CheckpointError(f"the model's layers ran {len(hooks.calls)} times for "
                              f"{len(maps)} attention maps", fix=f"choose rollout or flow "
                              f"with {option('method')}", where=printable(runner.source))
    blocks, outputs = [], []
    for i, which in enumerate(hooks.calls):
        layer = hooks.layers[which]
        residual, values, output = hooks.residual[i], hooks.values[i], hooks.outputs[i]
        if residual is None or values is None or output is None:
            raise CheckpointError(f"layer {i} of the model did not run as attnviz expects its "
                                  "family to", fix=f"choose rollout or flow with "
                                  f"{option('method')}", where=printable(runner.source))
        if block.read_flat and output.numel() == residual.numel():
            output = output.reshape(residual.shape)  # (B·L, E) back, in the order flattened
        if output.shape != residual.shape:
            raise CheckpointError(f"layer {i}'s block output has shape {tuple(output.shape)}, "
                                  f"its input {tuple(residual.shape)}", fix=f"choose rollout "
                                  f"or flow with {option('method')}, and report this model",
                                  where=printable(runner.source))
        W_o, b_o = _out_weight(runner, layer)
        H = maps[i].shape[0]
        d = W_o.shape[1] // H
        v = _value_states(block, values[b, :n].float().cpu(), H, d)
        H_kv = v.shape[-1] // d
        group = H // H_kv
        per_head = v.view(n, H_kv, d).transpose(0, 1)  # (H_kv, n, d)
        U = torch.stack([per_head[h // group] @ W_o[:, h * d:(h + 1) * d].T.cpu()
                         for h in range(H)])  # (H, n, E)
        own = output[b, :n].float().cpu()
        if block.plus_residual:
            own = own + residual[b, :n].float().cpu()
        rtol = TOLERANCE.get(str(output.dtype).removeprefix("torch."), 1e-4)
        blocks.append(BlockTerms(maps[i], U, residual[b, :n].float().cpu(),
                                 None if b_o is None else b_o.cpu(),
                                 _norm(runner, layer, block.post_norm), own, rtol,
                                 _norm(runner, layer, block.out_norm)))
        outputs.append(own)
    return blocks, outputs


def seen_causal(runner: ModelRunner, found: list[TokenTrace]) -> bool:
    """Causal when no query of the first layer reads a later key in any sentence of two tokens
    or more (what the model does, whatever its head or config says: a BertLMHeadModel built
    without is_decoder has a causal LM head and reads every token); with one-token sentences
    only: a causal LM head, or the config's is_decoder."""
    seen = [float(t.maps[0].triu(1).abs().max()) == 0.0 for t in found
            if t.maps and t.maps[0].shape[-1] > 1]
    if seen:
        return all(seen)
    return runner.causal_lm or bool(getattr(runner.config, "is_decoder", False))


def _measure(runner: ModelRunner, ids: torch.Tensor, mask: torch.Tensor, position: int
             ) -> torch.Tensor:
    """Per copy: the log-probabilities at `position` (causal LM), else its final hidden state."""
    with torch.no_grad(), guard.silenced():
        if runner.causal_lm:
            logits = runner.model(input_ids=ids, attention_mask=mask).logits
            return torch.log_softmax(logits[:, position].float(), -1)
        hidden = runner.runner(input_ids=ids, attention_mask=mask).last_hidden_state
        return hidden[:, position].float()


def baseline_id(runner: ModelRunner, baseline: str | None) -> int:
    """--baseline's one token, or the tokenizer's mask, pad or unknown token."""
    tok = runner.tokenizer
    if baseline is None:
        found = next((i for i in (getattr(tok, "mask_token_id", None), tok.pad_token_id,
                                  tok.unk_token_id) if isinstance(i, int)), None)
        if found is None:
            raise UsageError("the tokenizer has no mask, pad or unknown token to erase with",
                             fix=f"name one with {option('baseline')}", option="baseline")
        return int(found)
    ids = tok(baseline, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise UsageError(f"{option('baseline')} {printable(baseline)!r} is {len(ids)} tokens "
                         "for this tokenizer, not one", fix="choose a single token",
                         option="baseline")
    return int(ids[0])


def erasures(runner: ModelRunner, row: list[int], position: int, spec: EraseSpec) -> Erasures:
    """Leave-one-out of each token the output can see (masking: all but the output's own),
    copies stacked along the batch, as many per forward as the budget holds."""
    baseline, budget, baseline_name = spec.baseline, spec.budget, spec.name
    ids, mask = padded_batch(runner, [row])
    base = _measure(runner, ids, mask, position)[0]
    reach = range(position + 1) if runner.causal else range(len(row))
    erased = [j for j in reach if baseline is not None or j != position]
    config = runner.config
    H = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 8) or 8)
    E = int(getattr(config, "hidden_size", None) or getattr(config, "d_model", 64) or 64)
    per_copy = 4 * (3 * H * len(row) ** 2 + 12 * len(row) * E)
    if runner.causal_lm:
        per_copy += 4 * int(getattr(config, "vocab_size", 0) or 0) * len(row)
    target = int(base.argmax()) if runner.causal_lm else None
    effects = [effect(base, _measure(runner, copies, masks, position), target)
               for copies, masks in erased_copies(ids, mask, erased,
                                                  max(1, budget // max(1, per_copy)), baseline)]
    values = torch.cat(effects) if effects else torch.zeros(0, dtype=torch.float64)
    how = ("masked through the model's attention mask, as padding (the output token itself, "
           "whose query still runs, is not erased)" if baseline is None else
           f"replaced by the token {printable(baseline_name)!r} (id {baseline})")
    measure = (f"drop in log p(next token) at the output, for the token the model predicts "
               f"there (id {target})" if target is not None else
               "relative change ‖h′ − h‖ / ‖h‖ of the output's final hidden state")
    return Erasures(erased, values, measure, how,
                    None if target is None else float(base[target]))


def erased_copies(ids: torch.Tensor, mask: torch.Tensor, erased: list[int], step: int,
                  baseline: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Leave-one-out copies of one sentence (ids and mask (1, L)), `step` per chunk (what one
    forward holds): copy c of a chunk has its token erased — masked through the attention mask
    like padding (`baseline` None), or replaced by the baseline token."""
    for start in range(0, len(erased), step):
        chunk = erased[start:start + step]
        copies, masks = ids.repeat(len(chunk), 1), mask.repeat(len(chunk), 1)
        rows = torch.arange(len(chunk), device=ids.device)
        cols = torch.tensor(chunk, dtype=torch.long, device=ids.device)
        if baseline is None:
            masks[rows, cols] = 0
        else:
            copies[rows, cols] = baseline
        yield copies, masks


def effect(base: torch.Tensor, got: torch.Tensor, target: int | None) -> torch.Tensor:
    """Per copy (float64, on the CPU): the drop in log p(target) from the unerased `base`
    log-probabilities (an LM head), else (target None) the relative change ‖h′ − h‖ / ‖h‖ of
    the measured vector."""
    if target is not None:
        return (base[target] - got[:, target]).double().cpu()
    return ((got - base).norm(dim=-1) / base.norm().clamp(min=1e-30)).double().cpu()


def open_inputs(model: str, sentences: list[str], targets: list[str] | None,
                max_tokens: int, max_sentences: int
                ) -> tuple[OpenedModel, list[list[int]], list[list[str]],
                           list[list[int]] | None]:
    """The model's folder, config and tokenizer (no weights yet), each sentence's ids and
    token names and, with targets (encoder-decoders), each decoder input (its start token,
    then the target's ids); every limit checked before the weights load."""
    from attnviz.core.request import SourceSpec
    from attnviz.sources.hf.inputs import encode
    from attnviz.sources.hf.token_names import token_names
    from attnviz.sources.registry import open_model_source

    if len(sentences) > max_sentences:
        raise UsageError(f"{len(sentences)} sentences exceed {option('max_sentences')} "
                         f"{max_sentences}", fix=f"raise {option('max_sentences')} or pass fewer")
    opened = open_model_source(SourceSpec(model=model))
    encoded = encode(opened, list(sentences), targets, max_tokens)
    rows = [list(r["input_ids"]) for r in encoded.rows]
    decoder = None
    if encoded.target_rows is not None:
        start = getattr(opened.config, "decoder_start_token_id", None)
        if not isinstance(start, int):
            raise CheckpointError("the model's config has no decoder_start_token_id",
                                  fix="add it to config.json", where=printable_path(opened.folder))
        decoder = [[start, *r["input_ids"]] for r in encoded.target_rows]
    return opened, rows, [token_names(opened.tokenizer, r) for r in rows], decoder


def notes(runner: ModelRunner) -> list[str]:
    found = []
    if runner.block is None:
        found.append(f"model type {printable(str(runner.config.model_type))!r}: attnviz knows "
                     "no decomposition of its attention blocks")
    if getattr(runner.config, "is_encoder_decoder", False):
        found.append("encoder-decoder: the encoder's self-attention is traced")
    return found


def baseline_name(runner: ModelRunner, baseline: int) -> str:
    return str(runner.tokenizer.convert_ids_to_tokens(baseline))
