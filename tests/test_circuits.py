"""`attnviz circuits` against an independent dense computation: every W_QK^h and W_OV^h formed
explicitly as an E × E float64 matrix from weights read straight from torch's module, the
safetensors file or the transformers model (never through attnviz's recognition), then norms,
singular values, ranks, effective ranks, copying scores and composition scores compared to
1e-4 relative. Each source has a negative control: the same comparison with a wrong head slice
(or without the norm's scale) fails."""

from __future__ import annotations

import json

import pytest
import torch

from attnviz.app.circuits import CircuitsRequest, run_circuits
from attnviz.compute.qkov.circuits import EFFECTIVE_SHARE, RANK_RTOL
from attnviz.core.request import HeadHints, RandomSpec

RTOL = 1e-4
TOP = 8  # singular values compared per circuit (all of them for d ≤ 8)


# ---- the independent dense reference -----------------------------------------------------------

def dense_layer(Wq, Wk, Wv, Wo, H, Hkv, d, gamma=None, gamma_kv="same", kv_of=None):
    """[(W_QK^h, W_OV^h)] per head, E × E float64, formed explicitly."""
    Wq, Wk, Wv, Wo = (w.double() for w in (Wq, Wk, Wv, Wo))
    if gamma is not None:
        g = gamma.double()
        Wq = Wq * g
        if gamma_kv == "same":
            Wk, Wv = Wk * g, Wv * g
    kv_of = kv_of or (lambda h: h // (H // Hkv))
    out = []
    for h in range(H):
        g = kv_of(h)
        q, k, v = Wq[h * d:(h + 1) * d], Wk[g * d:(g + 1) * d], Wv[g * d:(g + 1) * d]
        out.append((q.T @ k, Wo[:, h * d:(h + 1) * d] @ v))
    return out


def dense_stats(M):
    s = torch.linalg.svdvals(M)
    share = torch.cumsum(s**2, 0) / (s**2).sum()
    rank = int(torch.linalg.matrix_rank(M, rtol=RANK_RTOL))
    effective = min(int((share < EFFECTIVE_SHARE - 1e-12).sum()) + 1, rank)
    return {"norm": float(torch.linalg.matrix_norm(M)), "sv": s, "rank": rank,
            "effective_rank": effective}


def dense_copying(M):
    eig = torch.linalg.eigvals(M)
    return float(eig.real.sum() / eig.abs().sum())


def dense_score(kind, X, Y):
    """K and V: ‖X Y‖ / (‖X‖‖Y‖) with X the later circuit; Q: ‖Yᵀ X‖ / (…)."""
    product = Y.T @ X if kind == "Q" else X @ Y
    norm = torch.linalg.matrix_norm
    return float(norm(product) / (norm(X) * norm(Y)))


def rel(a, b, scale=None):
    return abs(a - b) / max(abs(scale if scale is not None else b), 1e-300)


def head_errors(doc, reference):
    """Largest relative error of every per-head number: reference = {layer label: [(QK, OV)]}."""
    worst = 0.0
    for entry in doc["heads"]:
        if entry["label"] not in reference:
            continue
        qk, ov = reference[entry["label"]][entry["head"]]
        for ours, M in ((entry["qk"], qk), (entry["ov"], ov)):
            ref = dense_stats(M)
            worst = max(worst, rel(ours["norm"], ref["norm"]))
            top = ref["sv"][:TOP]
            for a, b in zip(ours["singular_values"][:TOP], top.tolist(), strict=True):
                worst = max(worst, rel(a, b, float(top[0])))
            if ours["rank"] != ref["rank"] or ours["effective_rank"] != ref["effective_rank"]:
                worst = max(worst, 1.0)
        if entry["ov"]["copying"] is not None:
            worst = max(worst, abs(entry["ov"]["copying"] - dense_copying(ov)))
    return worst


def composition_errors(doc, reference):
    worst, by_index = 0.0, {layer["layer"]: layer["label"] for layer in doc["layers"]}
    for entry in doc["composition"]:
        (lb, hb), (la, ha) = entry["later"], entry["earlier"]
        X_qk, X_ov = reference[by_index[lb]][hb]
        _, Y = reference[by_index[la]][ha]
        X = X_ov if entry["kind"] == "V" else X_qk
        worst = max(worst, rel(entry["score"], dense_score(entry["kind"], X, Y)))
    return worst


def run_json(**kwargs):
    return json.loads(json.dumps(run_circuits(CircuitsRequest(**kwargs)).to_json()))


# ---- a standalone nn.MultiheadAttention ----------------------------------------------------------

def test_random_mha_matches_dense():
    doc = run_json(random=RandomSpec(32, 4, seed=3))
    torch.manual_seed(3)  # what random_mha builds: torch's own init, then random biases
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0.0, 0.1)
    Wq, Wk, Wv = mha.in_proj_weight.detach().chunk(3)
    ref = {"0": dense_layer(Wq, Wk, Wv, mha.out_proj.weight.detach(), 4, 4, 8)}
    assert head_errors(doc, ref) <= RTOL
    bq = mha.in_proj_bias.detach()[:32]
    assert rel(doc["heads"][2]["bias_norms"]["q"], float(bq[16:24].norm())) <= RTOL
    assert doc["composition"] == [] and doc["composition_skipped"]
    # negative control: W_K of the next head
    wrong = {"0": dense_layer(Wq, Wk, Wv, mha.out_proj.weight.detach(), 4, 4, 8,
                              kv_of=lambda h: (h + 1) % 4)}
    assert head_errors(doc, wrong) > 1e-2


def test_checkpoint_mha_with_kdim(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(24, 3, kdim=16, vdim=20, batch_first=True)
    save_file({k: v.contiguous() for k, v in mha.state_dict().items()}, tmp_path / "m.safetensors")
    doc = run_json(weights=tmp_path / "m.safetensors", hints=HeadHints(num_heads=3))
    sd = mha.state_dict()
    ref = {"0": dense_layer(sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"],
                            sd["out_proj.weight"], 3, 3, 8)}
    assert head_errors(doc, ref) <= RTOL
    assert all(h["ov"]["copying"] is None for h in doc["heads"])  # W_OV is 24 × 20
    wrong = {"0": dense_layer(sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"],
                              sd["out_proj.weight"].roll(4, dims=1), 3, 3, 8)}
    assert head_errors(doc, wrong) > 1e-2


# ---- the bundled model ---------------------------------------------------------------------------

def bundled_reference(fold=True):
    from safetensors.torch import load_file

    from attnviz.data import BUNDLED

    w = load_file(BUNDLED)
    ref = {}
    for i in range(2):
        Wq, Wk, Wv = w[f"layers.{i}.self_attn.in_proj_weight"].chunk(3)
        ref[str(i)] = dense_layer(Wq, Wk, Wv, w[f"layers.{i}.self_attn.out_proj.weight"], 2, 2,
                                  32, w[f"layers.{i}.ln.weight"] if fold else None)
    return ref


@pytest.fixture(scope="module")
def bundled_doc():
    return run_json()


@pytest.mark.slow
def test_bundled_matches_dense(bundled_doc):
    assert head_errors(bundled_doc, bundled_reference()) <= RTOL
    assert composition_errors(bundled_doc, bundled_reference()) <= RTOL
    assert len(bundled_doc["composition"]) == 3 * 2 * 2
    assert all(layer["norm_folded"] for layer in bundled_doc["layers"])
    # negative control: without the LayerNorm's scale
    assert head_errors(bundled_doc, bundled_reference(fold=False)) > 1e-2
    assert composition_errors(bundled_doc, bundled_reference(fold=False)) > 1e-3


@pytest.mark.slow
def test_bundled_induction_heads_k_compose(bundled_doc):
    """Each layer-1 head's strongest composition is K-composition with a layer-0 head, far
    above its Q- and V-composition and above the random baseline."""
    for head in range(2):
        mine = [e for e in bundled_doc["composition"] if e["later"] == [1, head]]
        best = max(mine, key=lambda e: e["score"] / e["baseline"])
        assert best["kind"] == "K" and best["earlier"][0] == 0
        others = max(e["score"] for e in mine if e["kind"] != "K")
        assert best["score"] > 4 * others, (best, others)
        assert best["score"] > 1.5 * best["baseline"]


def test_baseline_is_computed():
    """The baseline is the mean score of seeded random factor pairs: recomputed densely from
    the same draws, and different for another seed."""
    from attnviz.compute.qkov.circuits import random_score

    for kind in ("Q", "K", "V"):
        ours = random_score(kind, ((12, 12), 3), ((12, 12), 4), draws=3, seed=7)
        gen, total = torch.Generator().manual_seed(7), 0.0
        for _ in range(3):
            L_b, R_b = (torch.randn(12, 3, generator=gen, dtype=torch.float64) for _ in "ab")
            L_a, R_a = (torch.randn(12, 4, generator=gen, dtype=torch.float64) for _ in "ab")
            total += dense_score(kind, L_b @ R_b.T, L_a @ R_a.T)
        assert rel(ours, total / 3) <= RTOL
        assert rel(random_score(kind, ((12, 12), 3), ((12, 12), 4), draws=3, seed=8), ours) > 1e-3


def test_rank_deficient_head(tmp_path):
    """A head whose W_Q rows repeat has rank < d: counted as the dense rank counts it."""
    from safetensors.torch import save_file

    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(16, 2, bias=False, batch_first=True)
    sd = {k: v.clone() for k, v in mha.state_dict().items()}
    sd["in_proj_weight"][4:8] = sd["in_proj_weight"][0:4]  # head 0: rank 4 of 8
    save_file(sd, tmp_path / "m.safetensors")
    doc = run_json(weights=tmp_path / "m.safetensors", hints=HeadHints(num_heads=2))
    assert doc["heads"][0]["qk"]["rank"] == 4 and doc["heads"][1]["qk"]["rank"] == 8
    Wq, Wk, Wv = sd["in_proj_weight"].chunk(3)
    assert head_errors(doc, {"0": dense_layer(Wq, Wk, Wv, sd["out_proj.weight"], 2, 2,
                                              8)}) <= RTOL


# ---- the command line ----------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_bundled(cli, tmp_path):
    result = cli("circuits", "--out", tmp_path / "c.png")
    assert result.exit_code == 0, result.output
    assert "K-composition" in result.stdout and "strongest composition" in result.stdout
    assert "1.0: K with 0." in result.stdout and "1.1: K with 0." in result.stdout
    from helpers import colored_runs, read_image

    image = read_image(tmp_path / "c.png")
    assert image.shape[0] > 300 and image.shape[1] > 600 and image.std() > 0.05
    assert len(colored_runs(image[image.shape[0] // 2:], 1)) == 3  # the three heatmaps


def test_cli_json_contract(cli):
    result = cli("circuits", "--json", "--layer", "1", "--no-composition")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {h["layer"] for h in doc["heads"]} == {1}
    entry = doc["heads"][0]
    assert set(entry["qk"]) >= {"norm", "rank", "singular_values"}
    values = entry["ov"]["singular_values"]
    assert values == sorted(values, reverse=True) and len(values) == 32
    assert doc["composition"] == []


def test_cli_errors(cli, tmp_path):
    from helpers import assert_clean_error

    assert_clean_error(cli("circuits", "--layer", "7"), 2, "--layer")
    assert_clean_error(cli("circuits", "--embed-dim", "8"), 2, "--random")
    assert_clean_error(cli("circuits", "--out", tmp_path / "x.txt"), 2, "--out")
    assert not (tmp_path / "x.txt").exists()


# ---- Hugging Face architectures of the zoo -------------------------------------------------------

@pytest.fixture(scope="module")
def zoo_scaled(tmp_path_factory):
    """zoo_scaled(kind) -> (folder, model): a zoo model whose norm scales are random (they start
    at 1, which would make folding them invisible), saved by transformers itself."""
    pytest.importorskip("transformers")
    import transformers
    from zoo import build_model

    built = {}

    def get(kind):
        if kind not in built:
            transformers.utils.logging.disable_progress_bar()
            model = build_model(kind)
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    low = name.lower()
                    if param.ndim == 1 and name.endswith("weight") and ("norm" in low
                                                                        or ".ln" in low):
                        param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            folder = tmp_path_factory.mktemp(kind)
            model.save_pretrained(folder)
            built[kind] = (folder, model)
        return built[kind]

    return get


def hf_reference(kind, model, wrong=False):
    """{label: [(QK, OV)]} from the transformers model's own modules. wrong: the negative
    control for that architecture (its characteristic slicing done the naive way)."""
    return EXTRACT[kind](model, model.config, wrong)


def _llama_like(model, config, wrong, fused=False, offset=0.0):
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    ref = {}
    for i, block in enumerate(model.layers):
        a = block.self_attn
        if fused:  # phi3: qkv_proj rows [q (H·d) | k (H_kv·d) | v (H_kv·d)]
            W = a.qkv_proj.weight.detach()
            Wq, Wk, Wv = W[:H * d], W[H * d:(H + Hkv) * d], W[(H + Hkv) * d:]
        else:
            Wq, Wk, Wv = (p.weight.detach() for p in (a.q_proj, a.k_proj, a.v_proj))
        gamma = block.input_layernorm.weight.detach().double() + offset
        kv_of = (lambda h: h % Hkv) if wrong else None  # the wrong grouping for GQA/MQA
        if wrong and Hkv == 1:
            gamma = gamma - offset if offset else None  # MQA: the scale is the control
        ref[str(i)] = dense_layer(Wq, Wk, Wv, a.o_proj.weight.detach(), H, Hkv, d, gamma,
                                  kv_of=kv_of)
    return ref


def _gpt2(model, config, wrong):
    H, E = config.n_head, config.n_embd
    ref = {}
    for i, block in enumerate(model.h):
        W = block.attn.c_attn.weight.detach().T  # Conv1D stores (in E, out 3E)
        Wo = block.attn.c_proj.weight.detach()  # (in, out) too
        Wo = Wo if wrong else Wo.T  # wrong: c_proj read as (out, in)
        ref[str(i)] = dense_layer(W[:E], W[E:2 * E], W[2 * E:], Wo, H, H, E // H,
                                  block.ln_1.weight.detach())
    return ref


def _neox(model, config, wrong):
    H, E = config.num_attention_heads, config.hidden_size
    d = E // H
    ref = {}
    for i, block in enumerate(model.layers):
        W = block.attention.query_key_value.weight.detach()
        if wrong:  # stacked [q; k; v], as if not interleaved
            Wq, Wk, Wv = W.chunk(3)
        else:  # interleaved per head: (H, 3, d, E)
            Wq, Wk, Wv = (W.view(H, 3, d, E)[:, s].reshape(H * d, E) for s in range(3))
        ref[str(i)] = dense_layer(Wq, Wk, Wv, block.attention.dense.weight.detach(), H, H, d,
                                  block.input_layernorm.weight.detach())
    return ref


def _falcon(model, config, wrong):
    H, Hkv, E = config.num_attention_heads, config.num_kv_heads, config.hidden_size
    d, r = E // H, H // Hkv
    ref = {}
    for i, block in enumerate(model.h):
        W = block.self_attention.query_key_value.weight.detach().view(Hkv, r + 2, d, E)
        Wq, Wk, Wv = (W[:, :r].reshape(H * d, E), W[:, r].reshape(Hkv * d, E),
                      W[:, r + 1].reshape(Hkv * d, E))
        if wrong:  # the fused rows read as stacked [q; k; v]
            flat = W.reshape(-1, E)
            Wq, Wk, Wv = flat[:H * d], flat[H * d:(H + Hkv) * d], flat[(H + Hkv) * d:]
        norm = getattr(block, "ln_attn", None) or block.input_layernorm
        ref[str(i)] = dense_layer(Wq, Wk, Wv, block.self_attention.dense.weight.detach(), H,
                                  Hkv, d, norm.weight.detach())
    return ref


def _t5(model, config, wrong):
    H, d = config.num_heads, config.d_kv
    ref = {}
    for stack, blocks in (("enc", model.encoder.block), ("dec", model.decoder.block)):
        for i, block in enumerate(blocks):
            parts = [(stack, block.layer[0].SelfAttention, block.layer[0].layer_norm)]
            if stack == "dec":
                parts.append(("cross", block.layer[1].EncDecAttention, block.layer[1].layer_norm))
            for label, a, norm in parts:
                gamma = None if wrong else norm.weight.detach()
                ref[f"{label} {i}"] = dense_layer(
                    a.q.weight.detach(), a.k.weight.detach(), a.v.weight.detach(),
                    a.o.weight.detach(), H, H, d, gamma,
                    gamma_kv="same" if label != "cross" else "none")
    return ref


EXTRACT = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like,
    "phi3": lambda m, c, w: _llama_like(m, c, w, fused=True),
    "gemma": lambda m, c, w: _llama_like(m, c, w, offset=1.0),
    "gpt2": _gpt2, "gpt_neox": _neox, "falcon": _falcon, "t5": _t5,
}


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EXTRACT))
def test_zoo_matches_dense(kind, zoo_scaled):
    folder, model = zoo_scaled(kind)
    doc = run_json(model=str(folder))
    reference = hf_reference(kind, model)
    assert {e["label"] for e in doc["heads"]} == set(reference)
    assert head_errors(doc, reference) <= RTOL
    assert doc["composition"], doc["composition_skipped"]
    assert composition_errors(doc, reference) <= RTOL
    wrong = hf_reference(kind, model, wrong=True)
    assert max(head_errors(doc, wrong), composition_errors(doc, wrong)) > 1e-3
    if kind == "t5":  # cross-attention: Q-composition only, and said so
        assert {e["kind"] for e in doc["composition"]
                if e["later"][0] in {x["layer"] for x in doc["layers"]
                                     if x["label"].startswith("cross")}} == {"Q"}
        assert any("cross-attention" in note for note in doc["notes"])
    if kind in ("llama", "gpt_neox", "falcon"):
        assert any("not part of W_QK" in note for note in doc["notes"])


def test_help_and_examples(cli, tmp_path):
    import shlex

    from helpers import ROOT

    from attnviz.cli.examples import EXAMPLES

    result = cli("circuits", "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "Examples" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    for example, _ in EXAMPLES["circuits"]:
        words = [str(ROOT / w) if w.startswith("sample_weights") else w
                 for w in shlex.split(example)[1:]]
        ran = cli(*words)
        assert ran.exit_code == 0, (example, ran.output)


# ---- the Python API

@pytest.mark.slow
def test_api_circuits_displays_itself(bundled_doc):
    import attnviz

    result = attnviz.circuits()
    assert isinstance(result, attnviz.Circuits)
    assert json.loads(json.dumps(result.to_json())) == bundled_doc
    page = result._repr_html_()
    assert "strongest composition" in page and "1.0: K with 0." in page
    assert result._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    one = attnviz.circuits(random=True, embed_dim=16, num_heads=2, seed=1)
    assert [layer.num_heads for layer in one.layers] == [2] and not one.compositions


def test_composition_skipped_when_too_large(monkeypatch):
    """Composition holds every chosen layer's weights: past the budget it is skipped and said
    so, unless asked for."""
    import attnviz.app.circuits as app

    monkeypatch.setattr(app, "COMPOSITION_AUTO_BYTES", 1000)
    skipped = run_json()
    assert skipped["composition"] == [] and "‹composition›" in skipped["composition_skipped"]
    forced = run_json(composition=True)
    assert len(forced["composition"]) == 12 and forced["composition_skipped"] is None


def test_encoder_decoder_order_and_grammar():
    """sample_weights/t5-tiny: stacks in order (encoder, then decoder self before cross), and
    the per-stack --layer grammar."""
    from helpers import SAMPLES

    doc = run_json(weights=SAMPLES / "t5-tiny")
    assert [layer["label"] for layer in doc["layers"]] == ["enc 0", "dec 0", "cross 0"]
    chosen = run_json(weights=SAMPLES / "t5-tiny", layer="cross 0,dec 0")
    assert [layer["label"] for layer in chosen["layers"]] == ["dec 0", "cross 0"]
    assert {(e["kind"], e["later"][0]) for e in chosen["composition"]} == {
        ("Q", chosen["layers"][1]["layer"])}


def test_terminal_marks_follow_the_baseline(bundled_doc):
    """The grids mark exactly the scores above their baseline (K on the bundled model, not Q
    or V), with the scores as computed."""
    import io

    from rich.console import Console

    from attnviz.render.circuits_terminal import print_circuits

    out = io.StringIO()
    print_circuits(Console(file=out, width=100), run_circuits(CircuitsRequest()))
    text = out.getvalue()
    marked = {e["kind"]: 0 for e in bundled_doc["composition"]}
    for e in bundled_doc["composition"]:
        marked[e["kind"]] += e["score"] > e["baseline"]
        shown = f"{e['score']:.3f}"
        assert (shown + "*" in text) == (e["score"] > e["baseline"]) and shown in text
    assert marked == {"K": 4, "Q": 0, "V": 0}
    assert text.count("*") - text.count("* above") == 4


def test_large_factors_float32_gram_refined():
    """Factors past EXACT_FACTOR_NUMEL take a float32 Gram refined in float64: singular values
    and ranks at RANK_RTOL as the float64 SVD of the factor gives them, for a full-rank head,
    one with a spectrum falling to 1e-3 and a rank-deficient one; the unrefined float32 Gram
    (the negative control) counts spurious singular values into the deficient head's rank."""
    from attnviz.compute.qkov import circuits

    E, d = 4096, 32
    assert E * d > circuits.EXACT_FACTOR_NUMEL
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(E, d, generator=gen)
    basis = torch.linalg.qr(torch.randn(E, d, generator=gen, dtype=torch.float64))[0]
    decaying = (basis * torch.logspace(0, -3, d, dtype=torch.float64)).float()
    deficient = torch.randn(E, 20, generator=gen) @ torch.randn(20, d, generator=gen)
    factors = torch.stack([full, decaying, deficient])
    T = circuits.factor_roots(factors)
    for F, root in zip(factors, T, strict=True):
        want = torch.linalg.svdvals(F.double())
        got = torch.linalg.svdvals(root)
        assert float((got - want).abs().max()) <= RTOL * float(want[0])
        assert circuits.spectrum(got).rank == int(torch.linalg.matrix_rank(
            F.double(), rtol=RANK_RTOL))
    assert circuits.spectrum(torch.linalg.svdvals(T[2])).rank == 20
    plain = (deficient.T @ deficient).double()
    values = torch.linalg.eigvalsh((plain + plain.T) / 2).clamp_min(0).sqrt().flip(0)
    assert circuits.spectrum(values).rank > 20


def test_cholesky_roots_serve_only_well_conditioned_heads():
    """A float32 Gram with no eigenvalue below REFINE_SHARE of its largest takes its Cholesky
    factor (proven by the factorization of G − REFINE_SHARE ‖G‖_F I): same singular values as
    the float64 SVD of the factor. A head with an eigenvalue below that share (the control)
    is left to the refined eigendecomposition, where its small singular values are exact."""
    from attnviz.compute.qkov import circuits_factors as factors

    E, d = 4096, 32
    gen = torch.Generator().manual_seed(6)
    full = torch.randn(E, d, generator=gen)
    basis = torch.linalg.qr(torch.randn(E, d, generator=gen, dtype=torch.float64))[0]
    steep = (basis * torch.logspace(0, -2, d, dtype=torch.float64)).float()  # λ down to 1e-4
    stack = torch.stack([full, steep])
    roots, done = factors._cholesky_roots(factors._grams(stack, torch.float32))
    assert done.tolist() == [True, False]
    want = torch.linalg.svdvals(full.double())
    assert float((torch.linalg.svdvals(roots[0]) - want).abs().max()) <= RTOL * float(want[0])
    both = factors.factor_roots(stack)  # the steep head through the refined path
    for F, root in zip(stack, both, strict=True):
        want = torch.linalg.svdvals(F.double())
        assert float((torch.linalg.svdvals(root) - want).abs().max()) <= 1e-6 * float(want[0])


def write_llama(folder, *, layers=2, E=96, H=4, Hkv=2, d=32, seed=4, scale=1.0,
                dtype=torch.float32):
    """A LLaMA-layout folder of random attention weights (times `scale`, drawn in float64 so a
    tiny or huge scale survives) and randomized RMSNorm scales (γ of order 1), stored as `dtype`
    (as benchmarks/run.py writes target 7's in bfloat16); returned as float64 as stored."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj.weight": (H * d, E), "self_attn.k_proj.weight": (Hkv * d, E),
              "self_attn.v_proj.weight": (Hkv * d, E), "self_attn.o_proj.weight": (E, H * d),
              "input_layernorm.weight": (E,)}
    tensors = {}
    for i in range(layers):
        for k, s in shapes.items():
            raw = torch.randn(s, generator=gen, dtype=torch.float64)
            value = raw * 0.02 * scale if len(s) == 2 else 1 + 0.5 * raw
            tensors[f"model.layers.{i}.{k}"] = value.to(dtype)
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": E,
        "num_attention_heads": H, "num_key_value_heads": Hkv, "num_hidden_layers": layers,
        "intermediate_size": 4 * E, "vocab_size": 100}))
    return {k: v.double() for k, v in tensors.items()}


def test_large_bf16_checkpoint_matches_dense(tmp_path, monkeypatch):
    """Heads past EXACT_FACTOR_NUMEL (lowered here, so a small model takes the large models'
    path), stored in bfloat16: converted a few heads at a time with γ folded in by one
    multiplication, float32 Grams and copying blocks, Cholesky roots, two layers computed at
    once on two threads, then composition from the kept weights: every number equals the
    dense float64 computation, in layer order; without γ (the control) they do not."""
    from attnviz.compute.qkov import circuits_factors

    E, H, Hkv, d = 96, 4, 2, 32
    monkeypatch.setattr(circuits_factors, "EXACT_FACTOR_NUMEL", E * d - 1)
    monkeypatch.setattr(circuits_factors, "EXACT_GRAM_NUMEL", E * d - 1)
    served = []
    cholesky = circuits_factors._cholesky_roots

    def counted(gram):
        roots, done = cholesky(gram)
        served.append(int(done.sum()))
        return roots, done
    monkeypatch.setattr(circuits_factors, "_cholesky_roots", counted)
    w = write_llama(tmp_path / "m", layers=2, E=E, H=H, Hkv=Hkv, d=d, seed=4,
                    dtype=torch.bfloat16)
    doc = run_json(model=str(tmp_path / "m"), composition=True)
    assert [layer["label"] for layer in doc["layers"]] == ["0", "1"]

    def reference(fold):
        found = {}
        for i in range(2):
            p = f"model.layers.{i}."
            W = [w[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"]
            found[str(i)] = dense_layer(*W, H, Hkv, d,
                                        w[p + "input_layernorm.weight"] if fold else None)
        return found

    ref = reference(True)
    assert head_errors(doc, ref) <= RTOL
    assert len(doc["composition"]) == 3 * H * H
    assert composition_errors(doc, ref) <= RTOL
    assert head_errors(doc, reference(False)) > 1e-2
    # every factor of both layers, 4 chunks each (the baselines come after): random heads
    assert sum(served[:8]) == 2 * (2 * H + 2 * Hkv)
