"""A Hugging Face causal LM (or an encoder-decoder's decoder, read with a target) decomposed
for direct logit attribution and the logit lens, from its own modules through hooks, never by
re-implementing a family (where the residual is written: `sources.hf.decoder_anatomy`).

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
from collections.abc import Callable
from typing import Any

import torch

from attnviz.compute.logit.frozen_norm import FrozenNorm, NormParams, fit_norm
from attnviz.compute.logit.lens_grid import softcap
from attnviz.compute.logit.logit_run import LensRows, LogitRun, LogitTransform, Prompts
from attnviz.compute.logit.residual_parts_data import ResidualParts, check_parts
from attnviz.errors import CheckFailed, CheckpointError, UsageError, option, printable, quoted
from attnviz.load.paths import library_path
from attnviz.sources.hf import guard
from attnviz.sources.hf.decoder_anatomy import Branch, find_anatomy
from attnviz.sources.hf.load import COMMON, FILES_FIX, OpenedModel, dtype_keyword
from attnviz.sources.hf.token_names import token_names

# the checks' relative tolerance per dtype (float32: round-off; half precision: its rounding
# of each module's output before the residual sum)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def load_lm(opened: OpenedModel, device: torch.device, dtype: str) -> Any:
    """The causal-LM model of the folder (eager attention, never repository code)."""
    from attnviz.sources.hf.ablation import lm_class

    arch, kind = lm_class(opened.config)
    if arch is None or kind not in ("causal", "seq2seq"):
        what = "a masked-LM" if kind == "masked" else "no language-model head"
        raise UsageError(f"direct logit attribution and the logit lens need a model with a "
                         f"causal-LM head (or an encoder-decoder's); config.json's "
                         f"architectures name {what}", fix="pass a causal LM, or an "
                         "encoder-decoder with its target", option="model")
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
        self.limit = opened.position_limit  # the most tokens its positions can number
        self.head = model.get_output_embeddings()
        if self.head is None or not hasattr(self.head, "weight"):
            raise CheckpointError("the model has no unembedding with a weight",
                                  fix="pass a causal LM")
        self.encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False))
        stack = model.get_decoder() if self.encoder_decoder else model
        anatomy = find_anatomy(model, opened, stack, _layer_count(self.config,
                                                                  self.encoder_decoder))
        self.blocks, self.norm_name, self.norm = anatomy.blocks, anatomy.norm_name, anatomy.norm
        self.anatomy = anatomy.layers
        # BART-family heads add a buffer after the unembedding (zeros unless trained so)
        extra = getattr(model, "final_logits_bias", None)
        self.extra_bias = None if not isinstance(extra, torch.Tensor) else extra.reshape(-1)
        self.transform = LogitTransform(_factor(self.config), getattr(
            self.config, "final_logit_softcapping", None) or None)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        ids = [int(i) for i in self.tokenizer(text)["input_ids"]]
        if not ids:
            raise UsageError("a prompt encodes to no token", fix="give a longer prompt")
        self._check_length(len(ids))
        return ids, token_names(self.tokenizer, ids)

    def _check_length(self, count: int) -> None:
        if self.limit is not None and count > self.limit:
            raise UsageError(f"a prompt of {count} tokens is longer than the model's "
                             f"{self.limit} positions", fix="shorten it")

    def target(self, text: str) -> tuple[list[int], list[str]]:
        """An encoder-decoder's decoder input: its start token, then the target's tokens
        (no special tokens): the last position predicts the token after the target."""
        start = getattr(self.config, "decoder_start_token_id", None)
        if start is None:
            raise CheckpointError("config.json has no decoder_start_token_id",
                                  fix="add it to the model's config.json")
        ids = [int(start)] + [int(i) for i in
                              self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        self._check_length(len(ids))
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

    def run(self, given: Prompts, lens_positions: list[list[int]] | None) -> LogitRun:
        """One right-padded forward (causal: padding after a prompt changes none of its
        tokens) with the hooks of the module docstring."""
        tokens, positions = given.tokens, given.positions
        B, L = len(given.ids), max(len(p) for p in given.ids)
        ids, mask = self._padded(given.ids)
        if given.encoder_ids is not None:
            source, source_mask = self._padded(given.encoder_ids)
            feed = {"input_ids": source, "attention_mask": source_mask, "decoder_input_ids": ids}
        else:
            feed = {"input_ids": ids, "attention_mask": mask}
        at = torch.tensor(positions, device=self.device)
        rows = torch.arange(B, device=self.device)

        def select(t: torch.Tensor) -> torch.Tensor:
            """(B, L, E) -> (B, E) at each prompt's position, a copy kept by the hooks: the
            rest of each (B, L, E) output is never held."""
            if t.ndim == 2:  # OPT runs its MLP on (B·L, E)
                t = t.reshape(B, L, -1)
            return t.detach()[rows.to(t.device), at.to(t.device)]

        seen, handles = self._hooks(select, lens_positions is not None)
        try:
            with torch.no_grad(), guard.silenced():
                outputs = self.model(**{k: v.to(self.device) for k, v in feed.items()},
                                     output_hidden_states=lens_positions is not None,
                                     use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        self._check_calls(seen["calls"])

        def pick(t: torch.Tensor) -> torch.Tensor:  # what a hook kept, as float on the CPU
            return t.float().cpu()

        with torch.no_grad():
            parts, notes = self._parts(seen, pick)
            check_parts(parts, f"model {quoted(self.name)}", self.tolerance)
            norm = _fit(self.norm, pick(seen["final_in"][0]), pick(seen["final_out"][0]),
                        f"the final norm {quoted(self.norm_name)}", self.tolerance)
            logits = pick(select(outputs.logits))
            self._check_head(pick(seen["final_out"][0]), logits)
            lens = None
            if lens_positions is not None:
                hidden = outputs.decoder_hidden_states if self.encoder_decoder \
                    else outputs.hidden_states
                lens = self._lens(hidden, seen["final_whole"][0], lens_positions, notes)
        weight = self.head.weight.detach().float().cpu()
        bias = self._bias()
        if self.dtype != "float32":
            notes.append(f"the model runs in {self.dtype}: each module rounds its output, so "
                         "the remainder holds that rounding, not float32 round-off")
        if self.encoder_decoder:
            notes.append("an encoder-decoder: its decoder is decomposed (positions are the "
                         "decoder's: start token + target); each decoder layer's "
                         "cross-attention is a part of its own (heads LnXh)")
        return LogitRun(f"model {quoted(self.name)}", tokens, positions, parts, norm, logits,
                        weight, bias, self.transform,
                        f"{self.norm_name} ({type(self.norm).__name__})", lens, lens_positions,
                        notes)

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), right-padded with the tokenizer's pad id (else 0)."""
        pad_id = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), max(len(r) for r in rows)),
                         0 if pad_id is None else int(pad_id), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, row in enumerate(rows):
            ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
        return ids, mask

    def _bias(self) -> torch.Tensor | None:
        """The unembedding's bias: the head's own, plus a buffer added after it (BART's)."""
        parts = [b.detach().float().cpu().reshape(-1) for b in
                 (getattr(self.head, "bias", None), self.extra_bias) if b is not None]
        return None if not parts else sum(parts[1:], parts[0])

    def _hooks(self, select: Callable[[torch.Tensor], torch.Tensor], whole: bool
               ) -> tuple[dict[str, Any], list[Any]]:
        """Hooks filling `seen`: lists of tensors by key (each `select`ed at the positions, a
        copy: Falcon adds the attention output into the MLP's in place), W_O calls by layer,
        and (`whole`, for the lens) the final norm's whole input."""
        seen: dict[str, Any] = {"calls": Counter()}

        def keep(key: str) -> Any:
            def hook(module: Any, args: Any, output: Any) -> None:
                value = output[0] if isinstance(output, tuple) else output
                seen.setdefault(key, []).append(select(value))
            return hook

        def keep_input(key: str, all_rows: bool = False) -> Any:
            def hook(module: Any, args: Any, kwargs: Any) -> None:
                value = args[0] if args else kwargs.get("hidden_states")
                seen.setdefault(key, []).append(value.detach().clone() if all_rows
                                                else select(value))
            return hook

        handles = [self.blocks[0].register_forward_pre_hook(keep_input("embed"),
                                                            with_kwargs=True),
                   self.norm.register_forward_pre_hook(keep_input("final_in"), with_kwargs=True),
                   self.norm.register_forward_hook(keep("final_out"))]
        if whole:
            handles.append(self.norm.register_forward_pre_hook(
                keep_input("final_whole", all_rows=True), with_kwargs=True))
        for i, layer in enumerate(self.anatomy):
            for kind, branch in (("attn", layer.attn), ("cross", layer.cross)):
                if branch is None:
                    continue

                def count(module: Any, args: Any, kwargs: Any, key: str = f"{kind}{i}") -> None:
                    seen["calls"][key] += 1
                    keep_input(f"z.{key}")(module, args, kwargs)
                handles.append(branch.o_proj.register_forward_pre_hook(count, with_kwargs=True))
                handles.append(branch.writer.register_forward_hook(keep(f"{kind}{i}")))
                if branch.post_norm is not None:
                    handles.append(branch.attention.register_forward_hook(keep(f"raw.{kind}{i}")))
            if layer.mlp_writer is not None:
                handles.append(layer.mlp_writer.register_forward_hook(keep(f"mlp{i}")))
        return seen, handles

    def _check_calls(self, calls: Counter[str]) -> None:
        for i, layer in enumerate(self.anatomy):
            for kind, branch in (("attn", layer.attn), ("cross", layer.cross)):
                if branch is not None and calls[f"{kind}{i}"] != 1:
                    raise CheckpointError(
                        f"the output projection {printable(branch.o_name)!r} ran "
                        f"{calls[f'{kind}{i}']} times in one forward pass: attnviz cannot "
                        "tell which call is which layer", fix="report this model to attnviz")

    def _parts(self, seen: dict[str, Any], pick: Any) -> tuple[ResidualParts, list[str]]:
        """Every part at the chosen positions: the branches' outputs as the hooks saw them,
        each head's share through W_O's own module."""
        found: dict[str, list[torch.Tensor]] = {}
        notes: list[str] = []
        for i, layer in enumerate(self.anatomy):
            for kind, branch in (("attn", layer.attn), ("cross", layer.cross)):
                if branch is None:
                    continue
                heads, bias = self._heads(branch, seen, pick, f"{kind}{i}")
                for key, value in ((kind, pick(seen[f"{kind}{i}"][0])),
                                   (f"{kind}.heads", heads), (f"{kind}.bias", bias)):
                    found.setdefault(key, []).append(value)
            if layer.mlp_writer is not None:
                found.setdefault("mlp", []).append(pick(seen[f"mlp{i}"][0]))
        if any(layer.attn.post_norm is not None for layer in self.anatomy):
            notes.append("each head's part passes the post-attention norm with its scale "
                         "frozen at this run (the norm's bias, if any, counted with W_O's)")
        for key in ("mlp", "cross"):
            if key in found and len(found[key]) != len(self.anatomy):
                raise CheckpointError(f"only some decoder layers have the {key} attnviz finds",
                                      fix="report this model to attnviz")

        def stacked(key: str) -> torch.Tensor | None:
            return torch.stack(found[key]) if key in found else None

        return ResidualParts(pick(seen["embed"][0]), torch.stack(found["attn"]), stacked("mlp"),
                             stacked("attn.heads"), stacked("attn.bias"),
                             pick(seen["final_in"][0]), cross=stacked("cross"),
                             cross_heads=stacked("cross.heads"),
                             cross_bias=stacked("cross.bias")), notes

    def _heads(self, branch: Branch, seen: dict[str, Any], pick: Any, key: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """((H, B, E) each head's share, (B, E) W_O's bias): W_O's own module applied to
        one head's columns of its input at a time, less its output on zeros (its bias)."""
        z = pick(seen[f"z.{key}"][0])  # (B, H·d)
        own = branch.o_proj
        weight_dtype = next(own.parameters()).dtype
        stacked = torch.stack([torch.zeros_like(z).index_copy(
            1, torch.arange(c0, c1), z[:, c0:c1]) for c0, c1 in branch.cols]
            + [torch.zeros_like(z)])
        out = own(stacked.to(self.device, weight_dtype)).float().cpu()  # (H+1, B, E)
        bias, per_head = out[-1], out[:-1] - out[-1]
        if branch.post_norm is not None:  # Gemma-2, OLMo-2: a norm before the residual
            post = _fit(branch.post_norm, pick(seen[f"raw.{key}"][0]), pick(seen[key][0]),
                        f"the post-attention norm of {key}", self.tolerance)
            per_head, bias = post.linear(per_head.double()).float(), \
                post.apply(bias.double()).float()
        return per_head, bias

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
        """The LM head module (and a bias buffer after it), then the model's logit
        transform."""
        logits = self.head(normed).double()
        if self.extra_bias is not None:
            logits = logits + self.extra_bias.to(logits.device, logits.dtype)
        logits = logits * self.transform.factor
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


def _layer_count(config: Any, decoder: bool) -> int | None:
    """How many layers the stack has, as config.json says."""
    names = ("decoder_layers", "num_decoder_layers", "num_layers") if decoder \
        else ("num_hidden_layers",)
    return next((int(v) for n in names if isinstance(v := getattr(config, n, None), int)),
                None)


def _factor(config: Any) -> float:
    """The linear logit transform after (or, T5's, just before) the head: Cohere's
    logit_scale, Granite's 1 / logits_scaling, T5's d_model^-0.5 on a tied head."""
    factor = getattr(config, "logit_scale", None)
    scaling = getattr(config, "logits_scaling", None)
    value = (float(factor) if isinstance(factor, int | float) else 1.0) \
        / (float(scaling) if isinstance(scaling, int | float) and scaling else 1.0)
    if getattr(config, "scale_decoder_outputs", False):
        value *= float(config.d_model) ** -0.5
    return value


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
