"""inspect: header-only inventory, per-head norms against torch, NaN reports, JSON, laziness."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import assert_clean_error, needs_safe_pickles
from safetensors.torch import save_file


def _mha_files(tmp_path, dtype=torch.float32, nan=False):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4)
    state = {k: v.detach().to(dtype).contiguous() for k, v in mha.state_dict().items()}
    if nan:
        state["in_proj_weight"][40, 1] = float("nan")
        state["out_proj.weight"][0, 0] = float("inf")
    st, pt = tmp_path / "mha.safetensors", tmp_path / "mha.pt"
    save_file(state, st, metadata={"num_heads": "4"})
    torch.save(state, pt)
    return mha, state, st, pt


def _json(cli, *args):
    result = cli("inspect", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inventory_json_is_exact(cli, tmp_path):
    mha, _, st, _ = _mha_files(tmp_path)
    doc = _json(cli, st)
    assert doc["format"] == "safetensors"
    (layer,) = doc["layers"]
    assert layer["family"] == "torch-mha"
    assert (layer["embed_dim"], layer["num_heads"], layer["num_kv_heads"], layer["head_dim"]) \
        == (32, 4, 4, 8)
    q, k, v = mha.in_proj_weight.chunk(3)
    assert layer["shapes"] == {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                               "o": list(mha.out_proj.weight.shape)}
    assert layer["params"] == sum(p.numel() for p in mha.parameters())
    assert doc["summary"]["attention_layers"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("pt", marks=needs_safe_pickles)])
def test_head_norms_equal_torch(cli, tmp_path, dtype, fmt):
    mha, state, st, pt = _mha_files(tmp_path, dtype)
    doc = _json(cli, st if fmt == "safetensors" else pt, "-H", "4", "--layer", "0")
    heads = doc["layer_detail"]["heads"]
    w = state["in_proj_weight"].float()
    o = state["out_proj.weight"].float()
    for h, row in enumerate(heads):
        rows = slice(8 * h, 8 * h + 8)
        assert row["q_rows"] == [8 * h, 8 * h + 8]
        assert row["q_norm"] == pytest.approx(torch.linalg.norm(w[rows]).item(), rel=1e-5)
        assert row["k_norm"] == pytest.approx(torch.linalg.norm(w[32:64][rows]).item(), rel=1e-5)
        assert row["v_norm"] == pytest.approx(torch.linalg.norm(w[64:][rows]).item(), rel=1e-5)
        assert row["o_norm"] == pytest.approx(torch.linalg.norm(o[:, rows]).item(), rel=1e-5)


def test_non_finite_values_are_reported(cli, tmp_path):
    _, _, st, _ = _mha_files(tmp_path, nan=True)
    doc = _json(cli, st, "--scan")
    assert doc["non_finite"] == {"in_proj_weight": 1, "in_proj_bias": 0, "out_proj.weight": 1,
                                 "out_proj.bias": 0}
    detail = _json(cli, st, "--layer", "0")["layer_detail"]["non_finite"]
    assert detail["in_proj_weight[32:64]"] == 1 and detail["out_proj.weight"] == 1
    text = cli("inspect", st, "--scan").stdout
    assert "in_proj_weight holds 1 NaN/Inf values" in text
    assert_clean_error(cli("split", "--weights", st), 1, "non-finite")


@needs_safe_pickles
def test_unknown_heads_are_listed_not_guessed(cli, tmp_path):
    path = tmp_path / "enc.pt"
    torch.save(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32), 3,
                                           enable_nested_tensor=False).state_dict(), path)
    doc = _json(cli, path)
    assert [layer["num_heads"] for layer in doc["layers"]] == [None] * 3
    assert doc["summary"]["heads_known"] is False
    text = cli("inspect", path).stdout
    assert "pass --num-heads" in " ".join(text.split())
    assert [layer["head_dim"] for layer in _json(cli, path, "-H", "2")["layers"]] == [8] * 3
    assert_clean_error(cli("inspect", path, "-H", "3"), 2, "not divisible by 3 heads")
    assert_clean_error(cli("inspect", path, "--layer", "0"), 2, "pass --num-heads")
    assert_clean_error(cli("inspect", path, "--layer", "7", "-H", "2"), 2, "out of range")


@needs_safe_pickles
def test_wrapper_prefixes_and_nesting(cli, tmp_path):
    state = torch.nn.MultiheadAttention(8, 2).state_dict()
    path = tmp_path / "wrapped.pt"
    torch.save({"state_dict": {f"module._orig_mod.{k}": v for k, v in state.items()},
                "epoch": 3}, path)
    doc = _json(cli, path, "-H", "2")
    assert [layer["name"] for layer in doc["layers"]] == [""]


@needs_safe_pickles
def test_decoder_layer_self_and_cross_attention(cli, tmp_path):
    path = tmp_path / "dec.pt"
    torch.save(torch.nn.TransformerDecoderLayer(16, 4, 32).state_dict(), path)
    names = [layer["name"] for layer in _json(cli, path, "-H", "4")["layers"]]
    assert names == ["multihead_attn", "self_attn"]


def test_terminal_table_fits_80_columns(cli, tmp_path):
    _, _, st, _ = _mha_files(tmp_path)
    result = cli("inspect", st, "--layer", "0")
    assert result.exit_code == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def _imports_after(code: str) -> set[str]:
    script = (f"import sys\n{code}\n"
              "print(' '.join(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    return set(out)


def test_help_and_version_import_neither_torch_nor_matplotlib():
    code = ("from attnviz.cli.main import app\nfrom typer.testing import CliRunner\n"
            "r = CliRunner()\n"
            "for args in (['--help'], ['--version'], ['split', '--help'], ['inspect', '--help'],"
            " ['heatmap', '--help']):\n"
            "    assert r.invoke(app, args).exit_code == 0\n")
    assert _imports_after(code) == set()


def test_shell_completion_imports_neither_torch_nor_matplotlib():
    code = ("import contextlib, io, os\nfrom attnviz.cli.main import main\n"
            "os.environ.update(_ATTNVIZ_COMPLETE='complete_bash', COMP_WORDS='attnviz he',"
            " COMP_CWORD='1')\nsys.argv = ['attnviz']\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "    main()\nassert out.getvalue().split() == ['heatmap'], out.getvalue()\n")
    assert _imports_after(code) == set()


def test_header_only_inspect_does_not_import_torch(tmp_path):
    _, _, st, _ = _mha_files(tmp_path)
    code = ("from attnviz.cli.main import app\nfrom typer.testing import CliRunner\n"
            f"r = CliRunner().invoke(app, ['inspect', {str(st)!r}, '--json', '--layer', '0'])\n"
            "assert r.exit_code == 0, r.output\n")
    assert _imports_after(code) == set()


def test_fused_layer_without_heads_is_listed_not_an_error(cli):
    """A bare GPT-NeoX file (no config.json): inspect lists the layer as unresolved and says how
    to resolve it; split names the same fix; with -H the layer appears with its heads."""
    from helpers import SAMPLES

    path = SAMPLES / "neox-tiny" / "model.safetensors"
    doc = _json(cli, path)
    assert doc["layers"] == [] and doc["unclassified"] == []
    (item,) = doc["unresolved"]
    assert item["name"] == "gpt_neox.layers.0.attention" and item["family"] == "gpt-neox"
    assert doc["summary"]["unresolved"] == 1
    text = " ".join(cli("inspect", path).stdout.split())
    assert "unresolved: gpt_neox.layers.0.attention (gpt-neox)" in text
    assert "pass --num-heads" in text
    assert_clean_error(cli("split", "--weights", path), 2, "number of heads", "--num-heads")
    assert_clean_error(cli("heatmap", "--weights", path, "a b", "--layer",
                           "gpt_neox.layers.0.attention"), 2, "number of heads")
    scanned = _json(cli, path, "--scan")["non_finite"]  # unresolved tensors are scanned too
    assert set(scanned) == set(item["keys"]) and not any(scanned.values())
    resolved = _json(cli, path, "-H", "2")
    assert resolved["unresolved"] == [] and resolved["layers"][0]["head_dim"] == 8


def test_unresolved_layers_of_one_pattern_share_a_line(cli, tmp_path):
    """Two bare NeoX layers: one 'unresolved' line naming the pattern and the count."""
    from helpers import SAMPLES
    from safetensors.torch import load_file, save_file

    one = load_file(str(SAMPLES / "neox-tiny" / "model.safetensors"))
    two = {**one, **{k.replace("layers.0.", "layers.1."): v.clone() for k, v in one.items()
                     if "layers.0." in k}}
    path = tmp_path / "neox2.safetensors"
    save_file(two, str(path))
    assert [item["name"] for item in _json(cli, path)["unresolved"]] == [
        "gpt_neox.layers.0.attention", "gpt_neox.layers.1.attention"]
    lines = [line for line in cli("inspect", path).stdout.replace("\n", " ").split("unresolved:")
             if "gpt_neox" in line]
    assert len(lines) == 1 and lines[0].startswith(" gpt_neox.layers.{i}.attention × 2 (gpt-neox)")
