"""`attnviz tokens` on the bundled model, each method against an independent computation:
rollout against the explicit O(L³) matrix product, flow against an Edmonds-Karp written here,
the per-source terms against the model's own layer output through torch's nn.MultiheadAttention,
leave-one-out against running each erased input alone (and the baseline erasure against the
bundled model's own logits), padded batches against each sentence alone, Spearman against a
rank formula written here. Each check has a negative control showing it can fail."""

from __future__ import annotations

import json
import math
from collections import deque

import pytest
import torch
import torch.nn.functional as F

from attnviz.app.tokens import TokensRequest, output_position, run_tokens
from attnviz.compute.forward_pass.forward import build_torch_mha, load_weights
from attnviz.compute.tokenflow import decompose, faithfulness, maxflow, rollout
from attnviz.core.choices import Erase, HeadReduce, TokenMethod
from attnviz.errors import UsageError
from attnviz.sources import bundled, tokens_bundled

pytestmark = pytest.mark.usefixtures("one_thread")

REPEATED = "the quick brown fox jumps over a lazy dog the quick brown fox"
RTOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tokens_bundled.TinyModel(bundled.open_bundled(), torch.device("cpu"))


@pytest.fixture(scope="module")
def trace(model):
    return tokens_bundled.traces(model, [REPEATED.split()])[0]


# ---- independent references ------------------------------------------------------------------

def mha_forward(store, tokens, erased=()):
    """The bundled model through torch's own nn.MultiheadAttention, one sentence: each layer's
    output x + MHA(LN(x)) and the final residual; `erased` keys masked (key_padding_mask), a
    query left with no key writing nothing."""
    layers = bundled.tiny_layers(store)
    vocab = int(store.metadata["vocab_size"])
    from attnviz.core.words import hashed_ids

    ids = torch.tensor([hashed_ids(tokens, vocab)])
    L = ids.shape[1]
    p = {name: store.read(name).float() for name in store.keys()}
    x = p["embed.weight"][ids] + p["pos_embed.weight"][:L][None]
    pad = torch.zeros(1, L, dtype=torch.bool)
    pad[0, list(erased)] = True
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    outputs = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            mha = build_torch_mha(layer, load_weights(layer, store))
            h = F.layer_norm(x, (x.shape[-1],), p[f"layers.{i}.ln.weight"],
                             p[f"layers.{i}.ln.bias"], eps=1e-5)
            out, _ = mha(h, h, h, key_padding_mask=pad, attn_mask=causal, need_weights=False)
            x = x + torch.nan_to_num(out, nan=0.0)
            outputs.append(x[0])
    return outputs, x[0]


def edmonds_karp(capacity: dict[tuple[int, int], float], source: int, sink: int) -> float:
    """Max flow by BFS augmenting paths over a dict of capacities."""
    residual = dict(capacity)
    for a, b in list(capacity):
        residual.setdefault((b, a), 0.0)
    neighbours: dict[int, list[int]] = {}
    for a, b in residual:
        neighbours.setdefault(a, []).append(b)
    total = 0.0
    while True:
        parent = {source: None}
        queue = deque([source])
        while queue and sink not in parent:
            a = queue.popleft()
            for b in neighbours.get(a, []):
                if b not in parent and residual[(a, b)] > 1e-12:
                    parent[b] = a
                    queue.append(b)
        if sink not in parent:
            return total
        path, b = [], sink
        while parent[b] is not None:
            path.append((parent[b], b))
            b = parent[b]
        amount = min(residual[e] for e in path)
        for a, b in path:
            residual[(a, b)] -= amount
            residual[(b, a)] += amount
        total += amount


def graph(matrices):
    L = matrices[0].shape[0]
    return {(k * L + j, (k + 1) * L + i): float(M[i, j])
            for k, M in enumerate(matrices) for i in range(L) for j in range(L) if M[i, j] > 0}


def rank_formula(v):
    """Rank i = #smaller + (#equal + 1) / 2: average ranks for ties, by counting."""
    return [sum(w < x for w in v) + (sum(w == x for w in v) + 1) / 2 for x in v]


# ---- rollout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", list(HeadReduce))
def test_rollout_rows_sum_to_one_and_stay_causal(trace, how):
    chain, matrices = rollout.rollout(trace.maps, len(trace.tokens) - 1, how, 0.5)
    for M in matrices:
        assert torch.allclose(M.sum(-1), torch.ones(M.shape[0], dtype=M.dtype), atol=1e-12)
        assert float(M.triu(1).abs().max()) == 0.0  # lower-triangular: causal
    assert torch.allclose(chain.sum(-1), torch.ones(chain.shape[0], dtype=chain.dtype))
    # negative control: the max over heads before row normalization does not sum to 1
    raw = 0.5 * torch.eye(len(trace.tokens)) + 0.5 * trace.maps[0].double().amax(0)
    if how is HeadReduce.MAX:
        assert not torch.allclose(raw.sum(-1), torch.ones(raw.shape[0], dtype=raw.dtype))


def test_rollout_vector_equals_the_full_matrix_product(trace):
    p = len(trace.tokens) - 1
    chain, matrices = rollout.rollout(trace.maps, p, HeadReduce.MEAN, 0.5)
    full = matrices[1] @ matrices[0]  # Ã_1 Ã_0: O(L³), the textbook rollout
    assert torch.allclose(chain[0], full[p], atol=1e-12)
    assert torch.allclose(chain[1], matrices[1][p], atol=1e-12)
    wrong = matrices[0] @ matrices[1]  # negative control: the product in the wrong order
    assert not torch.allclose(chain[0], wrong[p], atol=1e-6)


def test_maps_equal_torch_multihead_attention(model, trace):
    run = bundled.run_tiny(model.store, _batch([REPEATED]), None, torch.device("cpu"))
    for mine, theirs in zip(trace.maps, run.layers, strict=True):
        assert torch.allclose(mine, theirs.weights[0], atol=1e-6)
    bent = trace.maps[1].clone()
    bent[0, -1] = bent[0, -1].roll(1)  # negative control
    assert not torch.allclose(bent, run.layers[1].weights[0], atol=1e-6)


def _batch(sentences):
    from attnviz.compute.forward_pass.inputs import make_batch

    return make_batch(sentences)


# ---- flow ------------------------------------------------------------------------------------

def test_flow_equals_an_independent_max_flow(trace):
    p = len(trace.tokens) - 1
    _, matrices = rollout.rollout(trace.maps, p, HeadReduce.MEAN, 0.5)
    flows = maxflow.attention_flow(matrices, p)
    L, n = len(trace.tokens), len(matrices)
    capacities = graph(matrices)
    for s in range(L):
        expected = edmonds_karp(capacities, s, n * L + p)
        assert flows[s] == pytest.approx(expected, abs=1e-9)
    # negative control: halving one edge on the strongest route changes the flow
    s = int(flows.argmax())
    bent = [M.clone() for M in matrices]
    bent[0][s, s] *= 0.5
    assert edmonds_karp(graph(bent), s, n * L + p) < float(flows[s]) - 1e-6


def test_flow_agrees_with_networkx_where_installed(trace):
    nx = pytest.importorskip("networkx")
    p = len(trace.tokens) - 1
    _, matrices = rollout.rollout(trace.maps, p, HeadReduce.MAX, 0.3)
    flows = maxflow.attention_flow(matrices, p)
    g = nx.DiGraph()
    for (a, b), c in graph(matrices).items():
        g.add_edge(a, b, capacity=c)
    L, n = len(trace.tokens), len(matrices)
    for s in (0, L // 2, p):
        assert flows[s] == pytest.approx(nx.maximum_flow_value(g, s, n * L + p), abs=1e-9)


def test_flow_is_refused_up_front_past_its_limit():
    long = " ".join(f"w{i}" for i in range(maxflow.FLOW_MAX_TOKENS + 1))
    with pytest.raises(UsageError, match="max flow"):
        run_tokens(TokensRequest([long], methods=(TokenMethod.FLOW,), check=False))
    # by default flow is left out with a note instead
    result = run_tokens(TokensRequest([long], check=False))
    assert TokenMethod.FLOW not in result.methods
    assert any("flow left out" in note for note in result.notes)


# ---- contributions ---------------------------------------------------------------------------

def test_terms_reconstruct_each_layer_output(model, trace):
    outputs, _ = mha_forward(model.store, trace.tokens)
    assert trace.blocks is not None
    L = len(trace.tokens)
    for block, expected in zip(trace.blocks, outputs, strict=True):
        T = decompose.terms(block, torch.arange(L))
        rebuilt = T.sum(1)
        error = float((rebuilt - expected.double()).norm() / expected.double().norm())
        assert error <= RTOL
        # negative control: leaving the output bias out breaks the identity
        bare = decompose.BlockTerms(block.maps, block.values, block.residual, None)
        missed = decompose.terms(bare, torch.arange(L)).sum(1)
        assert float((missed - expected.double()).norm() / expected.double().norm()) > RTOL


def test_post_norm_terms_reconstruct_layer_norm_and_rms_norm():
    torch.manual_seed(0)
    H, L, E = 3, 5, 8
    maps = torch.softmax(torch.randn(H, L, L), -1)
    block = dict(maps=maps, values=torch.randn(H, L, E), residual=torch.randn(L, E),
                 out_bias=torch.randn(E))
    pre = decompose.terms(decompose.BlockTerms(**block), torch.arange(L)).sum(1)
    weight, bias = torch.randn(E), torch.randn(E)
    ln = decompose.PostNorm(weight, bias, 1e-5)
    T = decompose.terms(decompose.BlockTerms(**block, post_norm=ln), torch.arange(L))
    expected = F.layer_norm(pre, (E,), weight.double(), bias.double(), eps=1e-5)
    assert torch.allclose(T.sum(1), expected, atol=1e-10)
    rms = decompose.PostNorm(weight, None, 1e-6, rms=True)
    T = decompose.terms(decompose.BlockTerms(**block, post_norm=rms), torch.arange(L))
    expected = weight.double() * pre * (pre.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    assert torch.allclose(T.sum(1), expected, atol=1e-10)
    # negative control: each term normalized by its own scale does not add up
    own = F.layer_norm(decompose.terms(decompose.BlockTerms(**block), torch.arange(L)), (E,),
                       weight.double(), None, eps=1e-5)
    assert not torch.allclose(own.sum(1), expected, atol=1e-3)


def test_alti_and_norms_rows_follow_their_definitions(trace):
    block = trace.blocks[1]
    L = len(trace.tokens)
    rows = torch.arange(L)
    got = decompose.contribution_rows(block, rows, budget=4096)  # many small blocks of rows
    T = decompose.terms(block, rows)
    y = T.sum(1)
    for i in range(L):
        norms = torch.tensor([float(T[i, j].norm()) for j in range(L)], dtype=torch.float64)
        alti = torch.tensor([max(0.0, float(y[i].abs().sum() - (y[i] - T[i, j]).abs().sum()))
                             for j in range(L)], dtype=torch.float64)
        assert torch.allclose(got[TokenMethod.NORMS][i], norms / norms.sum(), atol=1e-9)
        assert torch.allclose(got[TokenMethod.ALTI][i], alti / alti.sum(), atol=1e-9)
        assert float(got[TokenMethod.ALTI][i, i + 1:].abs().sum()) == 0.0  # causal
    # negative control: ALTI is not the norms
    assert not torch.allclose(got[TokenMethod.NORMS], got[TokenMethod.ALTI], atol=1e-3)


def test_composed_contributions_equal_the_matrix_product(trace):
    p = len(trace.tokens) - 1
    composed = decompose.compose(trace.blocks, p, 1 << 20)
    L = len(trace.tokens)
    for method, (chain, _) in composed.items():
        C = [decompose.contribution_rows(b, torch.arange(L), 1 << 20)[method]
             for b in trace.blocks]
        assert torch.allclose(chain[0], (C[1] @ C[0])[p], atol=1e-12)
        assert not torch.allclose(chain[0], (C[0] @ C[1])[p], atol=1e-6)


# ---- padded batches and leave-one-out --------------------------------------------------------

def test_padded_batches_give_each_sentence_its_own_result(model):
    short, long = "the cat sat on the mat the cat", REPEATED
    both = tokens_bundled.traces(model, [long.split(), short.split()])
    alone = tokens_bundled.traces(model, [short.split()])[0]
    for a, b in zip(both[1].maps, alone.maps, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(both[1].blocks, alone.blocks, strict=True):
        assert torch.allclose(a.values, b.values, atol=1e-5)
        assert torch.allclose(a.residual, b.residual, atol=1e-5)
    # negative control: without the padding mask the short sentence's last rows would differ…
    ids, pad = tokens_bundled._padded(model, [long.split(), short.split()])
    _, unmasked = model.forward(ids, torch.zeros_like(pad), keep=True)
    n = len(short.split())
    # …only where padding is visible: a causal model's real rows never see later padding
    assert torch.allclose(unmasked[1].maps[1, :, :n, :n], alone.maps[1], atol=1e-6)
    encoder_like = torch.zeros(2, len(long.split()), dtype=torch.bool)
    _, wrong = model.forward(ids, encoder_like, keep=True)
    assert not torch.allclose(wrong[1].maps[1, :, n:, :n].sum(), torch.tensor(0.0))


@pytest.mark.parametrize("per_pass", [1, 3, 64])
def test_leave_one_out_equals_each_erased_input_alone(model, per_pass):
    tokens = REPEATED.split()
    p = len(tokens) - 1
    got = tokens_bundled.erasures(model, tokens, p, None, per_pass)
    _, base = mha_forward(model.store, tokens)
    base_lp = model.log_probs(base[p])
    target = int(base_lp.argmax())
    for j, effect in zip(got.erased, got.effects.tolist(), strict=True):
        _, erased = mha_forward(model.store, tokens, erased=[j])
        expected = float(base_lp[target] - model.log_probs(erased[p])[target])
        assert effect == pytest.approx(expected, abs=1e-4)
    assert p not in got.erased  # masking cannot erase the output's own query
    # negative control: erasing the neighbour instead gives another effect somewhere
    shifted = [float(base_lp[target] - model.log_probs(mha_forward(
        model.store, tokens, erased=[min(j + 1, p - 1)])[1][p])[target]) for j in got.erased]
    assert not torch.allclose(got.effects, torch.tensor(shifted, dtype=torch.float64), atol=1e-3)


def test_baseline_erasure_equals_the_bundled_models_own_logits(model):
    from attnviz.sources.bundled_generate import _Model

    tokens = REPEATED.split()
    p = len(tokens) - 1
    got = tokens_bundled.erasures(model, tokens, p, "<pad>", 4)
    reference = _Model(model.store, torch.device("cpu"))
    base = torch.log_softmax(reference.logits(torch.tensor([model.ids(tokens)]))[0, p], -1)
    target = int(base.argmax())
    for j, effect in zip(got.erased, got.effects.tolist(), strict=True):
        replaced = tokens[:j] + ["<pad>"] + tokens[j + 1:]
        lp = torch.log_softmax(reference.logits(torch.tensor([model.ids(replaced)]))[0, p], -1)
        assert effect == pytest.approx(float(base[target] - lp[target]), abs=1e-4)
    assert p in got.erased
    other = tokens_bundled.erasures(model, tokens, p, "zebra", 4)  # negative control
    assert not torch.allclose(got.effects, other.effects, atol=1e-3)


# ---- faithfulness ----------------------------------------------------------------------------

def test_spearman_matches_the_rank_formula():
    torch.manual_seed(1)
    for _ in range(5):
        a = torch.randint(0, 4, (9,)).double()  # ties
        b = torch.randn(9)
        ra = torch.tensor(rank_formula(a.tolist()), dtype=torch.float64)
        rb = torch.tensor(rank_formula(b.tolist()), dtype=torch.float64)
        expected = float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])
        assert faithfulness.spearman(a, b) == pytest.approx(expected, abs=1e-12)
    assert faithfulness.spearman(torch.ones(5), torch.randn(5)) is None
    up = torch.arange(6.0)
    assert faithfulness.spearman(up, up) == pytest.approx(1.0)
    assert faithfulness.spearman(up, -up) == pytest.approx(-1.0)


def test_mean_and_spread():
    mean, spread, count = faithfulness.mean_spread([0.2, None, 0.4, 0.9])
    values = [0.2, 0.4, 0.9]
    m = sum(values) / 3
    assert (mean, count) == (pytest.approx(m), 3)
    assert spread == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in values) / 2))


# ---- the induction route ---------------------------------------------------------------------

def test_the_last_token_draws_on_the_token_after_its_earlier_occurrence():
    result = run_tokens(TokensRequest([REPEATED]))
    s = result.sentences[0]
    after = REPEATED.split().index("fox") + 1  # 'jumps', after the earlier 'fox'
    assert s.tokens[after] == "jumps"
    erasure_top = sorted(s.erasures.erased, key=lambda j: -float(s.effects[j]))[:2]
    assert after in erasure_top  # the model does use it
    for method in (TokenMethod.ROLLOUT, TokenMethod.FLOW, TokenMethod.NORMS):
        assert after in s.top(method, 3), method
    assert result.best()  # the check names the method(s) closest to erasure
    rated = {m: s.correlations[m] for m in result.methods}
    assert all(rated[b] == max(rated.values()) for b in result.best())
    # negative control: a last token seen nowhere before has no such route
    other = run_tokens(TokensRequest([REPEATED.rsplit(" ", 1)[0] + " zebra"]))
    t = other.sentences[0]
    assert after not in sorted(t.erasures.erased, key=lambda j: -float(t.effects[j]))[:2]


# ---- options and outputs ---------------------------------------------------------------------

def test_output_position():
    tokens = "a b a c".split()
    assert output_position(tokens, None, True) == 3
    assert output_position(tokens, None, False) == 0
    assert output_position(tokens, "a", True) == 2
    assert output_position(tokens, "a", False) == 0
    assert output_position(tokens, "-2", True) == 2
    with pytest.raises(UsageError, match="out of range"):
        output_position(tokens, "4", True)
    with pytest.raises(UsageError, match="not in the sentence"):
        output_position(tokens, "zebra", True)


def test_cli_terminal_json_and_files(cli, tmp_path):
    result = cli("tokens", "the cat sat on the mat the cat")
    assert result.exit_code == 0, result.output
    assert "agreement with erasure" in result.output and "closest to erasure" in result.output
    out, page, export = tmp_path / "t.png", tmp_path / "t.html", tmp_path / "t.safetensors"
    result = cli("tokens", "the <b>cat</b> sat on the mat the <b>cat</b>", "--json", "--out",
                 out, "--html", page, "--export", export)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    s = doc["sentences"][0]
    assert set(s["scores"]) == {"rollout", "flow", "norms", "alti"}
    assert len(s["matrices"]["alti"]) == 2 and s["position"] == len(s["tokens"]) - 1
    from helpers import read_image

    image = read_image(out)
    assert image.shape[0] > 100 and image.std() > 0
    text = page.read_text()
    # the bundled model's words split '<', 'b', '>': each escaped in the table and the data
    assert "<td class='name'><</td>" not in text and "<td class='name'>&lt;</td>" in text
    assert '"\\u003c"' in text and '"<"' not in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    from safetensors import safe_open

    with safe_open(str(export), "pt") as f:
        keys = set(f.keys())
        assert {"s0.rollout", "s0.alti", "s0.effects", "s0.alti_matrix.0"} <= keys
        assert torch.allclose(f.get_tensor("s0.alti")[0],
                              torch.tensor(s["chains"]["alti"][0], dtype=torch.float64))


@pytest.mark.parametrize("args, fragment", [
    (["--dtype", "bfloat16"], "--dtype"),
    (["--baseline", "x"], "--baseline"),
    (["--no-check", "--erase", "baseline"], "--erase"),
    (["--residual-weight", "1.5"], "--residual-weight"),
    (["--position", "zebra"], "not in the sentence"),
    (["--dpi", "50"], "--dpi"),
])
def test_cli_refusals(cli, args, fragment):
    from helpers import assert_clean_error

    assert_clean_error(cli("tokens", "the cat sat on the mat", *args), 2, fragment)


def test_file_gives_mean_and_spread(cli, tmp_path):
    lines = tmp_path / "in.txt"
    lines.write_text("the cat sat on the mat the cat\na b c d a b c\none two three one two\n")
    result = cli("tokens", "--file", lines, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    values = [s["correlations"]["rollout"] for s in doc["sentences"]]
    kept = [v for v in values if v is not None]
    m = sum(kept) / len(kept)
    assert doc["summary"]["rollout"]["mean"] == pytest.approx(m)
    assert doc["summary"]["rollout"]["sentences"] == len(kept)


def test_erase_option_enum():
    assert Erase.parse("baseline", "erase") is Erase.BASELINE


def test_python_api_returns_the_same_result():
    from attnviz import api

    result = api.tokens([REPEATED], methods=["rollout", "alti"], heads="max",
                        residual_weight=0.4)
    direct = run_tokens(TokensRequest([REPEATED], methods=(TokenMethod.ROLLOUT, TokenMethod.ALTI),
                                      heads=HeadReduce.MAX, residual_weight=0.4))
    assert result.methods == direct.methods
    for m in result.methods:
        assert torch.equal(result.sentences[0].chains[m], direct.sentences[0].chains[m])
    with pytest.raises(UsageError, match="unknown"):
        api.tokens([REPEATED], heads="median")
    with pytest.raises(TypeError):
        api.tokens(REPEATED)  # a bare string, not a list of sentences


@pytest.mark.parametrize("how", list(HeadReduce))
@pytest.mark.parametrize("w", [0.0, 0.5, 0.9])
def test_the_fast_rollout_chain_equals_the_matrix_chain(trace, how, w):
    p = len(trace.tokens) - 1
    chain, _ = rollout.rollout(trace.maps, p, how, w)
    fast = rollout.rollout_chain(trace.maps, p, how, w)
    assert torch.allclose(fast, chain, atol=1e-12)
    other = rollout.rollout_chain(trace.maps, p - 1, how, w)  # negative control
    assert not torch.allclose(other, chain, atol=1e-6)


def test_matrices_are_kept_only_when_asked():
    kept = run_tokens(TokensRequest([REPEATED]))
    lean = run_tokens(TokensRequest([REPEATED], keep_matrices=False))
    assert lean.sentences[0].mixed == [] and len(kept.sentences[0].mixed) == 2
    for m in kept.methods:
        assert torch.allclose(kept.sentences[0].chains[m], lean.sentences[0].chains[m],
                              equal_nan=True)  # flow's rows between are NaN in both
    assert kept.sentences[0].correlations == lean.sentences[0].correlations


def test_rollout_alone_without_matrices_takes_the_row_vector_path(monkeypatch):
    """--method rollout printed to the terminal forms no L × L matrix (rollout.mixed never
    runs), and gives the chain the matrix path gives; control: with the matrices kept, it runs."""
    only = (TokenMethod.ROLLOUT,)
    kept = run_tokens(TokensRequest([REPEATED], methods=only, check=False))
    calls = []
    real = rollout.mixed
    monkeypatch.setattr(rollout, "mixed", lambda *a: calls.append(1) or real(*a))
    lean = run_tokens(TokensRequest([REPEATED], methods=only, check=False,
                                    keep_matrices=False))
    assert calls == []
    assert torch.allclose(lean.sentences[0].chains[TokenMethod.ROLLOUT],
                          kept.sentences[0].chains[TokenMethod.ROLLOUT], atol=1e-12)
    run_tokens(TokensRequest([REPEATED], methods=only, check=False))
    assert calls  # the control: the matrix path does call it


# ---- norms from per-key Gram matrices ---------------------------------------------------------

def elementwise_norms(block, rows):
    """The reference: every term T_ij formed (decompose.terms, E-wide) and its 2-norm taken."""
    return torch.linalg.vector_norm(decompose.terms(block, rows), dim=-1)


def relative_error(got, want):
    """Largest error per element, relative to the row's largest norm (a key the row cannot
    see is 0 in both)."""
    scale = want.abs().amax(-1, keepdim=True).clamp(min=1e-300)
    return float(((got - want).abs() / scale).max())


def assert_terms_add_up(block, want, rtol):
    """Σ_j T_ij equals the block's own output `want` (n, E) for every row; negative control:
    the residual left out of the self term breaks the identity."""
    from dataclasses import replace

    n = len(want)
    got = decompose.terms(block, torch.arange(n)).sum(1)
    assert float((got - want).norm() / want.norm()) <= rtol
    bare = replace(block, residual=torch.zeros_like(block.residual))
    wrong = decompose.terms(bare, torch.arange(n)).sum(1)
    assert float((wrong - want).norm() / want.norm()) > 1e-3


def assert_norms_and_alti_equal_the_terms(blocks, rtol):
    """Each block's Gram norms against every term formed and its norm taken, and its ALTI
    against the formula on the formed terms, over every row (≤ rtol of each row's largest)."""
    for block in blocks:
        everything = torch.arange(block.maps.shape[-1])
        want = elementwise_norms(block, everything)
        assert relative_error(decompose.norm_rows(block, everything, 1 << 20), want) <= rtol
        T = decompose.terms(block, everything)
        y = T.sum(1, keepdim=True)
        alti = (y.abs().sum(-1) - (y - T).abs().sum(-1)).clamp(min=0)
        assert relative_error(decompose.alti_rows(block, everything, 1 << 20), alti) <= rtol


def synthetic_blocks():
    """Post-LN (with and without β), RMSNorm and no norm; causal and not; biases on."""
    torch.manual_seed(3)
    H, L, E = 3, 9, 8
    norms = {"none": None, "layer norm": decompose.PostNorm(torch.randn(E), torch.randn(E), 1e-5),
             "layer norm, no bias": decompose.PostNorm(torch.randn(E), None, 1e-5),
             "rms": decompose.PostNorm(torch.randn(E), None, 1e-6, rms=True)}
    for causal in (False, True):
        scores = torch.randn(H, L, L)
        if causal:
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        for name, norm in norms.items():
            yield f"{name}, causal={causal}", decompose.BlockTerms(
                torch.softmax(scores, -1), torch.randn(H, L, E), torch.randn(L, E),
                torch.randn(E), norm)


def test_gram_norms_equal_the_elementwise_norms(trace):
    L = len(trace.tokens)
    blocks = [(f"bundled layer {i}", b) for i, b in enumerate(trace.blocks)]
    for name, block in [*blocks, *synthetic_blocks()]:
        n = block.maps.shape[-1]
        for rows, budget in ((torch.arange(n), 1 << 20), (torch.arange(n), 1),
                             (torch.tensor([n - 1, 0, n // 2]), 1 << 20)):
            want = elementwise_norms(block, rows)
            got = decompose.norm_rows(block, rows, budget)
            assert relative_error(got, want) <= RTOL, name
    # the rows as the command shows them (normalized) agree too
    rows = torch.arange(L)
    shown = decompose.contribution_rows(trace.blocks[0], rows, 1 << 20, (TokenMethod.NORMS,))
    want = elementwise_norms(trace.blocks[0], rows)
    assert torch.allclose(shown[TokenMethod.NORMS], want / want.sum(-1, keepdim=True),
                          atol=1e-9)
    assert set(shown) == {TokenMethod.NORMS}  # ALTI's terms are not built when not asked


def test_gram_norms_need_the_cross_terms(trace, monkeypatch):
    """Negative control: Gram matrices cut to their diagonal (Σ_p a_p² ‖w_p‖², the heads taken
    as orthogonal) are caught by the same comparison."""
    real = decompose.key_grams

    def diagonal(block):
        keys = real(block)
        eye = torch.eye(keys.grams.shape[0], dtype=torch.bool)[..., None]
        return decompose.KeyGrams(keys.vectors, torch.where(eye, keys.grams, 0.0),
                                  keys.values, keys.shares_beta)

    monkeypatch.setattr(decompose, "key_grams", diagonal)
    for name, block in [("bundled", trace.blocks[1]), *synthetic_blocks()]:
        rows = torch.arange(block.maps.shape[-1])
        assert relative_error(decompose.norm_rows(block, rows, 1 << 20),
                              elementwise_norms(block, rows)) > 1e-3, name


@pytest.mark.parametrize("method", [TokenMethod.NORMS, TokenMethod.ALTI])
def test_each_method_checks_the_identity(trace, method):
    """Both paths refuse a block whose terms do not add up to its own output (here the output
    the source read, 1% off); the true output passes."""
    from dataclasses import replace

    from attnviz.errors import CheckFailed

    block = trace.blocks[1]
    rows = torch.arange(len(trace.tokens))
    assert decompose.contribution_rows(block, rows, 1 << 20, (method,))
    wrong = replace(block, output=block.output * 1.01)
    with pytest.raises(CheckFailed, match="do not add up"):
        decompose.contribution_rows(wrong, rows, 1 << 20, (method,))


def test_compose_runs_only_the_asked_methods(trace):
    p = len(trace.tokens) - 1
    both = decompose.compose(trace.blocks, p, 1 << 20)
    alone = decompose.compose(trace.blocks, p, 1 << 20, (TokenMethod.NORMS,), keep=False)
    assert set(alone) == {TokenMethod.NORMS} and alone[TokenMethod.NORMS][1] == []
    assert torch.equal(alone[TokenMethod.NORMS][0], both[TokenMethod.NORMS][0])
    # negative control: the other method's chain differs
    assert not torch.allclose(alone[TokenMethod.NORMS][0], both[TokenMethod.ALTI][0], atol=1e-3)


def test_gram_norms_take_float64_maps_and_a_tight_identity_tolerance(trace):
    """A source handing float64 maps, or a check tighter than float32's rounding, gets its
    row sums in float64: the norms are unchanged and the true block still passes."""
    from dataclasses import replace

    block = trace.blocks[1]
    rows = torch.arange(len(trace.tokens))
    want = decompose.norm_rows(block, rows, 1 << 20)
    exact = decompose.terms(block, rows).sum(1)  # the output as a float64 source would give it
    wide = replace(block, maps=block.maps.double(), identity_rtol=1e-9, output=exact)
    assert torch.allclose(decompose.norm_rows(wide, rows, 1 << 20), want, rtol=1e-12)
    # negative control: that tolerance refuses the float32 output the model itself gave
    from attnviz.errors import CheckFailed

    with pytest.raises(CheckFailed):
        decompose.norm_rows(replace(block, identity_rtol=1e-12), rows, 1 << 20)
