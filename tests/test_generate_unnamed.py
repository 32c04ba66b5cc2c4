"""`attnviz generate` on models whose embedding has more rows than the tokenizer has tokens (#36).

Real models do this (Qwen2: 151,936 rows for 151,665 tokens; tables padded to a multiple of 64),
and greedy decoding or sampling can write such an id; the tokenizer names no token for it. Here a
tiny Phi (its lm_head has a bias) and a tiny Marian (its final_logits_bias) get 1,000 embedding
rows for a tokenizer of about 40 tokens, and a bias on id UNNAMED past the tokenizer, so greedy
decoding writes it: the tests assert that transformers' own `model.generate` does (the control
that the case is exercised), then check that every output names it `<id UNNAMED>`.

Also: a generation_config.json asking for beams, several sequences or no cache gives the tokens
of a clean folder with one note and nothing on stderr; an extreme --temperature is a usage error.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, assert_clean_error

ROWS = 1000  # the embedding's rows; the zoo's tokenizer has len(SPECIALS + WORDS) tokens
UNNAMED = 700  # the id the bias makes greedy decoding write
N_NEW = 4
PROMPT = "the cat sat on the mat"


def _build(kind: str, folder: Path) -> Path:
    """The zoo's `kind` with its LM head and ROWS embedding rows, id UNNAMED's logit raised by
    1e3 (Phi: lm_head.bias; Marian: final_logits_bias)."""
    import zoo

    def raise_unnamed(model: Any) -> None:
        if zoo.ZOO[kind].encoder_decoder:
            model.final_logits_bias[0, UNNAMED] = 1e3
        else:
            model.lm_head.bias[UNNAMED] = 1e3

    return zoo.build_lm(kind, folder, vocab_size=ROWS, edit=raise_unnamed)


@pytest.fixture(scope="module")
def padded_lm(tmp_path_factory: Any) -> Any:
    pytest.importorskip("transformers")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = _build(kind, tmp_path_factory.mktemp(f"padded_{kind}"))
        return built[kind]

    return get


def _reference_ids(folder: Path, encdec: bool) -> tuple[list[int], Any]:
    """transformers' own greedy generate (no attnviz), and the folder's tokenizer."""
    import torch
    import transformers
    import zoo

    tokenizer = zoo.load_tokenizer(folder)
    auto = transformers.AutoModelForSeq2SeqLM if encdec else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(folder, attn_implementation="eager").eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                             pad_token_id=zoo.PAD)
    start = 1 if encdec else len(ids)
    made = out[0, start:].tolist()
    stop = next((i + 1 for i, t in enumerate(made) if t == zoo.EOS), len(made))
    return made[:stop], tokenizer


def _expected_names(ids: list[int], tokenizer: Any) -> list[str]:
    """Independently: the tokenizer's token, or `<id N>` for an id past its vocabulary."""
    vocab = tokenizer.get_vocab()
    names = {i: t for t, i in vocab.items()}
    return [names[i] if i in names else f"<id {i}>" for i in ids]


def _page_document(path: Path) -> dict[str, Any]:
    page = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="attnviz-data">(.*?)</script>', page,
                      re.S)
    assert match is not None
    return json.loads(match.group(1))


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["phi", "marian"])
def test_unnamed_ids_in_every_output(padded_lm: Any, cli: Any, tmp_path: Path,
                                     kind: str) -> None:
    from safetensors import safe_open

    folder = padded_lm(kind)
    encdec = kind == "marian"
    ids, tokenizer = _reference_ids(folder, encdec)
    # the control: the model writes an id the tokenizer has no token for, which it cannot name
    assert UNNAMED in ids and len(tokenizer) <= UNNAMED < ROWS
    assert tokenizer.convert_ids_to_tokens(UNNAMED) is None
    names = _expected_names(ids, tokenizer)
    assert f"<id {UNNAMED}>" in names

    html, png, export = tmp_path / "g.html", tmp_path / "g.png", tmp_path / "g.safetensors"
    result = cli("generate", "--model", folder, PROMPT, "--max-new-tokens", N_NEW, "--json",
                 "--html", html, "--out", png, "--export", export)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    generation = data["generation"]
    assert generation["generated_ids"] == [ids]  # the model's own ids, untouched
    assert generation["generated_tokens"] == [names]
    assert f"<id {UNNAMED}>" in generation["generated_text"][0]
    shown = data["target_tokens"][0][1:] if encdec else data["tokens"][0][-len(ids):]
    assert shown == names
    assert f"<id {UNNAMED + 1}>" not in json.dumps(data)  # the right N, not any N
    assert data["head_stats"]  # the statistics took the name (they crashed on None)

    doc = _page_document(html)
    assert doc["generation"]["sentences"][0]["tokens"] == names
    assert png.stat().st_size > 0
    with safe_open(str(export), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["generated_ids"]) == [ids]
    assert json.loads(meta["generated_tokens"]) == [names]

    terminal = cli("generate", "--model", folder, PROMPT, "--max-new-tokens", N_NEW, "--no-stats")
    assert terminal.exit_code == 0, terminal.output
    line = next(x for x in terminal.stdout.splitlines() if x.startswith("sentence 1 (+"))
    assert f"<id {UNNAMED}>" in line


@pytest.mark.hf
@pytest.mark.slow
def test_unnamed_ids_when_streamed(padded_lm: Any) -> None:
    """The two-pass (bounded memory) path names them in the teacher-forced forward's tokens."""
    from attnviz.app.heatmap import run_heatmap
    from attnviz.core.request import GenerateSpec, HeatmapRequest

    folder = padded_lm("phi")
    ids, tokenizer = _reference_ids(folder, False)
    result = run_heatmap(HeatmapRequest.build(sentences=(PROMPT, "a small dog ran far away"),
                                              model=str(folder), device="cpu",
                                              generate=GenerateSpec(N_NEW), memory_budget=2048))
    assert any("teacher-forced forward" in note for note in result.run.notes)
    assert result.generation.generated_ids[0] == ids
    names = _expected_names(ids, tokenizer)
    assert result.run.batch.tokens[0][-len(ids):] == names
    assert f"<id {UNNAMED}>" in names


@pytest.mark.hf
def test_token_names_and_decoded_text() -> None:
    """Runs of named ids decode as the tokenizer decodes them; an unnamed id keeps its place."""
    import zoo

    from attnviz.sources.hf.token_names import decoded_text, token_names

    tokenizer = zoo.load_tokenizer(_tokenizer_folder())
    the, cat = tokenizer.convert_tokens_to_ids(["the", "cat"])
    assert token_names(tokenizer, [the, 900, cat]) == ["the", "<id 900>", "cat"]
    assert decoded_text(tokenizer, [the, 900, cat]) == "the <id 900> cat"
    # the library alone drops the id without a trace: what the test guards against
    assert "900" not in tokenizer.decode([the, 900, cat])
    assert decoded_text(tokenizer, [the, cat]) == tokenizer.decode([the, cat])

    class Raising:  # a sentencepiece tokenizer raises on an id past its vocabulary
        def convert_ids_to_tokens(self, ids: Any) -> Any:
            if isinstance(ids, list):
                return [self.convert_ids_to_tokens(i) for i in ids]
            if ids >= 3:
                raise IndexError("piece id is out of range")
            return "abc"[ids]

    assert token_names(Raising(), [0, 5, 2]) == ["a", "<id 5>", "c"]


_TOKENIZER_DIR: list[Path] = []


def _tokenizer_folder() -> Path:
    import tempfile

    import zoo

    if not _TOKENIZER_DIR:
        folder = Path(tempfile.mkdtemp(prefix="attnviz-tok-"))
        zoo.save_tokenizer(folder, zoo.ZOO["llama"])
        _TOKENIZER_DIR.append(folder)
    return _TOKENIZER_DIR[0]


# --- generation_config.json -------------------------------------------------------------------


def _attnviz(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "attnviz", "generate", "--model", str(folder),
                             PROMPT, "a small dog ran", "--max-new-tokens", str(N_NEW), "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("fields", [
    {"num_beams": 3, "num_return_sequences": 2, "use_cache": False},
    {"num_return_sequences": 2},  # transformers refuses this one at load time
    {"do_sample": True, "temperature": 0.7, "top_k": 4, "max_length": 3, "min_p": 0.5,
     "cache_implementation": "static", "prefill_chunk_size": 2, "early_stopping": True},
])
def test_generation_config_cannot_change_the_decoding(cli: Any, tmp_path: Path,
                                                      fields: dict[str, Any]) -> None:
    import torch
    import transformers
    import zoo
    from helpers import side_by_side

    clean = zoo.build_lm("llama", tmp_path / "clean")
    hostile = tmp_path / "hostile"
    shutil.copytree(clean, hostile)
    path = hostile / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    # the control: the file does change transformers' own generate (or its loading)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(hostile).eval()
    except ValueError:
        assert fields == {"num_return_sequences": 2}
    else:
        with torch.no_grad():
            out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=N_NEW,
                                 pad_token_id=1)
        clean_model = transformers.AutoModelForCausalLM.from_pretrained(clean).eval()
        with torch.no_grad():
            want = clean_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=N_NEW,
                                        do_sample=False, pad_token_id=1)
        assert out.shape != want.shape or not torch.equal(out, want)
    got, reference = side_by_side(_attnviz(hostile), _attnviz(clean))
    assert reference.returncode == 0, reference.stderr
    assert got.returncode == 0, got.stderr
    assert got.stderr == ""  # no library warning
    ours, theirs = json.loads(got.stdout), json.loads(reference.stdout)
    assert ours["generation"]["generated_ids"] == theirs["generation"]["generated_ids"]
    assert ours["generation"]["generated_tokens"] == theirs["generation"]["generated_tokens"]
    aside = " ".join(ours["generation"]["set_aside"])  # also the header's one note line
    for name in fields:
        assert name in aside, (name, aside)
    assert theirs["generation"]["set_aside"] == []
    terminal = cli("generate", "--model", hostile, PROMPT, "--max-new-tokens", N_NEW, "--no-maps",
                   "--no-stats")
    assert terminal.exit_code == 0, terminal.output
    header = " ".join(terminal.stdout.split())
    assert "note: generation: the model's generation_config asks for" in header
    assert all(name in header for name in fields)


# --- extreme options ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e-300", "1e-5", "1e300", "2e4", "nan", "inf", "0", "-1"])
def test_extreme_temperature_is_misuse(cli: Any, value: str) -> None:
    result = cli("generate", "the cat sat", "--max-new-tokens", "2", "--sample", "--temperature",
                 value)
    assert_clean_error(result, 2, "--temperature")


def test_temperature_bounds_in_the_api_and_why() -> None:
    import torch

    from attnviz.core.request import MAX_TEMPERATURE, MIN_TEMPERATURE, GenerateSpec
    from attnviz.errors import UsageError

    for temperature in (MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE):
        GenerateSpec(3, True, temperature).check()
    for temperature in (1e-300, MIN_TEMPERATURE / 2, MAX_TEMPERATURE * 2, math.nan):
        with pytest.raises(UsageError, match="temperature"):
            GenerateSpec(3, True, temperature).check()
    for bad in ({"max_new": True}, {"max_new": 2.0}, {"seed": -1}, {"seed": 2**64},
                {"top_p": 0.0}, {"top_p": math.nan}):
        with pytest.raises(UsageError):
            GenerateSpec(**{"max_new": 3, "sample": True, **bad}).check()
    # why a bound: float32 logits over 1e-300 (0 in float32), or over 1e300 (inf), are no
    # distribution; at the bounds they are
    logits = torch.tensor([-30.0, 2.0, 30.0, -math.inf])
    for temperature in (1e-300, 1e300):
        assert torch.softmax(logits / temperature, -1).isnan().any()
    for temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        probs = torch.softmax(logits / temperature, -1)
        assert probs.isfinite().all() and float(probs.sum()) == pytest.approx(1.0)


def test_sampling_options_on_heatmap_name_generate_even_zero(cli: Any) -> None:
    assert_clean_error(cli("heatmap", "the cat sat", "--temperature", "0"), 2,
                       "--temperature moved to its own command", "attnviz generate")
