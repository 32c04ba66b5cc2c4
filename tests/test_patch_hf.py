"""attnviz patch on tiny Hugging Face causal LMs of the zoo (grouped-query llama, multi-query
sliding-window mistral, GPT-2's fused Conv1D qkv, Gemma-2's softcapping and alternating
sliding windows, Qwen3's per-head q/k norms): every number against the model's own forward
with plain hand-written hooks on its own modules, each check with a negative control."""

from __future__ import annotations

import json

import pytest
import torch

from attnviz.compute.patching.engine import Engine, Patch, pair_batch
from attnviz.compute.patching.pairs import PromptPair, tokenize_pair
from attnviz.compute.patching.sweeps import baseline_runs, path_sweep
from attnviz.core.choices import PatchDirection, PatchMetric

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
KINDS = ["llama", "mistral", "gpt2", "gemma2", "qwen3"]
GROUPED = ["llama", "mistral", "gemma2"]
PAIRS = [PromptPair("the cat sat on the mat", "the dog sat on the mat", "cat", "dog"),
         PromptPair("a small dog ran far away from the big red", "a small cat ran far away "
                    "from the big red", "dog", "cat")]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """lm(kind) -> HFPatchModel: the zoo's causal LM with a sharper LM head (its logits ×30)
    and louder heads (W_O ×8), so that a random model's heads change its answer visibly."""
    pytest.importorskip("transformers")
    from zoo import build_lm

    from attnviz.sources.hf.patching import open_patch_model

    built = {}

    def sharpen(model):
        model.get_output_embeddings().weight.mul_(30.0)
        for name, param in model.named_parameters():  # heads that write visibly
            if name.endswith(("o_proj.weight", "attn.c_proj.weight")):
                param.mul_(8.0)

    def get(kind):
        if kind not in built:
            folder = build_lm(kind, tmp_path_factory.mktemp(kind), edit=sharpen)
            built[kind] = open_patch_model(str(folder))
        return built[kind]
    return get


def engine_for(model, pairs=PAIRS):
    tokenized = [tokenize_pair(p, model.tokenizer, PatchMetric.LOGIT_DIFF) for p in pairs]
    return Engine(model, pair_batch(tokenized, PatchMetric.LOGIT_DIFF)), tokenized


def own_metric(model, ids, tp, hooks=()):
    """The model's own forward on one unpadded prompt, with plain hooks: the logit difference."""
    handles = [module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
               for module, fn, pre in hooks]
    try:
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return float(logits[tp.answer[0]].double() - logits[tp.wrong].double())


def o_proj(model, layer):
    for name in (f"model.layers.{layer}.self_attn.o_proj", f"transformer.h.{layer}.attn.c_proj"):
        found = dict(model.model.named_modules()).get(name)
        if found is not None:
            return found
    raise AssertionError("no o_proj")


def record_input(store, key):
    def hook(module, args):
        store[key] = args[0].detach().clone()
    return hook


@pytest.mark.parametrize("kind", KINDS)
def test_padded_baselines_equal_the_models_own_forward_alone(lm, kind):
    model = lm(kind)
    engine, tokenized = engine_for(model)
    assert len(set(engine.batch.lengths)) == 2  # padded
    runs = baseline_runs(engine, set(), "")
    for p, tp in enumerate(tokenized):
        assert abs(runs.baselines.clean[p] - own_metric(model, tp.clean, tp)) < 1e-4
        assert abs(runs.baselines.corrupt[p] - own_metric(model, tp.corrupt, tp)) < 1e-4
    # negative control: the padded batch read at its last column (a reader that forgets each
    # pair's own length) gives another number for the short pair
    b = engine.batch
    short = min(range(2), key=lambda p: b.lengths[p])
    b.targets.positions[short] = b.length - 1
    assert abs(float(engine.run(False)[0][short]) - runs.baselines.clean[short]) > 1e-4
    assert abs(runs.baselines.clean[0] - runs.baselines.corrupt[0]) > 1e-3  # something to patch


@pytest.mark.parametrize("kind", KINDS)
def test_identities(lm, kind):
    model = lm(kind)
    engine, _ = engine_for(model)
    runs = baseline_runs(engine, {"z", "resid"}, "")
    every = tuple(Patch("z", layer) for layer in range(model.n_layers))
    scores, _ = engine.patched(True, [every, (), (Patch("resid", 0),),
                                      (Patch("resid", model.n_layers - 1),)],
                               {"source": runs.clean})
    clean = torch.tensor(runs.baselines.clean, dtype=torch.float64)
    corrupt = torch.tensor(runs.baselines.corrupt, dtype=torch.float64)
    # every head at every position: the last token is the same in both prompts, so only
    # attention carries the corrupted token to it, and the clean metric comes back
    assert (scores[0] - clean).abs().max() < 1e-5
    assert (scores[1] - corrupt).abs().max() < 1e-5
    assert (scores[2] - clean).abs().max() < 1e-5
    assert (scores[3] - clean).abs().max() < 1e-5
    # negative control: the clean activations one position off break the identity
    shifted = {key: value.roll(1, dims=1) for key, value in runs.clean.items()}
    wrong, _ = engine.patched(True, [every], {"source": shifted})
    assert (wrong[0] - clean).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_one_head_equals_a_hand_written_hook_on_w_o(lm, kind):
    model = lm(kind)
    engine, (tp, _) = engine_for(model, PAIRS)
    runs = baseline_runs(engine, {"z"}, "")
    d = model.head_dim
    results = {}
    for layer, head in ((0, 1), (1, 2)):
        module = o_proj(model, layer)
        clean = {}
        own_metric(model, tp.clean, tp, [(module, record_input(clean, "x"), True)])

        def patch(module, args, head=head, clean=clean):
            x = args[0].clone()
            x[..., head * d:(head + 1) * d] = clean["x"][..., head * d:(head + 1) * d]
            return (x, *args[1:])
        expected = own_metric(model, tp.corrupt, tp, [(module, patch, True)])
        got, _ = engine.patched(True, [(Patch("z", layer, head),)], {"source": runs.clean})
        assert abs(float(got[0, 0]) - expected) < 1e-4
        results[(layer, head)] = expected
    # negative control: the two heads' patches differ, so the check tells heads apart
    assert abs(results[(0, 1)] - results[(1, 2)]) > 1e-5


def k_proj_output(model, layer):
    modules = dict(model.model.named_modules())
    return modules[f"model.layers.{layer}.self_attn.k_proj"]


@pytest.mark.parametrize("kind", GROUPED)
def test_grouped_kv_patch_equals_a_hook_on_k_proj(lm, kind):
    """A key/value head's k patch equals replacing its rows of k_proj's output (before rotary:
    the same positions rotate the same way) — per key/value head, as repeat_kv shares it."""
    model = lm(kind)
    engine, (tp, _) = engine_for(model, PAIRS)
    runs = baseline_runs(engine, {"k"}, "")
    d = model.head_dim
    module = k_proj_output(model, 0)
    clean = {}

    def keep(module, args, output):
        clean["k"] = output.detach().clone()
    own_metric(model, tp.clean, tp, [(module, keep, False)])
    got = {}
    for kv in range(model.n_kv_heads):
        def patch(module, args, output, kv=kv):
            output = output.clone()
            output[..., kv * d:(kv + 1) * d] = clean["k"][..., kv * d:(kv + 1) * d]
            return output
        expected = own_metric(model, tp.corrupt, tp, [(module, patch, False)])
        scores, _ = engine.patched(True, [(Patch("k", 0, kv),)], {"source": runs.clean})
        assert abs(float(scores[0, 0]) - expected) < 1e-4
        got[kv] = expected
    # negative control: patching the keys differs from the corrupted run
    assert abs(got[0] - runs.baselines.corrupt[0]) > 1e-5


def hand_path(model, tp, base_ids, other_ids, sender, receiver):
    """Wang et al.'s two passes with plain hooks on o_proj (and q_proj for a q receiver)."""
    d = model.head_dim
    base, other = {}, {}
    own_metric(model, base_ids, tp, [(o_proj(model, i), record_input(base, i), True)
                                     for i in range(model.n_layers)])
    own_metric(model, other_ids, tp, [(o_proj(model, i), record_input(other, i), True)
                                      for i in range(model.n_layers)])

    def freeze(i):
        def hook(module, args):
            x = base[i].clone()
            if i == sender[0]:
                cols = slice(sender[1] * d, (sender[1] + 1) * d)
                x[..., cols] = other[i][..., cols]
            return (x, *args[1:])
        return hook
    frozen = [(o_proj(model, i), freeze(i), True) for i in range(model.n_layers)]
    if receiver is None:
        return own_metric(model, base_ids, tp, frozen)
    layer, head = receiver
    q_proj = dict(model.model.named_modules())[f"model.layers.{layer}.self_attn.q_proj"]
    seen = {}

    def keep(module, args, output):
        seen["q"] = output.detach().clone()
    own_metric(model, base_ids, tp, frozen + [(q_proj, keep, False)])

    def patch(module, args, output):
        output = output.clone()
        output[..., head * d:(head + 1) * d] = seen["q"][..., head * d:(head + 1) * d]
        return output
    return own_metric(model, base_ids, tp, [(q_proj, patch, False)])


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("receiver", [None, (1, 3)])
def test_path_patching_equals_hand_written_two_passes(lm, kind, receiver):
    model = lm(kind)
    # the corrupted token next to the last, inside Gemma-2's 4-token sliding window
    near = PromptPair("the cat sat on the mat", "the cat sat on a mat", "cat", "dog")
    engine, (tp,) = engine_for(model, [near])
    runs = baseline_runs(engine, {"z"}, "")
    grid = path_sweep(runs, PatchDirection.NOISING, [receiver] if receiver else [], "q",
                      lambda _: None)
    values = []
    for layer in range(len(grid.rows)):
        for head in range(model.n_heads):
            expected = hand_path(model, tp, tp.clean, tp.corrupt, (layer, head), receiver)
            assert abs(grid.raw[layer][head] - expected) < 1e-4, (layer, head)
            values.append(expected)
    # negative control: the senders' numbers are not all the same
    assert max(values) - min(values) > 1e-5


def test_cli_runs_every_site_and_asks_an_encoder_decoder_for_its_target(cli, lm, tmp_path):
    from zoo import build_lm

    model = lm("llama")
    args = ["patch", "the cat sat on the mat", "-c", "the dog sat on the mat", "-a", "cat",
            "--wrong", "dog", "--model", str(model.name)]
    result = cli(*args, "--json", "--site", "heads,residual,q,k,v,pattern,path,attribution",
                 "--direction", "both")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    sites = {(g["site"], g["direction"]) for g in doc["grids"]}
    assert ("k", "noising") in sites and ("attribution-heads", "denoising") in sites
    k = next(g for g in doc["grids"] if g["site"] == "k")
    assert k["cols"] == ["KV0", "KV1"] and "query heads 0-1" in k["col_notes"][0]
    folder = build_lm("t5", tmp_path / "t5")
    refused = cli("patch", "a b", "-c", "a c", "-a", "b", "--model", str(folder))
    assert refused.exit_code == 2
    assert "encoder-decoder" in refused.output


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_equals_whole_copies(lm, kind, monkeypatch):
    """One pair's copies share the run before their first patched layer (one row, copied at
    that layer's input): the same numbers as every copy run whole; the control shows the
    shared forward did run (fewer rows before the layer)."""
    model = lm(kind)
    engine, _ = engine_for(model, PAIRS[:1])
    engine.shortcuts = False  # the shared prefix run, not skipped (see the test below)
    runs = baseline_runs(engine, {"z"}, "")
    copies = [(Patch("z", 1, h),) for h in range(model.n_heads)]
    assert engine.shares(copies) == 1
    rows = []
    real_forward = model.forward

    def counting(ids, real, read, hook):
        rows.append(ids.shape[0])
        return real_forward(ids, real, read, hook)
    monkeypatch.setattr(model, "forward", counting)
    shared = engine.sweep(True, copies, {"source": runs.clean})
    monkeypatch.setattr(engine, "shares", lambda copies, record=frozenset(): None)
    whole = engine.sweep(True, copies, {"source": runs.clean})
    assert (shared - whole).abs().max() < 1e-5
    assert rows[0] == 1 and rows[-1] == model.n_heads


MORE = ["gpt_neox", "phi3", "falcon", "bloom", "opt", "gptj", "gpt_bigcode", "olmo2", "gemma3",
        "mixtral", "gpt_neo", "phi"]


@pytest.mark.parametrize("kind", MORE)
def test_more_families_keep_the_identities(lm, kind):
    """Fused and interleaved qkv (NeoX, Falcon, BLOOM), multi-query BigCode, MoE, per-head
    norms, and models outside the attention interface (their q/k/v/pattern refused, said in
    the notes): the baseline is the model's own, every head patched restores the clean run."""
    model = lm(kind)
    engine, (tp,) = engine_for(model, PAIRS[:1])
    runs = baseline_runs(engine, {"z", "resid"} & set(model.sites), "")
    assert abs(runs.baselines.clean[0] - own_metric(model, tp.clean, tp)) < 1e-4
    every = tuple(Patch("z", layer) for layer in range(model.n_layers))
    scores, _ = engine.patched(True, [every, (Patch("resid", 0),), ()], {"source": runs.clean})
    assert abs(float(scores[0, 0]) - runs.baselines.clean[0]) < 1e-5
    assert abs(float(scores[1, 0]) - runs.baselines.clean[0]) < 1e-5
    assert abs(float(scores[2, 0]) - runs.baselines.corrupt[0]) < 1e-5
    assert abs(runs.baselines.clean[0] - runs.baselines.corrupt[0]) > 1e-5  # control
    if "q" not in model.sites:
        assert any("attention interface" in note for note in model.notes)


def test_sites_outside_the_interface_are_refused(cli, lm):
    model = lm("falcon")
    args = ["patch", "the cat sat on the mat", "-c", "the dog sat on the mat", "-a", "cat",
            "--wrong", "dog", "--model", model.name]
    refused = cli(*args, "--site", "q")
    assert refused.exit_code == 2 and "--site q is not reachable" in refused.output
    assert cli(*args, "--site", "heads", "--json").exit_code == 0  # control


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    pytest.importorskip("transformers")
    from zoo import build_lm

    from attnviz.sources.hf.patching import open_patch_model

    built = {}

    def get(kind):
        if kind not in built:
            folder = build_lm(kind, tmp_path_factory.mktemp(kind))
            built[kind] = open_patch_model(str(folder), target="the")
        return built[kind]
    return get


def own_seq2seq(model, ids, tp, hooks=()):
    handles = [module.register_forward_pre_hook(fn) for module, fn in hooks]
    try:
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor([ids]), use_cache=False,
                                 decoder_input_ids=torch.tensor([model.target])).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return float(logits[tp.answer[0]].double() - logits[tp.wrong].double())


@pytest.mark.parametrize("kind, cross", [("t5", "decoder.block.0.layer.1.EncDecAttention.o"),
                                         ("bart", "model.decoder.layers.0.encoder_attn.out_proj")])
def test_encoder_decoder_on_the_decoder_side(seq2seq, kind, cross):
    """The prompts are the encoder's input, the answer follows --target: the baselines are the
    model's own, every head patched restores the clean run, and a cross-attention head's patch
    equals a hand-written pre-hook on its own output projection."""
    model = seq2seq(kind)
    assert model.layer_labels == ["enc 0", "enc 1", "dec 0", "cross 0", "dec 1", "cross 1"]
    engine, (tp,) = engine_for(model, PAIRS[:1])
    runs = baseline_runs(engine, {"z"}, "")
    assert abs(runs.baselines.clean[0] - own_seq2seq(model, tp.clean, tp)) < 1e-4
    assert abs(runs.baselines.corrupt[0] - own_seq2seq(model, tp.corrupt, tp)) < 1e-4
    every = tuple(Patch("z", layer) for layer in range(model.n_layers))
    scores, _ = engine.patched(True, [every, (), (Patch("z", 3, 1),)], {"source": runs.clean})
    assert abs(float(scores[0, 0]) - runs.baselines.clean[0]) < 1e-5
    assert abs(float(scores[1, 0]) - runs.baselines.corrupt[0]) < 1e-5
    module = dict(model.model.named_modules())[cross]
    clean, d = {}, model.head_dim
    own_seq2seq(model, tp.clean, tp, [(module, record_input(clean, "x"))])

    def patch(module, args):
        x = args[0].clone()
        x[..., d:2 * d] = clean["x"][..., d:2 * d]
        return (x, *args[1:])
    expected = own_seq2seq(model, tp.corrupt, tp, [(module, patch)])
    assert abs(float(scores[2, 0]) - expected) < 1e-5
    assert abs(expected - runs.baselines.corrupt[0]) > 1e-6  # control: the patch matters


def test_encoder_decoder_cli(cli, seq2seq):
    model = seq2seq("t5")
    args = ["patch", "the cat sat on the mat", "-c", "the dog sat on the mat", "-a", "cat",
            "--wrong", "dog", "--model", model.name]
    doc = json.loads(cli(*args, "--target", "the", "--json", "--site",
                         "heads,path,attribution").output)
    assert doc["grids"][0]["rows"][3] == "cross 0"
    assert {g["site"] for g in doc["grids"]} == {"heads", "path", "attribution-heads"}
    refused = cli(*args)  # no --target
    assert refused.exit_code == 2 and "--target" in refused.output
    assert cli(*args, "--target", "the", "--per-position").exit_code == 2


def test_prompts_past_the_models_positions_are_refused(cli, lm):
    model = lm("gpt2")  # 64 learned positions
    long = " ".join(["the cat sat on the mat"] * 12)
    args = ["patch", long, "-c", long.replace("cat", "dog", 1), "-a", "cat", "--wrong", "dog",
            "--model", model.name]
    refused = cli(*args)
    assert refused.exit_code == 2 and "more than the model's 64 positions" in refused.output
    short = ["patch", "the cat sat", "-c", "the dog sat", "-a", "cat", "--wrong", "dog",
             "--model", model.name, "--json"]
    assert cli(*short).exit_code == 0  # control


def _calls(model, monkeypatch):
    """Counters of W_O calls and of eager attention calls in `model`'s forwards."""
    from attnviz.sources.hf import patching

    counts = {"w_o": 0, "attention": 0}
    for module in dict.fromkeys(model.o_modules):
        module.register_forward_pre_hook(lambda *_: counts.__setitem__("w_o", counts["w_o"] + 1))
    eager = patching.eager_function

    def counted(module):
        inner = eager(module)

        def run(*args, **kwargs):
            counts["attention"] += 1
            return inner(*args, **kwargs)
        return run
    monkeypatch.setattr(patching, "eager_function", counted)
    return counts


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2", "mixtral", "falcon"])
@pytest.mark.parametrize("pairs", [1, 2])
def test_shortcuts_equal_the_whole_forward(lm, kind, pairs, monkeypatch):
    """The engine's shortcuts — a patched forward starting at its first patched layer from the
    unpatched run's stream, a frozen layer's attention skipped, path patching's first pass to
    receivers stopped once it has their inputs — give the numbers of the whole forward (every
    head, path to the logits and to a receiver, both directions; one pair, and two padded
    pairs). Controls: the shortcuts ran (fewer W_O and attention calls; Falcon's blocks return
    tuples, so it runs whole), and a wrong starting stream or a wrongly frozen layer is caught."""
    from attnviz.compute.patching import engine as engine_module
    from attnviz.compute.patching.sweeps import head_sweep

    model = lm(kind)
    fast, _ = engine_for(model, PAIRS[:pairs])
    slow, _ = engine_for(model, PAIRS[:pairs])
    slow.shortcuts = False
    runs = {"fast": baseline_runs(fast, {"z"}, ""), "slow": baseline_runs(slow, {"z"}, "")}
    counts = _calls(model, monkeypatch)
    used = {}

    def grids(name):
        before = dict(counts)
        found = []
        for direction in PatchDirection:
            found += head_sweep(runs[name], direction, "z", lambda _: None).raw
            for receivers in ([], [(1, 1)]):
                found += path_sweep(runs[name], direction, receivers, "q",
                                    lambda _: None).raw
        used[name] = {k: counts[k] - before[k] for k in counts}
        return torch.tensor([v for row in found for v in row], dtype=torch.float64)
    whole, quick = grids("slow"), grids("fast")
    assert (quick - whole).abs().max() < 1e-5
    if model.starts:
        assert used["fast"]["w_o"] < used["slow"]["w_o"]
        assert used["fast"]["attention"] < used["slow"]["attention"]
    else:
        assert used["fast"] == used["slow"]
        return
    assert (whole - whole.mean()).abs().max() > 1e-4  # the grids are not flat
    # negative control 1: start layer 1 from the other run's stream — the numbers change
    copies = [(Patch("z", 1, h),) for h in range(model.n_heads)]
    right = fast.sweep(True, copies, {"source": runs["fast"].clean})
    good = dict(fast.starts)
    fast.starts = {True: good[False], False: good[True]}
    wrong = fast.sweep(True, copies, {"source": runs["fast"].clean})
    fast.starts = good
    assert (wrong - right).abs().max() > 1e-4
    # negative control 2: one head patched (not the whole layer) and the layer skipped anyway
    monkeypatch.setattr(engine_module, "_frozen", lambda copies, plan, record: frozenset({1}))
    frozen = fast.sweep(True, copies, {"source": runs["fast"].clean})
    assert (frozen - right).abs().max() > 1e-4


def test_frozen_layers_are_whole_in_every_copy():
    """Only a layer whose head outputs every copy replaces at every head and position, and
    whose pattern nobody touches, counts as frozen."""
    from attnviz.compute.patching.engine import _frozen, _plan

    whole = (Patch("z", 1, None, None, "base"), Patch("z", 1, 2), Patch("z", 2, None, None))
    copies = [whole, whole]
    assert _frozen(copies, _plan(copies), frozenset()) == {1, 2}
    partial = [whole, (Patch("z", 1, None, None, "base"), Patch("z", 2, 0))]
    assert _frozen(partial, _plan(partial), frozenset()) == {1}
    at = [(Patch("z", 1, None, 3),)]
    assert _frozen(at, _plan(at), frozenset()) == frozenset()
    assert _frozen(copies, _plan(copies), {("pattern", 2)}) == {1}


@pytest.mark.parametrize("kind,shares", [("llama", True), ("gpt2", True), ("bloom", False),
                                         ("gpt_bigcode", False), ("xglm", False)])
def test_the_shared_prefix_runs_only_where_its_trial_holds(lm, kind, shares):
    """BLOOM's ALiBi bias, multi-query GPTBigCode's reshapes and XGLM's mask check are built
    for the batch the forward began with: copies made at a layer's input break them. A trial at
    load decides; either way one pair's patched copies equal the copies run whole. Control:
    forced on, those families fail or differ."""
    model = lm(kind)
    assert model.shares_prefix is shares
    engine, _ = engine_for(model, PAIRS[:1])
    engine.shortcuts = False
    runs = baseline_runs(engine, {"z"}, "")
    copies = [(Patch("z", 1, h),) for h in range(model.n_heads)]
    got = engine.sweep(True, copies, {"source": runs.clean})
    whole = Engine(model, engine.batch)
    whole.shortcuts = False
    whole.shares = lambda copies, record=frozenset(): None  # type: ignore[method-assign]
    assert (got - whole.sweep(True, copies, {"source": runs.clean})).abs().max() < 1e-5
    if shares:
        return
    model.shares_prefix = True
    try:
        assert engine.shares(copies) == 1
        forced = engine.sweep(True, copies, {"source": runs.clean})
    except (RuntimeError, ValueError):
        return
    finally:
        model.shares_prefix = False
    assert (forced - got).abs().max() > 1e-5
