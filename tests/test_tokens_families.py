"""`attnviz tokens --model`: norms and ALTI for the last four families of issue #34, each
block's per-source terms against the block's own output read through hooks written here
(≤ 1e-5 relative), on padded batches of two sentences:

- OPT pre-LN (x + attn(LN(x)): the layer's input plus its self_attn's output; its
  final_layer_norm sees the batch flattened) and post-LN as opt-350m (LN(x + attn(x)): the
  output of self_attn_layer_norm; with project_in/out, and without an elementwise affine);
- CodeGen (parallel: the layer's output minus its MLP's; qkv_proj in 4 model-parallel shards
  of [q; v; k]), with one head and two heads per shard;
- Granite and its MoE models (x + m·attn: the layer's input plus residual_multiplier times
  its self_attn's output), with m ≠ 1;
- ALBERT (one layer module run once per layer: the attention module's output at each call),
  shared by all layers, and in two groups of two inner layers.

Negative controls: each family's wrong description (the other OPT layout, the flattened read
taken as it is, CodeGen's value read as its shards' keys or as the middle third of the whole
projection, Granite's multiplier dropped, ALBERT's norm dropped or its calls paired with the
wrong module) is refused by the run-time check, and the terms without the residual miss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_tokens import assert_terms_add_up

from attnviz.app.tokens import TokensRequest, run_tokens
from attnviz.compute.tokenflow import decompose
from attnviz.errors import CheckFailed, CheckpointError
from attnviz.sources.hf import token_contributions as tc
from attnviz.sources.hf.load import open_model

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

RTOL = 1e-5
SENTENCES = ["the cat sat on the mat the cat", "a small dog ran far away"]

# name → (zoo kind, config changes); Granite's multipliers away from their default 1
VARIANTS = {
    "opt-pre": ("opt", {}),
    "opt-post": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 16}),
    "opt-post-plain": ("opt", {"do_layer_norm_before": False,
                               "layer_norm_elementwise_affine": False}),
    "codegen": ("codegen", {}),  # 4 heads: one per shard
    "codegen-8": ("codegen", {"n_head": 8}),  # two heads per shard
    "granite": ("granite", {"residual_multiplier": 0.3, "attention_multiplier": 0.5}),
    "granitemoe": ("granitemoe", {"residual_multiplier": 0.3, "attention_multiplier": 0.5}),
    "granitemoeshared": ("granitemoeshared", {"residual_multiplier": 0.3}),
    "albert": ("albert", {}),  # one layer module, run twice
    "albert-groups": ("albert", {"num_hidden_layers": 4, "num_hidden_groups": 2,
                                 "inner_group_num": 2}),  # 4 modules, 8 calls
}


def _extra():
    """Granite's MoE models, built as the zoo builds its rows (kept out of zoo.ZOO, whose
    rows every --model capture test runs): the same attention block as Granite."""
    import zoo

    moe = {**zoo._DECODER, "num_local_experts": 2, "num_experts_per_tok": 1}
    return {"granitemoe": zoo.Kind(zoo._config("GraniteMoeConfig", **moe), "GraniteMoeModel",
                                   side="left"),
            "granitemoeshared": zoo.Kind(zoo._config("GraniteMoeSharedConfig",
                                                     shared_intermediate_size=32, **moe),
                                         "GraniteMoeSharedModel", side="left")}


def _build(folder, kind, changes):
    import transformers
    import zoo

    row = _extra()[kind] if kind.startswith("granitemoe") else zoo.row_of(kind)
    config = row.config()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    auto = transformers.AutoModel if kind == "albert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager")
    zoo.randomize(model, row)
    model.eval().save_pretrained(folder)
    zoo.save_tokenizer(folder, row)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    return {name: _build(tmp_path_factory.mktemp(name), kind, changes)
            for name, (kind, changes) in VARIANTS.items()}


def _runner(folder):
    opened = open_model(str(folder))
    return tc.load_runner(opened, "cpu", "float32"), opened.tokenizer


def _rows(tokenizer, sentences):
    return [list(tokenizer(s)["input_ids"]) for s in sentences]


def own_outputs(runner, name, ids, mask):
    """The block's output at each call of a layer, through hooks written here: (B, L, E)."""
    model = runner.runner
    calls: list[dict[str, torch.Tensor]] = []

    def start(module, args, kwargs):
        calls.append({"input": (args[0] if args else kwargs["hidden_states"]).detach()})

    def keep(key):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            calls[-1].setdefault(key, out.detach().clone())
        return hook

    kind = VARIANTS[name][0]
    if kind == "albert":
        layers = [layer for group in model.encoder.albert_layer_groups
                  for layer in group.albert_layers]
        sites = {"attention": "read"}
    elif kind == "opt":
        layers = list(model.decoder.layers)
        post = not runner.config.do_layer_norm_before
        sites = {"self_attn_layer_norm": "read"} if post else {"self_attn": "attn"}
    elif kind == "codegen":
        layers, sites = list(model.h), {"mlp": "mlp", "": "layer"}
    else:
        layers, sites = list(model.layers), {"self_attn": "attn"}
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(start, with_kwargs=True))
        for path, key in sites.items():
            handles.append(layer.get_submodule(path).register_forward_hook(keep(key)))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    if "read" in sites.values():
        return [c["read"] for c in calls]
    if kind == "codegen":  # parallel: x + attn(ln(x)) + mlp(ln(x)), less the MLP's write
        return [c["layer"] - c["mlp"] for c in calls]
    scale = float(runner.config.residual_multiplier) if kind.startswith("granite") else 1.0
    return [c["input"] + scale * c["attn"] for c in calls]


def _refused(runner, rows, error=CheckFailed, match="do not add up"):
    """The run-time check (or the shape guard) refuses the runner's block row."""
    with pytest.raises(error, match=match):
        for block in tc.traces(runner, rows[:1], [["x"] * len(rows[0])])[0].blocks or []:
            decompose.norm_rows(block, torch.arange(len(rows[0])), 1 << 20)


@pytest.mark.parametrize("name", VARIANTS)
def test_terms_add_up_to_each_blocks_own_output(folders, name):
    runner, tokenizer = _runner(folders[name])
    assert runner.block is not None and runner.block is tc.block_of(runner.config)
    rows = _rows(tokenizer, SENTENCES)
    traces = tc.traces(runner, rows, [["x"] * len(r) for r in rows])
    ids, mask = tc.padded_batch(runner, rows)
    expected = own_outputs(runner, name, ids, mask)
    calls = runner.config.num_hidden_layers * getattr(runner.config, "inner_group_num", 1)
    assert len(expected) == calls
    for b, trace in enumerate(traces):
        n = len(trace.tokens)
        assert trace.blocks is not None and len(trace.blocks) == calls == len(trace.maps)
        for block, own in zip(trace.blocks, expected, strict=True):
            assert_terms_add_up(block, own[b, :n].double(), RTOL)


@pytest.mark.parametrize("name", ["opt-pre", "opt-post"])
def test_opt_each_layout_refuses_the_other(folders, name):
    """OPT's row follows do_layer_norm_before; the other layout's row, and the pre-LN read
    taken without undoing its flattening, are refused (never shown)."""
    runner, tokenizer = _runner(folders[name])
    rows = _rows(tokenizer, SENTENCES)
    pre, post = (dict(tc.BLOCKS["opt"].rows)[flag] for flag in (True, False))
    right, other = (pre, post) if name == "opt-pre" else (post, pre)
    assert runner.block is right
    runner.block = other
    if name == "opt-pre":  # post-LN's read on a pre-LN layer: LN(x), the attention's input
        _refused(runner, rows)
        runner.block = replace(pre, read_flat=False)
        _refused(runner, rows, CheckpointError, "shape")
    else:  # pre-LN's read on a post-LN layer: LN(x + attn) + mlp, the FFN's input and output
        _refused(runner, rows)


@pytest.mark.parametrize("name", ["codegen", "codegen-8"])
def test_codegen_wrong_value_slices_are_refused(folders, name):
    """The value is each shard's middle slice; each shard's last slice (the key), the middle
    third of the whole projection (one shard) or two shards are refused."""
    runner, tokenizer = _runner(folders[name])
    rows = _rows(tokenizer, SENTENCES)
    right = tc.BLOCKS["codegen"]
    assert isinstance(right, tc.Block) and right.value_shards == 4
    for wrong in (replace(right, value_shards=0, value_third=True),
                  replace(right, value_shards=1), replace(right, value_shards=2)):
        runner.block = wrong
        _refused(runner, rows)
    runner.block = right
    assert tc.traces(runner, rows[:1], [["x"] * len(rows[0])])[0].blocks


@pytest.mark.parametrize("name", ["granite", "granitemoe", "granitemoeshared"])
def test_granite_multiplier_dropped_is_refused(folders, name):
    runner, tokenizer = _runner(folders[name])
    rows = _rows(tokenizer, SENTENCES)
    assert runner.model.base_model.layers[0].residual_multiplier == pytest.approx(0.3)
    runner.block = replace(tc.BLOCKS[name], out_scale="")
    _refused(runner, rows)


@pytest.mark.parametrize("name", ["albert", "albert-groups"])
def test_albert_wrong_descriptions_are_refused(folders, name, monkeypatch):
    """ALBERT's post-LN norm dropped, and each call paired with another layer module's weights
    (one module per group and inner layer: their calls' order matters), are refused."""
    runner, tokenizer = _runner(folders[name])
    rows = _rows(tokenizer, SENTENCES)
    right = tc.BLOCKS["albert"]
    runner.block = replace(right, post_norm=None)
    _refused(runner, rows)
    runner.block = tc.block_of(runner.config)
    if name == "albert-groups":
        real = tc.layer_modules
        monkeypatch.setattr(tc, "layer_modules", lambda root, pattern: real(root, pattern)[::-1])
        # the hooks pair each call with the module that ran, wherever the list puts it
        for block in tc.traces(runner, rows[:1], [["x"] * len(rows[0])])[0].blocks or []:
            decompose.norm_rows(block, torch.arange(len(rows[0])), 1 << 20)
        monkeypatch.setattr(tc, "_out_weight", _shifted(tc._out_weight))
        _refused(runner, rows)


def _shifted(real):
    """_out_weight reading the next layer module's W_O (a call paired with the wrong module)."""
    def out_weight(runner, layer):
        layers = tc.layer_modules(runner.runner, runner.block.layers)
        at = next(i for i, m in enumerate(layers) if m is layer)
        return real(runner, layers[(at + 1) % len(layers)])
    return out_weight


@pytest.mark.parametrize("name", ["opt-post", "codegen-8", "granite", "albert-groups"])
def test_gram_norms_and_alti_equal_the_terms(folders, name):
    """--method norms (per-key Gram matrices) against every term formed and its norm taken,
    and ALTI against the formula on the formed terms (≤ 1e-5)."""
    from test_tokens import assert_norms_and_alti_equal_the_terms

    runner, tokenizer = _runner(folders[name])
    rows = _rows(tokenizer, SENTENCES[:1])
    trace = tc.traces(runner, rows, [["x"] * len(r) for r in rows])[0]
    assert trace.blocks is not None
    assert_norms_and_alti_equal_the_terms(trace.blocks, RTOL)


@pytest.mark.parametrize("name", ["opt-pre", "opt-post", "codegen", "granite", "granitemoe",
                                  "albert"])
def test_on_the_command(folders, name):
    """norms and ALTI run (no note about a missing decomposition), each row summing to 1."""
    result = run_tokens(TokensRequest(SENTENCES[:1], model=str(folders[name]), check=False))
    assert not any("no decomposition" in note or "left out" in note for note in result.notes)
    assert {"norms", "alti"} <= {str(m) for m in result.methods}


def test_a_layout_no_row_names_is_left_undecomposed():
    """A value of OPT's do_layer_norm_before that no row names gets no block (the command then
    keeps rollout and flow, with its note); controls: True, False and the flag left out."""
    from types import SimpleNamespace

    rows = dict(tc.BLOCKS["opt"].rows)
    assert tc.block_of(SimpleNamespace(model_type="opt", do_layer_norm_before=None)) is None
    assert tc.block_of(SimpleNamespace(model_type="opt", do_layer_norm_before=False)) \
        is rows[False]
    assert tc.block_of(SimpleNamespace(model_type="opt")) is rows[True]
