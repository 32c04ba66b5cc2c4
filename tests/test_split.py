"""The head split and its proof, checked against torch's own nn.MultiheadAttention."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import needs_safe_pickles

from attnviz.compute.forward_pass.forward import load_weights, per_head_forward, reshaped_forward
from attnviz.compute.splitting.split import (
    PROOF_TOLERANCE,
    make_report,
    prove_split,
    split_projections,
)
from attnviz.core.request import HeadHints, RandomSpec
from attnviz.load.store import DictStore
from attnviz.recognize import find_layers
from attnviz.sources.random_layer import random_mha

CASES = [  # (E, H, kdim, vdim, bias, add_bias_kv)
    (64, 8, None, None, True, False),
    (64, 1, None, None, True, False),
    (48, 6, None, None, False, False),
    (32, 4, 16, 24, True, False),
    (30, 5, 7, None, False, False),
    (64, 8, None, None, True, True),
    (256, 16, None, None, True, False),
]


def _module(E, H, kdim, vdim, bias, add_bias_kv, seed=0):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=add_bias_kv, kdim=kdim,
                                      vdim=vdim, batch_first=True).eval()
    if bias:
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return mha


def _layer(mha, H):
    store = DictStore(mha.state_dict())
    return find_layers(store, HeadHints(H)).layers[0], store


@pytest.mark.parametrize("case", CASES)
def test_per_head_recomputation_equals_torch_module(case):
    E, H, kdim, vdim, bias, add_bias_kv = case
    mha = _module(*case)
    layer, store = _layer(mha, H)
    weights = load_weights(layer, store)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, E, generator=gen)
    k = x if kdim is None else torch.randn(3, 5, kdim, generator=gen)
    v = x if vdim is None and kdim is None else torch.randn(3, k.shape[1], vdim or E,
                                                            generator=gen)
    padding = torch.zeros(3, k.shape[1], dtype=torch.bool)
    padding[1, -2:] = True
    with torch.no_grad():
        expected_out, expected_attn = mha(x, k, v, key_padding_mask=padding, need_weights=True,
                                          average_attn_weights=False)
    parts = per_head_forward(layer, weights, x, k, v, padding)
    torch.testing.assert_close(parts.out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts.attn, expected_attn, atol=1e-6, rtol=1e-5)
    out2, attn2 = reshaped_forward(layer, weights, x, k, v, padding)
    torch.testing.assert_close(out2, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn2, expected_attn, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_proof_passes_at_float32_round_off(case):
    layer, store = _layer(_module(*case), case[1])
    proof = prove_split(layer, load_weights(layer, store), seed=3)
    assert proof.passed
    assert proof.max_abs_diff < 1e-5 * proof.output_scale
    assert proof.reference.startswith("torch.nn.MultiheadAttention")


def test_proof_detects_a_wrong_split():
    """Giving head 0 the rows of head 1 (and back) must break the proof: the check can fail."""
    layer, store = _layer(_module(64, 8, None, None, True, False), 8)
    weights = load_weights(layer, store)

    class Shifted(type(layer)):
        def q_rows(self, head):
            swapped = {0: 1, 1: 0}.get(head, head)
            return super().q_rows(swapped)

        def o_cols(self, head):
            return super().q_rows(head)

    wrong = Shifted(**{f: getattr(layer, f) for f in layer.__dataclass_fields__})
    proof = prove_split(wrong, weights)
    assert not proof.passed
    assert proof.max_abs_diff > 100 * PROOF_TOLERANCE


def test_slices_equal_module_parameters():
    mha = _module(64, 8, None, None, True, False)
    layer, store = _layer(mha, 8)
    weights = load_weights(layer, store)
    E, d = 64, 8
    for h in range(8):
        rows = slice(h * d, (h + 1) * d)
        assert torch.equal(weights.W_q[rows], mha.in_proj_weight[h * d:(h + 1) * d])
        assert torch.equal(weights.W_k[rows], mha.in_proj_weight[E + h * d:E + (h + 1) * d])
        assert torch.equal(weights.W_v[rows],
                           mha.in_proj_weight[2 * E + h * d:2 * E + (h + 1) * d])
        assert torch.equal(weights.W_o[:, rows], mha.out_proj.weight[:, h * d:(h + 1) * d])
    projections = split_projections(layer)
    assert projections["k"].heads[3].stored_at == "in_proj_weight[88:96]"
    assert projections["o"].heads[3].stored_at == "out_proj.weight[:, 24:32]"


def test_random_init_is_torch_module_and_seeded():
    layer, store = random_mha(RandomSpec(embed_dim=32, num_heads=4, seed=5))
    torch.manual_seed(5)
    reference = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    assert torch.equal(store.read("in_proj_weight"), reference.in_proj_weight)
    assert layer.num_heads == 4 and layer.head_dim == 8


def test_non_finite_weights_are_refused():
    mha = _module(16, 2, None, None, True, False)
    state = mha.state_dict()
    state["in_proj_weight"][3, 3] = float("nan")
    layer, store = _layer_from_state(state, 2)
    from attnviz.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"tensor 'in_proj_weight' \(W_q of layer '[^']*'\) "
                       r"holds non-finite values \(1 NaN\)"):
        make_report(layer, store)
    state["in_proj_weight"][3, 3] = float("-inf")  # in W_q's rows too, counted as Inf
    with pytest.raises(CheckpointError, match=r"\(1 Inf\)"):
        make_report(*_layer_from_state(state, 2))
    state["in_proj_weight"][3, 3] = 0.5  # control: finite weights pass
    make_report(*_layer_from_state(state, 2))


def _layer_from_state(state, H):
    store = DictStore(state)
    return find_layers(store, HeadHints(H)).layers[0], store


def _json(cli, *args):
    result = cli("split", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("E,H,kdim,vdim", [(64, 8, None, None), (32, 4, 16, 24), (12, 3, 5, 7)])
def test_json_matches_torch_module_shapes(cli, E, H, kdim, vdim):
    args = ["-E", E, "-H", H] + (["--kdim", kdim, "--vdim", vdim] if kdim else [])
    doc = _json(cli, *args)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim)
    if kdim:
        q, k, v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    else:
        q, k, v = mha.in_proj_weight.chunk(3)
    d = E // H
    assert (doc["embed_dim"], doc["num_heads"], doc["head_dim"]) == (E, H, d)
    for name, param in (("q", q), ("k", k), ("v", v), ("o", mha.out_proj.weight)):
        proj = doc["projections"][name]
        assert proj["shape"] == list(param.shape)
        assert proj["split"] == ("columns" if name == "o" else "rows")
        assert [(h["start"], h["stop"]) for h in proj["heads"]] == [
            (h * d, (h + 1) * d) for h in range(H)]
        for h in proj["heads"]:
            expect = [param.shape[0], d] if name == "o" else [d, param.shape[1]]
            assert h["shape"] == expect
    assert doc["max_abs_diff"] <= 1e-5
    assert doc["proof"]["passed"] is True


def test_default_split_shows_heads_and_proof(cli):
    result = cli("split")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "W_q (64, 64) · split by rows" in out
    assert "W_o (64, 64) · split by columns" in out
    assert "in_proj_weight[24:32]" in out
    assert "H · d = 8 · 8 = 64 = E" in out
    assert "✓ equal to float32 round-off" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_kdim_view_says_not_square(cli):
    result = cli("split", "-E", "32", "-H", "4", "--kdim", "16", "--vdim", "24")
    assert result.exit_code == 0
    assert "W_k is 32 × 16 and W_v is 32 × 24, not square" in " ".join(result.stdout.split())


@pytest.mark.parametrize("flag", ["--out", "-o", "--png"])
def test_png_is_written_with_four_panels(cli, tmp_path, flag):
    """--out, as in every command; --png, its older name, still works."""
    from helpers import colored_runs, read_image

    out = tmp_path / "split.png"
    result = cli("split", "-E", "32", "-H", "4", flag, out)
    assert result.exit_code == 0, result.output
    image = read_image(out)
    height, width = image.shape[:2]
    assert width >= 800 and height >= 300
    assert image.std() > 0.05
    panels = [r for r in colored_runs(image, axis=1) if r[1] - r[0] > 0.08 * width]
    assert len(panels) == 4  # W_q, W_k, W_v, W_o (the colour bar is narrower)


@pytest.mark.parametrize("args,code,fragment", [
    (["-E", "50", "-H", "6"], 2, "choose --num-heads from 1, 2, 5, 10, 25, 50"),
    (["-E", "0"], 2, "--spec E= must be a positive integer"),
    (["--spec", "E=0"], 2, "--spec E= must be a positive integer"),
    (["--spec", "positions=sinusoidal"], 2, "unknown --spec key 'positions'"),
    (["--spec", "E=32", "-E", "32"], 2, "--spec E= is given twice"),
    (["--random", "--weights", "x.safetensors"], 2, "--random and --weights exclude"),
    (["-H", "-2"], 2, "--num-heads must be a positive integer"),
    (["--kdim", "0"], 2, "--spec kdim= must be a positive integer"),
    (["-E", "100000"], 2, "larger than"),
    (["-E", "abc"], 2, "--spec E="),
    (["--nope"], 2, "No such option"),
    (["--layer", "0"], 2, "need --weights"),
    (["--weights", "/nonexistent.safetensors"], 2, "no such file"),
    (["--png", "out.txt"], 2, "cannot tell the output format"),
    (["--out", "out.txt"], 2, "cannot tell the output format"),
    (["--out", "a.png", "--png", "b.png"], 2, "--png is the old name of --out"),
])
def test_bad_arguments(cli, args, code, fragment, tmp_path, monkeypatch):
    from helpers import assert_clean_error

    monkeypatch.chdir(tmp_path)
    assert_clean_error(cli("split", *args), code, fragment)
    assert list(tmp_path.iterdir()) == []


@needs_safe_pickles
def test_checkpoint_without_head_count_asks_for_it(cli, tmp_path):
    from helpers import assert_clean_error

    path = tmp_path / "mha.pt"
    torch.save(torch.nn.MultiheadAttention(16, 2).state_dict(), path)
    assert_clean_error(cli("split", "--weights", path), 2, "pass --num-heads")
    result = cli("split", "--weights", path, "-H", "2", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["head_dim"] == 8


def test_weights_file_round_trip_equals_random_init(cli, tmp_path):
    from safetensors.torch import save_file

    layer, store = random_mha(RandomSpec(embed_dim=32, num_heads=4, seed=0))
    path = tmp_path / "mha.safetensors"
    save_file({k: store.read(k).contiguous() for k in store.keys()}, path)
    from_file = _json(cli, "--weights", path, "-H", "4")
    from_init = _json(cli, "-E", "32", "-H", "4")
    assert from_file["projections"] == {
        name: {**p, "stored_at": p["stored_at"]} for name, p in from_init["projections"].items()}
    assert from_file["max_abs_diff"] == from_init["max_abs_diff"]


def test_replace_keeps_layer_frozen():
    layer, _ = random_mha(RandomSpec())
    assert replace(layer, name="x").name == "x"


def test_help_names_out_not_the_old_png(cli):
    result = cli("split", "--help")
    assert "--out" in result.output and "--png" not in result.output
