"""`attnviz tokens --model` on the tiny zoo (llama and gpt2 with their LM heads, bert, roberta,
the t5 and bart encoders) and the real all-MiniLM-L6-v2: each attention block's per-source terms
add up to the block's own output, read here through hooks written for each family (≤ 1e-5
relative); padded batches give each sentence's own result; leave-one-out equals running the
erased input alone through the model; rollout stays lower-triangular on causal models and flow
equals an independent max flow. The families of issue #34 (GPT-NeoX, GPT-J, Phi, Cohere, Falcon,
BLOOM, Gemma 2/3, OLMo-2, Phi-3, GPTBigCode, OLMoE, Persimmon, GPT-Neo, and config variants of
Falcon, GPT-NeoX, GPTBigCode and BLOOM) are checked the same way against the layer's output
minus its MLP's (parallel blocks) or the input of the module after the block. Each check has a
negative control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_tokens import assert_terms_add_up, edmonds_karp, graph

from attnviz.app.tokens import TokensRequest, run_tokens
from attnviz.compute.tokenflow import decompose, maxflow, rollout
from attnviz.core.choices import HeadReduce
from attnviz.sources.hf import token_contributions as tc
from attnviz.sources.hf import token_cross
from attnviz.sources.hf.load import open_model

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

RTOL = 1e-5
SENTENCES = ["the cat sat on the mat the cat", "a small dog ran far away"]
LM_KINDS = ("llama", "gpt2")
ENCODER_KINDS = ("bert", "roberta", "t5", "bart")

# the block's own output, as each family's modules hand it over: (module under the layer,
# whether it is that module's input (a pre-LN model's next norm) or its output)
OWN_OUTPUT = {"llama": ("post_attention_layernorm", True), "gpt2": ("ln_2", True),
              "bert": ("attention.output", False), "roberta": ("attention.output", False),
              "t5": ("layer.0", False), "bart": ("self_attn_layer_norm", False)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    import zoo
    from helpers import minilm_folder

    made = {kind: zoo.build_lm(kind, tmp_path_factory.mktemp(kind)) for kind in LM_KINDS}
    made.update({kind: zoo.build(kind, tmp_path_factory.mktemp(kind)) for kind in ENCODER_KINDS})
    made["minilm"] = minilm_folder()
    return made


def _runner(folder):
    opened = open_model(str(folder))
    return tc.load_runner(opened, "cpu", "float32"), opened.tokenizer


def _rows(tokenizer, sentences):
    return [list(tokenizer(s)["input_ids"]) for s in sentences]


def own_outputs(runner, kind, ids, mask, where=None):
    """Each layer's block output through a hook written here (not the module under test);
    `where`: (module, is_input) in place of OWN_OUTPUT's row."""
    path, is_input = where or OWN_OUTPUT.get(kind, ("attention.output", False))
    layers = runner.runner.get_submodule(runner.block.layers)
    seen = []

    def grab(module, args, *output):
        value = args[0] if is_input else output[0]
        seen.append((value[0] if isinstance(value, tuple) else value).detach())

    handles = []
    for layer in layers:
        site = layer.get_submodule(path)
        handles.append(site.register_forward_pre_hook(grab) if is_input
                       else site.register_forward_hook(grab))
    try:
        with torch.no_grad():
            runner.runner(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("kind", [*LM_KINDS, *ENCODER_KINDS, "minilm"])
def test_terms_add_up_to_each_blocks_own_output(folders, kind):
    runner, tokenizer = _runner(folders[kind])
    rows = _rows(tokenizer, SENTENCES)
    tokens = [[str(i) for i in r] for r in rows]
    traces = tc.traces(runner, rows, tokens)
    ids, mask = tc.padded_batch(runner, rows)
    expected = own_outputs(runner, "bert" if kind == "minilm" else kind, ids, mask)
    for b, trace in enumerate(traces):
        n = len(trace.tokens)
        assert trace.blocks is not None and len(trace.blocks) == len(expected)
        for block, own in zip(trace.blocks, expected, strict=True):
            assert_terms_add_up(block, own[b, :n].double(), RTOL)


# families added by issue #34, each with its language-model head; parallel blocks (attention
# and MLP on the same normed input) are checked as the layer's own output minus its MLP's
# output, a sequential one (BLOOM) at the input of the norm after its attention
PARALLEL_MLP = {"gpt_neox": "mlp", "gptj": "mlp", "phi": "mlp", "cohere": "mlp",
                "falcon": "mlp"}
# the sequential ones, read through a hook here at the input of the module after the block
# (Gemma 2/3 and OLMo-2: a norm on the attention output, then the residual)
SEQUENTIAL_READ = {"bloom": "post_attention_layernorm", "gemma2": "pre_feedforward_layernorm",
                   "gemma3": "pre_feedforward_layernorm", "olmo2": "mlp",
                   "phi3": "post_attention_layernorm", "gpt_bigcode": "ln_2",
                   "olmoe": "post_attention_layernorm", "persimmon": "post_attention_layernorm",
                   "gpt_neo": "ln_2"}
NEW_KINDS = (*PARALLEL_MLP, *SEQUENTIAL_READ)


@pytest.fixture(scope="module")
def new_folders(tmp_path_factory):
    pytest.importorskip("transformers")
    import zoo

    return {kind: zoo.build_lm(kind, tmp_path_factory.mktemp(kind)) for kind in NEW_KINDS}


def layer_minus_mlp(runner, kind, ids, mask):
    """Each layer's output minus its MLP's output, both through hooks written here: x + attn
    for a parallel block, whatever attnviz reads."""
    layers = runner.runner.get_submodule(runner.block.layers)
    outs, mlps = [], []

    def keep(store):
        def hook(module, args, output):
            # a copy: Falcon adds the attention output into its MLP's output in place
            store.append((output[0] if isinstance(output, tuple) else output).detach().clone())
        return hook

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_hook(keep(outs)))
        handles.append(layer.get_submodule(PARALLEL_MLP[kind]).register_forward_hook(keep(mlps)))
    try:
        with torch.no_grad():
            runner.runner(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return [o - m for o, m in zip(outs, mlps, strict=True)]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_new_families_terms_add_up_to_each_blocks_own_output(new_folders, kind, monkeypatch):
    """Σ_j T_ij equals the block's own output (≤ 1e-5 relative) for the families of issue #34,
    with the value states cut out of fused projections (GPT-NeoX, Falcon, BLOOM). Negative
    controls: the residual (and Gemma's / OLMo-2's norm on the attention output) left out of the
    terms; the fused projections cut one slice off (each head's or group's key read as its
    value) and the row with its residual dropped (parallel) or counted twice (sequential) are
    refused by the run-time check."""
    from dataclasses import replace

    runner, tokenizer = _runner(new_folders[kind])
    assert runner.block is tc.BLOCKS[kind]
    rows = _rows(tokenizer, SENTENCES)
    traces = tc.traces(runner, rows, [["x"] * len(r) for r in rows])
    ids, mask = tc.padded_batch(runner, rows)
    if kind in PARALLEL_MLP:
        expected = layer_minus_mlp(runner, kind, ids, mask)
    else:
        expected = own_outputs(runner, kind, ids, mask, (SEQUENTIAL_READ[kind], True))
    for b, trace in enumerate(traces):
        n = len(trace.tokens)
        assert trace.blocks is not None and len(trace.blocks) == len(expected)
        for block, own in zip(trace.blocks, expected, strict=True):
            want = own[b, :n].double()
            assert_terms_add_up(block, want, RTOL)
            if block.out_norm is not None:  # the norm on the attention output left out
                unnormed = replace(block, out_norm=None)
                wrong = decompose.terms(unnormed, torch.arange(n)).sum(1)
                assert float((wrong - want).norm() / want.norm()) > 1e-3
    # negative control on the row itself: the run-time check refuses a wrong description
    from attnviz.errors import CheckFailed

    row = tc.BLOCKS[kind]
    # each group's key slice (or, stacked, the slice before the values) read as its value
    if right_grouped := row.value_grouped or row.value_stacked:
        real = tc._value_states

        def keys_slice(block, v, H, d):
            shifted = torch.roll(v.view(v.shape[0], -1, d), 1, dims=1).reshape(v.shape)
            return real(block, shifted, H, d)

        monkeypatch.setattr(tc, "_value_states", keys_slice)
        with pytest.raises(CheckFailed, match="do not add up"):
            for block in tc.traces(runner, rows[:1], [["x"] * len(rows[0])])[0].blocks or []:
                decompose.norm_rows(block, torch.arange(len(rows[0])), 1 << 20)
        monkeypatch.setattr(tc, "_value_states", real)
    assert right_grouped == (kind in ("gpt_neox", "falcon", "bloom", "phi3", "gpt_bigcode",
                                      "persimmon"))

    right = tc.BLOCKS[kind]
    runner.block = replace(right, plus_residual=not right.plus_residual)  # residual lost/doubled
    with pytest.raises(CheckFailed, match="do not add up"):
        for block in tc.traces(runner, rows[:1], [["x"] * len(rows[0])])[0].blocks or []:
            decompose.norm_rows(block, torch.arange(len(rows[0])), 1 << 20)


# config variants of the same model types: Falcon-7B's multi-query parallel block, Falcon-RW's
# sequential one with [q; k; v] per head, GPT-NeoX without the parallel residual, GPTBigCode
# with multi-head attention ([q; k; v] per head); BLOOM whose
# residual is the normed input is refused (its row assumes the layer's input)
VARIANTS = [("falcon", {"new_decoder_architecture": False, "multi_query": True,
                        "parallel_attn": True}, True),
            ("falcon", {"new_decoder_architecture": False, "multi_query": False,
                        "parallel_attn": False, "num_kv_heads": 4}, True),
            ("gpt_neox", {"use_parallel_residual": False}, True),
            ("gpt_bigcode", {"multi_query": False}, True),
            ("bloom", {"apply_residual_connection_post_layernorm": True}, False)]


@pytest.mark.parametrize("kind, changes, holds", VARIANTS)
def test_config_variants_of_the_new_families(tmp_path, kind, changes, holds):
    import transformers
    import zoo

    from attnviz.errors import CheckFailed

    row = zoo.row_of(kind)
    config = row.config()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    zoo.randomize(model, row)
    model.eval().save_pretrained(tmp_path)
    zoo.save_tokenizer(tmp_path, row)
    runner, tokenizer = _runner(tmp_path)
    rows = _rows(tokenizer, SENTENCES[:1])
    ids, mask = tc.padded_batch(runner, rows)
    if kind in PARALLEL_MLP:
        expected = layer_minus_mlp(runner, kind, ids, mask)
    else:
        expected = own_outputs(runner, kind, ids, mask, (SEQUENTIAL_READ[kind], True))
    n = len(rows[0])
    blocks = tc.traces(runner, rows, [["x"] * n])[0].blocks
    assert blocks is not None
    for block, own in zip(blocks, expected, strict=True):
        want = own[0, :n].double()
        error = float((decompose.terms(block, torch.arange(n)).sum(1) - want).norm()
                      / want.norm())
        assert (error <= RTOL) == holds, error
        if holds:
            decompose.norm_rows(block, torch.arange(n), 1 << 20)
        else:  # the run-time check refuses what the terms get wrong
            with pytest.raises(CheckFailed, match="do not add up"):
                decompose.norm_rows(block, torch.arange(n), 1 << 20)


@pytest.mark.parametrize("kind", ["gpt_neox", "falcon", "gemma2", "olmo2", "phi3"])
def test_new_families_gram_norms_and_alti_equal_the_terms(new_folders, kind):
    """--method norms (per-key Gram matrices, the norm on the attention output folded into the
    coefficients) against every term formed and its norm taken, and ALTI against the formula
    on the formed terms (≤ 1e-5); negative control: Gemma's (1 + w) weight read as w."""
    from dataclasses import replace

    from test_tokens import assert_norms_and_alti_equal_the_terms

    runner, tokenizer = _runner(new_folders[kind])
    rows = _rows(tokenizer, SENTENCES[:1])
    trace = tc.traces(runner, rows, [["x"] * len(r) for r in rows])[0]
    assert trace.blocks is not None
    assert_norms_and_alti_equal_the_terms(trace.blocks, RTOL)
    if kind == "gemma2":
        from attnviz.errors import CheckFailed

        runner.block = replace(tc.BLOCKS[kind], norm_offset=0.0)
        block = tc.traces(runner, rows, [["x"] * len(rows[0])])[0].blocks[0]
        with pytest.raises(CheckFailed, match="do not add up"):
            decompose.norm_rows(block, torch.arange(len(rows[0])), 1 << 20)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_new_families_on_the_command(new_folders, kind):
    """norms and ALTI run (no note about a missing decomposition) and each row sums to 1."""
    result = run_tokens(TokensRequest(SENTENCES[:1], model=str(new_folders[kind]),
                                      check=False))
    assert not any("no decomposition" in note for note in result.notes)
    doc_methods = {str(m) for m in result.methods}
    assert {"norms", "alti"} <= doc_methods, doc_methods


@pytest.mark.parametrize("kind", [*LM_KINDS, *ENCODER_KINDS, "minilm"])
def test_gram_norms_equal_the_elementwise_norms(folders, kind, monkeypatch):
    """--method norms from per-key Gram matrices against every term formed and its norm taken
    (≤ 1e-5 of each row's largest norm), on each family's own blocks (post-LN BERT, RoBERTa,
    BART and MiniLM included); negative control: the Gram matrices cut to their diagonal."""
    from test_tokens import elementwise_norms, relative_error

    runner, tokenizer = _runner(folders[kind])
    rows = _rows(tokenizer, SENTENCES[:1])
    trace = tc.traces(runner, rows, [["x"] * len(r) for r in rows])[0]
    assert trace.blocks is not None
    everything = torch.arange(len(trace.tokens))
    for block in trace.blocks:
        want = elementwise_norms(block, everything)
        assert relative_error(decompose.norm_rows(block, everything, 1 << 20), want) <= RTOL
    real = decompose.key_grams

    def diagonal(block):
        keys = real(block)
        eye = torch.eye(keys.grams.shape[0], dtype=torch.bool)[..., None]
        return decompose.KeyGrams(keys.vectors, torch.where(eye, keys.grams, 0.0),
                                  keys.values, keys.shares_beta)

    monkeypatch.setattr(decompose, "key_grams", diagonal)
    block = trace.blocks[-1]
    assert relative_error(decompose.norm_rows(block, everything, 1 << 20),
                          elementwise_norms(block, everything)) > 1e-3


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_padded_batches_give_each_sentence_its_own_result(folders, kind):
    runner, tokenizer = _runner(folders[kind])
    rows = _rows(tokenizer, SENTENCES)
    both = tc.traces(runner, rows, [["x"] * len(r) for r in rows])
    for b, row in enumerate(rows):
        alone = tc.traces(runner, [row], [["x"] * len(row)])[0]
        for x, y in zip(both[b].maps, alone.maps, strict=True):
            assert torch.allclose(x, y, atol=1e-5)
        for x, y in zip(both[b].blocks, alone.blocks, strict=True):
            assert torch.allclose(x.values, y.values, atol=1e-4)
    if kind == "bert":  # negative control: padding left visible changes the short sentence
        ids, _ = tc.padded_batch(runner, rows)
        with torch.no_grad():
            visible = runner.runner(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    output_attentions=True).attentions
        short = 1 if len(rows[1]) < len(rows[0]) else 0
        n = len(rows[short])
        assert not torch.allclose(visible[-1][short, :, :n, :n], both[short].maps[-1], atol=1e-4)


@pytest.mark.parametrize("kind, erase", [("llama", "mask"), ("llama", "baseline"),
                                         ("bert", "mask"), ("minilm", "baseline")])
def test_leave_one_out_equals_each_erased_input_alone(folders, kind, erase):
    runner, tokenizer = _runner(folders[kind])
    row = _rows(tokenizer, SENTENCES[:1])[0]
    p = len(row) - 1 if runner.causal else 0
    baseline = tc.baseline_id(runner, None) if erase == "baseline" else None
    got = tc.erasures(runner, row, p, tc.EraseSpec(baseline, "", 1 << 16))  # a few per forward
    ids = torch.tensor([row])
    mask = torch.ones_like(ids)

    def measure(i, m):
        with torch.no_grad():
            if runner.causal_lm:
                return torch.log_softmax(runner.model(input_ids=i, attention_mask=m)
                                         .logits[0, p], -1)
            return runner.runner(input_ids=i, attention_mask=m).last_hidden_state[0, p]

    base = measure(ids, mask)
    expected = []
    for j in got.erased:
        i, m = ids.clone(), mask.clone()
        if baseline is None:
            m[0, j] = 0
        else:
            i[0, j] = baseline
        out = measure(i, m)
        if runner.causal_lm:
            t = int(base.argmax())
            expected.append(float(base[t] - out[t]))
        else:
            expected.append(float((out - base).norm() / base.norm()))
    assert torch.allclose(got.effects, torch.tensor(expected, dtype=torch.float64), atol=1e-4)
    # negative control: the effects of another sentence's erasures differ
    other_row = _rows(tokenizer, SENTENCES[1:])[0]
    other = tc.erasures(runner, other_row, len(other_row) - 1 if runner.causal else 0,
                        tc.EraseSpec(baseline, "", 1 << 16))
    k = min(len(other.effects), len(got.effects))
    assert not torch.allclose(other.effects[:k], got.effects[:k], atol=1e-4)


def test_rollout_is_lower_triangular_on_a_causal_model_and_flow_is_exact(folders):
    runner, tokenizer = _runner(folders["llama"])
    row = _rows(tokenizer, SENTENCES[:1])[0]
    trace = tc.traces(runner, [row], [["x"] * len(row)])[0]
    p = len(row) - 1
    chain, matrices = rollout.rollout(trace.maps, p, HeadReduce.MEAN, 0.5)
    for M in matrices:
        assert float(M.triu(1).abs().max()) == 0.0
        assert torch.allclose(M.sum(-1), torch.ones(len(row), dtype=M.dtype))
    flows = maxflow.attention_flow(matrices, p)
    L, n = len(row), len(matrices)
    for s in range(L):
        assert float(flows[s]) == pytest.approx(edmonds_karp(graph(matrices), s, n * L + p),
                                                abs=1e-9)
    # negative control: an encoder's rollout is not lower-triangular
    runner, tokenizer = _runner(folders["bert"])
    row = _rows(tokenizer, SENTENCES[:1])[0]
    trace = tc.traces(runner, [row], [["x"] * len(row)])[0]
    _, matrices = rollout.rollout(trace.maps, 0, HeadReduce.MEAN, 0.5)
    assert float(matrices[0].triu(1).abs().max()) > 0


def test_the_command_on_a_model(folders, cli):
    result = cli("tokens", "--model", folders["llama"], *SENTENCES, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["causal"] is True and doc["summary"]["alti"]["sentences"] >= 1
    assert doc["sentences"][0]["position"] == len(doc["sentences"][0]["tokens"]) - 1
    result = cli("tokens", "--model", folders["minilm"], "the cat sat on the mat", "--erase",
                 "baseline")
    assert result.exit_code == 0, result.output
    assert "[MASK]" in result.output and "output position 0 ([CLS])" in result.output


def test_encoder_decoder_runs_its_encoder(folders):
    result = run_tokens(TokensRequest(SENTENCES[:1], model=str(folders["t5"])))
    assert any("encoder" in note for note in result.notes)
    assert result.sentences[0].position == 0 and not result.causal


@pytest.mark.parametrize("methods", [None, ("norms",), ("alti",)])
def test_a_family_described_wrongly_is_refused(folders, monkeypatch, methods):
    """The run-time identity check: a block row with the wrong output projection (the value's
    own projection in its place) is refused instead of shown, whichever contribution method
    runs (norms from Gram matrices, ALTI from the terms); the true row passes."""
    from dataclasses import replace

    from attnviz.core.choices import TokenMethod
    from attnviz.errors import CheckFailed

    asked = None if methods is None else tuple(TokenMethod(m) for m in methods)
    right = tc.BLOCKS["bert"]
    monkeypatch.setitem(tc.BLOCKS, "bert", replace(right, out="attention.self.value"))
    with pytest.raises(CheckFailed, match="do not add up"):
        run_tokens(TokensRequest(SENTENCES[:1], model=str(folders["bert"]), methods=asked,
                                 check=False))
    monkeypatch.setitem(tc.BLOCKS, "bert", right)
    assert run_tokens(TokensRequest(SENTENCES[:1], model=str(folders["bert"]), methods=asked,
                                    check=False))


def test_causality_is_read_from_the_maps(folders):
    """A causal base model without an LM head (the zoo's gpt2 saved as GPT2Model) is traced
    from its last token; an encoder from its first."""
    import zoo

    result = run_tokens(TokensRequest(SENTENCES[:1], model=str(folders["bert"]), check=False))
    assert not result.causal and result.sentences[0].position == 0
    assert run_tokens(TokensRequest(SENTENCES[:1], model=str(folders["llama"]))).causal
    base = zoo.build("gpt2", folders["llama"].parent / "gpt2-base")
    result = run_tokens(TokensRequest(SENTENCES[:1], model=str(base)))
    s = result.sentences[0]
    assert result.causal and s.position == len(s.tokens) - 1
    assert "hidden state" in (result.measure or "")


# ---- the decoder's view of the source (encoder-decoder with --target) -----------------------

def joint_rollout(encoder, decoder, cross, p, w):
    """The same rollout as one explicit matrix product over the joint nodes [decoder tokens;
    encoder outputs] per decoder sublayer, then the encoder's matrices: O(N³), written here."""
    T, S = decoder[0].shape[-1], cross[0].shape[-1]
    N = T + S
    v = torch.zeros(N, dtype=torch.float64)
    v[p] = 1.0
    for self_maps, cross_maps in zip(reversed(decoder), reversed(cross), strict=True):
        X = torch.eye(N, dtype=torch.float64)  # cross sublayer: decoder rows read the encoder
        X[:T, :T] *= w
        C = cross_maps.double().mean(0)
        X[:T, T:] = (1 - w) * C / C.sum(-1, keepdim=True)
        A = torch.eye(N, dtype=torch.float64)  # self sublayer on the decoder rows only
        A[:T, :T] = w * torch.eye(T, dtype=torch.float64) + (1 - w) * self_maps.double().mean(0)
        v = v @ X @ A
    source = v[T:]
    for maps in reversed(encoder):
        source = source @ (w * torch.eye(S, dtype=torch.float64)
                           + (1 - w) * maps.double().mean(0))
    return source, v[:T]


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    pytest.importorskip("transformers")
    import zoo

    return {kind: zoo.build_lm(kind, tmp_path_factory.mktemp(f"{kind}-lm"))
            for kind in ("t5", "bart")}


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_cross_rollout_equals_the_joint_matrix_product(seq2seq, kind):
    from attnviz.compute.tokenflow.cross import cross_rollout

    runner, tokenizer = _runner(seq2seq[kind])
    rows = _rows(tokenizer, SENTENCES)
    start = runner.config.decoder_start_token_id
    decoder = [[start, *tokenizer(text_target=t)["input_ids"]] for t in ("a dog ran", "the cat")]
    traces = token_cross.cross_traces(runner, rows, decoder)
    for b, trace in enumerate(traces):
        p = len(decoder[b]) - 1
        chain, share, _ = cross_rollout(trace.encoder, trace.decoder, trace.cross, p,
                                        HeadReduce.MEAN, 0.5)
        source, kept = joint_rollout(trace.encoder, trace.decoder, trace.cross, p, 0.5)
        assert torch.allclose(chain[0], source, atol=1e-12)
        assert torch.allclose(share, kept, atol=1e-12)
        assert float(chain[0].sum() + share.sum()) == pytest.approx(1.0)
        # negative control: the decoder's layers taken in the wrong order
        wrong_chain, _, _ = cross_rollout(trace.encoder, trace.decoder[::-1], trace.cross, p,
                                          HeadReduce.MEAN, 0.5)
        assert not torch.allclose(wrong_chain[0], source, atol=1e-6)
        # padded batch: each sentence's own maps
        alone = token_cross.cross_traces(runner, [rows[b]], [decoder[b]])[0]
        for x, y in zip(trace.cross, alone.cross, strict=True):
            assert torch.allclose(x, y, atol=1e-5)


def test_cross_erasures_equal_each_erased_source_alone(seq2seq):
    runner, tokenizer = _runner(seq2seq["t5"])
    row = _rows(tokenizer, SENTENCES[:1])[0]
    start = runner.config.decoder_start_token_id
    target = [start, *tokenizer(text_target="a dog ran")["input_ids"]]
    p = len(target) - 1
    got = token_cross.cross_erasures(runner, row, target, p, tc.EraseSpec(None, "", 1 << 16))
    ids, dec = torch.tensor([row]), torch.tensor([target])

    def log_p(mask):
        with torch.no_grad():
            out = runner.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        return torch.log_softmax(out.logits[0, p], -1)

    base = log_p(torch.ones_like(ids))
    t = int(base.argmax())
    expected = []
    for j in got.erased:
        mask = torch.ones_like(ids)
        mask[0, j] = 0
        expected.append(float(base[t] - log_p(mask)[t]))
    assert torch.allclose(got.effects, torch.tensor(expected, dtype=torch.float64), atol=1e-4)
    shifted = expected[1:] + expected[:1]  # negative control: effects paired with other tokens
    assert not torch.allclose(got.effects, torch.tensor(shifted, dtype=torch.float64),
                              atol=1e-4)


def test_target_on_the_command_line(seq2seq, folders, cli):
    from helpers import assert_clean_error

    result = cli("tokens", "--model", seq2seq["t5"], "the cat sat on the mat", "--target",
                 "a dog ran", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    s = doc["sentences"][0]
    assert doc["methods"] == ["rollout", "flow", "norms", "alti"]
    assert s["decoder_tokens"][-1] == s["output"].split("@")[0]
    assert sum(s["chains"]["rollout"][0]) + sum(s["decoder_share"]) == pytest.approx(1.0)
    # flow asked past its limit is refused up front (tests/test_tokens_cross_parts.py: the rest)
    long = " ".join(["the cat sat"] * 20)
    assert_clean_error(cli("tokens", "--model", seq2seq["t5"], long, "--target", "a dog",
                           "--method", "flow"), 2, "--method")
    assert_clean_error(cli("tokens", "the cat", "--target", "a dog"), 2, "--target")
    assert_clean_error(cli("tokens", "--model", folders["llama"], "the cat", "--target", "a"),
                       2, "--target")


def test_a_model_folder_whose_name_is_not_utf8(cli, tmp_path):
    """--model and every output inside a folder named with byte 0xff (as Python names it from
    argv: a surrogate escape); the export's metadata names it by its escapes. Control: the
    name really is not UTF-8."""
    import os
    import shutil

    from helpers import SAMPLES

    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xff"))
    folder.mkdir()
    with pytest.raises(UnicodeEncodeError):
        str(folder).encode("utf-8")
    model = folder / "m"
    shutil.copytree(SAMPLES / "models" / "distilbert-tiny-model", model)
    result = cli("tokens", "--model", model, "the cat sat on the mat", "--out", folder / "t.png",
                 "--html", folder / "t.html", "--export", folder / "t.safetensors")
    assert result.exit_code == 0, result.output
    assert "tokenizer" not in result.stderr
    for name in ("t.png", "t.html", "t.safetensors"):
        assert (folder / name).stat().st_size > 100
    from safetensors import safe_open

    from attnviz.load.paths import library_path

    with safe_open(str(library_path(folder) / "t.safetensors"), "pt") as f:
        assert "caf\\udcff" in f.metadata()["source"]
