"""The decoder's view of the source (`attnviz tokens --model ENCODER_DECODER --target …`) with
every method, on the zoo's tiny T5, BART (post-LN), mBART and Pegasus (pre-LN) with their LM
heads:
- identity: each decoder self- and cross-attention sublayer's per-source terms add up to that
  sublayer's own output, read here through hooks at other sites than the source's (the next
  sublayer's input, or the layer's output minus its MLP's) (≤ 1e-5 relative);
- norms and ALTI composed down [decoder; source] equal the explicit product of full
  contribution matrices built here from the terms themselves (O(N³));
- flow equals an independent max flow (Edmonds–Karp over a graph built here from the maps);
- a padded batch gives each sentence its own result; leave-one-out's ρ per method.
Each check has a negative control."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_tokens import edmonds_karp, graph, rank_formula

from attnviz.app.tokens import TokensRequest, run_tokens
from attnviz.compute.tokenflow import cross, cross_parts, decompose, rollout
from attnviz.core.choices import HeadReduce, TokenMethod
from attnviz.sources.hf import token_contributions as tc
from attnviz.sources.hf import token_cross
from attnviz.sources.hf.load import open_model

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

KINDS = ("t5", "bart", "mbart", "pegasus")
MORE = ("mt5", "marian", "plbart", "m2m_100", "blenderbot")  # the identity test's other rows
SOURCES = ["the cat sat on the mat the cat", "a small dog"]
TARGETS = ["a dog ran", "the cat"]
RTOL = 1e-5
METHODS = (TokenMethod.NORMS, TokenMethod.ALTI)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    import zoo

    built = {kind: zoo.build_lm(kind, tmp_path_factory.mktemp(f"{kind}-cross"))
             for kind in KINDS}

    class Lazy(dict):
        def __missing__(self, kind):
            self[kind] = zoo.build_lm(kind, tmp_path_factory.mktemp(f"{kind}-cross"))
            return self[kind]

    return Lazy(built)


def _runner(folder: Path):
    opened = open_model(str(folder))
    return tc.load_runner(opened, "cpu", "float32"), opened.tokenizer


def _inputs(runner, tokenizer, sources=SOURCES, targets=TARGETS):
    rows = [list(tokenizer(s)["input_ids"]) for s in sources]
    start = runner.config.decoder_start_token_id
    decoder = [[start, *tokenizer(text_target=t)["input_ids"]] for t in targets]
    return rows, decoder


# ---- identity against the model's own modules -----------------------------------------------

def _sites(kind):
    """Per family, hooks written here at other sites than token_cross reads: (self sublayer's
    output, cross sublayer's output) as a function of what they capture per layer."""
    if kind in ("t5", "mt5"):  # the next sublayer's input
        return {"self": ("layer.1", "input"), "cross": ("layer.2", "input")}
    if kind in ("bart", "marian", "plbart"):  # post-LN: the next sublayer's first projection
        return {"self": ("encoder_attn.q_proj", "input"), "cross": ("fc1", "input")}
    # pre-LN: the layer's output minus its MLP's; the cross output minus the cross attention's
    return {"layer": ("", "output"), "fc2": ("fc2", "output"),
            "cross_attn": ("encoder_attn.out_proj", "output")}


def hooked_outputs(runner, kind, rows, decoder):
    """{"self"|"cross": per decoder layer (B, T, E)} through hooks registered here."""
    ids, mask = tc.padded_batch(runner, rows)
    dec_ids, dec_mask = tc.padded_batch(runner, decoder)
    layers = list(runner.model.get_decoder().get_submodule("block" if "t5" in kind else "layers"))
    sites = _sites(kind)
    seen: dict[str, list] = {name: [] for name in sites}
    handles = []
    for layer in layers:
        for name, (path, what) in sites.items():
            module = layer.get_submodule(path) if path else layer

            def grab(_, args, *output, name=name, what=what):
                value = args[0] if what == "input" else output[0]
                seen[name].append((value[0] if isinstance(value, tuple) else value).detach())

            handles.append(module.register_forward_pre_hook(grab) if what == "input"
                           else module.register_forward_hook(grab))
    try:
        with torch.no_grad():
            runner.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                         decoder_attention_mask=dec_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if "layer" in seen:
        crossed = [y - f for y, f in zip(seen["layer"], seen["fc2"], strict=True)]
        return {"cross": crossed,
                "self": [c - a for c, a in zip(crossed, seen["cross_attn"], strict=True)]}
    return seen


def summed(block, rows):
    return decompose.terms(block, rows).sum(1)  # (r, E): Σ_j T_ij, after a frozen post-norm


@pytest.mark.parametrize("kind", KINDS + MORE)
def test_each_sublayers_terms_add_up_to_its_own_output(folders, kind):
    runner, tokenizer = _runner(folders[kind])
    rows, decoder = _inputs(runner, tokenizer)
    traces = token_cross.cross_traces(runner, rows, decoder)
    want = hooked_outputs(runner, kind, rows, decoder)
    for b, trace in enumerate(traces):
        T = len(decoder[b])
        rows_t = torch.arange(T)
        assert trace.blocks is not None
        for i, (self_block, cross_sub) in enumerate(zip(trace.blocks.decoder,
                                                        trace.blocks.cross, strict=True)):
            joint = cross_parts.cross_block(cross_sub)
            for block, name in ((self_block, "self"), (joint, "cross")):
                y, own = summed(block, rows_t), want[name][i][b, :T].double()
                error = float((y - own).norm() / own.norm())
                assert error < RTOL, (kind, b, i, name, error)
            # negative control: the cross sublayer built with another layer's value terms
            # misses by far more than the tolerance (the residual dominates pre-LN sums)
            other = trace.blocks.cross[(i + 1) % len(trace.cross)].values
            wrong = cross_parts.cross_block(replace(cross_sub, values=other, output=None))
            own = want["cross"][i][b, :T].double()
            miss = float((summed(wrong, rows_t) - own).norm() / own.norm())
            assert miss > 10 * RTOL, (kind, miss)
        # the cross sublayer's terms over decoder keys are its residual alone (j = t)
        T_cross = decompose.terms(cross_parts.cross_block(trace.blocks.cross[0]), rows_t)[:, :T]
        off = T_cross.clone()
        off[rows_t, rows_t] = 0
        assert float(off.abs().max()) == 0.0 and float(T_cross[0, 0].abs().max()) > 0


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_a_decoder_described_wrongly_is_refused(folders, monkeypatch, kind):
    """The run-time identity check: a decoder row whose cross sublayer names the
    self-attention's output projection is refused, for norms and for ALTI; the true row runs."""
    from attnviz.errors import CheckFailed

    right = token_cross.DECODERS[kind]
    out = "layer.0.SelfAttention.o" if kind == "t5" else "self_attn.out_proj"
    monkeypatch.setitem(token_cross.DECODERS, kind,
                        replace(right, cross=replace(right.cross, out=out)))
    for method in METHODS:
        with pytest.raises(CheckFailed, match="do not add up"):
            run_tokens(TokensRequest(SOURCES[:1], model=str(folders[kind]), check=False,
                                     targets=tuple(TARGETS[:1]), methods=(method,)))
    monkeypatch.setitem(token_cross.DECODERS, kind, right)
    for method in METHODS:
        assert run_tokens(TokensRequest(SOURCES[:1], model=str(folders[kind]), check=False,
                                        targets=tuple(TARGETS[:1]), methods=(method,)))


# ---- the composition against explicit matrices ----------------------------------------------

def full_matrix(block, method):
    """(L, L) the block's contribution rows, every row, straight from its terms (no Gram)."""
    L = block.residual.shape[0]
    T = decompose.terms(block, torch.arange(L))  # (L, L, E)
    if method is TokenMethod.NORMS:
        c = T.norm(dim=-1)
    else:
        y = T.sum(1, keepdim=True)
        c = (y.abs().sum(-1) - (y - T).abs().sum(-1)).clamp(min=0)
    return c / c.sum(-1, keepdim=True)


def joint_composition(trace, p, method):
    """v ← v X_cross A_self per decoder layer over the joint nodes, then the encoder: one
    explicit (N, N) product per sublayer, built here."""
    T, S = len(trace.target), len(trace.source)
    N = T + S
    v = torch.zeros(N, dtype=torch.float64)
    v[p] = 1.0
    for self_block, cross_sub in zip(reversed(trace.blocks.decoder),
                                     reversed(trace.blocks.cross), strict=True):
        X = torch.eye(N, dtype=torch.float64)
        X[:T] = full_matrix(cross_parts.cross_block(cross_sub), method)[:T]
        A = torch.eye(N, dtype=torch.float64)
        A[:T, :T] = full_matrix(self_block, method)
        v = v @ X @ A
    source = v[T:]
    for block in reversed(trace.blocks.encoder):
        source = source @ full_matrix(block, method)
    return source, v[:T]


@pytest.mark.parametrize("kind", ["t5", "bart", "mbart"])
def test_composition_equals_the_joint_matrix_product(folders, kind):
    runner, tokenizer = _runner(folders[kind])
    rows, decoder = _inputs(runner, tokenizer)
    for b, trace in enumerate(token_cross.cross_traces(runner, rows, decoder)):
        p = len(decoder[b]) - 1
        got = cross_parts.compose_cross(trace.blocks, p, 1 << 20)
        for m in METHODS:
            source, kept = joint_composition(trace, p, m)
            assert torch.allclose(got[m].chain[0], source, atol=1e-10), (kind, m)
            assert torch.allclose(got[m].decoder_share, kept, atol=1e-10)
            assert float(source.sum() + kept.sum()) == pytest.approx(1.0, abs=1e-10)
            assert got[m].chain.shape == (len(trace.encoder) + 1, len(trace.source))
            assert torch.allclose(got[m].chain[-1].sum() + kept.sum(),
                                  torch.tensor(1.0, dtype=torch.float64))
            # negative control: the decoder's layers taken in the wrong order
            flipped = replace(trace.blocks, decoder=trace.blocks.decoder[::-1],
                              cross=trace.blocks.cross[::-1])
            wrong = cross_parts.compose_cross(flipped, p, 1 << 20, (m,))
            assert not torch.allclose(wrong[m].chain[0], source, atol=1e-6)


# ---- flow ------------------------------------------------------------------------------------

def hand_levels(trace, w):
    """The joint layered graph's matrices, built here from the maps: encoder layers, then per
    decoder layer its self then its cross sublayer (mean over heads)."""
    T, S = len(trace.target), len(trace.source)
    N = T + S
    eye = torch.eye(N, dtype=torch.float64)
    levels = []
    for maps in trace.encoder:
        M = eye.clone()
        M[T:, T:] = w * torch.eye(S, dtype=torch.float64) + (1 - w) * maps.double().mean(0)
        levels.append(M)
    for self_maps, cross_maps in zip(trace.decoder, trace.cross, strict=True):
        M = eye.clone()
        M[:T, :T] = w * torch.eye(T, dtype=torch.float64) + (1 - w) * self_maps.double().mean(0)
        X = eye.clone()
        X[:T, :T] *= w
        C = cross_maps.double().mean(0)
        X[:T, T:] = (1 - w) * C / C.sum(-1, keepdim=True)
        levels += [M, X]
    return levels


def test_flow_equals_an_independent_max_flow(folders):
    runner, tokenizer = _runner(folders["bart"])
    rows, decoder = _inputs(runner, tokenizer, ["the cat", "a small dog"], ["a", "the cat"])
    for trace in token_cross.cross_traces(runner, rows, decoder):
        T, S = len(trace.target), len(trace.source)
        p = T - 1
        flow, kept = cross.cross_flow(trace.encoder, trace.decoder, trace.cross, p,
                                      HeadReduce.MEAN, 0.5)
        levels = hand_levels(trace, 0.5)
        N, n = T + S, len(levels)
        capacity = graph(levels)
        expected = [edmonds_karp(capacity, j, n * N + p) for j in range(N)]
        assert torch.allclose(torch.cat([kept, flow]),
                              torch.tensor(expected, dtype=torch.float64), atol=1e-9)
        # the graph's matrices are rollout's: carried down they give cross_rollout's vector
        joint = rollout.carry_down(cross.joint_matrices(trace.encoder, trace.decoder,
                                                        trace.cross, HeadReduce.MEAN, 0.5), p)
        chain, share, _ = cross.cross_rollout(trace.encoder, trace.decoder, trace.cross, p,
                                              HeadReduce.MEAN, 0.5)
        assert torch.allclose(joint[0, T:], chain[0], atol=1e-12)
        assert torch.allclose(joint[0, :T], share, atol=1e-12)
        # negative control: without the cross sublayers' levels the source gets no flow
        no_cross = graph([L for k, L in enumerate(levels)
                          if k < len(trace.encoder) or (k - len(trace.encoder)) % 2 == 0])
        cut = edmonds_karp(no_cross, T, (n - len(trace.decoder)) * N + p)
        assert cut == 0.0 and float(flow[0]) > 0.1


# ---- padded batch, faithfulness, the command --------------------------------------------------

def test_a_padded_batch_gives_each_sentence_its_own_result(folders):
    runner, tokenizer = _runner(folders["mbart"])
    rows, decoder = _inputs(runner, tokenizer)
    batch = token_cross.cross_traces(runner, rows, decoder)
    results = []
    for b, trace in enumerate(batch):
        p = len(decoder[b]) - 1
        got = cross_parts.compose_cross(trace.blocks, p, 1 << 20)
        alone = token_cross.cross_traces(runner, [rows[b]], [decoder[b]])[0]
        want = cross_parts.compose_cross(alone.blocks, p, 1 << 20)
        for m in METHODS:
            assert torch.allclose(got[m].chain, want[m].chain, atol=1e-6)
            assert torch.allclose(got[m].decoder_share, want[m].decoder_share, atol=1e-6)
        results.append(got)
    # negative control: the two sentences' results differ (shapes, then values)
    assert results[0][TokenMethod.ALTI].chain.shape != results[1][TokenMethod.ALTI].chain.shape


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_faithfulness_per_method(folders, kind, capsys):
    result = run_tokens(TokensRequest(SOURCES[:1], model=str(folders[kind]),
                                      targets=tuple(TARGETS[:1])))
    assert set(result.methods) == set(TokenMethod)
    s = result.sentences[0]
    effects = s.effects[s.erasures.erased]
    with capsys.disabled():
        print(f"\n{kind} --target ρ with erasure:",
              {str(m): None if r is None else round(r, 3) for m, r in s.correlations.items()})
    for m in result.methods:
        values = s.chains[m][0][s.erasures.erased]
        a = torch.tensor(rank_formula(values.tolist()), dtype=torch.float64)
        b = torch.tensor(rank_formula(effects.tolist()), dtype=torch.float64)
        a, b = a - a.mean(), b - b.mean()
        rho = s.correlations[m]
        if float(a.norm() * b.norm()) == 0:
            assert rho is None
            continue
        assert rho == pytest.approx(float(a @ b / (a.norm() * b.norm())), abs=1e-12)
        # negative control: the scores reversed correlate with the opposite sign
        reversed_rho = float(-a @ b / (a.norm() * b.norm()))
        assert rho != pytest.approx(reversed_rho, abs=1e-9) or rho == 0
        if m is not TokenMethod.FLOW:
            total = float(s.chains[m][0].sum() + s.decoder_shares[m].sum())
            assert total == pytest.approx(1.0, abs=1e-9)


def test_every_method_on_the_command_line(folders, cli, monkeypatch):
    from helpers import assert_clean_error

    result = cli("tokens", "--model", folders["t5"], "the cat sat on the mat", "--target",
                 "a dog ran", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    s = doc["sentences"][0]
    assert doc["methods"] == ["rollout", "flow", "norms", "alti"]
    for m in ("rollout", "norms", "alti"):
        assert sum(s["chains"][m][0]) + sum(s["decoder_shares"][m]) == pytest.approx(1.0)
    assert s["decoder_share"] == s["decoder_shares"]["rollout"]
    result = cli("tokens", "--model", folders["t5"], "the cat sat on the mat", "--target",
                 "a dog ran", "--method", "alti", "--no-check")
    assert result.exit_code == 0, result.output
    assert "alti left" in result.output and "decoder position" in result.output
    # a family without a decoder row: norms and ALTI refused when asked, left out otherwise
    monkeypatch.delitem(token_cross.DECODERS, "t5")
    assert_clean_error(cli("tokens", "--model", folders["t5"], "the cat", "--target", "a dog",
                           "--method", "alti"), 2, "--method")
    result = run_tokens(TokensRequest(["the cat"], model=str(folders["t5"]),
                                      targets=("a dog",), check=False))
    assert result.methods == (TokenMethod.ROLLOUT, TokenMethod.FLOW)
    assert any("norms and alti left out" in note for note in result.notes)


def test_erased_copies_erase_one_token_each():
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    masked = list(tc.erased_copies(ids, mask, [0, 2, 3], 2, None))
    assert [len(c) for c, _ in masked] == [2, 1]
    masks = torch.cat([m for _, m in masked])
    assert torch.equal(masks, torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]))
    assert all(torch.equal(c, ids.expand(len(c), -1)) for c, _ in masked)
    replaced = torch.cat([c for c, _ in tc.erased_copies(ids, mask, [1, 3], 5, 0)])
    assert torch.equal(replaced, torch.tensor([[5, 0, 7, 8], [5, 6, 7, 0]]))
    # negative control: the original is untouched
    assert torch.equal(ids, torch.tensor([[5, 6, 7, 8]]))


def test_terms_are_built_only_for_norms_or_alti(folders):
    """Rollout and flow alone: no hooks, no blocks (the joint terms cost memory); asked for, the
    blocks are there (the control)."""
    runner, tokenizer = _runner(folders["bart"])
    rows, decoder = _inputs(runner, tokenizer)
    assert all(t.blocks is None
               for t in token_cross.cross_traces(runner, rows, decoder, terms=False))
    assert all(t.blocks is not None for t in token_cross.cross_traces(runner, rows, decoder))
    result = run_tokens(TokensRequest(SOURCES[:1], model=str(folders["bart"]), check=False,
                                      targets=tuple(TARGETS[:1]),
                                      methods=(TokenMethod.ROLLOUT, TokenMethod.FLOW)))
    assert result.methods == (TokenMethod.ROLLOUT, TokenMethod.FLOW)
