"""A Hugging Face decoder-only LM decomposed for direct logit attribution and the logit lens,
from its own modules through hooks, never by re-implementing a family.

One forward with hooks reads: the input of the first decoder layer (the embeddings as the model
scales and sums them), each layer's attention and MLP output as added to the residual stream
(the modules' outputs; with Gemma-2/OLMo-2's post-branch norms, those norms' outputs), the input
of each output projection W_O (found as attnviz recognizes the layer, as `sources.hf.ablation`
does; its calls counted: one per forward), and the final norm's input and output. Each head's
part is the output projection module itself applied to the head's columns alone, less its bias
(counted once as its own part); under a post-attention norm, through that norm with its scale
frozen. The parts must add up to the model's own residual (`check_parts`: a post-norm model is
refused there) and the final norm must be one attnviz reproduces (`fit_norm`).

The lens passes hidden_states (output_hidden_states) 0..N−1 and the final norm's own input
through the final norm module itself (its own statistics per layer) and the LM head, then the
model's logit transform: transformers' last hidden state already has the final norm applied in
most families, so the last row is read before the norm, where the hook saw it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from attnviz.compute.logit.frozen_norm import FrozenNorm, NormParams, fit_norm
from attnviz.compute.logit.lens_grid import softcap
from attnviz.compute.logit.logit_run import LensRows, LogitRun, LogitTransform
from attnviz.compute.logit.residual_parts_data import ResidualParts, check_parts
from attnviz.errors import CheckFailed, CheckpointError, UsageError, option, printable, quoted
from attnviz.load.paths import library_path
from attnviz.sources.hf import guard
from attnviz.sources.hf.load import COMMON, FILES_FIX, OpenedModel, dtype_keyword
from attnviz.sources.hf.token_names import token_names

FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "layer_norm")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "fc2")
SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm")  # Gemma-2, OLMo-2
# the checks' relative tolerance per dtype (float32: round-off; half precision: its rounding
# of each module's output before the residual sum)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass
class _Block:
    """One decoder layer's modules: what writes to the residual, and its W_O."""

    attn_writer: Any  # its output is the attention branch as added to the residual
    attention: Any  # the attention module (owner of W_O)
    o_proj: Any
    o_name: str
    mlp_writer: Any | None
    post_norm: Any | None  # the post-attention norm between attention and residual, if any
    heads: int
    cols: list[tuple[int, int]]  # each head's columns of W_O's input


def load_lm(opened: OpenedModel, device: torch.device, dtype: str) -> Any:
    """The causal-LM model of the folder (eager attention, never repository code)."""
    from attnviz.sources.hf.ablation import lm_class

    arch, kind = lm_class(opened.config)
    if arch is None or kind != "causal":
        what = "an encoder-decoder" if kind == "seq2seq" else \
            "a masked-LM" if kind == "masked" else "no causal-LM head"
        raise UsageError(f"direct logit attribution and the logit lens need a decoder-only "
                         f"model with a causal-LM head; config.json's architectures name "
                         f"{what}", fix="pass a decoder-only causal LM (encoder-decoder "
                         "models are not supported yet)", option="model")
    import transformers

    with guard.silenced(stderr=True), guard.contained(
            "transformers cannot load the model's LM head", FILES_FIX,
            printable(str(opened.folder))):
        model = getattr(transformers, arch).from_pretrained(
            library_path(opened.folder), attn_implementation="eager",
            **{dtype_keyword(): dtype if dtype == "auto" else getattr(torch, dtype)}, **COMMON)
    return model.eval().to(device)


class ModelLogits:
    """Tokenizing, naming and running a Hugging Face causal LM for `attribute` and `lens`."""

    def __init__(self, opened: OpenedModel, model: Any) -> None:
        self.tokenizer, self.model, self.config = opened.tokenizer, model, opened.config
        self.dtype = str(model.dtype).removeprefix("torch.")
        if self.dtype not in TOLERANCE:
            raise CheckpointError(f"the model's weights are {self.dtype}, which attnviz does "
                                  "not decompose", fix=f"pass {option('dtype')} float32")
        self.tolerance = TOLERANCE[self.dtype]
        self.name = printable(opened.folder.name)
        self.head = model.get_output_embeddings()
        if self.head is None or not hasattr(self.head, "weight"):
            raise CheckpointError("the model has no unembedding with a weight",
                                  fix="pass a causal LM")
        self.blocks_name, self.blocks = _decoder_layers(model, self.config)
        self.norm_name, self.norm = _final_norm(model, self.blocks_name)
        self.anatomy = [_block(model, opened, self.blocks_name, i, block)
                        for i, block in enumerate(self.blocks)]
        factor = getattr(self.config, "logit_scale", None)  # Cohere multiplies
        scaling = getattr(self.config, "logits_scaling", None)  # Granite divides
        self.transform = LogitTransform(
            (float(factor) if isinstance(factor, int | float) else 1.0)
            / (float(scaling) if isinstance(scaling, int | float) and scaling else 1.0),
            getattr(self.config, "final_logit_softcapping", None) or None)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        ids = [int(i) for i in self.tokenizer(text)["input_ids"]]
        if not ids:
            raise UsageError("a prompt encodes to no token", fix="give a longer prompt")
        return ids, token_names(self.tokenizer, ids)

    def prompt(self, text: str) -> tuple[list[int], list[str]]:
        """The pairs' tokenizer (attnviz.compute.patching.pairs): with special tokens."""
        return self.tokenize(text)

    def piece(self, text: str) -> tuple[list[int], list[str]]:
        """An answer's tokens: no special tokens added."""
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        return ids, token_names(self.tokenizer, ids)

    def token_id(self, text: str, what: str) -> int:
        """The one token `text` encodes to (without special tokens)."""
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if len(ids) != 1:
            shown = " ".join(quoted(n) for n in token_names(self.tokenizer, ids)) or "none"
            raise UsageError(f"the {what} {quoted(text)} encodes to {len(ids)} tokens "
                             f"({shown}); the metric reads one token's logit",
                             fix="give one token (with its leading space where the "
                             "tokenizer marks one, e.g. ' Mary')", option=what)
        return ids[0]

    def name_of(self, token_id: int) -> str:
        return token_names(self.tokenizer, [int(token_id)])[0]

    def run(self, prompts: list[list[int]], tokens: list[list[str]], positions: list[int],
            lens_positions: list[list[int]] | None) -> LogitRun:
        """One right-padded forward (causal: padding after a prompt changes none of its
        tokens) with the hooks of the module docstring."""
        B, L = len(prompts), max(len(p) for p in prompts)
        pad_id = self.tokenizer.pad_token_id
        pad_id = 0 if pad_id is None else int(pad_id)
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for b, row in enumerate(prompts):
            ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
        seen, handles = self._hooks()
        try:
            with torch.no_grad(), guard.silenced():
                outputs = self.model(input_ids=ids.to(self.device),
                                     attention_mask=mask.to(self.device),
                                     output_hidden_states=True, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        self._check_calls(seen["calls"])
        at = torch.tensor(positions)
        rows = torch.arange(B)

        def pick(t: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, E) float, on the CPU
            if t.ndim == 2:  # OPT runs its MLP on (B·L, E)
                t = t.reshape(B, L, -1)
            return t.detach().float().cpu()[rows, at]

        with torch.no_grad():
            parts, notes = self._parts(seen, pick, at)
            check_parts(parts, f"model {quoted(self.name)}", self.tolerance)
            norm = _fit(self.norm, pick(seen["final_in"][0]), pick(seen["final_out"][0]),
                        f"the final norm {quoted(self.norm_name)}", self.tolerance)
            logits = pick(outputs.logits)
            self._check_head(pick(seen["final_out"][0]), logits)
            lens = None
            if lens_positions is not None:
                lens = self._lens(outputs.hidden_states, seen["final_in"][0], lens_positions,
                                  notes)
        weight = self.head.weight.detach().float().cpu()
        bias = getattr(self.head, "bias", None)
        if self.dtype != "float32":
            notes.append(f"the model runs in {self.dtype}: each module rounds its output, so "
                         "the remainder holds that rounding, not float32 round-off")
        return LogitRun(f"model {quoted(self.name)}", tokens, positions, parts, norm, logits,
                        weight, None if bias is None else bias.detach().float().cpu(),
                        self.transform, f"{self.norm_name} ({type(self.norm).__name__})", lens,
                        lens_positions, notes)

    def _hooks(self) -> tuple[dict[str, Any], list[Any]]:
        """Hooks filling `seen`: lists of tensors by key, and W_O calls by layer."""
        seen: dict[str, Any] = {"calls": Counter()}

        def keep(key: str) -> Any:
            def hook(module: Any, args: Any, output: Any) -> None:
                value = output[0] if isinstance(output, tuple) else output
                # a copy: Falcon adds the attention output into the MLP's in place
                seen.setdefault(key, []).append(value.detach().clone())
            return hook

        def keep_input(key: str) -> Any:
            def hook(module: Any, args: Any, kwargs: Any) -> None:
                value = args[0] if args else kwargs.get("hidden_states")
                seen.setdefault(key, []).append(value.detach().clone())
            return hook

        handles = [self.blocks[0].register_forward_pre_hook(keep_input("embed"),
                                                            with_kwargs=True),
                   self.norm.register_forward_pre_hook(keep_input("final_in"), with_kwargs=True),
                   self.norm.register_forward_hook(keep("final_out"))]
        for i, block in enumerate(self.anatomy):
            def count(module: Any, args: Any, kwargs: Any, i: int = i) -> None:
                seen["calls"][i] += 1
                keep_input(f"z{i}")(module, args, kwargs)
            handles.append(block.o_proj.register_forward_pre_hook(count, with_kwargs=True))
            handles.append(block.attn_writer.register_forward_hook(keep(f"attn{i}")))
            if block.post_norm is not None:
                handles.append(block.attention.register_forward_hook(keep(f"raw{i}")))
            if block.mlp_writer is not None:
                handles.append(block.mlp_writer.register_forward_hook(keep(f"mlp{i}")))
        return seen, handles

    def _check_calls(self, calls: Counter[int]) -> None:
        for i, block in enumerate(self.anatomy):
            if calls[i] != 1:
                raise CheckpointError(f"the output projection {printable(block.o_name)!r} ran "
                                      f"{calls[i]} times in one forward pass: attnviz cannot "
                                      "tell which call is which layer",
                                      fix="report this model to attnviz")

    def _parts(self, seen: dict[str, Any], pick: Any, at: torch.Tensor
               ) -> tuple[ResidualParts, list[str]]:
        attn, mlp, heads, biases = [], [], [], []
        notes: list[str] = []
        for i, block in enumerate(self.anatomy):
            z = pick(seen[f"z{i}"][0])  # (B, H·d)
            own = block.o_proj
            weight_dtype = next(own.parameters()).dtype
            zero = torch.zeros_like(z)
            stacked = torch.stack([torch.zeros_like(z).index_copy(
                1, torch.arange(c0, c1), z[:, c0:c1]) for c0, c1 in block.cols] + [zero])
            out = own(stacked.to(self.device, weight_dtype)).float().cpu()  # (H+1, B, E)
            bias = out[-1]
            per_head = out[:-1] - bias  # the module's own map of each head's columns, unbiased
            if block.post_norm is not None:  # Gemma-2, OLMo-2: a norm before the residual
                post = _fit(block.post_norm, pick(seen[f"raw{i}"][0]), pick(seen[f"attn{i}"][0]),
                            f"the post-attention norm of layer {i}", self.tolerance)
                per_head, bias = post.linear(per_head.double()).float(), \
                    post.apply(bias.double()).float()
            heads.append(per_head)
            biases.append(bias)
            attn.append(pick(seen[f"attn{i}"][0]))
            if block.mlp_writer is not None:
                mlp.append(pick(seen[f"mlp{i}"][0]))
        if any(b.post_norm is not None for b in self.anatomy):
            notes.append("each head's part passes the post-attention norm with its scale "
                         "frozen at this run (the norm's bias, if any, counted with W_O's)")
        has_mlp = len(mlp) == len(self.anatomy)
        if mlp and not has_mlp:
            raise CheckpointError("only some decoder layers have an MLP attnviz finds",
                                  fix="report this model to attnviz")
        return ResidualParts(pick(seen["embed"][0]), torch.stack(attn),
                             torch.stack(mlp) if has_mlp else None, torch.stack(heads),
                             torch.stack(biases), pick(seen["final_in"][0])), notes

    def _check_head(self, normed: torch.Tensor, logits: torch.Tensor) -> None:
        """attnviz's head(norm(x)) and transform must give the model's own logits."""
        with torch.no_grad():
            weight_dtype = self.head.weight.dtype
            mine = self._logits(normed.to(self.device, weight_dtype)).float().cpu()
        gap = float((mine - logits).abs().max()) / max(1.0, float(logits.abs().max()))
        if gap > self.tolerance:
            raise CheckFailed(f"the model's logits are not its LM head applied to its final "
                              f"norm's output, then {self.transform.describe()} (relative gap "
                              f"{gap:.1e}): it transforms them in a way attnviz does not know",
                              fix="report this model to attnviz")

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head module, then the model's logit transform."""
        logits = self.head(normed).double() * self.transform.factor
        return softcap(logits, self.transform.softcap)

    def _lens(self, hidden: tuple[torch.Tensor, ...], final: torch.Tensor,
              positions: list[list[int]], notes: list[str]) -> LensRows:
        """Per prompt the rows hidden_states 0..N−1 and the final norm's input at its
        positions; logits through the final norm module (its own statistics) and the head."""
        if len(hidden) != len(self.blocks) + 1:
            raise CheckpointError(f"the model returned {len(hidden)} hidden states for "
                                  f"{len(self.blocks)} layers", fix="report this model")
        if torch.equal(hidden[-1], final):
            notes.append("transformers' last hidden state is the final norm's input here")
        else:
            notes.append("transformers' last hidden state has the final norm applied: the "
                         "last lens row reads the norm's input instead")
        states = [*hidden[:-1], final]

        def to_logits(rows: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self._logits(self.norm(rows))

        return LensRows([torch.stack([state[b, cols] for state in states])
                         for b, cols in enumerate(positions)], to_logits)


def _decoder_layers(model: Any, config: Any) -> tuple[str, Any]:
    """The ModuleList of decoder layers: num_hidden_layers long, the outermost such."""
    count = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and count:
            return name, module
    raise CheckpointError("attnviz finds no list of decoder layers in the model",
                          fix="report this model to attnviz")


def _final_norm(model: Any, blocks: str) -> tuple[str, Any]:
    found = [(name, module) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] in FINAL_NORMS and not name.startswith(blocks + ".")]
    if len(found) != 1:
        raise CheckpointError(f"attnviz finds {len(found)} final norms in the model "
                              f"({', '.join(printable(n) for n, _ in found) or 'none'})",
                              fix="report this model to attnviz")
    return found[0]


def _block(model: Any, opened: OpenedModel, blocks: str, index: int, block: Any) -> _Block:
    """Layer `index`'s modules; W_O is found as attnviz recognizes the layer (its o_weight's
    parameter), as the scorecard finds it."""
    from attnviz.recognize import find_layers
    from attnviz.sources.hf.verify import module_of, parameter_of

    prefix = f"{blocks}.{index}."
    params = dict(model.named_parameters())
    for layer in find_layers(opened.store).layers:
        try:
            o_name, _ = parameter_of(model, layer.o_weight.key)
        except CheckpointError:
            continue
        if not o_name.startswith(prefix) or o_name not in params:
            continue
        module_name, o_proj = module_of(model, o_name)
        child = module_name[len(prefix):].split(".", 1)[0]
        attention = getattr(block, child)
        children = dict(block.named_children())
        sandwich = all(name in children for name in SANDWICH)
        mlp_name = next((n for n in MLP_NAMES if n in children), None)
        H = layer.num_heads or 0
        return _Block(children[SANDWICH[0]] if sandwich else attention, attention, o_proj,
                      module_name, None if mlp_name is None
                      else children[SANDWICH[1]] if sandwich else children[mlp_name],
                      children[SANDWICH[0]] if sandwich else None, H,
                      [layer.o_cols(h) for h in range(H)])
    raise CheckpointError(f"attnviz does not recognize the output projection W_O of decoder "
                          f"layer {index}, which direct logit attribution needs",
                          fix="'attnviz inspect' shows which layers attnviz recognizes")


def _fit(module: Any, x: torch.Tensor, y: torch.Tensor, what: str,
         tolerance: float) -> FrozenNorm:
    """The norm module's kind and frozen scale, from its own input and output."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    eps = next((float(getattr(module, name)) for name in ("eps", "variance_epsilon", "epsilon")
                if isinstance(getattr(module, name, None), float | int)), None)
    params = NormParams(None if weight is None else weight.detach().float().cpu(),
                        None if bias is None else bias.detach().float().cpu(), eps)
    return fit_norm(x, y, params, what, tolerance)
