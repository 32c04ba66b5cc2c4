"""`attnviz ablate`: every scorecard number equals the same ablation done independently — the head's
W_O columns zeroed in the weights (for `mean`: those columns folded into the output bias with
the head's mean output) and the model run as it was trained or as transformers runs it — with
negative controls (a different head's columns), and the bundled model's induction circuit.
Losses and divergences of the references are float64 from the logits, as attnviz's are."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


def _tiny_model():
    """The bundled model as sample_weights/train_induction.py defines and trains it."""
    from safetensors.torch import load_file

    from attnviz.data import BUNDLED

    spec = importlib.util.spec_from_file_location(
        "train_induction", ROOT / "sample_weights" / "train_induction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TinyAttnModel(module.VOCAB_SIZE, module.MAX_POSITIONS, module.EMBED_DIM,
                                 module.NUM_LAYERS, module.NUM_HEADS)
    model.load_state_dict(load_file(str(BUNDLED)))
    return model.eval()


def _ids(sentences):
    from attnviz.compute.forward_pass.inputs import make_batch
    from attnviz.core.words import hashed_ids

    return [hashed_ids(tokens, 1024) for tokens in make_batch(sentences, 256, 64, None).tokens]


def _reference(model, ids_list, removed=None, mean=None):
    """(final hidden per sentence, next-token losses per sentence) with `removed` = (layer,
    head) zeroed in W_O (mean: W_O[:, cols] · mean folded into its bias)."""
    d = model.embed.embedding_dim // model.layers[0].self_attn.num_heads
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if removed is not None:
        layer, head = removed
        out = model.layers[layer].self_attn.out_proj
        with torch.no_grad():
            cols = slice(head * d, (head + 1) * d)
            if mean is not None:
                out.bias += out.weight[:, cols] @ mean
            out.weight[:, cols] = 0
    hidden, losses = [], []
    with torch.no_grad():
        for ids in ids_list:
            t = torch.tensor([ids])
            final = model.ln_f(model.residual(t))
            logits = final @ model.unembed.weight.T
            hidden.append(final[0])
            losses.append(torch.nn.functional.cross_entropy(logits[0, :-1].double(), t[0, 1:],
                                                            reduction="none"))
    model.load_state_dict(state)
    return hidden, losses


def _measures(base, other, repeats):
    hidden_b, loss_b = base
    hidden_o, loss_o = other
    change = torch.cat([(o - b).norm(dim=-1) / b.norm(dim=-1)
                        for b, o in zip(hidden_b, hidden_o, strict=True)]).mean()
    loss = torch.cat(loss_o).mean() - torch.cat(loss_b).mean()
    rep = torch.cat([lo[r] for lo, r in zip(loss_o, repeats, strict=True)]).mean() - \
        torch.cat([lb[r] for lb, r in zip(loss_b, repeats, strict=True)]).mean()
    return float(change), float(loss), float(rep)


def _repeats(ids_list):
    """Per sentence: prediction t whose target t+1 repeats a token at some j ≤ t."""
    out = []
    for ids in ids_list:
        out.append(torch.tensor([ids[t + 1] in ids[:t + 1] for t in range(len(ids) - 1)]))
    return out


@pytest.fixture(scope="module")
def probe_scorecard():
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.core.probe import induction_probe

    sentences = induction_probe()
    return sentences, run_heatmap(HeatmapRequest.build(sentences=tuple(sentences), ablate="zero",
                                                       device="cpu"))


def test_bundled_scorecard_equals_editing_the_weights(probe_scorecard):
    sentences, result = probe_scorecard
    model = _tiny_model()
    ids = _ids(sentences)
    repeats = _repeats(ids)
    base = _reference(model, ids)
    report = result.ablation
    assert report is not None and len(report.effects) == 4
    for effect in report.effects:
        expected = _measures(base, _reference(model, ids, (effect.layer, effect.head)), repeats)
        got = (effect.hidden_change, effect.loss_change, effect.repeat_loss_change)
        assert got == pytest.approx(expected, abs=TOL, rel=TOL), effect
        other = (effect.layer, 1 - effect.head)  # negative control: the other head removed
        wrong = _measures(base, _reference(model, ids, other), repeats)
        assert abs(wrong[2] - effect.repeat_loss_change) > 0.01
    assert report.base_loss == pytest.approx(float(torch.cat(base[1]).mean()), abs=TOL)


def test_bundled_induction_circuit_shows(probe_scorecard):
    """What the circuit predicts, measured: the previous-token head L0.1 matters by far the
    most on the repeated half; either induction head alone costs little."""
    _, result = probe_scorecard
    report = result.ablation
    rep = {(e.layer, e.head): e.repeat_loss_change for e in report.effects}
    assert rep[(0, 1)] > 3 * max(abs(v) for k, v in rep.items() if k != (0, 1))
    assert rep[(0, 1)] > 3.0
    assert abs(rep[(1, 0)]) < 1.0 and abs(rep[(1, 1)]) < 1.0
    labels = {(s.layer, s.head): s.label for s in result.head_stats}
    assert labels[(1, 0)] == labels[(1, 1)] == "induction"  # pattern ranking: layer 1 first
    causal = result.ranking()[-1]
    assert causal.head_type == "causal (ablation)"
    assert (causal.heads[0].layer, causal.heads[0].head) == (0, 1)


def test_bundled_mean_ablation_equals_folding_the_mean_into_the_bias():
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    sentences = ["red fox jumps high red fox jumps high", "one two three one two three"]
    result = run_heatmap(HeatmapRequest.build(sentences=tuple(sentences), ablate="mean",
                                              device="cpu", head=0))
    model = _tiny_model()
    ids = _ids(sentences)
    base = _reference(model, ids)
    d = 32
    for effect in result.ablation.effects:
        mean = _head_mean(model, ids, effect.layer, effect.head, d)
        got = (effect.hidden_change, effect.loss_change)
        expected = _measures(base, _reference(model, ids, (effect.layer, effect.head), mean),
                             _repeats(ids))[:2]
        assert got == pytest.approx(expected, abs=TOL, rel=TOL)
        zeroed = _measures(base, _reference(model, ids, (effect.layer, effect.head)),
                           _repeats(ids))[:2]
        assert got != pytest.approx(zeroed, abs=TOL, rel=TOL)  # negative control: zero ≠ mean


def _head_mean(model, ids_list, layer, head, d):
    """The head's output (its slice of the W_O input) averaged over every real token."""
    rows = []
    with torch.no_grad():
        for ids in ids_list:
            t = torch.tensor([ids])
            L = t.shape[1]
            x = model.embed(t) + model.pos_embed(torch.arange(L))
            mask = torch.ones(L, L, dtype=torch.bool).triu(1)
            for i, block in enumerate(model.layers):
                if i == layer:
                    h = block.ln(x)
                    mha = block.self_attn
                    _, w = mha(h, h, h, attn_mask=mask, need_weights=True,
                               average_attn_weights=False)
                    E = h.shape[-1]
                    v = h @ mha.in_proj_weight[2 * E:].T + mha.in_proj_bias[2 * E:]
                    rows.append(w[0, head] @ v[0, :, head * d:(head + 1) * d])
                    break
                x, _ = block(x, mask)
    return torch.cat(rows).mean(0)


def test_standalone_layer_hidden_change(tmp_path):
    from safetensors.torch import save_file

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.core.request import HeadHints

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    path = tmp_path / "mha.safetensors"
    save_file({k: v.contiguous() for k, v in mha.state_dict().items()}, str(path))
    result = run_heatmap(HeatmapRequest.build(sentences=("a b c d e", "f g h"), weights=path,
                                              hints=HeadHints(4),
                                    ablate="zero", keep_full_maps=True))
    x = result.run.layers[0].inputs
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        base, _ = mha(x, x, x, key_padding_mask=~real)
        for effect in result.ablation.effects:
            def edited(head):
                saved = mha.out_proj.weight.clone()
                mha.out_proj.weight[:, head * 4:(head + 1) * 4] = 0
                out, _ = mha(x, x, x, key_padding_mask=~real)
                mha.out_proj.weight.copy_(saved)
                return float(((out - base).norm(dim=-1) / base.norm(dim=-1))[real].mean())
            assert effect.hidden_change == pytest.approx(edited(effect.head), rel=TOL)
            assert effect.hidden_change != pytest.approx(edited((effect.head + 1) % 4),
                                                         rel=TOL)
            assert effect.loss_change is None


@pytest.mark.slow
def test_cli_scorecard_json_and_figure(cli, tmp_path):
    out = tmp_path / "maps.png"
    result = cli("ablate", "--probe", "induction", "--json", "--out", out)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [(a["layer"], a["head"]) for a in doc["ablation"]] == [(0, 0), (0, 1), (1, 0),
                                                                   (1, 1)]
    assert all(set(a) >= {"layer", "head", "hidden_change", "loss_change"}
               for a in doc["ablation"])
    assert (tmp_path / "maps.ablation.png").is_file()
    shown = cli("ablate", "--probe", "induction", "--no-maps", "--no-stats",
                "--overview", "ablation")
    assert shown.exit_code == 0, shown.output
    assert "causal head scorecard" in shown.output and "overview: ablation" in shown.output
    refused = cli("heatmap", "a b c", "--overview", "ablation")
    assert refused.exit_code == 2


def test_the_scorecard_figure_never_overwrites_an_input(cli, tmp_path):
    """--out x.png with --ablate also writes x.ablation.png: that name is checked against the
    inputs before the run, like every other output (negative control: without --ablate the
    same --out is fine)."""
    from helpers import assert_clean_error

    sentences = tmp_path / "maps.ablation.png"
    sentences.write_text("the cat sat on the mat the cat sat\n")
    before = sentences.read_bytes()
    result = cli("ablate", "-f", sentences, "--out", tmp_path / "maps.png")
    assert_clean_error(result, 1, "never overwrites its inputs")
    assert sentences.read_bytes() == before and not (tmp_path / "maps.png").exists()
    fine = cli("heatmap", "-f", sentences, "--out", tmp_path / "maps.png")
    assert fine.exit_code == 0, fine.output
    assert sentences.read_bytes() == before


# --- Hugging Face: the model's own forward, with its LM head ---------------------------------

def _o_weight(model, kind, layer):
    if kind == "gpt2":
        return model.transformer.h[layer].attn.c_proj.weight, True  # Conv1D (in, out): rows
    return model.model.layers[layer].self_attn.o_proj.weight, False


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind,cls", [("gpt2", "GPT2LMHeadModel"),
                                      ("llama", "LlamaForCausalLM")])
def test_hf_causal_lm_scorecard_equals_editing_the_weights(kind, cls, tmp_path):
    import transformers
    from zoo import build_lm

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder = build_lm(kind, tmp_path / kind, cls)
    sentences = ["the cat sat on the mat"]
    result = run_heatmap(HeatmapRequest.build(sentences=tuple(sentences), model=str(folder),
                                              ablate="zero", device="cpu"))
    report = result.ablation
    assert report.loss_kind == "next-token loss" and len(report.effects) == 8
    model = getattr(transformers, cls).from_pretrained(folder).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    ids = torch.tensor([tok(sentences[0])["input_ids"]])

    def run_model():
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1].double(), ids[0, 1:])
        return out.hidden_states[-1][0], float(loss)

    base_h, base_loss = run_model()
    d = model.config.hidden_size // model.config.num_attention_heads

    def removed(layer, head):
        weight, rows = _o_weight(model, kind, layer)
        saved = weight.detach().clone()
        with torch.no_grad():
            if rows:
                weight[head * d:(head + 1) * d] = 0
            else:
                weight[:, head * d:(head + 1) * d] = 0
        h, loss = run_model()
        with torch.no_grad():
            weight.copy_(saved)
        return float(((h - base_h).norm(dim=-1) / base_h.norm(dim=-1)).mean()), loss - base_loss

    for effect in report.effects:
        expected = removed(effect.layer, effect.head)
        assert (effect.hidden_change, effect.loss_change) == pytest.approx(expected, rel=1e-3,
                                                                           abs=1e-4)
        wrong = removed(effect.layer, (effect.head + 1) % 4)
        assert (effect.hidden_change, effect.loss_change) != pytest.approx(wrong, rel=1e-3,
                                                                           abs=1e-4)


@pytest.mark.hf
@pytest.mark.slow
def test_hf_mean_ablation_over_several_forwards_equals_a_mean_hook(tmp_path, monkeypatch):
    """`mean` on a LLaMA with two sentences of different lengths (padded in attnviz's batch),
    three copies per forward (the unablated run and two heads, then three heads at a time):
    each head's hidden and loss changes equal running transformers' model one sentence at a
    time, its head's W_O input replaced by the mean over both sentences' tokens of the
    unablated run; the next head's (the control) differ."""
    import transformers
    from zoo import build_lm

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.sources.hf import ablation

    monkeypatch.setattr(ablation, "MAX_COPIES", 3)
    folder = build_lm("llama", tmp_path / "llama", "LlamaForCausalLM")
    sentences = ["the cat sat on the mat", "a dog ran"]
    report = run_heatmap(HeatmapRequest.build(sentences=tuple(sentences), model=str(folder),
                                              ablate="mean", device="cpu")).ablation
    assert report.copies_per_forward == 3 and len(report.effects) == 8
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    ids_list = [torch.tensor([tok(s)["input_ids"]]) for s in sentences]
    d = model.config.hidden_size // model.config.num_attention_heads

    def run_all(layer=None, edit=None):
        hidden, losses = [], []
        module = model.model.layers[layer or 0].self_attn.o_proj
        handle = module.register_forward_pre_hook(edit) if edit else None
        with torch.no_grad():
            for ids in ids_list:
                out = model(ids, output_hidden_states=True)
                hidden.append(out.hidden_states[-1][0])
                losses.append(torch.nn.functional.cross_entropy(
                    out.logits[0, :-1].double(), ids[0, 1:], reduction="none"))
        if handle:
            handle.remove()
        return hidden, torch.cat(losses).mean()

    base_h, base_loss = run_all()

    def removed(layer, head):
        seen = []
        run_all(layer, lambda m, args: seen.append(args[0][0]))
        mean = torch.cat(seen).mean(0)
        cols = slice(head * d, (head + 1) * d)

        def replace(m, args):
            x = args[0].clone()
            x[..., cols] = mean[cols]
            return (x,)
        hidden, loss = run_all(layer, replace)
        change = torch.cat([(h - b).norm(dim=-1) / b.norm(dim=-1)
                            for h, b in zip(hidden, base_h, strict=True)]).mean()
        return float(change), float(loss - base_loss)

    for effect in report.effects:  # mean-ablation effects are small: absolute tolerances too
        hidden, loss = removed(effect.layer, effect.head)
        assert effect.hidden_change == pytest.approx(hidden, rel=1e-3, abs=1e-6)
        assert effect.loss_change == pytest.approx(loss, abs=1e-5)
        wrong, _ = removed(effect.layer, (effect.head + 1) % 4)
        assert effect.hidden_change != pytest.approx(wrong, rel=1e-2)


@pytest.mark.hf
@pytest.mark.slow
def test_hf_base_model_has_hidden_changes_only(zoo_model):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    result = run_heatmap(HeatmapRequest.build(sentences=("the cat sat on the mat",),
                                              model=str(zoo_model("bert")),
                                    ablate="zero", device="cpu", layer="0"))
    report = result.ablation
    assert report.loss_kind is None and len(report.effects) == 4
    assert all(e.loss_change is None and e.hidden_change > 0 for e in report.effects)
    assert result.to_json()["ablation"][0]["loss_change"] is None


@pytest.mark.hf
@pytest.mark.slow
def test_hf_masked_lm_kl_equals_editing_the_weights(tmp_path):
    """A masked LM head: loss_change is the mean KL(p ‖ p′) of the output distributions."""
    import transformers
    from zoo import build_lm

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder = build_lm("bert", tmp_path / "bert", "BertForMaskedLM")
    sharp = transformers.BertForMaskedLM.from_pretrained(folder)
    with torch.no_grad():  # outputs far from uniform: KL values well above round-off
        sharp.cls.predictions.transform.dense.weight.mul_(30)
        sharp.cls.predictions.bias.normal_(0, 3)
    sharp.save_pretrained(folder)
    sentence = "the cat sat on the mat"
    result = run_heatmap(HeatmapRequest.build(sentences=(sentence,), model=str(folder),
                                              ablate="zero", device="cpu", layer="1"))
    report = result.ablation
    assert report.loss_kind == "KL divergence" and len(report.effects) == 4
    model = transformers.BertForMaskedLM.from_pretrained(folder).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    feed = tok(sentence, return_tensors="pt")
    with torch.no_grad():  # float64 from the logits on, as attnviz computes divergences
        base = torch.log_softmax(model(**feed).logits[0].double(), -1)
    d = 8

    def kl(head):
        weight = model.bert.encoder.layer[1].attention.output.dense.weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight[:, head * d:(head + 1) * d] = 0
            other = torch.log_softmax(model(**feed).logits[0].double(), -1)
            weight.copy_(saved)
        return float((base.exp() * (base - other)).sum(-1).mean())

    for effect in report.effects:
        assert effect.layer == 1
        assert effect.loss_change > 1e-6
        assert effect.loss_change == pytest.approx(kl(effect.head), rel=1e-2, abs=1e-9)
        assert effect.loss_change != pytest.approx(kl((effect.head + 1) % 4), rel=1e-2,
                                                   abs=1e-9)


@pytest.mark.hf
@pytest.mark.slow
def test_hf_encoder_decoder_scorecard_equals_editing_the_weights(zoo_model):
    """BART (no LM head) with targets: the decoder's final hidden states, heads of an encoder
    layer and of a cross-attention layer removed by zeroing their out_proj columns."""
    import transformers
    from zoo import load_tokenizer

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder = zoo_model("bart")
    sentence, target = "the cat sat on the mat", "the red barn"
    result = run_heatmap(HeatmapRequest.build(sentences=(sentence,), model=str(folder),
                                              ablate="zero", device="cpu", targets=(target,),
                                              layer="enc 1,cross 0"))
    report = result.ablation
    assert report.loss_kind is None and len(report.effects) == 8
    model = transformers.BartModel.from_pretrained(folder).eval()
    tok = load_tokenizer(folder)
    ids = tok(sentence, return_tensors="pt")["input_ids"]
    dec = torch.tensor([[model.config.decoder_start_token_id,
                         *tok(target)["input_ids"]]])

    def run():
        with torch.no_grad():
            return model(input_ids=ids, decoder_input_ids=dec).last_hidden_state[0]

    base = run()
    modules = {"enc 1": model.encoder.layers[1].self_attn.out_proj,
               "cross 0": model.decoder.layers[0].encoder_attn.out_proj}

    def removed(label, head):
        weight = modules[label].weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight[:, head * 8:(head + 1) * 8] = 0
        h = run()
        with torch.no_grad():
            weight.copy_(saved)
        return float(((h - base).norm(dim=-1) / base.norm(dim=-1)).mean())

    assert {e.label for e in report.effects} == {"enc 1", "cross 0"}
    for effect in report.effects:
        assert effect.hidden_change == pytest.approx(removed(effect.label, effect.head),
                                                     rel=1e-3, abs=1e-8)
        other = "cross 0" if effect.label == "enc 1" else "enc 1"  # the same head elsewhere
        assert effect.hidden_change != pytest.approx(removed(other, effect.head), rel=1e-3,
                                                     abs=1e-6)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind,path", [("gemma", "layers.{i}.self_attn.o_proj"),
                                       ("gpt_neox", "layers.{i}.attention.dense"),
                                       ("phi3", "layers.{i}.self_attn.o_proj"),
                                       ("opt", "decoder.layers.{i}.self_attn.out_proj")])
def test_hf_base_model_scorecards_equal_editing_the_weights(kind, path, zoo_model):
    """MQA (gemma), interleaved (gpt_neox), fused qkv (phi3), OPT: hidden changes only."""
    import transformers
    from zoo import ZOO, load_tokenizer

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder = zoo_model(kind)
    sentence = "the cat sat on the mat"
    result = run_heatmap(HeatmapRequest.build(sentences=(sentence,), model=str(folder),
                                              ablate="zero", device="cpu", layer="1"))
    model = getattr(transformers, ZOO[kind].model_class).from_pretrained(folder).eval()
    feed = load_tokenizer(folder)(sentence, return_tensors="pt")

    def run():
        with torch.no_grad():
            return model(**feed).last_hidden_state[0]

    base = run()
    weight = model.get_submodule(path.format(i=1)).weight
    d = weight.shape[1] // 4

    def removed(head):
        saved = weight.detach().clone()
        with torch.no_grad():
            weight[:, head * d:(head + 1) * d] = 0
        h = run()
        with torch.no_grad():
            weight.copy_(saved)
        return float(((h - base).norm(dim=-1) / base.norm(dim=-1)).mean())

    effects = result.ablation.effects
    assert len(effects) == 4 and all(e.loss_change is None for e in effects)
    for effect in effects:
        assert effect.hidden_change == pytest.approx(removed(effect.head), rel=1e-3, abs=1e-7)
        assert effect.hidden_change != pytest.approx(removed((effect.head + 1) % 4), rel=1e-3,
                                                     abs=1e-7)
