"""attnviz patch on the bundled model: every number against an independent computation (the
bundled model's own generation forward; a hand-written per-head forward with plain hooks; a
hand-written two-pass path patching; finite differences for attribution), each check with a
negative control that shows it can fail."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnviz.compute.patching.engine import Engine, Patch, pair_batch
from attnviz.compute.patching.metric import EXPLAINED
from attnviz.compute.patching.pairs import PromptPair, parse_pairs, tokenize_pair
from attnviz.compute.patching.result import correlation
from attnviz.compute.patching.sweeps import baseline_runs, path_sweep
from attnviz.core.choices import PatchDirection, PatchMetric
from attnviz.errors import UsageError
from attnviz.sources import bundled, bundled_generate
from attnviz.sources.patch_bundled import BUILT_IN, open_bundled_patch

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
SECOND = PromptPair("cat dog bird fish cat dog", "cat dog tree fish cat dog", "bird", "tree")


@pytest.fixture(scope="module")
def model():
    return open_bundled_patch(CPU)


def engine_for(model, pairs, metric=PatchMetric.LOGIT_DIFF):
    tokenized = [tokenize_pair(p, model.tokenizer, metric) for p in pairs]
    return Engine(model, pair_batch(tokenized, metric)), tokenized


# --- an independent forward: the bundled model's weights, per head, written out here ----------

class HandForward:
    """softmax(q kᵀ/√d) v per head from the stored in_proj/out_proj, with `edit(layer, z)`
    called on the (L, H, d) head outputs of one sequence; returns the last-token logits."""

    def __init__(self, store):
        self.store = store
        self.read = lambda name: store.read(name).float()
        self.H = 2

    def __call__(self, ids, edit=None, pattern_edit=None):
        r = self.read
        L = len(ids)
        x = r("embed.weight")[torch.tensor(ids)] + r("pos_embed.weight")[:L]
        zs = []
        for i in range(2):
            h = F.layer_norm(x, (x.shape[-1],), r(f"layers.{i}.ln.weight"),
                             r(f"layers.{i}.ln.bias"), eps=1e-5)
            qkv = h @ r(f"layers.{i}.self_attn.in_proj_weight").T \
                + r(f"layers.{i}.self_attn.in_proj_bias")
            E = x.shape[-1]
            d = E // self.H
            q, k, v = qkv[:, :E], qkv[:, E:2 * E], qkv[:, 2 * E:]
            z = torch.zeros(L, self.H, d)
            for head in range(self.H):
                cols = slice(head * d, (head + 1) * d)
                scores = q[:, cols] @ k[:, cols].T / math.sqrt(d)
                scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
                pattern = scores.softmax(-1)
                if pattern_edit is not None:
                    pattern = pattern_edit(i, head, pattern)
                z[:, head] = pattern @ v[:, cols]
            if edit is not None:
                z = edit(i, z)
            zs.append(z)
            x = x + z.reshape(L, E) @ r(f"layers.{i}.self_attn.out_proj.weight").T \
                + r(f"layers.{i}.self_attn.out_proj.bias")
        x = F.layer_norm(x, (x.shape[-1],), r("ln_f.weight"), r("ln_f.bias"), eps=1e-5)
        return x[-1] @ r("unembed.weight").T, zs


def logit_diff(logits, tp):
    return float(logits[tp.answer[0]] - logits[tp.wrong])


def test_forward_equals_the_bundled_models_own_logits(model):
    reference = bundled_generate._Model(bundled.open_bundled(), CPU)
    ids = torch.tensor([model.tokenizer.prompt(BUILT_IN.clean)[0]])
    L = ids.shape[1]
    mine = model.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(L)[None],
                         None)
    theirs = reference.logits(ids)
    assert (mine - theirs).abs().max() < 1e-4
    # negative control: a changed position is seen
    other = ids.clone()
    other[0, 2] = (other[0, 2] + 1) % 1024
    assert (model.forward(other, torch.ones_like(ids, dtype=torch.bool),
                          torch.arange(L)[None], None) - theirs).abs().max() > 1e-2


def test_baselines_and_identities(model):
    engine, (tp,) = engine_for(model, [BUILT_IN])
    hand = HandForward(model.store)
    runs = baseline_runs(engine, {"z", "resid"}, "")
    clean = logit_diff(hand(tp.clean)[0], tp)
    corrupt = logit_diff(hand(tp.corrupt)[0], tp)
    assert abs(runs.baselines.clean[0] - clean) < 1e-4
    assert abs(runs.baselines.corrupt[0] - corrupt) < 1e-4
    every = tuple(Patch("z", layer) for layer in range(model.n_layers))
    scores, _ = engine.patched(True, [every, (), (Patch("resid", 0),)],
                               {"source": runs.clean})
    assert abs(scores[0, 0] - runs.baselines.clean[0]) < 1e-5  # every head → clean
    assert abs(scores[1, 0] - runs.baselines.corrupt[0]) < 1e-5  # none → corrupted
    assert abs(scores[2, 0] - runs.baselines.clean[0]) < 1e-5  # the whole stream → clean
    # negative control: the clean activations one position off (a misaligned patch) break it
    shifted = {key: value.roll(1, dims=1) for key, value in runs.clean.items()}
    wrong, _ = engine.patched(True, [every], {"source": shifted})
    assert abs(wrong[0, 0] - runs.baselines.clean[0]) > 1e-2
    noised, _ = engine.patched(False, [every], {"source": runs.corrupt})
    assert abs(noised[0, 0] - runs.baselines.corrupt[0]) < 1e-5


@pytest.mark.parametrize("layer, head, position", [(0, 1, None), (1, 0, 9), (0, 0, 3)])
def test_one_head_equals_a_hand_written_patch(model, layer, head, position):
    engine, (tp,) = engine_for(model, [BUILT_IN])
    runs = baseline_runs(engine, {"z"}, "")
    hand = HandForward(model.store)
    _, clean_z = hand(tp.clean)
    at = slice(None) if position is None else position

    def edit(i, z):
        if i == layer:
            z = z.clone()
            z[at, head] = clean_z[i][at, head]
        return z
    expected = logit_diff(hand(tp.corrupt, edit)[0], tp)
    got, _ = engine.patched(True, [(Patch("z", layer, head, position),)],
                            {"source": runs.clean})
    assert abs(float(got[0, 0]) - expected) < 1e-4
    # negative control: the other head of the layer gives another number
    wrong, _ = engine.patched(True, [(Patch("z", layer, 1 - head, position),)],
                              {"source": runs.clean})
    assert abs(float(wrong[0, 0]) - expected) > 1e-3


def test_padded_batch_equals_each_pair_alone(model):
    both, _ = engine_for(model, [BUILT_IN, SECOND])
    assert both.batch.lengths[0] != both.batch.lengths[1]
    copies = [(Patch("z", layer, h),) for layer in range(2) for h in range(2)]
    runs = baseline_runs(both, {"z"}, "")
    together = both.sweep(True, copies, {"source": runs.clean})
    for p, pair in enumerate((BUILT_IN, SECOND)):
        alone, _ = engine_for(model, [pair])
        own = baseline_runs(alone, {"z"}, "")
        scores = alone.sweep(True, copies, {"source": own.clean})
        assert (together[:, p] - scores[:, 0]).abs().max() < 1e-4
    # negative control: the shorter pair LEFT-padded (its positions shifted, as a batch
    # without position ids would run it) gives other numbers
    b = both.batch
    short = 1 if b.lengths[1] < b.lengths[0] else 0
    shift = b.length - b.lengths[short]
    moved = pair_batch([tokenize_pair(p, model.tokenizer, PatchMetric.LOGIT_DIFF)
                        for p in (BUILT_IN, SECOND)], PatchMetric.LOGIT_DIFF)
    for ids in (moved.clean, moved.corrupt):
        ids[short] = ids[short].roll(shift)
    moved.real[short] = moved.real[short].roll(shift)
    moved.targets.positions[short] += shift
    left = Engine(model, moved)
    assert abs(float(left.run(False)[0][short]) - runs.baselines.clean[short]) > 1e-3


def test_copies_per_forward_do_not_change_results(model):
    engine, _ = engine_for(model, [BUILT_IN])
    runs = baseline_runs(engine, {"resid"}, "")
    copies = [(Patch("resid", layer, None, p),) for layer in range(2) for p in range(10)]
    whole = engine.sweep(True, copies, {"source": runs.clean})
    engine.budget_bytes = 1  # one copy a forward
    assert engine.per_forward == 1
    assert (engine.sweep(True, copies, {"source": runs.clean}) - whole).abs().max() < 1e-5


def hand_path_patch(hand, base_ids, other_ids, sender, receivers, site, tp):
    """Wang et al.'s two passes, written out on the hand forward: pass 1 runs the base input
    with the sender's z from the other run and every other head frozen at the base run's; the
    receivers' `site` input (q from the residual into their layer) is read; pass 2 runs the
    base input with those receiver inputs. For the logits, pass 1's output is the answer."""
    _, base_z = hand(base_ids)
    _, other_z = hand(other_ids)
    s_layer, s_head = sender

    def freeze(i, z):
        z = base_z[i].clone()
        if i == s_layer:
            z[:, s_head] = other_z[i][:, s_head]
        return z
    if not receivers:
        return logit_diff(hand(base_ids, freeze)[0], tp)
    # pass 1: the receivers' layer input with the frozen-and-sender earlier layers; with an
    # attention-only model their q is a function of the residual entering their layer, so the
    # receivers' z under pass-1 q is what pass 2 patches in (k, v: the same for keys/values)
    layer, head = receivers[0]
    r = hand.read
    L = len(base_ids)
    x = r("embed.weight")[torch.tensor(base_ids)] + r("pos_embed.weight")[:L]
    for i in range(layer):
        x = x + freeze(i, None).reshape(L, -1) @ r(f"layers.{i}.self_attn.out_proj.weight").T \
            + r(f"layers.{i}.self_attn.out_proj.bias")
    h = F.layer_norm(x, (x.shape[-1],), r(f"layers.{layer}.ln.weight"),
                     r(f"layers.{layer}.ln.bias"), eps=1e-5)
    qkv = h @ r(f"layers.{layer}.self_attn.in_proj_weight").T \
        + r(f"layers.{layer}.self_attn.in_proj_bias")
    recorded = qkv
    # pass 2: the base run; the receiver head's z recomputed with the recorded q and the base
    # run's own k, v
    hb = F.layer_norm(_resid_at(hand, base_ids, layer), (x.shape[-1],),
                      r(f"layers.{layer}.ln.weight"), r(f"layers.{layer}.ln.bias"), eps=1e-5)
    base_qkv = hb @ r(f"layers.{layer}.self_attn.in_proj_weight").T \
        + r(f"layers.{layer}.self_attn.in_proj_bias")
    E = x.shape[-1]
    d = E // hand.H
    cols = slice(head * d, (head + 1) * d)
    part = {"q": 0, "k": 1, "v": 2}
    mixed = [base_qkv[:, j * E:(j + 1) * E] for j in range(3)]
    mixed[part[site]] = mixed[part[site]].clone()
    mixed[part[site]][:, cols] = recorded[:, part[site] * E:(part[site] + 1) * E][:, cols]
    q, k, v = mixed
    scores = q[:, cols] @ k[:, cols].T / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
    new_z = scores.softmax(-1) @ v[:, cols]

    def edit(i, z):
        if i == layer:
            z = z.clone()
            z[:, head] = new_z
        return z
    return logit_diff(hand(base_ids, edit)[0], tp)


def _resid_at(hand, ids, layer):
    r = hand.read
    L = len(ids)
    x = r("embed.weight")[torch.tensor(ids)] + r("pos_embed.weight")[:L]
    _, zs = hand(ids)
    for i in range(layer):
        x = x + zs[i].reshape(L, -1) @ r(f"layers.{i}.self_attn.out_proj.weight").T \
            + r(f"layers.{i}.self_attn.out_proj.bias")
    return x


@pytest.mark.parametrize("receivers, site", [([], "q"), ([(1, 0)], "q"), ([(1, 1)], "k"),
                                             ([(1, 1)], "v")])
@pytest.mark.parametrize("direction", list(PatchDirection))
def test_path_patching_equals_a_hand_written_two_pass(model, receivers, site, direction):
    engine, (tp,) = engine_for(model, [BUILT_IN])
    runs = baseline_runs(engine, {"z"}, "")
    grid = path_sweep(runs, direction, receivers, site, lambda _: None)
    hand = HandForward(model.store)
    base, other = (tp.corrupt, tp.clean) if direction is PatchDirection.DENOISING \
        else (tp.clean, tp.corrupt)
    scale = runs.baselines.scale
    for layer in range(len(grid.rows)):
        for head in range(model.n_heads):
            expected = hand_path_patch(hand, base, other, (layer, head), receivers, site, tp)
            got = grid.raw[layer][head]
            assert abs(got - expected) < 1e-4, (layer, head)
            assert abs(grid.mean[layer][head] - (got - runs.baselines.corrupt[0]) / scale) \
                < 1e-9
    # negative control: without freezing the other heads, the sender's total effect (plain
    # patching) is another number for the previous-token head into the induction head
    if receivers == [(1, 0)] and direction is PatchDirection.DENOISING:
        plain, _ = engine.patched(True, [(Patch("z", 0, 1),)], {"source": runs.clean})
        assert abs(float(plain[0, 0]) - grid.raw[0][1]) > 1e-3


def test_attribution_is_the_first_order_change(model):
    engine, (tp,) = engine_for(model, [BUILT_IN])
    runs = baseline_runs(engine, {"z"}, "")
    scores, acts, grads = engine.gradients(True, {"z"})
    eps = 1e-3
    for layer, head in ((0, 1), (1, 0)):
        delta = runs.clean[("z", layer)] - acts[("z", layer)]
        first = float((delta[..., head, :] * grads[("z", layer)][..., head, :]).sum())

        def nudge(site, i, x, layer=layer, head=head, delta=delta):
            if site == "z" and i == layer:
                x = x.clone()
                x[..., head, :] += eps * delta[..., head, :]
            return x
        b = engine.batch
        moved = model.forward(b.corrupt, b.real, b.targets.positions, nudge)
        base = model.forward(b.corrupt, b.real, b.targets.positions, None)
        finite = (logit_diff(moved[0, 0], tp) - logit_diff(base[0, 0], tp)) / eps
        assert abs(first - finite) < 1e-2 * max(1.0, abs(first))
        # negative control: another head's gradient is another number
        other = float((delta[..., 1 - head, :] * grads[("z", layer)][..., 1 - head, :]).sum())
        assert abs(other - finite) > 1e-2


def test_correlation():
    assert abs(correlation([1, 2, 3], [2, 4, 6.5]) - float(
        torch.corrcoef(torch.tensor([[1, 2, 3], [2, 4, 6.5]], dtype=torch.float64))[0, 1])) < 1e-9
    assert math.isnan(correlation([1, 1], [1, 2]))


def test_cli_names_the_previous_token_and_induction_heads(cli, model):
    result = cli("patch", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["metric"] == "logit-diff" and doc["grids"][0]["direction"] == "denoising"
    # independent: the layer-0 head that attends most to the previous token (its pattern)
    ids = torch.tensor([model.tokenizer.prompt(BUILT_IN.clean)[0]])
    patterns = {}

    def keep(site, layer, x):
        if site == "pattern":
            patterns[layer] = x
        return x
    model.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[9]]), keep)
    previous = [float(patterns[0][0, h].diagonal(-1).mean()) for h in range(2)]
    prev_head = max(range(2), key=lambda h: previous[h])
    notes = " ".join(doc["notes"])
    assert f"L0H{prev_head} is the previous-token head" in notes
    assert "L1H0 is an induction head" in notes or "L1H1 is an induction head" in notes
    # negative control: the other layer-0 head is not named
    assert f"L0H{1 - prev_head} is the previous-token head" not in notes
    text = cli("patch")
    assert "direction: denoising" in text.output and "baselines: clean" in text.output


def test_pairs_parse_and_refuse():
    pairs = parse_pairs(["clean\tcorrupt\tanswer\twrong", "a b\tc b\tx\ty",
                         '{"clean": "a", "corrupt": "b", "answer": "c"}', ""], "t")
    assert pairs == [PromptPair("a b", "c b", "x", "y"), PromptPair("a", "b", "c", None)]
    with pytest.raises(UsageError, match="line 1 has 2 tab-separated"):
        parse_pairs(["a\tb"], "t")
    with pytest.raises(UsageError, match="not valid JSON"):
        parse_pairs(["{nope"], "t")


def test_unequal_lengths_show_both_tokenizations(model):
    with pytest.raises(UsageError) as caught:
        tokenize_pair(PromptPair("a b c", "a b", "c", "d"), model.tokenizer,
                      PatchMetric.LOGIT_DIFF)
    assert "3 tokens ['a', 'b', 'c']" in caught.value.what
    assert "2 ['a', 'b']" in caught.value.what


@pytest.mark.parametrize("metric", [PatchMetric.LOGPROB, PatchMetric.LOSS])
def test_other_metrics_equal_the_hand_forward(model, metric):
    pair = PromptPair(BUILT_IN.clean, BUILT_IN.corrupt, "window forest" if metric is
                      PatchMetric.LOSS else "window")
    engine, (tp,) = engine_for(model, [pair], metric)
    runs = baseline_runs(engine, set(), EXPLAINED[metric])
    r = HandForward(model.store)
    if metric is PatchMetric.LOGPROB:
        logits, _ = r(tp.clean)
        expected = float(torch.log_softmax(logits.double(), -1)[tp.answer[0]])
    else:
        full = tp.clean + tp.answer
        losses = []
        for j, token in enumerate(tp.answer):
            logits, _ = r(full[:len(tp.clean) + j])
            losses.append(-float(torch.log_softmax(logits.double(), -1)[token]))
        expected = sum(losses) / len(losses)
    assert abs(runs.baselines.clean[0] - expected) < 1e-4
    assert abs(runs.baselines.corrupt[0] - expected) > 1e-3  # the corrupted run differs


def test_api_returns_the_cli_numbers(cli):
    from attnviz.api import patch

    result = patch(sites=["heads", "v"], directions=["noising"])
    doc = json.loads(cli("patch", "--site", "heads,v", "--direction", "noising",
                         "--json").output)
    assert result.to_json()["grids"] == doc["grids"]
    assert [g.site for g in result.grids] == ["heads", "head-positions", "v"]
    with pytest.raises(UsageError, match="unknown metric 'nope'"):
        patch(metric="nope")


def test_q_v_and_pattern_patches_equal_the_hand_forward(model):
    """The bundled model's q, v and pattern patches against the hand forward's own math."""
    engine, (tp,) = engine_for(model, [BUILT_IN])
    runs = baseline_runs(engine, {"q", "v", "pattern"}, "")
    got, _ = engine.patched(True, [(Patch("q", 1, 0),), (Patch("v", 0, 1),),
                                   (Patch("pattern", 1, 1),)], {"source": runs.clean})
    # the same patches through the model's own hook, one at a time, without the engine
    for c, (site, layer, unit) in enumerate((("q", 1, 0), ("v", 0, 1), ("pattern", 1, 1))):
        def hook(s, i, x, site=site, layer=layer, unit=unit):
            if s == site and i == layer:
                x = x.clone()
                if site == "pattern":
                    x[:, unit] = runs.clean[(s, i)][:, unit]
                else:
                    x[:, :, unit] = runs.clean[(s, i)][:, :, unit]
            return x
        b = engine.batch
        logits = model.forward(b.corrupt, b.real, b.targets.positions, hook)
        assert abs(float(got[c, 0]) - logit_diff(logits[0, 0], tp)) < 1e-5
    # the pattern patch by hand: the clean run's softmax of L1H1, times the corrupted values
    hand = HandForward(model.store)
    kept = {}

    def keep(i, head, pattern):
        kept[(i, head)] = pattern
        return pattern
    hand(tp.clean, pattern_edit=keep)
    expected = logit_diff(hand(tp.corrupt, pattern_edit=lambda i, head, p: kept[(i, head)]
                               if (i, head) == (1, 1) else p)[0], tp)
    assert abs(float(got[2, 0]) - expected) < 1e-4
    assert abs(expected - runs.baselines.corrupt[0]) > 1e-3  # negative control: it matters


def test_out_figure_export_and_terminal(cli, tmp_path):
    out, export = tmp_path / "p.png", tmp_path / "p.json"
    result = cli("patch", "--out", out, "--export", export, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    import numpy as np
    from PIL import Image

    with Image.open(out) as image:  # read back: drawn, not blank
        assert image.size[0] > 300 and len(np.unique(np.asarray(image.convert("L")))) > 10
    doc = json.loads(export.read_text())
    assert doc["baselines"]["clean"] and doc["grids"][0]["by_pair"][0] == \
        doc["grids"][0]["raw"]  # one pair: its own numbers are the means
    text = result.output
    assert "direction: denoising" in text and "0 = corrupted, 1 = clean" in text
    assert "top: L0 H1" in text.replace("\n", " ")
    # the pair file: two pairs, means ± spread over them
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(f"{BUILT_IN.clean}\t{BUILT_IN.corrupt}\twindow\tforest\n"
                     f"{SECOND.clean}\t{SECOND.corrupt}\tbird\ttree\n")
    two = json.loads(cli("patch", "--pairs", pairs, "--json").output)
    heads = two["grids"][0]
    assert len(heads["by_pair"]) == 2
    import statistics

    for i in range(2):
        for j in range(2):
            per = [(heads["by_pair"][p][i][j] - two["baselines"]["corrupted"][p])
                   / (two["baselines"]["clean_mean"] - two["baselines"]["corrupted_mean"])
                   for p in range(2)]
            assert abs(heads["mean"][i][j] - statistics.mean(per)) < 1e-9
            assert abs(heads["spread"][i][j] - statistics.stdev(per)) < 1e-9
    assert any("differ in length" in note for note in two["notes"])


def test_pair_files_are_read_safely(tmp_path):
    import os

    from attnviz.compute.patching.pairs import MAX_LINE_BYTES, read_pairs

    with pytest.raises(UsageError, match="longer than"):
        read_pairs(Path("/dev/zero"))  # stops at its first over-long line
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="holds no pair"):
        read_pairs(fifo)  # no writer: empty, not a hang
    with pytest.raises(UsageError, match="is a folder"):
        read_pairs(tmp_path)
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"a\tb\tc\n\xff\n")
    with pytest.raises(UsageError, match="line 2 is not UTF-8"):
        read_pairs(bad)
    good = tmp_path / "good.tsv"
    good.write_text("a b\tc b\tx\ty\n" + "x" * 10 + "\n" * 3)
    with pytest.raises(UsageError, match="line 2 has 1 tab-separated"):
        read_pairs(good)  # control: a readable file reaches the parser
    assert MAX_LINE_BYTES == 1 << 16
