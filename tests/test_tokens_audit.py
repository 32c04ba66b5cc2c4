"""A held-out audit of `attnviz tokens` (#34): every method the command prints, recomputed here
from the model's own forward with code that shares nothing with attnviz's.

- rollout: the model's `output_attentions`, heads reduced (mean, max, min), mixed as
  w·I + (1 − w)·A, rows normalized, multiplied out as full L × L matrices (the command carries
  a row vector);
- flow: an Edmonds–Karp (tests/test_tokens.py) over the layered graph of those matrices (the
  command runs Dinic's);
- norms and ALTI: each layer's terms T_ij formed one by one from hooks written here on the
  model's own modules (the value projection applied here to the layer's input, W_O per head,
  a post-LN's norm frozen at the scale of the whole sum, Gemma 2's norm on the attention
  output), checked against the layer's own output (≤ 1e-5 relative), ‖T_ij‖₂ and the L1
  proximity row-normalized, composed as full matrix products;
- erasure: each erased input run alone through the model (its own LM head, or its hidden
  state), and Spearman's ρ from ranks counted here.

On the real all-MiniLM-L6-v2 and the tiny zoo's llama (grouped-query), gpt2, gemma2 and bert,
and the decoder's view of t5 and bart (--target). Each comparison has a negative control: the
recomputation with one documented step changed (no row normalization, the post-LN left
unfrozen, a token deleted instead of masked) is caught."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tokens import edmonds_karp, graph, rank_formula

from attnviz.app.tokens import TokensRequest, output_position, repeated_word_note, run_tokens
from attnviz.core.choices import Erase, HeadReduce, TokenMethod

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]

ATOL = 1e-6  # chains: float64 recomputations of float32 maps
# erasure: float32 forwards, batched there, one at a time here (seen: ≤ 4e-7); the zoo's LM
# effects are 1e-5 to 1e-3 nats, so a looser tolerance would check nothing
EFFECT_ATOL = 5e-6
CAUGHT = 20 * EFFECT_ATOL  # a negative control's effects differ by more
REAL_TEXT = "The quick brown fox, naïvely, jumped over the lazy dog — twice!"
LM_KINDS = ("llama", "gpt2", "gemma2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    import zoo
    from helpers import minilm_folder

    made = {kind: zoo.build_lm(kind, tmp_path_factory.mktemp(kind))
            for kind in (*LM_KINDS, "t5", "bart")}
    made["bert"] = zoo.build("bert", tmp_path_factory.mktemp("bert"))
    made["minilm"] = minilm_folder()
    return made


# ---- the independent recomputation -----------------------------------------------------------

def load(folder: Path) -> tuple[Any, Any, bool]:
    """(model, tokenizer, has a causal LM head), loaded here with transformers alone."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    lm = any("CausalLM" in a or "LMHead" in a for a in config.architectures or [])
    cls = transformers.AutoModelForCausalLM if lm else transformers.AutoModel
    model = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    if (Path(folder) / "vocab.txt").exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    else:
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return model, tokenizer, lm


def mixed(A: torch.Tensor, how: str, w: float, normalize: bool = True) -> torch.Tensor:
    A = A.double()
    R = {"mean": A.mean(0), "max": A.amax(0), "min": A.amin(0)}[how]
    M = w * torch.eye(R.shape[0], dtype=R.dtype) + (1 - w) * R
    if not normalize:
        return M
    s = M.sum(-1, keepdim=True)
    return torch.where(s > 0, M / s, torch.zeros_like(M))


def product_row(matrices: list[torch.Tensor], p: int) -> torch.Tensor:
    """Row p of M_{n-1} ⋯ M_0, as the full matrix product."""
    P = torch.eye(matrices[0].shape[0], dtype=torch.float64)
    for M in matrices:
        P = M @ P
    return P[p]


def flows(matrices: list[torch.Tensor], p: int) -> torch.Tensor:
    L, n = matrices[0].shape[0], len(matrices)
    capacity = graph(matrices)
    return torch.tensor([edmonds_karp(capacity, s, n * L + p) for s in range(L)],
                        dtype=torch.float64)


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None
    ra = torch.tensor(rank_formula(a), dtype=torch.float64)
    rb = torch.tensor(rank_formula(b), dtype=torch.float64)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    d = float(ra.norm() * rb.norm())
    return None if d == 0 else float(ra @ rb / d)


def per_head(v: torch.Tensor, W_o: torch.Tensor, H: int) -> torch.Tensor:
    """(H, L, E): head h's W_O slice times its (shared, grouped-query) value states."""
    d = W_o.shape[1] // H
    groups = v.shape[-1] // d
    heads = v.reshape(v.shape[0], groups, d)
    return torch.stack([heads[:, h // (H // groups)] @ W_o[:, h * d:(h + 1) * d].T
                        for h in range(H)]).double()


def raw_terms(A: torch.Tensor, U: torch.Tensor, b_o: torch.Tensor | None,
              residual: torch.Tensor | None) -> torch.Tensor:
    """(L, L, E): Σ_h α^h_ij U^h_j + ᾱ_ij b_O + [i = j] r_i."""
    a = A.double()
    T = torch.einsum("hij,hje->ije", a, U)
    if b_o is not None:
        T = T + a.mean(0)[..., None] * b_o.double()
    if residual is not None:
        i = torch.arange(T.shape[0])
        T[i, i] += residual.double()
    return T


def frozen_layer_norm(T: torch.Tensor, norm: Any, share: torch.Tensor) -> torch.Tensor:
    y = T.sum(1)
    sigma = (y.var(-1, unbiased=False) + norm.eps).sqrt()
    centred = T - T.mean(-1, keepdim=True)
    return norm.weight.double() * centred / sigma[:, None, None] + \
        share[..., None] * norm.bias.double()


# per family: its layers, and where the layer's attention output (with the residual) is read:
# (module under the layer, its input (True) or its output)
LAYOUT = {"llama": ("model.layers", "post_attention_layernorm", True),
          "gemma2": ("model.layers", "pre_feedforward_layernorm", True),
          "gpt2": ("transformer.h", "ln_2", True),
          "bert": ("encoder.layer", "attention", False)}


def family_terms(family: str, model: Any, ids: torch.Tensor, unfrozen: bool = False
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(per layer T (L, L, E), the layer's own output to compare Σ_j T_ij with, the maps).
    `unfrozen` (the negative control): BERT's post-LN left out of the terms."""
    path, site, is_input = LAYOUT[family]
    layers = model.get_submodule(path)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k: inputs.append((a[0] if a else k["hidden_states"])[0].detach()),
            with_kwargs=True))
        module = layer.get_submodule(site)
        if is_input:
            handles.append(module.register_forward_pre_hook(
                lambda m, a: outputs.append(a[0][0].detach())))
        else:
            handles.append(module.register_forward_hook(
                lambda m, a, o: outputs.append(o[0][0].detach())))
    try:
        with torch.no_grad():
            maps = [a[0] for a in model(input_ids=ids, output_attentions=True).attentions]
    finally:
        for h in handles:
            h.remove()
    terms = []
    with torch.no_grad():
        for layer, x, A in zip(layers, inputs, maps, strict=True):
            H = A.shape[0]
            if family in ("llama", "gemma2"):
                attn = layer.self_attn
                U = per_head(attn.v_proj(layer.input_layernorm(x[None]))[0],
                             attn.o_proj.weight, H)
                if family == "llama":
                    T = raw_terms(A, U, attn.o_proj.bias, x)
                else:  # x + N(a): N frozen at the whole attention output's scale
                    T = raw_terms(A, U, attn.o_proj.bias, None)
                    norm = layer.post_attention_layernorm
                    scale = (T.sum(1).pow(2).mean(-1) + norm.eps).rsqrt()
                    T = T * scale[:, None, None] * (1.0 + norm.weight.double())
                    i = torch.arange(T.shape[0])
                    T[i, i] += x.double()
            elif family == "gpt2":
                qkv = layer.attn.c_attn(layer.ln_1(x[None]))[0]
                U = per_head(qkv[:, 2 * qkv.shape[-1] // 3:], layer.attn.c_proj.weight.T, H)
                T = raw_terms(A, U, layer.attn.c_proj.bias, x)
            else:  # bert: LN(x + attn(x)), the LN frozen at the whole sum's scale
                attention = layer.attention
                U = per_head(attention.self.value(x[None])[0], attention.output.dense.weight, H)
                T = raw_terms(A, U, attention.output.dense.bias, x)
                if not unfrozen:
                    T = frozen_layer_norm(T, attention.output.LayerNorm, A.double().mean(0))
            terms.append(T)
    return terms, [o.double() for o in outputs], maps


def contributions(T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms, alti) row-normalized (L, L) from the terms."""
    y = T.sum(1)
    norms = T.norm(dim=-1)
    alti = (y.abs().sum(-1)[:, None] - (y[:, None] - T).abs().sum(-1)).clamp(min=0)
    return (norms / norms.sum(-1, keepdim=True), alti / alti.sum(-1, keepdim=True))


def measure(model: Any, lm: bool, ids: torch.Tensor, mask: torch.Tensor, p: int) -> torch.Tensor:
    with torch.no_grad():
        if lm:
            return torch.log_softmax(model(input_ids=ids, attention_mask=mask)
                                     .logits[0, p].double(), -1)
        return model(input_ids=ids, attention_mask=mask).last_hidden_state[0, p].double()


def leave_one_out(model: Any, lm: bool, row: list[int], p: int, causal: bool,
                  baseline: int | None = None, delete: bool = False) -> dict[int, float]:
    """Each erased input alone through the model. `delete` (the negative control): the token
    removed from the input instead of masked."""
    ids = torch.tensor([row])
    mask = torch.ones_like(ids)
    base = measure(model, lm, ids, mask, p)
    target = int(base.argmax())
    effects = {}
    for j in range(p + 1) if causal else range(len(row)):
        if baseline is None and j == p:
            continue
        erased_ids, erased_mask, q = ids.clone(), mask.clone(), p
        if delete:
            erased_ids = torch.tensor([row[:j] + row[j + 1:]])
            erased_mask = torch.ones_like(erased_ids)
            q = p - 1 if j < p else p
        elif baseline is None:
            erased_mask[0, j] = 0
        else:
            erased_ids[0, j] = baseline
        got = measure(model, lm, erased_ids, erased_mask, q)
        effects[j] = float(base[target] - got[target]) if lm else \
            float((got - base).norm() / base.norm())
    return effects


def independent(family: str, folder: Path, text: str, p: int, causal: bool, how: str = "mean",
                w: float = 0.5, baseline: int | None = None) -> dict[str, Any]:
    model, tokenizer, lm = load(folder)
    row = list(tokenizer(text)["input_ids"])
    terms, own, maps = family_terms(family, model, torch.tensor([row]))
    for T, y in zip(terms, own, strict=True):  # the defining identity, on the model's output
        assert float((T.sum(1) - y).norm() / y.norm()) <= 1e-5
    matrices = [mixed(A, how, w) for A in maps]
    pairs = [contributions(T) for T in terms]
    return {"row": row, "model": model, "lm": lm, "maps": maps,
            "rollout": product_row(matrices, p), "flow": flows(matrices, p),
            "norms": product_row([n for n, _ in pairs], p),
            "alti": product_row([a for _, a in pairs], p),
            "effects": leave_one_out(model, lm, row, p, causal, baseline)}


def assert_agrees(s: Any, want: dict[str, Any], methods: tuple[TokenMethod, ...]) -> None:
    """Every chain[0], effect and ρ of one sentence against the recomputation."""
    for m in methods:
        got = s.chains[m][0]
        assert torch.allclose(got, want[str(m)], atol=ATOL, rtol=0), (m, got, want[str(m)])
    effects = want["effects"]
    erased = list(effects)
    assert s.erasures.erased == erased
    expected = torch.tensor(list(effects.values()), dtype=torch.float64)
    assert torch.allclose(s.erasures.effects, expected, atol=EFFECT_ATOL, rtol=0)
    for m in methods:  # ρ from the command's effects: near-equal effects may swap ranks
        rho = spearman([float(s.chains[m][0][j]) for j in erased], s.erasures.effects.tolist())
        got = s.correlations[m]
        assert (got is None) == (rho is None) and (rho is None or abs(got - rho) < 1e-9), m


ALL = (TokenMethod.ROLLOUT, TokenMethod.FLOW, TokenMethod.NORMS, TokenMethod.ALTI)


# ---- the real all-MiniLM-L6-v2 ---------------------------------------------------------------

@pytest.mark.slow
def test_minilm_every_method_equals_an_independent_recomputation(folders):
    """Real text on the real MiniLM: the identity on each layer's own output, rollout, flow,
    norms, ALTI, erasure and ρ; negative controls: rollout without row normalization (max
    heads), the post-LN left unfrozen, and deletion in place of masking, are each caught."""
    folder = folders["minilm"]
    result = run_tokens(TokensRequest([REAL_TEXT], model=str(folder), heads=HeadReduce.MAX))
    s = result.sentences[0]
    assert not result.causal and s.position == 0 and result.methods == ALL
    want = independent("bert", folder, REAL_TEXT, 0, False, how="max")
    assert s.tokens[0] == "[CLS]" and len(s.tokens) == len(want["row"])
    assert_agrees(s, want, ALL)
    # negative control 1: max rows left unnormalized (vit-explain's #16) differ
    loose = product_row([mixed(A, "max", 0.5, normalize=False) for A in want["maps"]], 0)
    assert float((s.chains[TokenMethod.ROLLOUT][0] - loose).abs().max()) > 1e-3
    # negative control 2: the terms before the post-LN break the identity and move the norms
    model = want["model"]
    terms, own, _ = family_terms("bert", model, torch.tensor([want["row"]]), unfrozen=True)
    assert float((terms[0].sum(1) - own[0]).norm() / own[0].norm()) > 1e-2
    unfrozen = product_row([contributions(T)[0] for T in terms], 0)
    assert float((s.chains[TokenMethod.NORMS][0] - unfrozen).abs().max()) > 1e-3
    # negative control 3: deleting a token is not masking it
    deleted = leave_one_out(model, False, want["row"], 0, False, delete=True)
    assert max(abs(deleted[j] - want["effects"][j]) for j in deleted) > CAUGHT


@pytest.mark.slow
def test_minilm_baseline_erasure_and_a_repeated_word(folders):
    """--erase baseline with the tokenizer's [MASK], and --position as a word found twice (an
    encoder: its first occurrence, with a note): erasure and every method against the
    recomputation; negative control: the [PAD] baseline's effects differ."""
    folder = folders["minilm"]
    text = "the cat sat on the mat"
    result = run_tokens(TokensRequest([text], model=str(folder), position="the",
                                      erase=Erase.BASELINE))
    s = result.sentences[0]
    assert s.position == 1 and any("occurs at 1, 5" in note for note in result.notes)
    _, tokenizer, _ = load(folder)
    want = independent("bert", folder, text, 1, False, baseline=tokenizer.mask_token_id)
    assert_agrees(s, want, ALL)
    padded = leave_one_out(want["model"], False, want["row"], 1, False,
                           baseline=tokenizer.pad_token_id)
    assert max(abs(padded[j] - want["effects"][j]) for j in padded) > CAUGHT


# ---- the tiny zoo ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind, how, w", [("llama", "mean", 0.5), ("llama", "min", 0.0),
                                          ("gpt2", "max", 0.3), ("gemma2", "mean", 1.0),
                                          ("bert", "mean", 0.5)])
def test_zoo_every_method_equals_an_independent_recomputation(folders, kind, how, w):
    """llama (grouped-query), gpt2, gemma2 (a norm on the attention output, sliding window,
    softcapping) with their LM heads and bert (post-LN, hidden-state measure), over a padded
    batch of two sentences: each sentence's result equals its own recomputation alone."""
    sentences = ["the cat sat on the mat the cat",
                 "a small dog ran far away from the big red barn"]
    result = run_tokens(TokensRequest(sentences, model=str(folders[kind]), heads=HeadReduce(how),
                                      residual_weight=w))
    causal = kind != "bert"
    assert result.causal is causal and result.methods == ALL
    for text, s in zip(sentences, result.sentences, strict=True):
        p = len(s.tokens) - 1 if causal else 0
        assert s.position == p
        assert_agrees(s, independent(kind, folders[kind], text, p, causal, how, w), ALL)
    # the terminal's path: no matrices kept, rollout as a row vector (no flow: it needs them)
    fast = run_tokens(TokensRequest(sentences, model=str(folders[kind]), heads=HeadReduce(how),
                                    residual_weight=w, check=False, keep_matrices=False,
                                    methods=(TokenMethod.ROLLOUT, TokenMethod.NORMS,
                                             TokenMethod.ALTI)))
    for s, checked in zip(fast.sentences, result.sentences, strict=True):
        for m in fast.methods:
            assert torch.allclose(s.chains[m][0], checked.chains[m][0], atol=1e-12, rtol=0)
    for m in ALL:  # over the sentences: the mean and the sample standard deviation
        rhos = [s.correlations[m] for s in result.sentences if s.correlations[m] is not None]
        mean, spread, count = result.summary[m]
        assert count == len(rhos)
        if len(rhos) == 2:
            assert mean == pytest.approx(statistics.mean(rhos), abs=1e-12)
            assert spread == pytest.approx(statistics.stdev(rhos), abs=1e-12)


def test_zoo_recomputation_catches_a_changed_step(folders):
    """Negative controls on a causal model: another mixing weight's rollout, and the effects
    of replacing tokens by <unk> rather than masking them, each differ from what the command
    returns."""
    text = "the cat sat on the mat the cat"
    s = run_tokens(TokensRequest([text], model=str(folders["llama"]))).sentences[0]
    p = len(s.tokens) - 1
    want = independent("llama", folders["llama"], text, p, True)
    other = product_row([mixed(A, "mean", 0.3) for A in want["maps"]], p)
    assert float((s.chains[TokenMethod.ROLLOUT][0] - other).abs().max()) > 1e-3
    # (deleting a token equals masking it here, up to rounding: rotary positions are relative)
    replaced = leave_one_out(want["model"], True, want["row"], p, True, baseline=0)
    assert max(abs(replaced[j] - want["effects"][j]) for j in want["effects"]) > CAUGHT


# ---- the decoder's view of the source (--target) ---------------------------------------------

@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_cross_view_equals_an_independent_recomputation(folders, kind):
    """Rollout and flow over the joint [decoder; source] nodes built here from the model's own
    encoder, decoder and cross maps; erasure by masking each source token alone; ρ. Norms and
    ALTI: the source's share plus the decoder's is 1. Negative control: the cross sublayer
    without its residual share moves the source vector."""
    import transformers

    folder = folders[kind]
    source, target = "the cat sat on the mat", "a dog ran far"
    result = run_tokens(TokensRequest([source], model=str(folder), targets=(target,),
                                      heads=HeadReduce.MAX, residual_weight=0.3))
    s = result.sentences[0]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    row = list(tokenizer(source)["input_ids"])
    decoder = [model.config.decoder_start_token_id, *tokenizer(target)["input_ids"]]
    ids, dec = torch.tensor([row]), torch.tensor([decoder])
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=dec, output_attentions=True)
    T, S = len(decoder), len(row)
    p = T - 1
    assert s.position == p and s.tokens == tokenizer.convert_ids_to_tokens(row)

    def levels(keep: float) -> list[torch.Tensor]:
        found = []
        for A in out.encoder_attentions:
            M = torch.eye(T + S, dtype=torch.float64)
            M[T:, T:] = mixed(A[0], "max", 0.3)
            found.append(M)
        for A, C in zip(out.decoder_attentions, out.cross_attentions, strict=True):
            M = torch.eye(T + S, dtype=torch.float64)
            M[:T, :T] = mixed(A[0], "max", 0.3)
            X = torch.eye(T + S, dtype=torch.float64)
            reduced = C[0].double().amax(0)
            X[:T, :T] *= keep
            X[:T, T:] = (1 - keep) * reduced / reduced.sum(-1, keepdim=True)
            found += [M, X]
        return found

    joint = levels(0.3)
    want = product_row(joint, p)
    assert torch.allclose(s.chains[TokenMethod.ROLLOUT][0], want[T:], atol=ATOL, rtol=0)
    assert torch.allclose(s.decoder_shares[TokenMethod.ROLLOUT], want[:T], atol=ATOL, rtol=0)
    flow = flows(joint, p)
    assert torch.allclose(s.chains[TokenMethod.FLOW][0], flow[T:], atol=ATOL, rtol=0)
    assert torch.allclose(s.decoder_shares[TokenMethod.FLOW], flow[:T], atol=ATOL, rtol=0)
    for m in (TokenMethod.NORMS, TokenMethod.ALTI):
        total = float(s.chains[m][0].sum() + s.decoder_shares[m].sum())
        assert total == pytest.approx(1.0, abs=1e-9)

    def logp(i: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=i, attention_mask=mask, decoder_input_ids=dec).logits
        return torch.log_softmax(logits[0, p].double(), -1)

    base = logp(ids, torch.ones_like(ids))
    t = int(base.argmax())
    effects = []
    for j in range(S):
        mask = torch.ones_like(ids)
        mask[0, j] = 0
        effects.append(float(base[t] - logp(ids, mask)[t]))
    assert torch.allclose(s.effects, torch.tensor(effects, dtype=torch.float64),
                          atol=EFFECT_ATOL, rtol=0)
    for m in ALL:
        rho = spearman([float(v) for v in s.chains[m][0]], s.effects.tolist())
        assert rho is not None and s.correlations[m] == pytest.approx(rho, abs=1e-9)
    # negative control: the cross sublayer sending all of a row through its map
    no_residual = product_row(levels(0.0), p)
    assert float((s.chains[TokenMethod.ROLLOUT][0] - no_residual[T:]).abs().max()) > 1e-3


# ---- --position as a word --------------------------------------------------------------------

def test_a_word_position_matches_past_word_markers_and_names_a_repeat():
    """`--position the` finds GPT-2's Ġthe and sentencepiece's ▁the (case aside); a word found
    twice is its last occurrence on a causal model, its first on an encoder, with a note; a
    word written with its marker finds that token alone. Negative control: a word not there
    is refused."""
    from attnviz.errors import UsageError

    gpt2 = ["The", "Ġcat", "Ġsat", "Ġon", "Ġthe", "Ġmat"]
    assert output_position(gpt2, "the", True) == 4
    assert output_position(gpt2, "the", False) == 0  # "The": case aside
    assert output_position(gpt2, "cat", True) == 1
    assert output_position(gpt2, "Ġthe", False) == 4  # a marked word: that token alone
    pieces = ["▁the", "▁cat", "▁sat", "▁on", "▁the", "▁mat"]
    assert output_position(pieces, "the", True) == 4
    assert output_position(pieces, "THE", False) == 0
    note = repeated_word_note(pieces, "the", 4, 0)
    assert note is not None and "occurs at 0, 4" in note and "traced 4" in note
    assert repeated_word_note(pieces, "cat", 1, 0) is None
    assert repeated_word_note(pieces, "-2", 4, 0) is None
    with pytest.raises(UsageError, match="not in the sentence"):
        output_position(pieces, "dog", True)


# ---- what counts as causal, and what the terminal names --------------------------------------

def test_a_causal_lm_head_that_reads_every_token_counts_as_an_encoder(tmp_path):
    """BertLMHeadModel without is_decoder has a causal LM head class but reads later tokens:
    traced as the model runs (every token in the table, the chain and the erasures), not as
    its head's class says. Negative control: the tokens after the position hold a real share
    of rollout, which the old rule (a causal LM head → causal) hid and never erased."""
    import zoo

    folder = zoo.build_lm("bert", tmp_path / "bert-lm", model_class="BertLMHeadModel")
    text = "the cat sat on the mat"
    result = run_tokens(TokensRequest([text], model=str(folder), position="2"))
    s = result.sentences[0]
    assert not result.causal and s.reached(result.causal) == len(s.tokens)
    assert s.erasures.erased == [j for j in range(len(s.tokens)) if j != 2]
    model, tokenizer, lm = load(folder)
    assert lm
    row = list(tokenizer(text)["input_ids"])
    with torch.no_grad():
        maps = [a[0] for a in model(input_ids=torch.tensor([row]),
                                    output_attentions=True).attentions]
    want = product_row([mixed(A, "mean", 0.5) for A in maps], 2)
    assert torch.allclose(s.chains[TokenMethod.ROLLOUT][0], want, atol=ATOL, rtol=0)
    effects = leave_one_out(model, True, row, 2, False)
    assert torch.allclose(s.erasures.effects, torch.tensor(list(effects.values()),
                                                           dtype=torch.float64),
                          atol=EFFECT_ATOL, rtol=0)
    assert float(want[3:].sum()) > 1e-2  # the share the causal reading left unshown


def test_top_tokens_are_among_those_the_output_sees(cli):
    """On a causal model the top tokens of an early position are never later tokens (which
    hold 0), and with nothing erased the erasure line says so. Negative control: ranked over
    every token, the top names a later one."""
    result = run_tokens(TokensRequest(["the cat sat on the mat"], position="1"))
    s = result.sentences[0]
    for m in result.methods:
        assert all(j <= 1 for j in s.top(m, reach=s.reached(result.causal)))
    assert any(j > 1 for j in s.top(TokenMethod.ROLLOUT))
    shown = cli("tokens", "the cat sat on the mat", "--position", "1")
    assert shown.exit_code == 0, shown.output
    tops = [line for line in shown.output.splitlines() if ": top " in line]
    assert len(tops) == 5 and not any(f"@{j}" in line for line in tops for j in range(2, 6))
    alone = cli("tokens", "cat")
    assert alone.exit_code == 0, alone.output
    assert "erasure: top – (no token the output sees could be erased)" in alone.output


# ---- the decoder's view: norms and ALTI from the model's own sublayers -----------------------

def _layer_io(model: Any, kind: str, ids: torch.Tensor, dec: torch.Tensor) -> dict[str, Any]:
    """Each encoder and decoder layer's input, and each sublayer's own output (T5: the
    sublayer module's output; BART: the output of the norm after its residual sum)."""
    encoder = model.get_encoder().block if kind == "t5" else model.get_encoder().layers
    decoder = model.get_decoder().block if kind == "t5" else model.get_decoder().layers
    got: dict[str, list[torch.Tensor]] = {key: [] for key in
                                          ("enc_in", "dec_in", "enc", "self", "cross")}
    handles = []

    def keep_input(key: str) -> Any:
        return lambda m, a, k: got[key].append((a[0] if a else k["hidden_states"])[0].detach())

    def keep_output(key: str) -> Any:
        return lambda m, a, o: got[key].append((o[0] if isinstance(o, tuple) else o)[0]
                                               .detach().double())

    for layer in encoder:
        handles.append(layer.register_forward_pre_hook(keep_input("enc_in"), with_kwargs=True))
        site = layer.layer[0] if kind == "t5" else layer.self_attn_layer_norm
        handles.append(site.register_forward_hook(keep_output("enc")))
    for layer in decoder:
        handles.append(layer.register_forward_pre_hook(keep_input("dec_in"), with_kwargs=True))
        sites = (layer.layer[0], layer.layer[1]) if kind == "t5" else \
            (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm)
        handles.append(sites[0].register_forward_hook(keep_output("self")))
        handles.append(sites[1].register_forward_hook(keep_output("cross")))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, decoder_input_ids=dec, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    return {"encoder": encoder, "decoder": decoder, "out": out, **got}


def _self_terms(kind: str, attention: Any, norm_in: Any, post: Any, x: torch.Tensor,
                A: torch.Tensor) -> torch.Tensor:
    """A self-attention sublayer's terms: T5 x + o(SA(LN(x))); BART LN(x + out(SA(x)))."""
    H = A.shape[0]
    if kind == "t5":
        return raw_terms(A, per_head(attention.v(norm_in(x[None]))[0], attention.o.weight, H),
                         None, x)
    U = per_head(attention.v_proj(x[None])[0], attention.out_proj.weight, H)
    return frozen_layer_norm(raw_terms(A, U, attention.out_proj.bias, x), post,
                             A.double().mean(0))


def _cross_terms(kind: str, layer: Any, residual: torch.Tensor, enc: torch.Tensor,
                 C: torch.Tensor, with_residual: bool = True) -> torch.Tensor:
    """(T, 1 + S, E): per decoder row its residual, then one term per encoder output; a
    BART post-LN frozen over the whole row (β shared by the cross weights alone)."""
    H = C.shape[0]
    attention = layer.layer[1].EncDecAttention if kind == "t5" else layer.encoder_attn
    if kind == "t5":
        U = per_head(attention.v(enc[None])[0], attention.o.weight, H)
    else:
        U = per_head(attention.v_proj(enc[None])[0], attention.out_proj.weight, H)
    share = C.double().mean(0)
    T = torch.einsum("htj,hje->tje", C.double(), U)
    if kind == "bart":
        T = T + share[..., None] * attention.out_proj.bias.double()
    rows = torch.cat([residual.double()[:, None] * float(with_residual), T], 1)
    if kind == "bart":
        norm = layer.encoder_attn_layer_norm
        sigma = (rows.sum(1).var(-1, unbiased=False) + norm.eps).sqrt()
        rows = norm.weight.double() * (rows - rows.mean(-1, keepdim=True)) / sigma[:, None, None]
        rows[:, 1:] += share[..., None] * norm.bias.double()
    return rows


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_cross_view_contributions_equal_an_independent_recomputation(folders, kind):
    """--target norms and ALTI: every sublayer's terms formed here from the model's own
    modules (each sum checked against the sublayer's own output, ≤ 1e-5), the joint
    [decoder; encoder output] matrices composed by full products, then the encoder's; the
    source chain and the decoder's share equal the command's. Negative control: the cross
    sublayer's residual left out of its row moves the source vector."""
    import transformers

    folder = folders[kind]
    source, target = "the cat sat on the mat", "a dog ran far"
    result = run_tokens(TokensRequest([source], model=str(folder), targets=(target,),
                                      methods=(TokenMethod.NORMS, TokenMethod.ALTI),
                                      check=False))
    s = result.sentences[0]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    row = list(tokenizer(source)["input_ids"])
    decoder = [model.config.decoder_start_token_id, *tokenizer(target)["input_ids"]]
    io = _layer_io(model, kind, torch.tensor([row]), torch.tensor([decoder]))
    out = io["out"]
    T, S = len(decoder), len(row)
    N, p = T + S, s.position
    enc_out = out.encoder_last_hidden_state[0]

    def identity(terms: torch.Tensor, own: torch.Tensor) -> None:
        assert float((terms.sum(1) - own).norm() / own.norm()) <= 1e-5

    with torch.no_grad():
        encoder = []
        for layer, x, A, own in zip(io["encoder"], io["enc_in"], out.encoder_attentions,
                                    io["enc"], strict=True):
            sub = layer.layer[0] if kind == "t5" else layer
            attention = sub.SelfAttention if kind == "t5" else layer.self_attn
            terms = _self_terms(kind, attention, getattr(sub, "layer_norm", None),
                                getattr(layer, "self_attn_layer_norm", None), x, A[0])
            identity(terms, own)
            encoder.append(contributions(terms))
        joint: list[list[torch.Tensor]] = [[], [], []]  # norms, alti, alti w/o cross residual
        for layer, x, A, C, mid, own in zip(io["decoder"], io["dec_in"],
                                            out.decoder_attentions, out.cross_attentions,
                                            io["self"], io["cross"], strict=True):
            sub = layer.layer[0] if kind == "t5" else layer
            attention = sub.SelfAttention if kind == "t5" else layer.self_attn
            terms = _self_terms(kind, attention, getattr(sub, "layer_norm", None),
                                getattr(layer, "self_attn_layer_norm", None), x, A[0])
            identity(terms, mid)
            rows = _cross_terms(kind, layer, mid, enc_out, C[0])
            identity(rows, own)
            bare = _cross_terms(kind, layer, mid, enc_out, C[0], with_residual=False)
            for k, (self_part, cross_part) in enumerate(
                    [*zip(contributions(terms), contributions(rows), strict=True),
                     (contributions(terms)[1], contributions(bare)[1])]):
                M = torch.eye(N, dtype=torch.float64)
                M[:T, :T] = self_part
                X = torch.eye(N, dtype=torch.float64)
                X[:T, :T] = torch.diag(cross_part[:, 0])
                X[:T, T:] = cross_part[:, 1:]
                joint[k] += [M, X]

    def carried(levels: list[torch.Tensor], layers: list[torch.Tensor]) -> tuple[
            torch.Tensor, torch.Tensor]:
        v = product_row(levels, p)
        rows = [v[T:]]
        for M in reversed(layers):
            rows.append(rows[-1] @ M)
        return torch.stack(rows[::-1]), v[:T]

    for k, m in enumerate((TokenMethod.NORMS, TokenMethod.ALTI)):
        chain, share = carried(joint[k], [pair[k] for pair in encoder])
        assert torch.allclose(s.chains[m], chain, atol=ATOL, rtol=0), m
        assert torch.allclose(s.decoder_shares[m], share, atol=ATOL, rtol=0), m
    wrong, _ = carried(joint[2], [pair[1] for pair in encoder])
    assert float((s.chains[TokenMethod.ALTI][0] - wrong[0]).abs().max()) > 1e-3


# ---- families beyond the zoo: built from a config, decomposed by the rows added here ---------

# family → (config class, extra config, the norm before attention, the norm on the attention
# output (None: none), the module whose output the layer adds last: the block's output is the
# layer's output minus it, a read no row of attnviz uses)
BEYOND = {
    "arcee": ("ArceeConfig", {}, "input_layernorm", None, "mlp"),
    "glm": ("GlmConfig", {"head_dim": 8}, "input_layernorm", None, "mlp"),
    "seed_oss": ("SeedOssConfig", {"head_dim": 8}, "input_layernorm", None, "mlp"),
    "ministral": ("MinistralConfig", {"sliding_window": 4, "head_dim": 8}, "input_layernorm",
                  None, "mlp"),
    "apertus": ("ApertusConfig", {}, "attention_layernorm", None, "mlp"),
    "olmo3": ("Olmo3Config", {"sliding_window": 4}, None, "post_attention_layernorm",
              "post_feedforward_layernorm"),
    "exaone4": ("Exaone4Config", {"sliding_window": 4}, None, "post_attention_layernorm",
                "post_feedforward_layernorm"),
    "glm4": ("Glm4Config", {"head_dim": 8}, "input_layernorm", "post_self_attn_layernorm",
             "post_mlp_layernorm"),
    # parallel: x + attn(norm(x)) + mlp(norm(x))
    "cohere2": ("Cohere2Config", {"sliding_window": 4}, "input_layernorm", None, "mlp"),
}


@pytest.fixture(scope="module")
def beyond(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import zoo

    made = {}
    for name, (config, extra, *_) in BEYOND.items():
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config)(**{**zoo._DECODER, **extra}),
            attn_implementation="eager")
        zoo.randomize(model, zoo.Kind(lambda: None, ""))
        model.eval().save_pretrained(folder)
        zoo.save_tokenizer(folder, zoo.Kind(lambda: None, ""))
        made[name] = folder
    return made


@pytest.mark.parametrize("name", list(BEYOND))
def test_families_beyond_the_zoo_decompose_as_recomputed_here(beyond, name):
    """Each family's terms formed here (the value projection on the layer's own normed input,
    a norm on the attention output frozen at the whole output's scale) add up to the block's
    output read as the layer's output minus its last branch (≤ 1e-5); norms and ALTI composed
    by full products equal the command's. Negative control: the residual left out of the
    self terms breaks the identity."""
    _, _, norm_in, out_norm, last = BEYOND[name]
    text = "the cat sat on the mat the cat"
    result = run_tokens(TokensRequest([text], model=str(beyond[name]),
                                      methods=(TokenMethod.NORMS, TokenMethod.ALTI),
                                      check=False))
    s = result.sentences[0]
    model, tokenizer, _ = load(beyond[name])
    ids = torch.tensor([list(tokenizer(text)["input_ids"])])
    layers = model.model.layers
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    branches: list[torch.Tensor] = []
    handles = []
    for layer in layers:
        handles += [
            layer.register_forward_pre_hook(
                lambda m, a, k: inputs.append((a[0] if a else k["hidden_states"])[0]),
                with_kwargs=True),
            layer.register_forward_hook(
                lambda m, a, o: outputs.append((o[0] if isinstance(o, tuple) else o)[0])),
            layer.get_submodule(last).register_forward_hook(
                lambda m, a, o: branches.append(o[0]))]
    try:
        with torch.no_grad():
            maps = [a[0] for a in model(input_ids=ids, output_attentions=True).attentions]
    finally:
        for h in handles:
            h.remove()
    pairs = []
    with torch.no_grad():
        for layer, x, A, out, branch in zip(layers, inputs, maps, outputs, branches,
                                            strict=True):
            attention = layer.self_attn
            normed = x if norm_in is None else layer.get_submodule(norm_in)(x[None])[0]
            U = per_head(attention.v_proj(normed[None])[0], attention.o_proj.weight, A.shape[0])
            bias = attention.o_proj.bias
            if out_norm is None:
                T = raw_terms(A, U, bias, x)
            else:
                T = raw_terms(A, U, bias, None)
                norm = layer.get_submodule(out_norm)
                scale = (T.sum(1).pow(2).mean(-1) + norm.variance_epsilon).rsqrt()
                T = T * scale[:, None, None] * norm.weight.double()
                i = torch.arange(T.shape[0])
                T[i, i] += x.double()
            own = (out - branch).double()
            assert float((T.sum(1) - own).norm() / own.norm()) <= 1e-5
            i = torch.arange(T.shape[0])
            bare = T.clone()
            bare[i, i] -= x.double()
            assert float((bare.sum(1) - own).norm() / own.norm()) > 1e-3
            pairs.append(contributions(T))
    p = s.position
    assert p == ids.shape[1] - 1 and result.causal
    for k, m in enumerate((TokenMethod.NORMS, TokenMethod.ALTI)):
        want = product_row([pair[k] for pair in pairs], p)
        assert torch.allclose(s.chains[m][0], want, atol=ATOL, rtol=0), m


def test_export_holds_the_decoders_view(folders, tmp_path):
    """--export of a --target run, read back with safetensors: every chain, each method's
    share on the decoder's own tokens and the decoder's tokens equal --json's. Negative
    control: a run without --target writes no decoder share."""
    import json

    from safetensors import safe_open

    from attnviz.app.tokens_export import write_export

    result = run_tokens(TokensRequest(["the cat sat on the mat"], model=str(folders["t5"]),
                                      targets=("a dog ran",)))
    path = tmp_path / "cross.safetensors"
    write_export(result, path)
    doc = result.to_json()["sentences"][0]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert json.loads(meta["decoder_tokens"]) == [doc["decoder_tokens"]]
        for m in result.methods:
            share = f.get_tensor(f"s0.{m}.decoder_share")
            assert torch.allclose(share, torch.tensor(doc["decoder_shares"][str(m)],
                                                      dtype=torch.float64))
        assert torch.equal(f.get_tensor("s0.rollout")[0],
                           torch.tensor(doc["scores"]["rollout"], dtype=torch.float64))
    plain = tmp_path / "plain.safetensors"
    write_export(run_tokens(TokensRequest(["the cat sat"], check=False)), plain)
    with safe_open(str(plain), "pt") as f:
        assert not any("decoder_share" in k for k in f.keys())
        assert "decoder_tokens" not in f.metadata()


def test_a_word_missing_from_one_of_several_sentences_names_that_sentence(cli):
    """--file or several sentences: the refusal says which sentence lacks the word, or is too
    short for the index (exit 2); one sentence keeps "the sentence"."""
    several = cli("tokens", "the cat sat", "a dog ran", "--position", "cat")
    assert several.exit_code == 2 and "not in sentence 2" in several.output
    short = cli("tokens", "the cat sat on the mat", "a dog", "--position", "4")
    assert short.exit_code == 2 and "sentence 2 has 2 tokens" in short.output
    one = cli("tokens", "a dog ran", "--position", "cat")
    assert one.exit_code == 2 and "not in the sentence" in one.output


def test_flow_past_its_limit_is_refused_before_the_weights_load(folders, monkeypatch):
    """--method flow on a sentence past the token limit (one stack, and the decoder's view
    over T + S nodes) is refused from the token counts, before any weight is read. Negative
    control: within the limit the run goes on to load the model."""
    from attnviz.errors import UsageError
    from attnviz.sources.hf import token_contributions

    class Loaded(Exception):
        pass

    def load_runner(*args: Any, **kwargs: Any) -> Any:
        raise Loaded

    monkeypatch.setattr(token_contributions, "load_runner", load_runner)
    long = " ".join(["the cat sat on the mat"] * 9)  # 54 words
    flow = (TokenMethod.FLOW,)
    with pytest.raises(UsageError, match="past its limit"):
        run_tokens(TokensRequest([long], model=str(folders["minilm"]), methods=flow))
    half = " ".join(["the cat sat on the mat"] * 5)  # 30 + 30 nodes
    with pytest.raises(UsageError, match="past its limit"):
        run_tokens(TokensRequest([half], model=str(folders["t5"]), targets=(half,),
                                 methods=flow))
    with pytest.raises(Loaded):
        run_tokens(TokensRequest([half], model=str(folders["t5"]), methods=flow))
    with pytest.raises(Loaded):  # flow not asked for: left out later, with a note
        run_tokens(TokensRequest([long], model=str(folders["minilm"])))


def test_the_python_api_gives_the_decoders_view(folders):
    """attnviz.api.tokens(targets=[...]) equals the use case with --target; a bare string is
    refused as for sentences. Negative control: without targets the encoder's own view."""
    import json

    from attnviz import api

    got = api.tokens(["the cat sat on the mat"], model=folders["t5"], targets=["a dog ran"])
    want = run_tokens(TokensRequest(["the cat sat on the mat"], model=str(folders["t5"]),
                                    targets=("a dog ran",)))
    assert json.dumps(got.to_json()) == json.dumps(want.to_json())  # NaN written alike
    assert got.sentences[0].output_tokens is not None
    with pytest.raises(TypeError, match="targets must be a list"):
        api.tokens(["the cat sat"], model=folders["t5"], targets="a dog")
    encoder = api.tokens(["the cat sat on the mat"], model=folders["t5"], check=False)
    assert encoder.sentences[0].output_tokens is None
