"""Models transformers runs whose attention attnviz cannot show as full maps are refused in one
clean line, with nothing from transformers on stderr: a state-space model (no attention at all)
and LED (Longformer-style local windows, returned as (B, H, L, window) rather than L × L)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import lazy_import

pytestmark = pytest.mark.hf
lazy_import("transformers")

import zoo  # noqa: E402
from helpers import assert_clean_error, finish  # noqa: E402
from zoo import _BERTLIKE, _SEQ2SEQ, EOS, PAD, POSITIONS, VOCAB, Kind, _config  # noqa: E402

EXTRA = {
    "longt5": Kind(_config("LongT5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2,
                           num_decoder_layers=2, num_heads=4, local_radius=2, vocab_size=VOCAB,
                           pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD),
                   "LongT5Model", eos=True, encoder_decoder=True),
    "convbert": Kind(_config("ConvBertConfig", embedding_size=32, **_BERTLIKE), "ConvBertModel",
                     bos=True),
    "mamba": Kind(_config("MambaConfig", hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                          pad_token_id=PAD), "MambaModel"),
    "led": Kind(_config("LEDConfig", **{**_SEQ2SEQ, "max_encoder_position_embeddings": POSITIONS,
                                        "max_decoder_position_embeddings": POSITIONS,
                                        "attention_window": 4}),
                "LEDModel", bos=True, eos=True, encoder_decoder=True),
}


@pytest.fixture
def extra_model(tmp_path, monkeypatch):
    def build(kind: str):
        monkeypatch.setitem(zoo.ZOO, kind, EXTRA[kind])
        return zoo.build(kind, tmp_path / kind)
    return build


REFUSED = {
    "mamba": "MambaModel returned no attention weights",
    "led": "not one full map per head over its 8 × 8 positions",
    # its decoder uses the attention interface, its encoder a local attention of its own: the
    # interface alone would have shown the decoder and silently dropped the encoder
    "longt5": "LongT5Stack returns attention of shape",
}


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory):
    """Each refused kind's folder, and its CLI run in a process of its own (transformers' log
    handler writes to the real stderr, where Mamba's forward reports its missing fast kernels,
    and CliRunner does not capture it): all started at once, each finished by its test while
    the in-process runs go on beside them."""
    root = tmp_path_factory.mktemp("refused")
    with pytest.MonkeyPatch.context() as patch:
        for kind in REFUSED:
            patch.setitem(zoo.ZOO, kind, EXTRA[kind])
        folders = {kind: zoo.build(kind, root / kind) for kind in REFUSED}
    started = {kind: subprocess.Popen([sys.executable, "-m", "attnviz", "heatmap", "--model",
                                       str(folder), zoo.SENTENCES[0]], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for kind, folder in folders.items()}
    yield folders, started
    for proc in started.values():  # any a deselected test left running
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("kind", list(REFUSED))
def test_models_without_full_maps_are_refused_cleanly(cli, refused_runs, kind):
    folders, started = refused_runs
    try:
        assert_clean_error(cli("heatmap", "--model", folders[kind], zoo.SENTENCES[0]), 1,
                           REFUSED[kind])
    finally:
        run = finish(started[kind], timeout=300)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr


def test_a_layout_attnviz_reads_differently_does_not_block_the_model(cli, extra_model, tmp_path):
    """ConvBERT (head_ratio 2: half its heads are convolutions) does not fit attnviz's reading
    of a BERT-style layer, but `--model` lets the model compute: its maps are transformers' own."""
    import torch
    import transformers
    from safetensors import safe_open

    folder = extra_model("convbert")
    out = tmp_path / "maps.safetensors"
    assert cli("heatmap", "--model", folder, zoo.SENTENCES[0], "--layer", "all",
               "--export", out, "--quiet").exit_code == 0
    model = transformers.ConvBertModel.from_pretrained(folder, attn_implementation="eager")
    ids = zoo.load_tokenizer(folder)(zoo.SENTENCES[0])["input_ids"]
    with torch.no_grad():
        expected = model.eval()(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    with safe_open(out, "pt") as f:
        for i, reference in enumerate(expected):
            torch.testing.assert_close(f.get_tensor(f"attn.{i}"), reference, atol=1e-6, rtol=0)
