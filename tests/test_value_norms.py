"""--weighting norm: every exported norm.{layer} equals α_ij · ‖W_O[:, cols(h)] (W_V x_j + b_V)‖
computed independently from the exported inputs.{layer} and the weights (read straight from the
checkpoint or the model's own modules), each with a negative control (the wrong head's W_O)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4


def _read(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _expected(attn, values, wo_blocks, groups):
    """attn (B, H, L, S); values (B, H_kv, S, d); wo_blocks (H, E, d); groups[h] = kv head."""
    out = torch.empty_like(attn)
    for h, g in enumerate(groups):
        written = values[:, g] @ wo_blocks[h].T  # (B, S, E): what head h writes from each key
        out[:, h] = attn[:, h] * written.norm(dim=-1)[:, None, :]
    return out


def _close(a, b, tol=TOL):
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def _mha_checkpoint(tmp_path, E=16, H=4, seed=3):
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_(0, 0.5)
        mha.out_proj.bias.normal_(0, 0.5)
    state = {k: v.contiguous() for k, v in mha.state_dict().items()}
    path = tmp_path / "mha.safetensors"
    save_file(state, str(path))
    return path, state


def test_standalone_layer_norms_match_an_independent_computation(cli, tmp_path):
    path, state = _mha_checkpoint(tmp_path)
    out = tmp_path / "x.safetensors"
    result = cli("heatmap", "the cat sat on the mat .", "a dog ran", "--weights", path, "-H",
                 "4", "--weighting", "norm", "--export", out, "--quiet")
    assert result.exit_code == 0, result.output
    tensors, metadata = _read(out)
    assert metadata["weighting"] == "norm"
    E, H, d = 16, 4, 4
    x, attn = tensors["inputs.0"], tensors["attn.0"]
    W_v, b_v = state["in_proj_weight"][2 * E:], state["in_proj_bias"][2 * E:]
    v = (x @ W_v.T + b_v).view(*x.shape[:2], H, d).transpose(1, 2)  # (B, H, S, d)
    W_o = state["out_proj.weight"]
    blocks = torch.stack([W_o[:, h * d:(h + 1) * d] for h in range(H)])
    expected = _expected(attn, v, blocks, list(range(H)))
    assert _close(tensors["norm.0"], expected)
    wrong = _expected(attn, v, blocks.roll(1, 0), list(range(H)))  # negative control
    assert not _close(tensors["norm.0"], wrong)


def test_displayed_rows_are_the_norms_normalized(tmp_path):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    path, _ = _mha_checkpoint(tmp_path)
    job = HeatmapRequest.build(sentences=("one two three four five",), weights=path,
                     hints=__import__("attnviz.recognize.base", fromlist=["HeadHints"])
                     .HeadHints(4), weighting="norm", keep_full_maps=True)
    result = run_heatmap(job)
    layer = result.run.layers[0]
    weighting = layer.weighting
    raw = weighting.attention_weights * weighting.value_norms[:, :, None, :]
    assert _close(layer.weights, raw / raw.sum(-1, keepdim=True))
    assert _close(layer.weights.sum(-1), torch.ones_like(layer.weights.sum(-1)))
    assert not _close(layer.weights, weighting.attention_weights)  # not the attention itself
    assert result.to_json()["weighting"] == "norm"
    assert any("weighting norm" in note for note in result.run.notes)


def test_bundled_model_norms(cli, tmp_path):
    from safetensors.torch import load_file

    from attnviz.data import BUNDLED

    out = tmp_path / "b.safetensors"
    result = cli("heatmap", "--probe", "induction", "--weighting", "norm", "--export", out,
                 "--quiet")
    assert result.exit_code == 0, result.output
    tensors, _ = _read(out)
    weights = load_file(str(BUNDLED))
    E = weights["embed.weight"].shape[1]
    H, d = 2, E // 2
    for i in (0, 1):
        x, attn = tensors[f"inputs.{i}"], tensors[f"attn.{i}"]
        prefix = f"layers.{i}.self_attn."
        W_v = weights[prefix + "in_proj_weight"][2 * E:]
        b_v = weights[prefix + "in_proj_bias"][2 * E:]
        v = (x @ W_v.T + b_v).view(*x.shape[:2], H, d).transpose(1, 2)
        W_o = weights[prefix + "out_proj.weight"]
        blocks = torch.stack([W_o[:, h * d:(h + 1) * d] for h in range(H)])
        assert _close(tensors[f"norm.{i}"], _expected(attn, v, blocks, [0, 1]))
        assert not _close(tensors[f"norm.{i}"], _expected(attn, v, blocks.flip(0), [0, 1]))


def test_terminal_and_json_say_which_weighting(cli):
    shown = cli("heatmap", "a b c d", "--weighting", "norm", "--no-maps")
    assert shown.exit_code == 0, shown.output
    assert "weighting norm" in shown.output
    plain = cli("heatmap", "a b c d", "--no-maps", "--json")
    assert json.loads(plain.output)["weighting"] == "attention"


def test_unknown_weighting_is_a_usage_error(cli):
    from helpers import assert_clean_error

    assert_clean_error(cli("heatmap", "a b", "--weighting", "size"), 2, "--weighting")


# --- Hugging Face models: value states captured from the model's own attention call ---------

def _hf_parts(model, kind, i, x):
    """(values (B, H_kv, S, d), W_O blocks (H, E, d), kv group per head) from the model's own
    modules on its exported attention input x (B, S, E)."""
    cfg = model.config
    if kind == "gpt2":
        attn = model.h[i].attn
        H, E = cfg.n_head, cfg.n_embd
        d = E // H
        qkv = x @ attn.c_attn.weight + attn.c_attn.bias  # Conv1D: (in, out)
        v = qkv[..., 2 * E:].view(*x.shape[:2], H, d).transpose(1, 2)
        W_o = attn.c_proj.weight.T  # (out, in)
        groups = list(range(H))
    elif kind == "gpt_neox":
        attn = model.layers[i].attention
        H, E = cfg.num_attention_heads, cfg.hidden_size
        d = E // H
        qkv = attn.query_key_value(x).view(*x.shape[:2], H, 3 * d)  # interleaved per head
        v = qkv[..., 2 * d:].transpose(1, 2)
        W_o = attn.dense.weight
        groups = list(range(H))
    elif kind == "bart":
        attn = model.encoder.layers[i].self_attn
        H = cfg.encoder_attention_heads
        d = cfg.d_model // H
        v = attn.v_proj(x).view(*x.shape[:2], H, d).transpose(1, 2)
        W_o = attn.out_proj.weight
        groups = list(range(H))
    elif kind == "t5":  # no biases, relative position bias inside attention
        attn = model.encoder.block[i].layer[0].SelfAttention
        H, d = cfg.num_heads, cfg.d_kv
        v = attn.v(x).view(*x.shape[:2], H, d).transpose(1, 2)
        W_o = attn.o.weight
        groups = list(range(H))
    elif kind == "opt":
        attn = model.decoder.layers[i].self_attn
        H = cfg.num_attention_heads
        d = cfg.hidden_size // H
        v = attn.v_proj(x).view(*x.shape[:2], H, d).transpose(1, 2)
        W_o = attn.out_proj.weight
        groups = list(range(H))
    elif kind == "phi3":  # fused qkv_proj: [q (H·d) | k (H_kv·d) | v (H_kv·d)]
        attn = model.layers[i].self_attn
        H, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.hidden_size // H
        qkv = attn.qkv_proj(x)
        v = qkv[..., (H + H_kv) * d:].view(*x.shape[:2], H_kv, d).transpose(1, 2)
        W_o = attn.o_proj.weight
        groups = [h // (H // H_kv) for h in range(H)]
    else:  # llama-style GQA / MQA
        attn = model.layers[i].self_attn
        H, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        v = attn.v_proj(x).view(*x.shape[:2], H_kv, d).transpose(1, 2)
        W_o = attn.o_proj.weight
        groups = [h // (H // H_kv) for h in range(H)]
    blocks = torch.stack([W_o[:, h * d:(h + 1) * d] for h in range(len(groups))])
    return v, blocks, groups


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt2", "gpt_neox", "bart", "qwen2", "t5",
                                  "opt", "phi3", "mistral"])
def test_hf_norms_match_the_models_own_modules(kind, zoo_model, cli, tmp_path):
    """GQA (llama, qwen2, phi3), MQA (gemma, mistral), fused Conv1D (gpt2), fused Linear (phi3),
    interleaved (gpt_neox), LayerNorm and RMSNorm models, encoder-decoders (bart's and t5's
    encoders)."""
    import transformers

    folder = zoo_model(kind)
    out = tmp_path / f"{kind}.safetensors"
    result = cli("heatmap", "--model", folder, "the cat sat on the mat",
                 "a small dog ran far away", "--weighting", "norm", "--export", out, "--quiet",
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    tensors, _ = _read(out)
    from zoo import ZOO

    model = getattr(transformers, ZOO[kind].model_class).from_pretrained(folder).eval()
    with torch.no_grad():
        for i in (0, 1):
            x, attn = tensors[f"inputs.{i}"], tensors[f"attn.{i}"]
            v, blocks, groups = _hf_parts(model, kind, i, x)
            S = attn.shape[-1]
            expected = _expected(attn, v[:, :, :S], blocks, groups)
            assert _close(tensors[f"norm.{i}"], expected), kind
            assert not _close(tensors[f"norm.{i}"],
                              _expected(attn, v[:, :, :S], blocks.roll(1, 0), groups))


@pytest.mark.hf
def test_output_attentions_models_are_refused(zoo_model, cli):
    from helpers import assert_clean_error

    result = cli("heatmap", "--model", zoo_model("bloom"), "the cat sat", "--weighting", "norm",
                 "--device", "cpu")
    assert_clean_error(result, 2, "--weighting")


@pytest.mark.hf
@pytest.mark.slow
def test_hf_encoder_decoder_cross_and_decoder_norms(zoo_model, cli, tmp_path):
    """BART with --target: decoder self-attention (values from the target) and cross-attention
    (values from the encoder's output) against the model's own modules."""
    import transformers

    folder = zoo_model("bart")
    out = tmp_path / "bart.safetensors"
    sentences, targets = ["the cat sat on the mat", "a dog ran"], ["the red barn", "a dog"]
    result = cli("heatmap", "--model", folder, *sentences, "--target", targets[0], "--target",
                 targets[1], "--layer", "dec 0,cross 1", "--weighting", "norm", "--export",
                 out, "--quiet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    tensors, _ = _read(out)
    model = transformers.BartModel.from_pretrained(folder).eval()
    from zoo import load_tokenizer

    tok = load_tokenizer(folder)
    H, d = 4, 8
    with torch.no_grad():
        dec = model.decoder.layers[0].self_attn
        x, attn = tensors["inputs.decoder.0"], tensors["decoder.0"]
        v = dec.v_proj(x).view(*x.shape[:2], H, d).transpose(1, 2)
        blocks = torch.stack([dec.out_proj.weight[:, h * d:(h + 1) * d] for h in range(H)])
        assert _close(tensors["norm.decoder.0"], _expected(attn, v, blocks, list(range(H))))
        assert not _close(tensors["norm.decoder.0"],
                          _expected(attn, v, blocks.roll(1, 0), list(range(H))))
        cross = model.decoder.layers[1].encoder_attn
        attn = tensors["cross.1"]
        S = attn.shape[-1]
        for b, sentence in enumerate(sentences):
            ids = tok(sentence, return_tensors="pt")["input_ids"]
            enc = model.encoder(ids).last_hidden_state  # (1, n, E): each sentence alone
            n = enc.shape[1]
            v = cross.v_proj(enc).view(1, n, H, d).transpose(1, 2)
            blocks = torch.stack([cross.out_proj.weight[:, h * d:(h + 1) * d] for h in range(H)])
            expected = _expected(attn[b:b + 1, :, :, :n], v, blocks, list(range(H)))
            got = tensors["norm.cross.1"][b:b + 1, :, :, :n]
            assert _close(got, expected, 1e-3)
            assert float(tensors["norm.cross.1"][b, :, :, n:S].abs().max() if n < S else 0) == 0
            assert not _close(got, _expected(attn[b:b + 1, :, :, :n], v, blocks.roll(1, 0),
                                             list(range(H))), 1e-3)
