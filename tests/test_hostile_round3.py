"""Round three of the hostile checks (issue #36 item 7): every attention tensor cross-checked
before any forward, and training checkpoints whose weights sit beside metric tensors.

Each mutated checkpoint is a good one with one tensor changed; every command must refuse it
with one `error:` line naming that tensor and its expected and found shapes (exit 1), never an
"unexpected" error from inside a forward. Negative control: the unmutated checkpoint runs
through the same commands.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error, needs_safe_pickles
from safetensors.torch import save_file

from attnviz.load.pickles import find_state_dict

E, H = 8, 2
PREFIX = "layers.0.self_attn."


def _separate() -> dict[str, torch.Tensor]:
    """A LLaMA-style layer (separate q/k/v/o projections, q bias) of width 8, two heads."""
    torch.manual_seed(0)
    names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
    return {**{PREFIX + name: torch.randn(E, E) for name in names},
            PREFIX + "q_proj.bias": torch.randn(E)}


def _mha(bias_kv: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, add_bias_kv=bias_kv)
    return {k: v.contiguous() for k, v in module.state_dict().items()}


def _gpt2() -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D layout: c_attn (E, 3E) and c_proj (E, E), stored (in, out)."""
    torch.manual_seed(0)
    return {"h.0.attn.c_attn.weight": torch.randn(E, 3 * E),
            "h.0.attn.c_attn.bias": torch.randn(3 * E),
            "h.0.attn.c_proj.weight": torch.randn(E, E), "h.0.attn.c_proj.bias": torch.randn(E)}


def _set(state: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**state, key: value}


def _columns_short(state: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return _set(state, key, state[key][:, :-1].contiguous())


# name → (build the checkpoint, the tensor the error must name, a shape it must show)
MUTATIONS: dict[str, tuple[Callable[[], dict[str, torch.Tensor]], str, str]] = {
    "W_q one input column short": (lambda: _columns_short(_separate(), PREFIX + "q_proj.weight"),
                                   PREFIX + "q_proj.weight has shape (8, 7), expected (8, 8)",
                                   "(8, 8)"),
    "W_k one input column short": (lambda: _columns_short(_separate(), PREFIX + "k_proj.weight"),
                                   PREFIX + "k_proj.weight has shape (8, 7), expected (8, 8)",
                                   "(8, 8)"),
    "W_o one row short": (lambda: _set(_separate(), PREFIX + "o_proj.weight", torch.randn(7, 8)),
                          PREFIX + "o_proj.weight has shape (7, 8), expected (8, 8)", "(8, 8)"),
    "q bias of the wrong length": (lambda: _set(_separate(), PREFIX + "q_proj.bias",
                                                torch.randn(7)),
                                   PREFIX + "q_proj.bias has shape (7)", "8 output rows"),
    "GQA k width not a multiple of head_dim": (
        lambda: _set(_set(_separate(), PREFIX + "k_proj.weight", torch.randn(6, E)),
                     PREFIX + "v_proj.weight", torch.randn(6, E)),
        PREFIX + "k_proj.weight has 6 rows", "head_dim 4"),
    "MHA packed W_q one input column short": (
        lambda: _columns_short(_mha(), "in_proj_weight"), "in_proj_weight has shape (24, 7)",
        "3·7 = 21 rows"),
    "MHA out_proj one row short": (
        lambda: _set(_mha(), "out_proj.weight", torch.randn(7, E)),
        "out_proj.weight has shape (7, 8), expected (8, 8)", "in_proj_weight[0:8] (8, 8)"),
    "W_v rows unlike W_k's (GQA)": (
        lambda: _set(_set(_separate(), PREFIX + "k_proj.weight", torch.randn(4, E)),
                     PREFIX + "v_proj.weight", torch.randn(8, E)),
        PREFIX + "v_proj.weight has shape (8, 8), expected (4, 8)", "rows like W_k"),
    "MHA out_proj one column short": (
        lambda: _set(_mha(), "out_proj.weight", torch.randn(E, 7)),
        "out_proj.weight has shape (8, 7), expected (8, 8)", "columns (H·d)"),
    "MHA out_proj bias of the wrong length": (
        lambda: _set(_mha(), "out_proj.bias", torch.randn(7)), "out_proj.bias has shape (7)",
        "8 output rows"),
    "GPT-2 c_proj one output short (Conv1D)": (
        lambda: {**_gpt2(), "h.0.attn.c_proj.weight": torch.randn(E, 7)},
        "h.0.attn.c_proj.weight.T has shape (7, 8), expected (8, 8)", "c_attn.weight.T[0:8]"),
    "bias_k of the wrong width": (lambda: _set(_mha(True), "bias_k", torch.randn(1, 1, 6)),
                                  "bias_k has shape (6)", "8 output rows"),
}


def _commands(weights: Path, out: Path) -> dict[str, list[str | Path]]:
    return {"inspect": ["inspect", weights],
            "inspect --layer": ["inspect", weights, "--layer", "0"],
            "split": ["split", "-w", weights, "--layer", "0"],
            "heatmap": ["heatmap", "the cat sat", "-w", weights, "--layer", "0", "--out", out],
            "circuits": ["circuits", "-w", weights, "--layer", "0"]}


@pytest.mark.parametrize("build", [_separate, _mha, lambda: _mha(True), _gpt2],
                         ids=["separate", "mha", "mha-bias-kv", "gpt2"])
def test_good_checkpoints_run_through_every_command(cli, tmp_path, build):
    weights = tmp_path / "good.safetensors"
    save_file(build(), weights, metadata={"num_heads": str(H)})
    for name, args in _commands(weights, tmp_path / "o.png").items():
        result = cli(*args)
        assert result.exit_code == 0, (name, result.output[-1500:])
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_mutated_tensor_is_refused_by_every_command(cli, tmp_path, case):
    build, named, shape = MUTATIONS[case]
    weights = tmp_path / "bad.safetensors"
    save_file(build(), weights, metadata={"num_heads": str(H)})
    out = tmp_path / "o.png"
    for name, args in _commands(weights, out).items():
        result = cli(*args)
        assert "unexpected" not in result.output, (name, result.output)
        assert_clean_error(result, 1, named, shape)
    assert not out.exists()


def test_cross_attention_may_read_a_wider_encoder(cli, tmp_path):
    """Only self-attention must read one width: a decoder's cross-attention whose keys and
    values come from a wider encoder (vision-encoder-decoder) stays usable."""
    torch.manual_seed(0)
    prefix = "decoder.layers.0.encoder_attn."
    state = {prefix + "q_proj.weight": torch.randn(E, E), prefix + "k_proj.weight":
             torch.randn(E, 12), prefix + "v_proj.weight": torch.randn(E, 12),
             prefix + "out_proj.weight": torch.randn(E, E)}
    weights = tmp_path / "cross.safetensors"
    save_file(state, weights, metadata={"num_heads": str(H)})
    result = cli("inspect", weights, "--json")
    assert result.exit_code == 0, result.output
    (layer,) = json.loads(result.stdout)["layers"]
    assert (layer["embed_dim"], layer["kdim"], layer["vdim"]) == (E, 12, 12)
    # the same widths under a self-attention name are refused (the check is not vacuous)
    self_attn = {key.replace("encoder_attn", "self_attn"): value for key, value in state.items()}
    save_file(self_attn, weights, metadata={"num_heads": str(H)})
    assert_clean_error(cli("inspect", weights), 1, "self_attn.k_proj.weight has shape (8, 12)")


# --- nested state dicts beside metric tensors (item 3) -------------------------------------


def _layer_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(E, H, 16).state_dict()


def _optimizer_state() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 16)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.randn(3, 1, E)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


CHECKPOINTS = {
    "model beside best_acc and epoch": (
        lambda sd: {"model": sd, "best_acc": torch.tensor(0.93), "epoch": 7}, ["model"]),
    "state_dict beside optimizer and step": (
        lambda sd: {"state_dict": sd, "optimizer": _optimizer_state(), "step": 3},
        ["state_dict"]),
    "ema weights under an unusual key, beside a tensor": (
        lambda sd: {"ema": sd, "loss": torch.tensor(1.5), "name": "run 3"}, ["ema"]),
    "flat state dict (control)": (lambda sd: sd, []),
}


@needs_safe_pickles
@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_nested_state_dict_found_beside_other_entries(cli, tmp_path, case):
    wrap, entry = CHECKPOINTS[case]
    state = _layer_state()
    path = tmp_path / "train.pt"
    torch.save(wrap(state), path)
    result = cli("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["attention_layers"] == 1
    assert doc["entry"] == entry
    assert doc["summary"]["tensors"] == len(state)
    if entry:
        assert f"weights in ['{entry[0]}']" in doc["format"]
        shown = cli("inspect", path)
        assert f"weights in ['{entry[0]}']" in shown.stdout
    # the numbers are the file's own: split's proof runs on the weights found
    assert cli("split", "-w", path, "--layer", "0", "-H", str(H)).exit_code == 0


def test_state_dict_choice_and_its_negative_control():
    """The entry with the most named tensors wins over a top-level metric tensor; the rule it
    replaces (the first mapping holding any tensor) picks the metric and would show 0 layers."""
    state = {f"w{i}": torch.zeros(1) for i in range(5)}
    obj = {"model": state, "best_acc": torch.tensor(0.93), "epoch": 7}
    tensors, entry = find_state_dict(obj)
    assert entry == ("model",) and set(tensors) == set(state)
    first_with_tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    assert list(first_with_tensors) == ["best_acc"]  # what the old rule returned
    # a two-tensor model beside an optimizer's three-tensor state: the weights' names win
    tiny = {"proj.weight": torch.zeros(2, 2), "proj.bias": torch.zeros(2)}
    adam = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2),
                          "exp_avg_sq": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]}
    assert find_state_dict({"optimizer": adam, "model": tiny, "step": 3})[1] == ("model",)
    # ties: the shallower wins (a flat dict that also keeps an EMA copy inside it)
    flat = {**state, "ema": dict(state)}
    assert find_state_dict(flat)[1] == ()


def test_state_dict_search_is_bounded():
    """100,000 levels of nesting and 50,000 small dicts: answered at once, without recursion."""
    deep: dict = {"w": torch.zeros(1)}
    for _ in range(100_000):
        deep = {"next": deep}
    assert find_state_dict(deep) == ({}, ())
    wide = {str(i): {"x": torch.zeros(1)} for i in range(50_000)}
    wide["model"] = {f"w{i}": torch.zeros(1) for i in range(3)}
    tensors, _ = find_state_dict(wide)
    assert len(tensors) == 1  # the search stopped at MAX_MAPPINGS, before "model"
