"""`attnviz circuits` on inputs issue #36 found it failing on: weights far from scale 1 (the
float32 Gram underflowed to rank 0), non-finite weights (a LAPACK error instead of a named
tensor), layers of different widths in one checkpoint (a shape error in composition), head-count
options the source cannot take (silently ignored), and a deep path in the header (wrapped
mid-name). Every number is compared with an independent float64 computation on the full
E × E product matrices (tests/test_circuits.py's `dense_layer`), each with a negative control."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import save_file
from test_circuits import (
    RTOL,
    composition_errors,
    dense_layer,
    head_errors,
    run_json,
    write_llama,
)

from attnviz.core.request import HeadHints, RandomSpec

# ---- 1. scale: ranks and ratios do not depend on the weights' scale ----------------------------


def llama_reference(w, H=4, Hkv=2, d=32, layers=2):
    found = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        W = [w[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"]
        found[str(i)] = dense_layer(*W, H, Hkv, d, w[p + "input_layernorm.weight"])
    return found


@pytest.fixture
def float32_path(monkeypatch):
    """Every factor and product through the float32 path large models take (a 4096-wide
    layer's), lowered here so that a small model takes it."""
    from attnviz.compute.qkov import circuits_factors

    monkeypatch.setattr(circuits_factors, "EXACT_FACTOR_NUMEL", 0)
    monkeypatch.setattr(circuits_factors, "EXACT_GRAM_NUMEL", 0)


@pytest.mark.parametrize("scale", [1e-26, 1e20])
def test_scale_does_not_change_ranks_or_ratios(tmp_path, float32_path, scale):
    """Weights ×1e-26 (products ~1e-52, below float32's smallest number) and ×1e20 (products
    ~1e40, above its largest): the same ranks, effective ranks, copying scores and composition
    scores as at scale 1, norms and singular values scaled by scale² (each circuit is a product
    of two weights), and every number equal to the dense float64 computation on the full
    product matrices of the weights as stored."""
    write_llama(tmp_path / "one")
    base = run_json(model=str(tmp_path / "one"), composition=True)
    w = write_llama(tmp_path / "scaled", scale=scale)
    doc = run_json(model=str(tmp_path / "scaled"), composition=True)
    ref = llama_reference(w)
    assert head_errors(doc, ref) <= RTOL
    assert len(doc["composition"]) == 3 * 4 * 4
    assert composition_errors(doc, ref) <= RTOL
    for ours, one in zip(doc["heads"], base["heads"], strict=True):
        for circuit in ("qk", "ov"):
            assert ours[circuit]["rank"] == one[circuit]["rank"] == 32
            assert ours[circuit]["effective_rank"] == one[circuit]["effective_rank"]
            # float32 rounding of the scaled weights as stored: 1e-6 relative
            assert abs(ours[circuit]["norm"] / (one[circuit]["norm"] * scale**2) - 1) < 1e-5
        assert abs(ours["ov"]["copying"] - one["ov"]["copying"]) < 1e-5
    for ours, one in zip(doc["composition"], base["composition"], strict=True):
        assert abs(ours["score"] - one["score"]) < 1e-5 * one["score"]
    # negative control: the dense reference of other weights (scale 1's, unscaled) fails
    assert head_errors(doc, llama_reference({k: v / scale if v.dim() == 2 else v
                                             for k, v in w.items()})) > 1e-2


def test_unnormalized_float32_gram_loses_tiny_weights():
    """The negative control for the scale fix: the float32 Gram of weights at 1e-26, taken as
    stored (unit 1, the old path), underflows to zero (rank 0, norm 0); the same weights in
    their power-of-two unit give the float64 SVD's full rank and singular values."""
    from attnviz.compute.qkov import circuits, circuits_factors

    gen = torch.Generator().manual_seed(7)
    W = (torch.randn(2 * 32, 4096, generator=gen, dtype=torch.float64) * 1e-26).float()
    assert W.numel() // 2 > circuits_factors.EXACT_FACTOR_NUMEL  # each head: a float32 Gram
    old = circuits_factors.row_roots(circuits_factors.StoredWeight(W), 2, 32, "cpu")
    assert float(old.abs().max()) == 0.0
    assert circuits.spectrum(torch.linalg.svdvals(old[0])).rank == 0
    unit = circuits_factors.unit_of(circuits_factors.peak(circuits_factors.StoredWeight(W)))
    assert unit == 2.0 ** -85  # max |W| ≈ 4e-26 ∈ [2^-85, 2^-84)
    new = circuits_factors.row_roots(circuits_factors.StoredWeight(W, unit=unit), 2, 32, "cpu")
    for h in range(2):
        want = torch.linalg.svdvals(W[h * 32:(h + 1) * 32].double())
        got = torch.linalg.svdvals(new[h]) * unit
        assert float((got - want).abs().max()) <= RTOL * float(want[0])
        assert circuits.spectrum(got).rank == 32


# ---- 2. non-finite weights: one error line naming the tensor, before any algebra --------------


def write_two_mha(path, bad):
    """Two nn.MultiheadAttention(16, 2) under `blocks.N.attn.`, with `bad` = {key: (row, col,
    value)} written into them."""
    torch.manual_seed(0)
    sd = {}
    for i in range(2):
        mha = torch.nn.MultiheadAttention(16, 2)
        sd.update({f"blocks.{i}.attn.{k}": v.detach().clone() for k, v in
                   mha.state_dict().items()})
    for key, (row, col, value) in bad.items():
        sd[key][row, col] = value
    save_file({k: v.contiguous() for k, v in sd.items()}, path)


@pytest.mark.parametrize("bad, named, role", [
    ({"blocks.0.attn.in_proj_weight": (3, 5, float("nan")),
      "blocks.1.attn.out_proj.weight": (1, 2, float("inf"))},
     "blocks.0.attn.in_proj_weight", "W_Q of layer '0') holds non-finite values (1 NaN)"),
    ({"blocks.1.attn.out_proj.weight": (1, 2, float("-inf"))},
     "blocks.1.attn.out_proj.weight", "W_O of layer '1') holds non-finite values (1 Inf)"),
])
def test_non_finite_weight_is_one_error_line(cli, tmp_path, bad, named, role):
    from helpers import assert_clean_error

    path = tmp_path / "m.safetensors"
    write_two_mha(path, bad)
    result = cli("circuits", "--weights", path, "-H", "2")
    assert_clean_error(result, 1, f"tensor '{named}' ({role}", str(path))
    assert "LinAlgError" not in result.stderr and "unexpected" not in result.stderr
    # control: the same file without the bad values is computed
    write_two_mha(path, {})
    assert cli("circuits", "--weights", path, "-H", "2", "--json").exit_code == 0


def test_non_finite_weight_from_the_api(tmp_path):
    import attnviz
    from attnviz.errors import CheckpointError

    path = tmp_path / "m.safetensors"
    write_two_mha(path, {"blocks.1.attn.in_proj_weight": (20, 0, float("nan"))})  # W_K
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.1.attn.in_proj_weight' \(W_K "
                       r"of layer '1'\) holds non-finite values \(1 NaN\)"):
        attnviz.circuits(path, num_heads=2)


# ---- 3. layers of different widths: per-layer numbers, composition only within a width --------


def test_layers_of_different_widths(tmp_path):
    """nn.MultiheadAttention(16, 2), (32, 2) and (16, 2) in one state dict: every head's
    numbers equal the dense computation from torch's own modules' weights; composition is
    computed between the two 16-wide layers (checked densely too) and left out, with a note,
    between widths 16 and 32."""
    torch.manual_seed(3)
    modules = [torch.nn.MultiheadAttention(E, 2) for E in (16, 32, 16)]
    sd = {f"blocks.{i}.attn.{k}": v.detach().contiguous()
          for i, m in enumerate(modules) for k, v in m.state_dict().items()}
    save_file(sd, tmp_path / "m.safetensors")
    doc = run_json(weights=tmp_path / "m.safetensors", hints=HeadHints(num_heads=2))
    assert [layer["head_dim"] for layer in doc["layers"]] == [8, 16, 8]
    ref = {}
    for i, m in enumerate(modules):
        Wq, Wk, Wv = m.in_proj_weight.detach().chunk(3)
        ref[str(i)] = dense_layer(Wq, Wk, Wv, m.out_proj.weight.detach(), 2, 2, m.head_dim)
    assert head_errors(doc, ref) <= RTOL
    pairs = {(e["later"][0], e["earlier"][0]) for e in doc["composition"]}
    assert pairs == {(2, 0)} and len(doc["composition"]) == 3 * 2 * 2
    assert composition_errors(doc, ref) <= RTOL
    assert doc["composition_skipped"] is None
    notes = [n for n in doc["notes"] if "not composable" in n]
    assert notes == [
        "Q, K, V-composition of layer 1 on layer 0: not composable: width 32 vs 16 (every "
        "per-head number is still computed)",
        "Q, K, V-composition of layer 2 on layer 1: not composable: width 16 vs 32 (every "
        "per-head number is still computed)"]
    # one head by hand, float64 throughout: layer 1 (32 wide), head 1
    Wq, Wk, Wv = (w.double() for w in modules[1].in_proj_weight.detach().chunk(3))
    qk = Wq[16:32].T @ Wk[16:32]
    entry = next(h for h in doc["heads"] if h["label"] == "1" and h["head"] == 1)
    assert abs(entry["qk"]["norm"] / float(torch.linalg.matrix_norm(qk)) - 1) <= RTOL
    assert entry["qk"]["rank"] == int(torch.linalg.matrix_rank(qk, rtol=1e-4)) == 16
    # negative control: head 0's slice instead
    assert abs(entry["qk"]["norm"] / float(torch.linalg.matrix_norm(
        Wq[0:16].T @ Wk[0:16])) - 1) > 1e-2


def test_only_different_widths_skip_composition(tmp_path, cli):
    torch.manual_seed(4)
    sd = {f"blocks.{i}.attn.{k}": v.detach().contiguous()
          for i, E in enumerate((16, 32)) for k, v in
          torch.nn.MultiheadAttention(E, 2).state_dict().items()}
    save_file(sd, tmp_path / "m.safetensors")
    result = cli("circuits", "--weights", tmp_path / "m.safetensors", "-H", "2")
    assert result.exit_code == 0, result.output
    assert "composition: not composable: the layers' widths differ" in result.stdout
    assert "not composable: width 32 vs 16" in " ".join(result.stdout.split())


def test_compose_heads_of_different_sizes():
    """Same width (24), different head sizes (2 heads of 12, 3 of 8): composition's cross
    blocks are (d_later × d_earlier), and the scores equal the dense ones."""
    from attnviz.compute.qkov.circuits import compose, layer_circuits
    from attnviz.compute.qkov.circuits_factors import StoredWeight

    gen = torch.Generator().manual_seed(9)
    layers = []
    for H in (2, 3):
        W = {n: torch.randn(24, 24, generator=gen) for n in "qkvo"}
        factors, _ = layer_circuits(lambda n, W=W: StoredWeight(W[n]), (H, H, 24 // H),
                                    keep=True)
        layers.append((W, H, factors))
    (Wa, Ha, fa), (Wb, Hb, fb) = layers
    comps = {c.kind: c.scores for c in compose(fb, fa)}
    dense_a = dense_layer(Wa["q"], Wa["k"], Wa["v"], Wa["o"], Ha, Ha, 24 // Ha)
    dense_b = dense_layer(Wb["q"], Wb["k"], Wb["v"], Wb["o"], Hb, Hb, 24 // Hb)
    norm = torch.linalg.matrix_norm
    for i in range(Hb):
        for j in range(Ha):
            (qk_b, ov_b), (_, ov_a) = dense_b[i], dense_a[j]
            want = {"K": qk_b @ ov_a, "Q": ov_a.T @ qk_b, "V": ov_b @ ov_a}
            for kind, product in want.items():
                size = norm(ov_b if kind == "V" else qk_b) * norm(ov_a)
                assert abs(float(comps[kind][i, j]) / float(norm(product) / size) - 1) <= RTOL
    # negative control: the earlier layer's head 1 in place of head 0
    product = dense_b[0][0] @ dense_a[1][1]
    wrong = float(norm(product) / (norm(dense_b[0][0]) * norm(dense_a[1][1])))
    assert abs(float(comps["K"][0, 0]) / wrong - 1) > 1e-2


# ---- 4. head-count options: applied, or refused naming them -------------------------------------

BUNDLED_FIX = "— drop it, or pass --weights or --model"
RANDOM_REST = ("applies to a checkpoint's layers: the random nn.MultiheadAttention has as many "
               "key/value heads as heads, each --spec E / --num-heads wide")


@pytest.mark.parametrize("args, message", [
    (("-H", "3"), "error: --num-heads applies to a checkpoint's layers: the bundled model's "
     f"head counts are its own (--num-heads) {BUNDLED_FIX}"),
    (("--num-kv-heads", "1"), "error: --spec kv applies to a checkpoint's layers: the "
     f"bundled model's head counts are its own (--spec kv) {BUNDLED_FIX}"),
    (("--head-dim", "16"), "error: --spec d applies to a checkpoint's layers: the bundled "
     f"model's head counts are its own (--spec d) {BUNDLED_FIX}"),
    (("-H", "2", "--head-dim", "32"), "error: --num-heads and --spec d apply to a "
     "checkpoint's layers: the bundled model's head counts are its own (--num-heads) — drop "
     "them, or pass --weights or --model"),
    (("--random", "--num-kv-heads", "2"), f"error: --spec kv {RANDOM_REST} (--spec kv)"
     " — drop it; size the random layer with --spec E and --num-heads"),
    (("--random", "--head-dim", "4"), f"error: --spec d {RANDOM_REST} (--spec d) — drop "
     "it; size the random layer with --spec E and --num-heads"),
])
def test_head_options_refused_where_they_cannot_apply(cli, args, message):
    from helpers import assert_clean_error

    result = cli("circuits", *args)
    assert_clean_error(result, 2)
    assert result.stderr.strip() == message


def test_num_heads_applies_to_the_random_layer(cli):
    """--random -H 4: the random layer has 4 heads (the option is applied, not ignored), and
    its numbers are those of torch's module built the same way."""
    result = cli("circuits", "--random", "-H", "4", "--embed-dim", "32", "--seed", "3", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layers"][0]["num_heads"] == 4 and doc["layers"][0]["head_dim"] == 8
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    Wq, Wk, Wv = mha.in_proj_weight.detach().chunk(3)
    assert head_errors(doc, {"0": dense_layer(Wq, Wk, Wv, mha.out_proj.weight.detach(), 4, 4,
                                              8)}) <= RTOL
    # control: -H 2 gives another layer
    other = json.loads(cli("circuits", "--random", "-H", "2", "--embed-dim", "32", "--seed",
                           "3", "--json").stdout)
    assert other["layers"][0]["num_heads"] == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"num_heads": 3}, "num_heads applies to a checkpoint's layers: the bundled model's head "
     "counts are its own (num_heads) — drop it, or pass weights or model"),
    ({"num_kv_heads": 1}, "num_kv_heads applies to a checkpoint's layers: the bundled model's "
     "head counts are its own (num_kv_heads) — drop it, or pass weights or model"),
    ({"head_dim": 16}, "head_dim applies to a checkpoint's layers: the bundled model's head "
     "counts are its own (head_dim) — drop it, or pass weights or model"),
    ({"random": True, "num_kv_heads": 2}, "num_kv_heads applies to a checkpoint's layers: the "
     "random nn.MultiheadAttention has as many key/value heads as heads, each embed_dim / "
     "num_heads wide (num_kv_heads) — drop it; size the random layer with embed_dim and "
     "num_heads"),
    ({"random": True, "head_dim": 4}, "head_dim applies to a checkpoint's layers: the random "
     "nn.MultiheadAttention has as many key/value heads as heads, each embed_dim / num_heads "
     "wide (head_dim) — drop it; size the random layer with embed_dim and num_heads"),
])
def test_api_head_options_refused(kwargs, message):
    import attnviz
    from attnviz.errors import UsageError

    with pytest.raises(UsageError) as caught:
        attnviz.circuits(**kwargs)
    assert caught.value.one_line() == message


def test_api_num_heads_applies_to_the_random_layer():
    import attnviz

    doc = attnviz.circuits(random=True, num_heads=4, embed_dim=32, seed=3).to_json()
    assert doc["layers"][0]["num_heads"] == 4
    assert doc == run_json(random=RandomSpec(32, 4, seed=3))


# ---- 5. the header elides a deep path at component boundaries ----------------------------------


def test_header_elides_a_deep_path(tmp_path):
    """A checkpoint 10 folders deep, printed at 80 columns: the header's source line fits, has
    whole components only (the leading ones and the last ones, the file's name among them)
    and no line wraps a path mid-name. Control: the whole path, printed as before, wraps."""
    from rich.console import Console

    from attnviz.app.circuits import CircuitsRequest, run_circuits
    from attnviz.render.circuits_terminal import header, print_circuits

    folder = tmp_path.joinpath(*[f"component{i:02d}" for i in range(10)])
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in torch.nn.MultiheadAttention(16, 2).state_dict()
               .items()}, folder / "weights_file.safetensors")
    result = run_circuits(CircuitsRequest(weights=folder / "weights_file.safetensors",
                                          hints=HeadHints(num_heads=2)))
    path = str(folder / "weights_file.safetensors")
    assert len("circuits of " + path) > 80
    components = set(path.split("/"))

    def render(draw) -> list[str]:
        out = io.StringIO()
        draw(Console(file=out, width=80, color_system=None, legacy_windows=False))
        return out.getvalue().splitlines()

    lines = render(lambda console: print_circuits(console, result))
    source = lines[0]
    assert source.startswith("circuits of /") and len(source) <= 80 and "…/" in source
    assert source.endswith("/component08/component09/weights_file.safetensors")
    shown = source.removeprefix("circuits of ").split("/")
    assert all(part in components or part == "…" for part in shown), shown
    for line in lines[1:]:  # no piece of the path continues on another line
        assert "component0" not in line and "weights_file" not in line, line
    # control: the unelided header (as before) wraps the path inside a name
    whole = render(lambda console: console.print(header(result)))
    path_lines = [line for line in whole if "component0" in line]
    assert len(path_lines) > 1
    assert any(part not in components for line in path_lines for part in line.split("/"))


@pytest.mark.parametrize("scale", [1e-100, 1e100])
def test_float64_weights_past_float32s_range(float32_path, scale):
    """float64 weights at 1e±100, which float32 cannot hold at all (they became 0 or inf on
    conversion), through the float32 path in their unit: the dense float64 computation's
    ranks, norms (~1e±200) and singular values; a γ of 1e-30 folded in as well."""
    from attnviz.compute.qkov.circuits import layer_circuits
    from attnviz.compute.qkov.circuits_factors import StoredWeight

    gen = torch.Generator().manual_seed(11)
    W = {n: torch.randn(64, 64, generator=gen, dtype=torch.float64) * scale for n in "qkvo"}
    gamma = (1 + 0.5 * torch.rand(64, generator=gen, dtype=torch.float64)) * 1e-30

    def read(name):
        return StoredWeight(W[name], gamma.float() if name != "o" else None)

    _, heads = layer_circuits(read, (2, 2, 32))
    g = gamma.float().double()
    dense = dense_layer(W["q"] * g, W["k"] * g, W["v"] * g, W["o"], 2, 2, 32)
    for head, (qk, ov) in zip(heads, dense, strict=True):
        for ours, M in ((head.qk, qk), (head.ov, ov)):
            want = torch.linalg.svdvals(M)[:32]
            assert ours.rank == int(torch.linalg.matrix_rank(M, rtol=1e-4)) == 32
            top = float(M.abs().max())  # torch's norm squares the entries: 1e-520, 1e+340
            assert abs(ours.norm / (top * float(torch.linalg.matrix_norm(M / top))) - 1) <= RTOL
            got = torch.tensor(ours.singular_values, dtype=torch.float64)
            assert float((got - want).abs().max()) <= RTOL * float(want[0])
    # control: converted to float32 as stored (the old conversion) they are 0 or inf
    assert not torch.isfinite(W["q"].float() * gamma.float()).all() or \
        float((W["q"].float() * gamma.float()).abs().max()) == 0.0


def test_column_peaks_read_in_blocks():
    """max |W| per column over several blocks of rows equals torch's over the whole tensor; a
    NaN in the last block is not lost (the finiteness check relies on it)."""
    from attnviz.compute.qkov.circuits_factors import PEAK_ROWS, column_peaks

    W = torch.randn(2 * PEAK_ROWS + 100, 8, dtype=torch.bfloat16)
    assert torch.equal(column_peaks(W), W.abs().amax(dim=0).double())
    W[-1, 3] = float("nan")
    assert torch.isnan(column_peaks(W)[3]) and not torch.isnan(column_peaks(W)[2])


@pytest.mark.hf
def test_swin_stages_of_different_widths(tmp_path):
    """A tiny Swin (stages 16 and 32 wide, 2 and 4 heads) saved by transformers: each stage's
    heads equal the dense computation from the model's own modules (LayerNorm scale folded,
    randomized so folding shows); composition between the stages is noted, not attempted."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 4], window_size=2)
    torch.manual_seed(0)
    model = transformers.SwinModel(config)
    with torch.no_grad():
        for stage in model.encoder.layers:
            stage.blocks[0].layernorm_before.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "swin")
    doc = run_json(model=str(tmp_path / "swin"))

    def reference(fold):
        found = {}
        for i, stage in enumerate(model.encoder.layers):
            block = stage.blocks[0]
            a, H = block.attention, config.num_heads[i]
            W = [getattr(a, f"{n}_proj").weight.detach() for n in "qkvo"]
            found[str(i)] = dense_layer(*W, H, H, W[0].shape[0] // H,
                                        block.layernorm_before.weight.detach() if fold else None)
        return found

    assert [(layer["num_heads"], layer["head_dim"]) for layer in doc["layers"]] == [(2, 8),
                                                                                   (4, 8)]
    assert head_errors(doc, reference(True)) <= RTOL
    assert head_errors(doc, reference(False)) > 1e-2  # control: γ left out
    assert doc["composition"] == []
    assert any("not composable: width 32 vs 16" in note for note in doc["notes"])


def test_float8_weights_peaks_and_non_finite(tmp_path):
    """float8 weights (no abs/amax/isnan kernels on a CPU) still get their unit and their
    finiteness check: numbers equal the dense computation of the float8 values; a NaN is named."""
    from attnviz.errors import CheckpointError

    torch.manual_seed(0)
    sd = {k: v.to(torch.float8_e4m3fn).contiguous()
          for k, v in torch.nn.MultiheadAttention(16, 2).state_dict().items()}
    save_file(sd, tmp_path / "m.safetensors")
    doc = run_json(weights=tmp_path / "m.safetensors", hints=HeadHints(num_heads=2))
    Wq, Wk, Wv = sd["in_proj_weight"].double().chunk(3)
    ref = {"0": dense_layer(Wq, Wk, Wv, sd["out_proj.weight"].double(), 2, 2, 8)}
    assert head_errors(doc, ref) <= RTOL
    assert head_errors(doc, {"0": dense_layer(Wq, Wk, Wv, sd["out_proj.weight"].double()
                                              .roll(8, dims=1), 2, 2, 8)}) > 1e-2
    bad = sd["out_proj.weight"].float()
    bad[0, 0] = float("nan")
    sd["out_proj.weight"] = bad.to(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"'out_proj.weight' \(W_O of layer '0'\) holds "
                       r"non-finite values \(1 NaN\)"):
        run_json(weights=tmp_path / "m.safetensors", hints=HeadHints(num_heads=2))
