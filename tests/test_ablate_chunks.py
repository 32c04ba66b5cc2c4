"""How the scorecard splits its copies into forwards (issue 33, item 9): every chunking the memory
budget can choose gives the same numbers (≤ 1e-6), with or without reusing the unablated run's
prefix of blocks; negative controls show the comparison catches a chunk that skips one block too
many, and that the prefix's proof (`Prefix.confirm`) catches a recorded prefix that is not the
model's."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from attnviz.sources.copy_budget import (
    CPU_STACK_BYTES,
    MAX_COPIES,
    CopyCost,
    copies_per_forward,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SAME = 1e-6
MB = 2**20


# --- the rule ------------------------------------------------------------------------------------

def test_copies_per_forward_follows_the_budget_and_the_cpu_cap():
    cost = CopyCost(kept_bytes=MB, largest_bytes=MB)  # 4 MB a copy
    assert copies_per_forward(cost, 40 * MB, on_cpu=False) == 10
    assert copies_per_forward(cost, 40 * MB, on_cpu=True) == CPU_STACK_BYTES // (4 * MB)
    assert copies_per_forward(cost, None, on_cpu=False) == 64  # the default 256 MB
    assert copies_per_forward(cost, 40 * MB, on_cpu=False, most=3) == 3
    assert copies_per_forward(CopyCost(1, 0), 2**40, on_cpu=False) == MAX_COPIES
    # a copy larger than the budget still runs, alone
    assert copies_per_forward(CopyCost(2**30, 2**30), MB, on_cpu=True) == 1


# --- Hugging Face models -------------------------------------------------------------------------

def _numbers(report):
    return [(e.layer, e.head, e.hidden_change, e.loss_change, e.repeat_loss_change)
            for e in report.effects]


def _same(a, b) -> float:
    """The largest difference between two scorecards' numbers (inf when they do not pair)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x[:2] != y[:2]:
            return float("inf")
        for u, v in zip(x[2:], y[2:], strict=True):
            if (u is None) != (v is None):
                return float("inf")
            if u is not None:
                worst = max(worst, abs(u - v))
    return worst


def _hf(folder, budget=None, mode="zero", targets=None):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap

    sentences = ("the cat sat on the mat and the cat sat", "a dog ran")
    extra = {} if targets is None else {"targets": targets, "layer": "all"}
    return run_heatmap(HeatmapRequest.build(sentences=sentences, model=str(folder), ablate=mode,
                                            device="cpu", memory_budget=budget, **extra)).ablation


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    pytest.importorskip("transformers")
    from zoo import build_lm

    root = tmp_path_factory.mktemp("lms")
    return {"gpt2": build_lm("gpt2", root / "gpt2", "GPT2LMHeadModel"),
            "llama": build_lm("llama", root / "llama", "LlamaForCausalLM"),
            "t5": build_lm("t5", root / "t5", "T5ForConditionalGeneration")}


def _skips(monkeypatch):
    """The `below` of every forward that skipped blocks, recorded."""
    from attnviz.sources.hf.ablation_prefix import Prefix

    seen: list[int] = []
    original = Prefix.skipping

    def spy(self, skip, copies, batch):
        if skip is not None:
            seen.append(skip.below)
        return original(self, skip, copies, batch)
    monkeypatch.setattr(Prefix, "skipping", spy)
    return seen


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_every_chunking_gives_the_same_numbers(lms, kind, mode, monkeypatch):
    """One copy per forward (a 1-byte budget), three (MAX_COPIES 3), as many as the default
    budget holds, and the same without the prefix: the same numbers; the prefix was used."""
    from attnviz.sources.hf import ablation
    from attnviz.sources.hf.ablation_prefix import Prefix

    targets = ("the red barn", "a hat") if kind == "t5" else None
    skips = _skips(monkeypatch)
    every = _hf(lms[kind], None, mode, targets)
    assert skips.count(1) > 1, "no chunk reused the unablated run's blocks"  # (1: the proof)
    one = _hf(lms[kind], 1, mode, targets)
    monkeypatch.setattr(ablation, "MAX_COPIES", 3)
    three = _hf(lms[kind], None, mode, targets)
    def unproved(self, forward, hidden, logits):
        for stack in self.stacks.values():
            stack.usable = False
    monkeypatch.setattr(Prefix, "confirm", unproved)
    skips.clear()
    whole = _hf(lms[kind], None, mode, targets)
    assert not skips
    assert (one.copies_per_forward, three.copies_per_forward) == (1, 3)
    assert every.copies_per_forward > 3
    for other in (one, three, whole):
        assert _same(_numbers(every), _numbers(other)) <= SAME
    assert any(e.hidden_change > 1e-3 for e in every.effects)  # the numbers say something


@pytest.mark.hf
@pytest.mark.slow
def test_skipping_one_block_too_many_is_caught(lms, monkeypatch):
    """The negative control: chunks that skip their own heads' block (the edit never runs) give
    other numbers, and the comparison above sees it."""
    from attnviz.sources.hf import ablation
    from attnviz.sources.hf.ablation_prefix import Skip

    right = _hf(lms["gpt2"])
    assert right.copies_per_forward > 1
    original = ablation._Runner._skip

    def too_far(self, chunk):
        skip = original(self, chunk)
        return None if skip is None else Skip(skip.stack, skip.below + 1)
    monkeypatch.setattr(ablation._Runner, "_skip", too_far)
    wrong = _hf(lms["gpt2"])
    assert _same(_numbers(right), _numbers(wrong)) > 1e-3


@contextmanager
def _perturbed(original, prefix):
    with original(prefix):
        yield
    for stack in prefix.stacks.values():
        if stack.outputs:
            first = stack.outputs[0]
            tensor = first if isinstance(first, torch.Tensor) else first[0]
            tensor += 1e-2  # a prefix that is not what the model computes


@pytest.mark.hf
@pytest.mark.slow
def test_a_prefix_that_is_not_the_models_is_never_used(lms, monkeypatch):
    """Recorded block outputs changed after the unablated run (as a block keeping state
    between calls would): the proof marks the stack unusable and the numbers stay right;
    without the proof they would not (the control)."""
    from attnviz.sources.hf.ablation_prefix import Prefix

    right = _hf(lms["llama"])
    original = Prefix.recording
    monkeypatch.setattr(Prefix, "recording", lambda self: _perturbed(original, self))
    skips = _skips(monkeypatch)
    guarded = _hf(lms["llama"])
    assert skips == [1]  # the proof's forward alone (two blocks: all but the last skipped)
    assert _same(_numbers(right), _numbers(guarded)) <= SAME
    monkeypatch.setattr(Prefix, "confirm", lambda self, forward, hidden, logits: None)
    unguarded = _hf(lms["llama"])
    assert skips
    assert _same(_numbers(right), _numbers(unguarded)) > 1e-4


def test_a_stack_is_found_from_the_output_projections_name():
    from attnviz.sources.hf.ablation_prefix import block_of, repeated

    model = torch.nn.Module()
    model.h = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(3)])
    found = block_of(model, "h.2.0")
    assert found is not None and found[0] is model.h and found[1] == 2
    assert block_of(model, "h") is None
    out = repeated((torch.ones(2, 3), None, torch.ones(1, 3)), 3, 2)
    assert out[0].shape == (6, 3) and out[1] is None and out[2].shape == (1, 3)


# --- the bundled model ---------------------------------------------------------------------------

def _bundled(mode="zero"):
    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.core.probe import induction_probe

    return run_heatmap(HeatmapRequest.build(sentences=tuple(induction_probe()), ablate=mode,
                                            device="cpu")).ablation


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_bundled_chunkings_give_the_same_numbers(mode, monkeypatch):
    """The bundled model (--memory-budget does not apply to it) one copy per forward and as
    many as the default budget holds: the same numbers; starting a chunk one layer too high
    (the control) changes them."""
    from attnviz.sources import head_ablation

    every = _bundled(mode)
    monkeypatch.setattr(head_ablation, "MAX_COPIES", 1)
    one = _bundled(mode)
    assert one.copies_per_forward == 1 < every.copies_per_forward
    assert _same(_numbers(every), _numbers(one)) <= SAME
    original = head_ablation.TinyForward.__call__

    def too_high(self, copies, edit, start=0):
        # after the unablated run (which records the inputs), past the head's own layer
        if self.inputs and start < len(self.layers) - 1:
            start += 1
        return original(self, copies, edit, start)
    monkeypatch.setattr(head_ablation.TinyForward, "__call__", too_high)
    wrong = _bundled(mode)
    assert _same(_numbers(every), _numbers(wrong)) > 1e-4


def test_a_standalone_layers_budget_chooses_its_copies(tmp_path):
    """A standalone layer's --memory-budget reaches the scorecard: 1 MB holds fewer copies of
    a long input than the default; both give the same numbers."""
    from safetensors.torch import save_file

    from attnviz.app.heatmap import HeatmapRequest, run_heatmap
    from attnviz.core.request import HeadHints

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    path = tmp_path / "mha.safetensors"
    save_file({k: v.contiguous() for k, v in mha.state_dict().items()}, str(path))
    words = " ".join(f"w{i}" for i in range(200))

    def scorecard(budget):
        return run_heatmap(HeatmapRequest.build(sentences=(words,), weights=path,
                                                hints=HeadHints(4), ablate="zero",
                                                memory_budget=budget)).ablation
    every, small = scorecard(None), scorecard(MB)
    assert small.copies_per_forward < every.copies_per_forward
    assert _same(_numbers(every), _numbers(small)) <= SAME
    assert any(e.hidden_change > 1e-3 for e in every.effects)
