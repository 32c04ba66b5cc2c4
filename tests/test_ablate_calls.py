"""`attnviz ablate` edits CALLS, not modules, and measures in float64 what the input defines.

- ALBERT runs one shared attention module for every layer: removing a head of layer n edits the
  n-th call of that module only (a hand-written hook that counts calls is the reference; the old
  hook, which edited every call, is the negative control);
- an encoder–decoder's encoder head under `mean` takes the mean over the SOURCE's real tokens
  (sources and targets padded to different and to equal widths), the measured output staying
  the decoder's; the decoder's mask on the source (the old computation) is the control;
- KL divergences are float64 from the logits (a float64 reference; float32's loss of digits is
  the control);
- one-token sentences leave the loss change undefined: null in JSON, "n/a" in the terminal,
  and never ranked;
- --max-memory holds for the LM-head model the scorecard loads too.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _hook(module, calls, edit):
    """A pre-hook on `module` that applies edit(x) on the calls numbered in `calls` (0 first,
    counted over one forward; None: every call); returns (handle, counter)."""
    seen = [0]

    def hook(m, args):
        n = seen[0]
        seen[0] += 1
        if calls is None or n in calls:
            return (edit(args[0].clone()), *args[1:])
        return None
    return module.register_forward_pre_hook(hook), seen


def _zero(cols):
    def edit(x):
        x[..., cols] = 0
        return x
    return edit


def _set(cols, mean):
    def edit(x):
        x[..., cols] = mean[cols]
        return x
    return edit


# --- ALBERT: one module, one call per layer ------------------------------------------------------

@pytest.fixture(scope="module")
def albert(tmp_path_factory):
    pytest.importorskip("transformers")
    import transformers
    from zoo import build_lm, load_tokenizer

    def sharpen(model):  # outputs far from uniform: KL values well above round-off
        model.get_parameter("predictions.LayerNorm.weight").mul_(30)

    folder = build_lm("albert", tmp_path_factory.mktemp("albert") / "albert",
                      "AlbertForMaskedLM", edit=sharpen)
    model = transformers.AlbertForMaskedLM.from_pretrained(folder).eval()
    # two layers, one shared group: every call the same module
    assert model.config.num_hidden_layers == 2 and model.config.num_hidden_groups == 1
    return folder, model, load_tokenizer(folder)


def _albert_reference(model, tok, sentences, hooks):
    """(hidden per token, float64 log-probabilities per token), sentence by sentence, with
    `hooks` = [(calls, edit)] on the shared W_O module (albert's attention.dense)."""
    dense = model.albert.encoder.albert_layer_groups[0].albert_layers[0].attention.dense
    hidden, logp = [], []
    for sentence in sentences:
        handles = [_hook(dense, calls, edit) for calls, edit in hooks]
        try:
            with torch.no_grad():
                out = model(**tok(sentence, return_tensors="pt"), output_hidden_states=True)
        finally:
            for handle, seen in handles:
                handle.remove()
                assert seen[0] == 2  # the module ran once per layer
        hidden.append(out.hidden_states[-1][0].double())
        logp.append(torch.log_softmax(out.logits[0].double(), -1))
    return torch.cat(hidden), torch.cat(logp)


def _albert_means(model, tok, sentences, call):
    """The mean W_O input of `call` over every token of every sentence (run one at a time)."""
    dense = model.albert.encoder.albert_layer_groups[0].albert_layers[0].attention.dense
    seen = []

    def keep(x):
        seen.append(x[0].clone())
        return x
    for sentence in sentences:
        handle, _ = _hook(dense, {call}, keep)
        with torch.no_grad():
            model(**tok(sentence, return_tensors="pt"))
        handle.remove()
    return torch.cat(seen).mean(0)


def _changes(base, other):
    (h0, p0), (h1, p1) = base, other
    hidden = float(((h1 - h0).norm(dim=-1) / h0.norm(dim=-1)).mean())
    kl = float((p0.exp() * (p0 - p1)).sum(-1).mean())
    return hidden, kl


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_albert_removes_a_head_in_its_own_call_only(albert, mode):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder, model, tok = albert
    sentences = ["the cat sat on the mat", "a dog ran"]  # padded in attnviz's batch
    report = run_heatmap(HeatmapRequest.build(sentences=tuple(sentences), model=str(folder),
                                              ablate=mode, device="cpu")).ablation
    assert report.loss_kind == "KL divergence" and len(report.effects) == 8
    assert [e.layer for e in report.effects] == [0] * 4 + [1] * 4
    base = _albert_reference(model, tok, sentences, [])
    d = model.config.hidden_size // model.config.num_attention_heads
    means = {n: _albert_means(model, tok, sentences, n) for n in (0, 1)}

    def removed(calls, head, mean_of):
        cols = slice(head * d, (head + 1) * d)
        if mode == "zero":
            return _changes(base, _albert_reference(model, tok, sentences,
                                                    [(calls, _zero(cols))]))
        hooks = [({n}, _set(cols, means[n])) for n in sorted(mean_of)]
        return _changes(base, _albert_reference(model, tok, sentences, hooks))

    for effect in report.effects:
        n = effect.layer
        hidden, kl = removed({n}, effect.head, {n})
        # the reference runs sentence by sentence, attnviz a padded batch of copies: their
        # float32 forwards differ by round-off (KL ≥ 1e-10 here; its relative round-off,
        # ≤ 1.3e-3 under `mean`, whose effects are small, 2e-5 under `zero`)
        assert kl > 1e-10
        assert effect.hidden_change == pytest.approx(hidden, rel=1e-3, abs=0)
        assert effect.loss_change == pytest.approx(kl, rel=1e-2, abs=0)
        # the control: the old hook edited every call of the shared module
        everywhere, _ = removed(None if mode == "zero" else {0, 1}, effect.head, {0, 1})
        assert effect.hidden_change != pytest.approx(everywhere, rel=1e-2)
    # both layers' removals of one head differ (the old hook reported one number twice)
    by = {(e.layer, e.head): e.hidden_change for e in report.effects}
    assert all(by[0, h] != pytest.approx(by[1, h], rel=1e-3) for h in range(4))


def test_a_w_o_module_running_more_often_than_its_attention_is_refused():
    """The runtime check that keeps edits on calls: a W_O module whose call count per forward
    is not its attention module's is refused, named."""
    from attnviz.errors import CheckpointError
    from attnviz.sources.hf.ablation import _Runner, _Site

    linear = torch.nn.Linear(4, 4)

    class Twice(torch.nn.Module):  # one attention call, its W_O module run twice
        def forward(self, input_ids, output_hidden_states=False):
            x = input_ids.float()[..., None].expand(-1, -1, 4)
            return (linear(linear(x)),)

    site = _Site(0, "attn.o_proj", linear, 0, None, torch.ones(1, 3, dtype=torch.bool), "0")
    runner = _Runner(Twice(), {"input_ids": torch.ones(1, 3)}, [site], {id(linear): 1})
    with pytest.raises(CheckpointError, match="'attn.o_proj' of layer '0' ran 2 times"):
        runner._forward(1, lambda s, x: x)
    runner.expected = {id(linear): 2}  # the control: the count it really has passes
    runner._forward(1, lambda s, x: x)


# --- encoder–decoder: an encoder head's mean over the source's real tokens -----------------------

@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    pytest.importorskip("transformers")
    import transformers
    from zoo import build_lm, load_tokenizer

    folder = build_lm("t5", tmp_path_factory.mktemp("t5") / "t5", "T5ForConditionalGeneration")
    model = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    return folder, model, load_tokenizer(folder)


def _t5_run(model, tok, source, target, hook=None):
    """(decoder hidden per target token, float64 log-probabilities), one pair, unpadded."""
    ids = tok(source, return_tensors="pt")["input_ids"]
    dec = torch.tensor([[model.config.decoder_start_token_id, *tok(target)["input_ids"]]])
    handle = hook() if hook else None
    try:
        with torch.no_grad():
            out = model(input_ids=ids, decoder_input_ids=dec, output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    return out.decoder_hidden_states[-1][0].double(), torch.log_softmax(out.logits[0].double(), -1)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("sources,targets,same", [
    (("the cat sat on the mat", "a dog ran"), ("the red barn", "a cat"), False),
    (("the cat sat", "a dog ran on"), ("the red barn", "a dog ran"), True)])
def test_t5_encoder_mean_ablation_uses_the_sources_tokens(t5, sources, targets, same):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    folder, model, tok = t5
    src_width = max(len(tok(s)["input_ids"]) for s in sources)
    tgt_width = max(1 + len(tok(t)["input_ids"]) for t in targets)
    assert (src_width == tgt_width) is same
    report = run_heatmap(HeatmapRequest.build(sentences=sources, model=str(folder),
                                              ablate="mean", device="cpu", targets=targets,
                                              layer="enc 1")).ablation
    assert report.loss_kind == "KL divergence" and len(report.effects) == 4
    o = model.encoder.block[1].layer[0].SelfAttention.o
    pairs = list(zip(sources, targets, strict=True))
    base = [_t5_run(model, tok, s, t) for s, t in pairs]
    inputs = []  # the W_O input over each source's tokens (unpadded: all real)
    for s, t in pairs:
        _t5_run(model, tok, s, t, lambda: o.register_forward_pre_hook(
            lambda m, args: inputs.append(args[0][0].clone())))
    mean = torch.cat(inputs).mean(0)
    # the control, the old computation: the padded source's W_O input averaged over the
    # positions the DECODER's mask marks (only possible where the widths agree)
    padded = torch.zeros(len(pairs), src_width, mean.shape[0])
    for b, x in enumerate(inputs):
        padded[b, :x.shape[0]] = x
    dec_real = torch.zeros(len(pairs), tgt_width, dtype=torch.bool)
    for b, t in enumerate(targets):
        dec_real[b, :1 + len(tok(t)["input_ids"])] = True

    def removed(head, value):
        cols = slice(head * 8, (head + 1) * 8)
        runs = [_t5_run(model, tok, s, t, lambda: _hook(o, None, _set(cols, value))[0])
                for s, t in pairs]
        return _changes((torch.cat([h for h, _ in base]), torch.cat([p for _, p in base])),
                        (torch.cat([h for h, _ in runs]), torch.cat([p for _, p in runs])))

    for effect in report.effects:
        assert effect.label == "enc 1"
        hidden, kl = removed(effect.head, mean)
        assert effect.hidden_change == pytest.approx(hidden, rel=1e-4, abs=1e-9)
        assert effect.loss_change == pytest.approx(kl, rel=1e-3, abs=1e-9)
        if same:
            old = padded[dec_real].mean(0)
            wrong, _ = removed(effect.head, old)
            assert effect.hidden_change != pytest.approx(wrong, rel=1e-3)


# --- float64 divergences --------------------------------------------------------------------------

def _kl_by_hand(p_logits, q_logits):
    """KL(p ‖ q) of one position in Python floats (float64), log-sum-exp by math.fsum."""
    def log_softmax(row):
        top = max(row)
        total = math.log(math.fsum(math.exp(v - top) for v in row)) + top
        return [v - total for v in row]
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True))


def test_kl_is_float64_from_float32_logits():
    """Float32 logits far from zero, nearly equal: the KL of the float32 values, computed in
    float64, against a by-hand float64 reference; float32 arithmetic (the old computation)
    misses it by far more than the tolerance."""
    from attnviz.compute.measures.ablation_measures import kl_divergence

    rng = random.Random(0)
    base = torch.tensor([[[800.0 + rng.gauss(0, 2) for _ in range(50)] for _ in range(3)]])
    other = base + torch.tensor([[[rng.gauss(0, 1e-3) for _ in range(50)] for _ in range(3)]])
    real = torch.tensor([[True, True, False]])
    expected = sum(_kl_by_hand(base[0, t].double().tolist(), other[0, t].double().tolist())
                   for t in range(2)) / 2
    got = kl_divergence(base, other, real)
    assert got == pytest.approx(expected, rel=1e-9)
    log_p, log_q = torch.log_softmax(base, -1), torch.log_softmax(other, -1)  # float32
    old = float((log_p.exp() * (log_p - log_q)).sum(-1)[real].mean())
    assert old != pytest.approx(expected, rel=1e-2)


def test_losses_are_float64_and_undefined_without_a_next_token():
    from attnviz.compute.measures.ablation_measures import next_token_losses

    torch.manual_seed(0)
    logits = (torch.randn(2, 4, 30) + 500).float()
    ids = torch.tensor([[3, 5, 3, 0], [7, 0, 0, 0]])
    real = torch.tensor([[True, True, True, False], [True, False, False, False]])
    mean, repeat = next_token_losses(logits, ids, real)
    lp = torch.log_softmax(logits.double(), -1)
    expected = -(lp[0, 0, 5] + lp[0, 1, 3]) / 2  # sentence 2 has no next token
    assert mean == pytest.approx(float(expected), rel=1e-12)
    assert repeat == pytest.approx(float(-lp[0, 1, 3]), rel=1e-12)  # 3 repeats token 0
    assert mean != pytest.approx(float(-(lp[0, 0, 5] + lp[0, 1, 3] + lp[1, 0, 0]) / 3), rel=1e-6)
    assert next_token_losses(logits, ids, torch.tensor([[True, False, False, False]] * 2)) \
        == (None, None)


# --- one-token sentences: undefined, shown so, never ranked ---------------------------------------

def test_one_token_sentences_leave_the_loss_change_undefined(cli):
    from attnviz.compute.measures.ablation_measures import NO_NEXT_TOKEN

    result = cli("ablate", "hello", "world", "zero", "--mode", "zero", "--no-maps", "--rank",
                 "--overview", "ablation", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    effects = doc["ablation"]
    assert effects and all(e["loss_change"] is None and e["repeat_loss_change"] is None
                           for e in effects)
    assert doc["ablation_run"]["undefined"]["loss_change"] == NO_NEXT_TOKEN
    assert doc["ablation_run"]["base_loss"] is None
    # the overview's key names the loss change: its cells are undefined, not hidden changes
    cells = [c["value"] for row in doc["overview"]["rows"] for c in row["heads"]]
    assert len(cells) == len(effects) and all(v is None for v in cells)
    causal = next(r for r in doc["ranking"] if r["type"] == "causal (ablation)")
    # ranked by what is defined: the hidden changes, largest first, saying why
    expected = sorted(effects, key=lambda e: (-e["hidden_change"], e["layer"], e["head"]))
    assert [(h["layer"], h["head"]) for h in causal["heads"]] == \
        [(e["layer"], e["head"]) for e in expected[:len(causal["heads"])]]
    assert causal["statistic"] == "hidden change" and NO_NEXT_TOKEN in causal["meaning"]
    # the control: index order (what ranking by NaN gave) is not the hidden-change order
    assert [(h["layer"], h["head"]) for h in causal["heads"]] != \
        [(e["layer"], e["head"]) for e in effects[:len(causal["heads"])]]

    defined = json.loads(cli("ablate", "hello world", "zero", "--mode", "zero", "--no-maps",
                             "--overview", "ablation", "--json").stdout)
    by_head = {(e["layer"], e["head"]): e["loss_change"] for e in defined["ablation"]}
    shown = {(row["layer"], c["head"]): c["value"] for row in defined["overview"]["rows"]
             for c in row["heads"]}
    assert shown == by_head and None not in shown.values()

    text = cli("ablate", "hello", "world", "zero", "--mode", "zero", "--no-maps")
    assert text.exit_code == 0, text.output
    assert "nan" not in text.stdout.lower().replace("n/a", "")
    assert "n/a: no next token to predict" in " ".join(text.stdout.split())
    first = expected[0]
    assert "largest effect (by the hidden change" in text.stdout
    line = " ".join(text.stdout.split()).split("largest effect")[1].split("; pattern")[0]
    assert f"one token): L{first['label']}.{first['head']} (" in line


def test_a_report_never_ranks_undefined_entries():
    from attnviz.app.ablation_view import causal_ranking
    from attnviz.compute.measures.ablation_measures import AblationReport, HeadEffect

    effects = [HeadEffect(0, "0", 0, 0.1, float("nan")), HeadEffect(0, "0", 1, 0.3, 0.5),
               HeadEffect(1, "1", 0, 0.2, None), HeadEffect(1, "1", 1, 0.4, 0.2)]
    report = AblationReport("zero", "KL divergence", effects)
    ranking = causal_ranking(report, 10)
    assert [(h.layer, h.head) for h in ranking.heads] == [(0, 1), (1, 1)]
    assert report.ranked_field == "loss_change" and report.fallback is None
    assert json.loads(json.dumps(effects[0].to_json(), allow_nan=False))["loss_change"] is None


# --- --max-memory holds for the LM-head model too -------------------------------------------------

@pytest.fixture(scope="module")
def big_llama(tmp_path_factory):
    """A LLaMA with an LM head and 134 MB of float32 weights: enough that a second, whole copy
    in memory shows in the process's peak, well above the interpreter's own noise."""
    pytest.importorskip("transformers")
    import transformers
    from zoo import ZOO, save_tokenizer

    folder = tmp_path_factory.mktemp("big-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=2000, pad_token_id=1,
                                      bos_token_id=2, eos_token_id=3, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_tokenizer(folder, ZOO["llama"])
    return folder


@pytest.mark.hf
@pytest.mark.slow
def test_max_memory_scorecard_is_offloaded_and_equal(big_llama):
    """The LM-head model loads under the same limit (the note says so) and its scorecard
    equals the unlimited run's."""
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    def scorecard(**limit):
        return run_heatmap(HeatmapRequest.build(
            sentences=("the cat sat on the mat",), model=str(big_llama), ablate="zero",
            device="cpu", layer="0", **limit)).ablation

    bounded, whole = scorecard(max_memory=16 * 2**20), scorecard()
    assert any("LM-head model is loaded under the same" in note and "offloaded to disk" in note
               for note in bounded.notes), bounded.notes
    assert not any("under the same" in note for note in whole.notes)
    for b, w in zip(bounded.effects, whole.effects, strict=True):
        assert (b.layer, b.head) == (w.layer, w.head)
        assert b.hidden_change == pytest.approx(w.hidden_change, rel=1e-5, abs=1e-9)
        assert b.loss_change == pytest.approx(w.loss_change, rel=1e-4, abs=1e-7)


def test_the_lm_head_model_is_placed_as_the_first_load_was():
    """The LM-head model's from_pretrained placement follows the first load: --max-memory's
    limits and a fresh offload folder; a device map (accelerate's, which --device-map auto
    leaves where it spread the model) as "auto"; else none (moved to the first load's
    device)."""
    from types import SimpleNamespace

    from attnviz.sources.hf.ablation import _lm_placement

    model = torch.nn.Embedding(4, 2)
    model.get_input_embeddings = lambda: model
    bounded, folder = _lm_placement(SimpleNamespace(model=model, max_memory=5_000))
    try:
        assert bounded == {"device_map": "auto", "max_memory": {"cpu": 5_000},
                           "offload_folder": folder.name}
    finally:
        folder.cleanup()
    model.hf_device_map = {"": "cpu"}
    assert _lm_placement(SimpleNamespace(model=model, max_memory=None)) == \
        ({"device_map": "auto"}, None)
    del model.hf_device_map  # the control: one device, no map
    assert _lm_placement(SimpleNamespace(model=model, max_memory=None)) == ({}, None)


def _peak_mb(*args, command="heatmap"):
    """The peak resident memory (MB) of one `attnviz COMMAND` process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # this checkout's attnviz, not another
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    script = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
              "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", script, sys.executable, "-m", "attnviz",
                           command, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)
    code, peak = done.stdout.split()[-2:]
    assert code == "0", done.stdout + done.stderr
    return int(peak) / 1024  # ru_maxrss is in KB on Linux


@pytest.mark.hf
@pytest.mark.slow
def test_max_memory_bounds_the_scorecards_peak(big_llama):
    """ablate under --max-memory 16MB peaks about where --max-memory alone does; the control,
    ablate without a limit, holds both 134 MB models whole and peaks far higher."""
    base = ("--model", big_llama, "the cat sat on the mat", "--no-maps", "--layer", "0")
    limited = _peak_mb(*base, "--max-memory", "16MB")
    ablated = _peak_mb(*base, "--max-memory", "16MB", "--mode", "zero", command="ablate")
    unbounded = _peak_mb(*base, "--mode", "zero", command="ablate")
    assert ablated < limited + 60, (limited, ablated, unbounded)
    assert unbounded > ablated + 150, (limited, ablated, unbounded)


@pytest.mark.hf
@pytest.mark.slow
def test_hf_causal_lm_one_token_sentences_are_undefined(tmp_path):
    """GPT-2 (no <s> added) on one-word sentences: no next token anywhere, so the loss change
    is undefined for every head and the ranking goes by the hidden change; the control, a
    two-word sentence, defines it."""
    from zoo import build_lm

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.compute.measures.ablation_measures import NO_NEXT_TOKEN

    folder = build_lm("gpt2", tmp_path / "gpt2", "GPT2LMHeadModel")

    def report(*sentences):
        return run_heatmap(HeatmapRequest.build(sentences=sentences, model=str(folder),
                                                ablate="zero", device="cpu")).ablation

    one = report("cat", "dog")
    assert one.loss_kind == "next-token loss" and one.base_loss is None
    assert all(e.loss_change is None and e.hidden_change > 0 for e in one.effects)
    assert one.undefined["loss_change"] == NO_NEXT_TOKEN and one.measure == "hidden change"
    assert [e.hidden_change for e in one.ranked()] == \
        sorted((e.hidden_change for e in one.effects), reverse=True)
    two = report("the cat")
    assert two.base_loss is not None and "loss_change" not in two.undefined
    assert all(e.loss_change is not None and math.isfinite(e.loss_change) for e in two.effects)
    assert two.measure == "loss change"


def test_rank_heads_never_ranks_a_nan_statistic():
    """A NaN statistic (undefined) is left out of its type's ranking, not sorted by index; the
    control: the same head with a number is ranked."""
    from attnviz.compute.measures.ranking import rank_heads
    from attnviz.compute.measures.stats import HeadStats

    def stats(head, previous):
        return HeadStats(0, head, 1.0, 0.5, 1.0, 0.1, previous, 0.2, None, None)

    row = next(r for r in rank_heads([stats(0, float("nan")), stats(1, 0.4)], top=5)
               if r.head_type == "previous-token")
    assert [(h.head, h.score) for h in row.heads] == [(1, 0.4)]
    row = next(r for r in rank_heads([stats(0, 0.9), stats(1, 0.4)], top=5)
               if r.head_type == "previous-token")
    assert [h.head for h in row.heads] == [0, 1]
