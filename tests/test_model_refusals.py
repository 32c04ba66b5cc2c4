"""Models transformers runs whose attention attnviz cannot show as full maps are refused in one
clean line, with nothing from transformers on stderr: a state-space model (no attention at all)
and LED (Longformer-style local windows, returned as (B, H, L, window) rather than L × L)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.hf
pytest.importorskip("transformers")

import zoo  # noqa: E402
from conftest import assert_clean_error  # noqa: E402
from zoo import _SEQ2SEQ, PAD, POSITIONS, VOCAB, Kind, _config  # noqa: E402

EXTRA = {
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


@pytest.mark.parametrize("kind, fragment", [
    ("mamba", "MambaModel returned no attention weights"),
    ("led", "not one full map per head over its 8 × 8 positions"),
])
def test_models_without_full_maps_are_refused_cleanly(cli, extra_model, kind, fragment):
    folder = extra_model(kind)
    assert_clean_error(cli("heatmap", "--model", folder, zoo.SENTENCES[0]), 1, fragment)
    # in a process of its own: transformers' log handler writes to the real stderr (Mamba's
    # forward reports its missing fast kernels there), which CliRunner does not capture
    run = subprocess.run([sys.executable, "-m", "attnviz", "heatmap", "--model", str(folder),
                          zoo.SENTENCES[0]], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
