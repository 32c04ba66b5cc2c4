"""A Hugging Face causal LM as a `PatchModel` (attnviz.compute.patching.model): the model's own
forward, with its sites reached through its own modules and attention function.

- z (each head's output): a forward pre-hook on each layer's output projection — the module
  holding attnviz's W_O (found by the naming table, as `attnviz ablate` finds it), Linear or
  GPT-2's Conv1D — whose input (N, L, H·d) is viewed as (N, L, H, d).
- resid (the residual stream entering layer i): a forward pre-hook on each decoder block (the
  ModuleList element holding the attention module), on its hidden_states argument.
- q, k, v, pattern: attnviz's function registered in transformers' attention interface
  (`NAME`): it receives per-head query (after rotary) and key/value (before the grouped-query
  repeat), lets the hook replace them, and runs the module's OWN eager attention; a replaced
  pattern is multiplied by the (repeated) values as eager attention does.

Every hook counts calls within one forward: the j-th call of any W_O (block, attention call)
is layer j, so a module that runs for several layers (ALBERT) is a layer per call. A model
whose calls do not number its layers is refused. Inputs are right-padded with an attention
mask, so positions count from 0 in every row (no left-padding position shift).

`forward_from` takes a `Shortcut` (attnviz.compute.patching.model): the blocks before its
start return the given residual stream instead of running (allowed when each block is its own
module and returns the stream as a plain tensor, as checked on a trial forward), and a frozen
layer's attention function returns zeros after its q, k, v hooks (the hook on W_O's input
replaces every head's output there, so the attention's result is never read).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from attnviz.compute.forward_pass.device import resolve_device
from attnviz.compute.patching.model import Hook, Shortcut
from attnviz.errors import CheckpointError, UsageError, option, printable
from attnviz.load.paths import library_path
from attnviz.sources.hf import capture, guard
from attnviz.sources.hf.ablation import lm_class
from attnviz.sources.hf.capture_eager import eager_function
from attnviz.sources.hf.known_layers import attention_layers
from attnviz.sources.hf.load import COMMON, FILES_FIX, OpenedModel, dtype_keyword, open_model
from attnviz.sources.hf.verify import module_of, parameter_of

NAME = "attnviz_patch"  # the attention function's name in transformers' interface


@dataclass
class _Session:
    """One forward's hook and call counters."""

    hook: Hook | None
    calls: dict[str, int] = field(default_factory=lambda: {"attention": 0, "z": 0, "resid": 0})
    modules: list[Any] = field(default_factory=list)  # attention modules, in call order
    frozen: frozenset[int] = frozenset()  # layers whose attention result is not needed
    start: int = 0  # the blocks before it are skipped (their inputs are not hooked)
    names: list[str] = field(default_factory=list)  # W_O modules' names, in call order

    def next(self, what: str) -> int:
        number = self.calls[what]
        self.calls[what] += 1
        return number


ACTIVE: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("attnviz_patch",
                                                                         default=None)


def patch_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered function (module, query, key, value, attention_mask, …): the module's
    own eager attention, with q, k, v and the pattern passed through the session's hook
    (query (N, H, L, d) as (N, L, H, d), and so on)."""
    eager = eager_function(module)
    session = ACTIVE.get()
    if session is None:
        return eager(module, query, key, value, *args, **kwargs)
    layer = session.next("attention")
    session.modules.append(module)
    hook = session.hook
    if hook is None:
        return eager(module, query, key, value, *args, **kwargs)
    query = hook("q", layer, query.transpose(1, 2)).transpose(1, 2)
    key = hook("k", layer, key.transpose(1, 2)).transpose(1, 2)
    value = hook("v", layer, value.transpose(1, 2)).transpose(1, 2)
    if layer in session.frozen:  # W_O's hook replaces every head's output: nothing reads it
        return value.new_zeros(query.shape[0], query.shape[2], query.shape[1],
                               value.shape[-1]), None
    out, weights = eager(module, query, key, value, *args, **kwargs)
    if weights is None:
        return out, weights
    pattern = hook("pattern", layer, weights)
    if pattern is not weights:  # replaced: its product with the values, as eager forms it
        values = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out = torch.matmul(pattern.to(values.dtype), values).transpose(1, 2).contiguous()
    return out, weights


def register() -> None:
    """`NAME` as an attn_implementation, with the eager mask builder (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, patch_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


class HFTokenizer:
    """A transformers tokenizer as patching uses it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _encode(self, text: str, special: bool) -> tuple[list[int], list[str]]:
        ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        return ids, [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def prompt(self, text: str) -> tuple[list[int], list[str]]:
        return self._encode(text, True)

    def piece(self, text: str) -> tuple[list[int], list[str]]:
        return self._encode(text, False)


class HFPatchModel:
    """A causal LM, hooked for patching."""

    def __init__(self, model: Any, tokenizer: Any, name: str, store: Any,
                 target: list[int] | None = None) -> None:
        self.model, self.name = model, name
        self.target = target  # an encoder-decoder's decoder input ids (start token first)
        self.shares_prefix = target is None
        self.tokenizer = HFTokenizer(tokenizer)
        self.device = next(model.parameters()).device
        self.notes: list[str] = []
        self.position_limit: int | None = None
        layers = attention_layers(store)
        if not layers:
            raise CheckpointError("attnviz finds no attention layer in the model",
                                  where=printable(name))
        first = layers[0]
        assert first.num_heads is not None and first.num_kv_heads is not None
        self.n_heads, self.n_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim or 0
        if any((x.num_heads, x.num_kv_heads) != (self.n_heads, self.n_kv_heads) for x in layers):
            raise CheckpointError("the model's layers have different head counts, which "
                                  "patching's grids do not hold", where=printable(name))
        self.o_modules = []
        self._o_names: dict[int, str] = {}
        for layer in layers:
            pname, _ = parameter_of(model, layer.o_weight.key)
            oname, module = module_of(model, pname)
            self.o_modules.append(module)
            self._o_names[id(module)] = oname
        self.blocks = _blocks(model, self.o_modules)
        self.interface = capture.uses_interface(model)
        if self.interface:
            register()
            model.set_attn_implementation(NAME)
            self.sites: tuple[str, ...] = ("resid", "q", "k", "v", "pattern", "z")
        else:
            self.sites = ("resid", "z") if self.blocks else ("z",)
            self.notes.append("the model's attention does not go through transformers' "
                              "attention interface: q, k, v and pattern cannot be patched")
        self.layer_labels: list[str] = []
        self.starts = False  # whether blocks may be skipped (see _count_layers)
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.n_layers = self._count_layers()
        if self.shares_prefix and not self._prefix_broadcasts():
            self.shares_prefix = self.starts = False

    def _count_layers(self) -> int:
        """Layers = W_O calls in one forward (a shared module counts once per call)."""
        session = _Session(None)
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        # each block call returned a tensor shaped as its input, and (after the first) was
        # given the previous block's output object itself: nothing runs between blocks
        plain: list[bool] = []
        last: list[Any] = []

        def returns(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            given = args[0] if args else kwargs.get("hidden_states")
            plain.append(isinstance(output, torch.Tensor) and isinstance(given, torch.Tensor)
                         and output.shape == given.shape and (not last or given is last[0]))
            last[:] = [output]
        handles = [b.register_forward_hook(returns, with_kwargs=True)
                   for b in dict.fromkeys(self.blocks)]
        try:
            self._run(ids, torch.ones_like(ids, dtype=torch.bool), session)
        finally:
            for handle in handles:
                handle.remove()
        n = session.calls["z"]
        self.layer_labels = _labels(session.names) if self.target is not None \
            else [f"L{i}" for i in range(n)]
        if self.interface and session.calls["attention"] != n:
            raise CheckpointError(f"the model ran its attention {session.calls['attention']} "
                                  f"times and its output projections {n} times in one forward: "
                                  "attnviz cannot tell which call is which layer",
                                  where=printable(self.name))
        if self.blocks and session.calls["resid"] != n:
            self.blocks = []
            self.sites = tuple(s for s in self.sites if s != "resid")
            self.notes.append("the model's blocks do not run once per attention layer (an "
                              "encoder-decoder's decoder block holds two): the residual stream "
                              "is not patched")
        # a block may be skipped (its output given) when each layer is its own block, run once,
        # that returns the stream itself: the model passes it on to the next block unchanged
        self.starts = (self.shares_prefix and bool(self.blocks) and len(plain) == n
                       and all(plain) and len({id(b) for b in self.blocks}) == n)
        return n

    def _prefix_broadcasts(self) -> bool:
        """Whether one row's run, copied where the residual stream enters layer 1, goes on as
        the copies' own runs do: the engine's shared prefix (compute/patching/engine.py) needs
        every mask and position table the model built for one row to serve the copies. BLOOM's
        ALiBi bias, XGLM's mask check and multi-query GPTBigCode's reshapes are built for the
        batch the forward began with, so they fail (or could differ): tried once, on a
        three-token input, against the copies run whole."""
        if "resid" not in self.sites or self.n_layers < 2:
            return False
        ids = torch.tensor([[1, 2, 3]], device=self.device)
        real = torch.ones_like(ids, dtype=torch.bool)
        read = torch.tensor([[2], [2]], device=self.device)  # per copy

        def copied(site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
            if site == "resid" and layer == 1 and x.shape[0] == 1:
                return x.expand(2, *x.shape[1:]).contiguous()
            return x
        try:
            with torch.no_grad():
                shared = self.forward(ids, real, read, copied)
                whole = self.forward(ids.repeat(2, 1), real.repeat(2, 1), read, None)
        except (RuntimeError, ValueError, IndexError):
            return False
        return shared.shape == whole.shape and bool(torch.allclose(
            shared.float(), whole.float(), rtol=1e-4, atol=1e-5))

    def row_bytes(self, length: int) -> int:
        config = self.model.config
        E = int(getattr(config, "hidden_size", 0) or self.n_heads * self.head_dim)
        size = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        inter = int(getattr(config, "intermediate_size", 4 * E) or 4 * E)
        # the eager attention's scores, weights and their float32 softmax (≈ 6 tensors of
        # H·L per token), the MLP's activations (≈ 4 of its width) and the stream's own
        # (≈ 16 of E), as measured against the allocator's peak (benchmarks/run.py step 11)
        return size * length * (16 * E + 4 * inter + 6 * self.n_heads * length) + 8 * 4096

    def _run(self, ids: torch.Tensor, real: torch.Tensor, session: _Session,
             keep: torch.Tensor | None = None, shortcut: Shortcut | None = None) -> Any:
        handles = []
        skipped: list[Any] = []
        if shortcut is not None and shortcut.start > 0 and shortcut.state is not None \
                and self.starts:
            state = shortcut.state

            def given(*args: Any, **kwargs: Any) -> torch.Tensor:
                return state
            skipped = self.blocks[:shortcut.start]
            session.start = shortcut.start
            for number in ("z", "attention"):  # their layers' modules do not run
                session.calls[number] = shortcut.start
        if shortcut is not None and self.interface:
            session.frozen = shortcut.frozen

        def on_z(module: Any, args: tuple) -> tuple | None:
            layer = session.next("z")
            session.names.append(self._o_names.get(id(module), ""))
            if session.hook is None or not args:
                return None
            x = args[0]
            N, L, W = x.shape
            if W != self.n_heads * self.head_dim:
                raise CheckpointError(f"the output projection of layer {layer} reads {W} "
                                      f"features, not {self.n_heads} heads × {self.head_dim}",
                                      where=printable(self.name))
            z = session.hook("z", layer, x.view(N, L, self.n_heads, self.head_dim))
            return (z.reshape(N, L, W), *args[1:])

        def on_block(module: Any, args: tuple, kwargs: dict) -> tuple | None:
            layer = session.next("resid")
            if session.hook is None or layer < session.start:
                return None
            if args:
                return (session.hook("resid", layer, args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states":
                          session.hook("resid", layer, kwargs["hidden_states"])}
            return args, kwargs
        for module in dict.fromkeys(self.o_modules):
            handles.append(module.register_forward_pre_hook(on_z))
        for module in dict.fromkeys(self.blocks):
            handles.append(module.register_forward_pre_hook(on_block, with_kwargs=True))
        feed: dict[str, Any] = {"input_ids": ids, "attention_mask": real.long(),
                                "use_cache": False}
        if self.target is not None:
            feed["decoder_input_ids"] = torch.tensor([self.target], device=ids.device
                                                     ).repeat(ids.shape[0], 1)
        if keep is not None and self._keep:
            feed["logits_to_keep"] = keep
        token = ACTIVE.set(session)
        try:
            for block in skipped:  # an instance attribute: nn.Module.__call__ calls it
                block.forward = given
            with guard.silenced():
                return self.model(**feed)
        finally:
            ACTIVE.reset(token)
            for block in skipped:
                del block.forward
            for handle in handles:
                handle.remove()

    def forward(self, ids: torch.Tensor, real: torch.Tensor, read: torch.Tensor,
                hook: Hook | None) -> torch.Tensor:
        """(N, K, V) logits at `read` (N, K), the model's own (softcapping and all)."""
        return self.forward_from(ids, real, read, hook, None)

    def forward_from(self, ids: torch.Tensor, real: torch.Tensor, read: torch.Tensor,
                     hook: Hook | None, shortcut: Shortcut | None) -> torch.Tensor:
        """`forward`, leaving out the work `shortcut` allows."""
        if self.target is not None:  # the answer follows the decoder prefix
            read = torch.full_like(read, len(self.target) - 1)
        wanted = torch.unique(read)  # sorted; the model computes logits at these only
        session = _Session(hook)
        logits = self._run(ids, real, session, wanted if self._keep else None, shortcut).logits
        if self._keep:
            read = torch.searchsorted(wanted, read)
        if session.calls["z"] != self.n_layers:
            raise CheckpointError(f"the model ran {session.calls['z']} output projections, "
                                  f"{self.n_layers} before", where=printable(self.name))
        return logits.gather(1, read[..., None].expand(-1, -1, logits.shape[-1]))


def _labels(names: list[str]) -> list[str]:
    """An encoder-decoder's layers by their W_O's name, numbered per stack: enc 0, dec 0,
    cross 0, … (cross-attention: a name with 'EncDec', 'encoder_attn' or 'cross')."""
    counts: dict[str, int] = {}
    labels = []
    for name in names:
        low = name.lower()
        kind = "cross" if any(k in low for k in ("encdec", "encoder_attn", "cross")) \
            else "enc" if "encoder" in low else "dec"
        labels.append(f"{kind} {counts.get(kind, 0)}")
        counts[kind] = counts.get(kind, 0) + 1
    return labels


def _blocks(model: Any, o_modules: list[Any]) -> list[Any]:
    """Each W_O's decoder block: its nearest ancestor that is an element of a ModuleList."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    blocks = []
    for o in o_modules:
        current = o
        while id(current) in parents:
            parent = parents[id(current)]
            if isinstance(parent, torch.nn.ModuleList):
                blocks.append(current)
                break
            current = parent
        else:
            return []
    return blocks


def load_patch_model(opened: OpenedModel, device: torch.device, dtype: str = "float32",
                     target: str | None = None) -> HFPatchModel:
    """A --model folder opened by the registry, loaded with its language-model head (causal,
    or an encoder-decoder's, on the decoder side after `target`), hooked."""
    arch, kind = lm_class(opened.config)
    where = printable(str(opened.folder))
    if arch is None or kind not in ("causal", "seq2seq"):
        raise UsageError("patching scores next-token logits, and config.json's architectures "
                         "name no language-model head (…ForCausalLM, …LMHeadModel, "
                         "…ForConditionalGeneration)", fix="use a language model", where=where)
    if kind == "seq2seq" and target is None:
        raise UsageError("an encoder-decoder's answer follows a decoder prefix",
                         fix=f"add {option('target')} TEXT (may be empty: '')", where=where,
                         option="target")
    if kind == "causal" and target is not None:
        raise UsageError(f"{option('target')} is an encoder-decoder model's decoder prefix",
                         fix=f"drop {option('target')}", option="target")
    import transformers

    with guard.silenced(stderr=True), \
            guard.contained("transformers cannot load the model's LM head", FILES_FIX, where):
        model, info = getattr(transformers, arch).from_pretrained(
            library_path(opened.folder), attn_implementation="eager", output_loading_info=True,
            **{dtype_keyword(): dtype if dtype == "auto" else getattr(torch, dtype)}, **COMMON)
    if info.get("missing_keys"):
        raise CheckpointError("the folder lacks the LM head's weights", where=where,
                              fix=f"pass a folder with the whole {arch}")
    model = model.eval().requires_grad_(False).to(device)
    decoder = None
    if target is not None:
        start = getattr(opened.config, "decoder_start_token_id", None)
        if start is None:
            raise CheckpointError("config.json names no decoder_start_token_id", where=where)
        decoder = [int(start)] + list(opened.tokenizer(target, add_special_tokens=False)
                                      ["input_ids"])
    patched = HFPatchModel(model, opened.tokenizer, where, opened.store, decoder)
    patched.position_limit = opened.position_limit
    if decoder is not None:
        names = opened.tokenizer.convert_ids_to_tokens(decoder)
        patched.notes.append("encoder-decoder: the pair's prompts are the encoder's input; the "
                             "decoder reads " + " ".join(printable(str(n), 24) for n in names)
                             + " and the answer is scored after its last token")
    return patched


def open_patch_model(spec: str, device: str = "cpu", dtype: str = "float32",
                     target: str | None = None) -> HFPatchModel:
    """A model folder (or cached hub id), ready to patch (tests, the API)."""
    return load_patch_model(open_model(spec), resolve_device(device), dtype, target)
