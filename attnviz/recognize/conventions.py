"""Naming conventions and storage schemes of attention weights, as data: one row each.

A row names, relative to an attention module's prefix, the tensor(s) holding W_q, W_k, W_v (each
alone, or several stacked in one tensor) and the candidates for W_o; how a stacked tensor lays
out its rows (a `Packing`, unless the model_type decides, see `model_types`); whether weights are
stored (in, out) like GPT-2's Conv1D; and which model-type facts to assume when config.json names
none. Rows are tried in order and a tensor claimed by one row is never offered to a later one.

Adding a naming convention is one `Convention(...)` appended to `CONVENTIONS`; code exists only
for packings (`attnviz.recognize.packing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnviz.recognize.model_type_table import STACKED, THIRDS, Packing

Parts = tuple[tuple[str, str], ...]  # (tensor name under the prefix, the parts it holds in order)


@dataclass(frozen=True)
class Convention:
    """One naming convention + storage scheme of an attention module's tensors."""

    label: str  # family inspect shows when config.json names no model_type attnviz knows
    weights: Parts  # e.g. (("self.query.weight", "q"), …) or (("c_attn.weight", "qkv"),)
    out: tuple[str, ...]  # W_o's name under the prefix; the first present wins
    biases: Parts | None = None  # None: each weight's ".weight" → ".bias", same parts
    packing: Packing | None = THIRDS  # of a tensor holding several parts; None: model_type's
    conv1d: bool = False  # weights stored (in, out), as transformers' Conv1D
    square: bool = False  # each part is exactly as tall as the input is wide (H·d = E)
    module: tuple[str, ...] = ()  # the attention module's own name must be one of these
    only: tuple[str | None, ...] = ()  # model_types it applies to (None: no config.json)
    never: tuple[str, ...] = ()  # model_types it does not apply to
    assume: str | None = None  # MODEL_TYPES row to use when config.json names none known
    config: bool = True  # False: a config.json beside the file is not this format's
    extras: tuple[tuple[str, str], ...] = ()  # (name, field): nn.MHA's bias_k / bias_v
    also: tuple[str, ...] = ()  # other tensors of the module, claimed but not split (DeBERTa)
    storage: str = ""  # how inspect describes separate weights (fused ones: the packing says)
    positions_keys: tuple[tuple[str, str], ...] = ()  # (a tensor anywhere, positions it means)
    missing_notes: tuple[tuple[str, str], ...] = ()  # (tensor under the prefix, note if absent)
    no_heads_note: str = ""  # a note when no head count is known
    ambiguous: str = ""  # why the layout is unknown without config.json's model_type
    fix: str = ""  # how to fix a shape that does not fit (e.g. a Linear read as Conv1D)

    @property
    def parts_key(self) -> str:
        """The first weight's name: prefixes are the keys that end with it."""
        return self.weights[0][0]

    def bias_parts(self) -> Parts:
        if self.biases is not None:
            return self.biases
        return tuple((name.removesuffix("weight") + "bias", parts) for name, parts in self.weights)


def linear(*names: str) -> Parts:
    """Separate nn.Linear q, k, v weights under these names: ("q_proj", "k_proj", "v_proj")."""
    return tuple((f"{name}.weight", part) for name, part in zip(names, "qkv", strict=True))


def separate(names: str, out: str) -> str:
    return f"separate {names} + {out}, nn.Linear (out, in)"


_MHA_EXTRAS = (("bias_k", "bias_k"), ("bias_v", "bias_v"))

CONVENTIONS: tuple[Convention, ...] = (
    # torch.nn.MultiheadAttention at any prefix (nn.Transformer*, torchvision ViT, OpenAI CLIP)
    Convention("torch-mha", (("in_proj_weight", "qkv"),), ("out_proj.weight",),
               biases=(("in_proj_bias", "qkv"),), square=True, assume="torch-mha", config=False,
               extras=_MHA_EXTRAS, storage="packed in_proj_weight [q; k; v]"),
    Convention("torch-mha", (("q_proj_weight", "q"), ("k_proj_weight", "k"),
                             ("v_proj_weight", "v")), ("out_proj.weight",),
               biases=(("in_proj_bias", "qkv"),), assume="torch-mha", config=False,
               extras=_MHA_EXTRAS, storage="separate q/k/v_proj_weight (kdim/vdim ≠ E)"),
    # BERT, RoBERTa, ELECTRA, MiniLM, Swin (`<block>.self.*`); Hugging Face ViT, DeiT, DINOv2
    # (Megatron-BERT: its pre-attention LayerNorm `ln` belongs to the attention module)
    Convention("bert", linear("self.query", "self.key", "self.value"), ("output.dense.weight",),
               assume="bert", also=("ln.weight", "ln.bias"),
               storage=separate("self.{query,key,value}", "output.dense")),
    Convention("vit", linear("attention.query", "attention.key", "attention.value"),
               ("output.dense.weight",), assume="vit",
               storage=separate("attention.{query,key,value}", "output.dense")),
    Convention("deberta", linear("self.query_proj", "self.key_proj", "self.value_proj"),
               ("output.dense.weight",), assume="deberta-v2",
               also=tuple(f"self.pos_{p}_proj.{t}" for p in ("key", "query")
                          for t in ("weight", "bias")),
               storage=separate("self.{query,key,value}_proj", "output.dense")),
    Convention("albert", linear("query", "key", "value"), ("dense.weight",), assume="albert",
               storage=separate("{query,key,value}", "dense")),
    Convention("distilbert", linear("q_lin", "k_lin", "v_lin"), ("out_lin.weight",),
               assume="distilbert", storage=separate("{q,k,v}_lin", "out_lin")),
    Convention("mpnet", linear("attn.q", "attn.k", "attn.v"), ("attn.o.weight",), assume="mpnet",
               storage=separate("attn.{q,k,v}", "attn.o")),
    # LLaMA, Mistral, Qwen, Gemma, Phi, GPT-J, GPT-Neo, OPT, CLIP, BART, Marian, Whisper, …
    Convention("qkv_proj", linear("q_proj", "k_proj", "v_proj"),
               ("o_proj.weight", "out_proj.weight", "dense.weight"),
               storage=separate("q_proj/k_proj/v_proj", "{out}")),
    # T5, mT5, UMT5, Flan-T5: self- and cross-attention modules, no biases
    Convention("t5", linear("q", "k", "v"), ("o.weight",),
               module=("SelfAttention", "EncDecAttention"), assume="t5",
               storage="separate {module}.{q,k,v,o} nn.Linear (out, in), no bias",
               missing_notes=(("relative_attention_bias.weight", "adds the relative position "
                               "bias computed by the first block's relative_attention_bias"),)),
    # any other module with projections named q, k, v and o / out / proj (hand-written models)
    Convention("qkv", linear("q", "k", "v"),
               ("o.weight", "out.weight", "proj.weight", "out_proj.weight"),
               storage=separate("{q,k,v}", "{out}")),
    # GPT-2's Conv1D: cross-attention (q_attn + c_attn [k | v]) before self-attention
    Convention("gpt2", (("q_attn.weight", "q"), ("c_attn.weight", "kv")), ("c_proj.weight",),
               conv1d=True, square=True, never=("gpt_bigcode",), assume="gpt2",
               storage="Conv1D q_attn (E, E) + c_attn (in, out) = (E, 2E), [k | v] columns"),
    Convention("gpt2", (("c_attn.weight", "qkv"),), ("c_proj.weight",), conv1d=True, square=True,
               never=("gpt_bigcode",), assume="gpt2",
               storage="Conv1D c_attn (in, out) = (E, 3E), [q | k | v] columns",
               fix="if c_attn is an nn.Linear (GPTBigCode/StarCoder), open the model folder with "
               "its config.json (model_type gpt_bigcode)"),
    Convention("gpt_bigcode", (("c_attn.weight", "qkv"),), ("c_proj.weight",), packing=None,
               only=("gpt_bigcode",)),
    # Phi-3 (stacked, grouped-query sizes); CodeGen's own layout comes from its model_type
    Convention("qkv_proj", (("qkv_proj.weight", "qkv"),), ("o_proj.weight", "out_proj.weight"),
               packing=STACKED),
    # MPT, ModernBERT: stacked thirds. W_o is the attention module's own Wo, never mlp.Wo.
    Convention("wqkv", (("Wqkv.weight", "qkv"),), ("Wo.weight", "out_proj.weight")),
    # timm ViT, DeiT, DINOv2, BEiT (q_bias + v_bias, k none), Swin, SAM, …
    Convention("timm", (("qkv.weight", "qkv"),), ("proj.weight",),
               biases=(("qkv.bias", "qkv"), ("q_bias", "q"), ("v_bias", "v")), assume="timm",
               config=False, positions_keys=(("pos_embed", "learned"),),
               no_heads_note="timm stores no head count: pass --num-heads (e.g. 12 for "
               "vit_base), or add num_heads to the safetensors metadata"),
    # fused query_key_value: the row layout is the model_type's (see model_type_table.MODEL_TYPES)
    Convention("gpt-neox", (("query_key_value.weight", "qkv"),), ("dense.weight",),
               packing=None, module=("attention",), only=(None, "gpt_neox"), assume="gpt_neox"),
    # Persimmon (and Fuyu's language model): per-head interleaved, from the model_type's row
    Convention("query_key_value", (("query_key_value.weight", "qkv"),), ("dense.weight",),
               packing=None, module=("self_attn",)),
    Convention("bloom or falcon", (("query_key_value.weight", "qkv"),), ("dense.weight",),
               packing=None, module=("self_attention",),
               ambiguous="BLOOM and Falcon both name a fused self_attention.query_key_value, "
               "with different row layouts"),
)
