"""Work bounded before each third-party call: the figure's canvas, matplotlib's rc files,
head counts and sentence counts the caller passed (exit codes), the tokenizer's expansion.

Each bound is checked on both sides: a value past it is refused with the fix named, and one
within it works.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_clean_error, doubling_normalizer, model_with_normalizer, side_by_side

ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    return width, height


def test_canvas_cap_refuses_before_drawing(cli, tmp_path, monkeypatch):
    """--figure size=20 and dpi=600 are each in range; together 8 panels would be ~98,000 px
    wide."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda *a, **k: drawn.append(a))
    monkeypatch.setattr(FigureCanvasAgg, "draw", lambda *a, **k: drawn.append(a))  # PNGs
    out = tmp_path / "m.png"
    result = cli("heatmap", "--random", "the cat sat", "--out", out, "--figure", "size=20",
                 "--figure", "dpi=600")
    assert_clean_error(result, 2, "the figure would be", "more than the 50,000,000 pixels",
                       "lower --figure dpi or --figure size")
    assert drawn == [] and not out.exists()


def test_canvas_within_the_cap_is_drawn(cli, tmp_path):
    """Negative control: the same figure at a dpi inside the cap is written at that size."""
    from attnviz.render.figure_io import MAX_CANVAS_PIXELS

    out = tmp_path / "m.png"
    result = cli("heatmap", "--random", "the cat sat", "--head", "0", "--out", out,
                 "--figure", "size=3", "--figure", "dpi=200")
    assert result.exit_code == 0, result.output
    width, height = png_size(out)
    assert width * height <= MAX_CANVAS_PIXELS and width > 3 * 200  # the dpi was honoured


def test_canvas_cap_in_the_api():
    import attnviz
    from attnviz.errors import UsageError

    heat = attnviz.run_heatmap(["the cat sat"], random=True)
    with pytest.raises(UsageError) as caught:
        heat.figure(size=20, dpi=600)
    assert "lower dpi or size" in caught.value.one_line()
    assert heat.figure(size=2, dpi=100).dpi == 100


HOSTILE_RC = "savefig.dpi: 3000\nsavefig.bbox: tight\nfigure.figsize: 50, 50\nfigure.dpi: 400\n"


def _start_out(cwd: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "attnviz", "heatmap", "--random",
                             "the cat sat", "--out", str(out)], cwd=cwd, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_matplotlibrc_in_cwd_and_mplconfigdir_change_nothing(tmp_path):
    """A model folder's matplotlibrc (cwd) or one in MPLCONFIGDIR: the same bytes as without."""
    plain, hostile, config = tmp_path / "plain", tmp_path / "hostile", tmp_path / "config"
    for folder in (plain, hostile, config):
        folder.mkdir()
    (hostile / "matplotlibrc").write_text(HOSTILE_RC)
    (config / "matplotlibrc").write_text(HOSTILE_RC)
    for done in side_by_side(_start_out(plain, plain / "a.png"),
                             _start_out(hostile, hostile / "b.png"),
                             _start_out(plain, plain / "c.png", {"MPLCONFIGDIR": str(config)}),
                             timeout=300):
        assert done.returncode == 0, done.stderr
    reference = (plain / "a.png").read_bytes()
    assert (hostile / "b.png").read_bytes() == reference
    assert (plain / "c.png").read_bytes() == reference


def test_rc_isolation_is_what_keeps_the_size(tmp_path):
    """Negative control in process: without isolation the same rc values change the output."""
    import matplotlib

    import attnviz
    from attnviz.render.figure_io import save_figure

    heat = attnviz.run_heatmap(["the cat sat"], random=True)
    hostile = {"savefig.dpi": 300, "savefig.bbox": "tight", "figure.dpi": 400}
    with matplotlib.rc_context(hostile):
        fig = heat.figure(size=2)
        save_figure(fig, tmp_path / "ours.png")
        fig.savefig(tmp_path / "raw.png", format="png")  # matplotlib alone reads the rc
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        save_figure(heat.figure(size=2), tmp_path / "default.png")
    assert png_size(tmp_path / "ours.png") == png_size(tmp_path / "default.png")
    assert png_size(tmp_path / "raw.png") != png_size(tmp_path / "default.png")


def _mha_file(tmp_path: Path, heads: int = 8, embed: int = 64) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "mha.safetensors"
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in
               torch.nn.MultiheadAttention(embed, heads).state_dict().items()}, path)
    return path


@pytest.mark.parametrize("command", ["heatmap", "split", "inspect"])
def test_head_count_that_contradicts_the_weights_is_misuse(cli, tmp_path, command):
    path = _mha_file(tmp_path)
    args = {"heatmap": ["heatmap", "--weights", path, "a b"],
            "split": ["split", "--weights", path], "inspect": ["inspect", path]}[command]
    assert_clean_error(cli(*args, "--num-heads", "5"), 2, "not divisible by 5 heads",
                       "--num-heads")
    assert cli(*args, "--num-heads", "8").exit_code == 0  # negative control


def test_head_count_from_config_that_contradicts_the_weights_is_bad_data(cli, tmp_path):
    """Negative control: the same contradiction from the file (metadata) stays exit 1."""
    from safetensors.torch import save_file

    path = tmp_path / "meta.safetensors"
    save_file({k: v.contiguous() for k, v in torch.nn.MultiheadAttention(64, 8).state_dict()
               .items()}, path, metadata={"num_heads": "5"})
    assert_clean_error(cli("split", "--weights", path), 1, "not divisible by 5 heads")


@pytest.mark.hf
@pytest.mark.slow
def test_max_sentences_is_honoured_with_model(cli, minilm):
    many = [f"sentence {i}" for i in range(70)]
    assert_clean_error(cli("heatmap", "--model", minilm, "--budget", "sentences=3", *many[:4]), 2,
                       "4 sentences exceed --budget sentences 3")
    result = cli("heatmap", "--model", minilm, "--layer", "0", "--head", "0", "--json",
                 "--budget", "sentences=100", *many)
    assert result.exit_code == 0, result.output
    assert "exceed" not in result.output


# --- the tokenizer's normalizers: bounded before any text reaches Rust ----------------------

def _steps(normalizer: dict, pre_tokenizer: dict | None = None):
    from attnviz.sources.hf.tokenizer_bound import steps_of

    return steps_of(normalizer, "normalizer") + steps_of(pre_tokenizer, "pre_tokenizer")


def _precompiled(longest: int) -> dict:
    import base64

    trie = b"\0" * 8
    blob = struct.pack("<I", len(trie)) + trie + b"x\0" + b"y" * longest + b"\0"
    return {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(blob).decode()}


AMPLIFIERS = {
    "replace doubling": doubling_normalizer(),
    "regex replace on the empty match": {"type": "Replace", "pattern": {"Regex": ""},
                                         "content": "z" * 5000},
    "precompiled map": _precompiled(100_000),
    "nested sequences": {"type": "Sequence",
                         "normalizers": [doubling_normalizer(10), doubling_normalizer(15)]},
}


@pytest.mark.parametrize("name", sorted(AMPLIFIERS))
def test_amplifying_normalizers_are_refused_by_step(name):
    from attnviz.errors import CheckpointError
    from attnviz.sources.hf.tokenizer_bound import check_text_bound

    steps = _steps(AMPLIFIERS[name])
    with pytest.raises(CheckpointError) as caught:
        check_text_bound(steps, 1000, "sentence 1", "model")
    assert "past 4,000,000 characters" in caught.value.what
    assert "normalizer" in caught.value.what and "grows it" in caught.value.what


def test_ordinary_normalizers_pass():
    """Negative control: BERT's, NFKC with a Metaspace, a shrinking Replace — long texts pass."""
    from attnviz.sources.hf.tokenizer_bound import check_text_bound

    for normalizer, pre in (
            ({"type": "BertNormalizer", "lowercase": True}, {"type": "BertPreTokenizer"}),
            ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, _precompiled(3)]},
             {"type": "Metaspace", "replacement": "▁"}),
            ({"type": "Replace", "pattern": {"String": "``"}, "content": "\""}, None)):
        check_text_bound(_steps(normalizer, pre), 65_536, "sentence 1", "model")


def test_the_bound_is_an_upper_bound_of_what_tokenizers_does():
    """The bound is never below the real growth (tokenizers' own normalizer, on its worst
    input for each step), so a text it lets through cannot grow further."""
    from tokenizers import normalizers

    cases = [({"type": "Replace", "pattern": {"String": "a"}, "content": "aaa"}, "a" * 50,
              normalizers.Replace("a", "aaa")),
             ({"type": "NFKC"}, "\ufdfa" * 10, normalizers.NFKC()),
             ({"type": "Lowercase"}, "İ" * 10, normalizers.Lowercase())]
    for spec, text, real in cases:
        (step,) = _steps(spec)
        grown = len(real.normalize_str(text))
        assert grown > len(text)  # the case does grow (the check could fail)
        assert step.grow(len(text)) >= grown, spec


def _capped(args: list[str], cap: int = 4 << 30) -> subprocess.Popen:
    """`python -m attnviz ARGS` started under an address-space cap (`side_by_side` waits)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    full = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.Popen([sys.executable, "-m", "attnviz", *args], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)


@pytest.mark.hf
@pytest.mark.slow
def test_amplifying_tokenizer_json_is_one_error_line(minilm, tmp_path):
    """The issue's 1.9 KB tokenizer.json (one letter → 10⁹ characters), under a 4 GB cap: one
    error line naming the step, exit 1; the same folder with the model's own normalizer runs."""
    hostile = model_with_normalizer(minilm, tmp_path / "hostile", doubling_normalizer())
    control = model_with_normalizer(minilm, tmp_path / "control", None)
    done, ok = side_by_side(
        _capped(["heatmap", "--model", str(hostile), "--json", "a cat"]),
        _capped(["heatmap", "--model", str(control), "--json", "--layer", "0", "a cat"]))
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: the model's tokenizer could grow sentence 1")
    assert "normalizer[0][0] Replace alone grows it 2×" in lines[0]
    assert ok.returncode == 0, ok.stderr


# --- memory: the budget within what the machine has; an allocator failure is one line ------

def test_budget_past_available_memory_is_refused_up_front(cli, monkeypatch):
    from attnviz.app import heatmap_sources

    monkeypatch.setattr(heatmap_sources, "available_memory", lambda: 4 * 2**30)
    assert_clean_error(cli("heatmap", "--random", "a b", "--budget", "memory=100GB"), 2,
                       "more than the 4.0 GB this machine has available", "--budget memory",
                       "give at most 4096MB")
    assert cli("heatmap", "--random", "a b", "--budget", "memory=1GB").exit_code == 0


def test_available_memory_reads_the_address_space_limit():
    """Under RLIMIT_AS (a container's cap) the limit, not the machine's RAM, bounds the budget."""
    script = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30));"
              "from attnviz.app.heatmap_sources import available_memory as a; print(a())")
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) <= 3 << 30


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 80000000000 bytes.")])
def test_allocator_failure_is_one_line_naming_the_budget(cli, monkeypatch, failure):
    from attnviz.compute.forward_pass import attention

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(attention, "run_layer", fail)
    from attnviz.app import heatmap_sources

    monkeypatch.setattr(heatmap_sources, "run_layer", fail, raising=False)
    result = cli("heatmap", "--random", "a b")
    assert_clean_error(result, 1, "out of memory", "lower --budget memory")
    assert "unexpected" not in result.stderr


def test_export_metadata_is_bounded(cli, tmp_path):
    """200 one-word sentences of 15,000 'é': 3 MB of text, 21 MB once escaped twice in the
    header — refused before the file is written; a tenth of it is exported."""
    word = "é" * 15_000
    out = tmp_path / "m.safetensors"
    args = ["heatmap", "--random", "--json", "--budget", "sentences=200", "--export", out]
    assert_clean_error(cli(*args, *[word] * 200), 2, "the export's metadata",
                       "more than 16 MB", "drop --export")
    assert list(tmp_path.iterdir()) == []
    result = cli(*args, *[word] * 20)
    assert result.exit_code == 0, result.output
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        import json

        assert json.loads(f.metadata()["tokens"]) == [[word]] * 20


# --- every tensor checked where it is used: biases of every projection -----------------------

def _bias_variant(tmp_path: Path, name: str) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    E = 8
    if name.startswith("separate"):
        state = {f"{p}_proj.weight": torch.randn(E, E) for p in "qkvo"}
        state.update({f"{p}_proj.bias": torch.randn(E) for p in "qkvo"})
        if name != "separate-ok":
            state[f"{name[-1]}_proj.bias"] = torch.randn(5)
    else:
        mha = torch.nn.MultiheadAttention(E, 2, add_bias_kv=True)
        state = {k: v.detach().contiguous() for k, v in mha.state_dict().items()}
        if name != "mha-ok":
            state[name.removeprefix("mha-")] = torch.randn(1, 1, 5) if "bias_" in name \
                else torch.randn(5)
    path = tmp_path / f"{name}.safetensors"
    save_file(state, path)
    return path


@pytest.mark.parametrize("name", ["separate-q", "separate-k", "separate-v", "separate-o",
                                  "mha-bias_k", "mha-bias_v", "mha-out_proj.bias",
                                  "mha-in_proj_bias"])
@pytest.mark.parametrize("command", ["split", "heatmap", "inspect"])
def test_bias_of_the_wrong_length_is_named(cli, tmp_path, name, command):
    path = _bias_variant(tmp_path, name)
    args = {"split": ["split", "--weights", path, "-H", "2"],
            "heatmap": ["heatmap", "--weights", path, "-H", "2", "a b"],
            "inspect": ["inspect", path, "-H", "2"]}[command]
    assert_clean_error(cli(*args), 1, "bias", "has shape (5")


@pytest.mark.parametrize("name", ["separate-ok", "mha-ok"])
def test_biases_of_the_right_length_pass(cli, tmp_path, name):
    """Negative control: the same layouts with every bias right are split and proved."""
    result = cli("split", "--weights", _bias_variant(tmp_path, name), "-H", "2")
    assert result.exit_code == 0, result.output
    assert "✓ equal to float32 round-off" in result.stdout


def _bundled_variant(tmp_path: Path, change: str) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from attnviz.data import BUNDLED

    with safe_open(str(BUNDLED), framework="pt") as f:
        metadata = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if change == "ln-width":
        state["layers.0.ln.weight"] = state["layers.0.ln.weight"][:-3].clone()
    elif change == "ln-missing":
        del state["layers.1.ln.bias"]
    elif change == "pos-width":
        state["pos_embed.weight"] = state["pos_embed.weight"][:, :-2].clone()
    elif change == "embed-width":
        state["embed.weight"] = state["embed.weight"][:, :-2].clone()
    path = tmp_path / f"{change}.safetensors"
    save_file(state, path, metadata=metadata)
    return path


@pytest.mark.parametrize("change", ["ln-width", "ln-missing", "pos-width", "embed-width"])
def test_bundled_format_checks_every_tensor(cli, tmp_path, change):
    path = _bundled_variant(tmp_path, change)
    result = cli("heatmap", "--weights", path, "the cat sat")
    assert_clean_error(result, 1)
    assert "unexpected" not in result.stderr


def test_bundled_copy_unchanged_runs(cli, tmp_path):
    """Negative control: the unchanged copy runs through the same checks."""
    result = cli("heatmap", "--weights", _bundled_variant(tmp_path, "none"), "the cat sat")
    assert result.exit_code == 0, result.output


# --- dtypes attnviz computes nothing with: refused only where a needed tensor has one --------

def _with_extra(tmp_path: Path, name: str, extra: torch.Tensor, replace: bool = False) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in torch.nn.MultiheadAttention(8, 2).state_dict().items()}
    state["in_proj_weight" if replace else name] = extra
    path = tmp_path / f"{name}.safetensors"
    save_file(state, path)  # written by safetensors itself
    return path


@pytest.mark.parametrize("dtype", ["complex64", "float8_e8m0fnu"])
def test_an_unused_tensor_of_another_dtype_does_not_block_the_file(cli, tmp_path, dtype):
    path = _with_extra(tmp_path, dtype, torch.zeros(4, dtype=getattr(torch, dtype)))
    result = cli("split", "--weights", path, "-H", "2")
    assert result.exit_code == 0, result.output
    assert "✓ equal to float32 round-off" in result.stdout
    assert cli("inspect", path).exit_code == 0


def test_a_needed_tensor_of_another_dtype_is_refused_by_name(cli, tmp_path):
    path = _with_extra(tmp_path, "needed", torch.randn(24, 8, dtype=torch.complex64), True)
    assert_clean_error(cli("split", "--weights", path, "-H", "2"), 1,
                       "'in_proj_weight' has dtype C64, not a floating-point type")


def test_a_dtype_safetensors_does_not_know_is_still_refused(cli, tmp_path):
    """Negative control: a name no safetensors release writes (the library refuses it too)."""
    import json

    header = json.dumps({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "q7.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    assert_clean_error(cli("inspect", path), 1, "unknown dtype 'Q7'")


@pytest.mark.parametrize("dtype", ["complex64", "float8_e8m0fnu", "float8_e4m3fnuz",
                                   "float8_e5m2fnuz"])
def test_inspect_lists_skipped_tensors_and_shows_the_rest(cli, tmp_path, dtype):
    """A tensor of a dtype attnviz computes nothing with is named as skipped, in the table and
    in --json; the layer beside it is shown and split runs on it."""
    import json

    path = _with_extra(tmp_path, "extra.w", torch.zeros(4, dtype=getattr(torch, dtype)))
    result = cli("inspect", path)
    assert result.exit_code == 0, result.output
    short = {"complex64": "C64", "float8_e8m0fnu": "F8_E8M0", "float8_e4m3fnuz": "F8_E4M3FNUZ",
             "float8_e5m2fnuz": "F8_E5M2FNUZ"}[dtype]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("skipped:")]
    if short.endswith("FNUZ"):  # float8 variants are read as floats: nothing skipped
        assert skipped == []
    else:
        assert skipped == [f"skipped: extra.w (dtype {short}): attnviz computes nothing with it"]
    assert "torch-mha · 1 layer" in result.stdout
    doc = json.loads(cli("inspect", "--json", path).stdout)
    assert doc["skipped"] == ([] if short.endswith("FNUZ") else
                              [{"name": "extra.w", "dtype": short}])
    assert doc["summary"]["skipped"] == len(doc["skipped"]) and len(doc["layers"]) == 1


def test_a_layer_with_a_skipped_dtype_leaves_the_others_usable(cli, tmp_path):
    import json

    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {}
    for name in ("l0", "l1"):
        mha = torch.nn.MultiheadAttention(8, 2)
        state.update({f"{name}.{k}": v.contiguous() for k, v in mha.state_dict().items()})
    state["l1.in_proj_weight"] = torch.randn(24, 8, dtype=torch.complex64)
    path = tmp_path / "two.safetensors"
    save_file(state, path)
    result = cli("inspect", "--json", path)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [layer["name"] for layer in doc["layers"]] == ["l0"]
    assert doc["unresolved"][0]["name"] == "l1" and "dtype C64" in doc["unresolved"][0]["reason"]
    assert doc["skipped"] == [{"name": "l1.in_proj_weight", "dtype": "C64"}]
    assert cli("split", "--weights", path, "-H", "2", "--layer", "l0").exit_code == 0
    for command in (["split", "--weights", path, "-H", "2"],
                    ["heatmap", "--weights", path, "-H", "2", "a b"]):
        assert_clean_error(cli(*command, "--layer", "l1"), 1,
                           "'l1.in_proj_weight' has dtype C64, not a floating-point type")


# --- config.json values the forward turns into NaN; index files naming non-weights ----------

def _config_copy(source: Path, folder: Path, **changes: object) -> Path:
    import json

    folder.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    for dotted, value in changes.items():
        target = config
        *parents, last = dotted.split("__")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[last] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


CONFIG_CASES = [("rope_theta", 0, "must be a positive number"),
                ("rope_theta", -10000.0, "must be a positive number"),
                ("rms_norm_eps", -1, "must be a number >= 0"),
                ("rope_theta", "abc", "'abc', not a number"),
                ("rope_scaling__factor", 0.0, "'rope_scaling.factor' is 0.0")]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("field,value,message", CONFIG_CASES,
                         ids=[f"{c[0]}={c[1]}" for c in CONFIG_CASES])
def test_config_values_that_make_nan_are_named(cli, zoo_model, tmp_path, field, value, message):
    folder = _config_copy(zoo_model("llama"), tmp_path / "model", **{field: value})
    result = cli("heatmap", "--model", folder, "--json", "the cat sat")
    assert_clean_error(result, 1, "config.json field", field.split("__")[0], message)


@pytest.mark.hf
@pytest.mark.slow
def test_sane_config_values_run(cli, zoo_model, tmp_path):
    """Negative control: a positive rope_theta and epsilon of another size run."""
    folder = _config_copy(zoo_model("llama"), tmp_path / "model", rope_theta=500000.0,
                          rms_norm_eps=0.0)
    result = cli("heatmap", "--model", folder, "--json", "the cat sat")
    assert result.exit_code == 0, result.output


# rope_theta 1e-300 passes the up-front check (it is positive) but its inverse frequencies
# overflow: the maps come out NaN on every path, and each names the config.json fields.
# 600 tokens: past the 512 keys held whole and the 512 cells a display shows, and 11 MB of
# maps against a 1 MB budget, so both long paths stream (in ~20 blocks a layer, not ~150).
LONG = " ".join(["cat"] * 600)
NAN_PATHS = {
    "whole maps": ["--json", "the cat sat"],
    "streamed": ["--json", "--budget", "tokens=4000", "--budget", "memory=1MB", LONG],
    "exported": ["--budget", "memory=1MB", "--budget", "tokens=4000", "--export", "{out}", LONG],
}


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NAN_PATHS))
def test_non_finite_maps_name_the_config_fields_on_every_path(cli, zoo_model, tmp_path, path):
    out = tmp_path / "maps.safetensors"
    args = [a.replace("{out}", str(out)) for a in NAN_PATHS[path]]
    folder = _config_copy(zoo_model("llama"), tmp_path / "model", rope_theta=1e-300,
                          rope_parameters__rope_theta=1e-300, max_position_embeddings=4096)
    result = cli("heatmap", "--model", folder, *args)
    assert_clean_error(result, 1, "non-finite attention weights",
                       "config.json fields that could cause this:", "rope_theta (1e-300)")
    assert not out.exists()
    # negative control: the same path with the model's own rope_theta runs
    sane = _config_copy(zoo_model("llama"), tmp_path / "sane", max_position_embeddings=4096)
    result = cli("heatmap", "--model", sane, *args)
    assert result.exit_code == 0, result.output


@pytest.mark.hf
@pytest.mark.slow
def test_split_verify_blames_non_finite_maps_on_the_model_not_attnviz(cli, zoo_model, tmp_path):
    folder = _config_copy(zoo_model("llama"), tmp_path / "model", rope_theta=1e-300,
                          rope_parameters__rope_theta=1e-300)
    result = cli("split", "--model", folder, "--verify")  # the report, then the failure
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the model's own attention on the verification sentences is "
                           "not finite") and "rope_theta (1e-300)" in line
    assert "report this" not in line
    assert cli("split", "--model", zoo_model("llama"), "--verify").exit_code == 0


@pytest.mark.parametrize("shard", ["config.json", "tokenizer.json", "README.md"])
def test_index_naming_a_non_weights_shard_is_bad_data(cli, tmp_path, shard):
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / shard).write_text("{}")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"in_proj_weight": shard}}))
    assert_clean_error(cli("inspect", folder), 1, "model.safetensors.index.json names",
                       f"'{shard}' as a shard, which is not a weights file")
    assert_clean_error(cli("heatmap", "--weights", folder, "-H", "2", "a"), 1, "not a weights")


# --- post-processor templates and decoders: other amplifiers of tokenizer.json ---------------

def _template(copies: int) -> dict:
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}]
            + [{"Sequence": {"id": "A", "type_id": 0}}] * copies,
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [101], "tokens": ["[CLS]"]}}}


def test_a_template_repeating_the_text_is_refused_by_step():
    from attnviz.errors import CheckpointError
    from attnviz.sources.hf.tokenizer_bound import check_text_bound, steps_of

    with pytest.raises(CheckpointError) as caught:
        check_text_bound(steps_of(_template(5000), "post_processor"), 1000, "sentence 1", "m")
    assert "post_processor TemplateProcessing alone grows it 5,000×" in caught.value.what
    # negative control: BERT's own template ([CLS] $A [SEP]) lets a long text through
    check_text_bound(steps_of(_template(1), "post_processor"), 65_536, "sentence 1", "m")


def test_the_template_bound_is_an_upper_bound_of_what_tokenizers_does():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"[CLS]": 101, "a": 1}, unk_token="[CLS]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A $A $A", special_tokens=[("[CLS]", 101)])
    from attnviz.sources.hf.tokenizer_bound import steps_of

    text = "a a a a"
    (step,) = steps_of(_template(3), "post_processor")
    real = len(tok.encode(text).ids)
    assert real > len(text.split()) * 2  # the template does multiply (the check could fail)
    assert step.grow(len(text)) >= real


class _Described:
    """A stand-in for a fast tokenizer: what chain_of reads is its backend's description."""

    def __init__(self, spec: dict) -> None:
        import json

        text = json.dumps(spec)
        self.backend_tokenizer = type("B", (), {"to_str": lambda self: text})()


def test_a_decoder_that_multiplies_text_is_refused(minilm):
    import json

    from attnviz.errors import CheckpointError
    from attnviz.sources.hf.tokenizer_bound import chain_of

    spec = json.loads((minilm / "tokenizer.json").read_text())
    assert chain_of(_Described(spec))  # negative control: the model's own decoder passes
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * 20}
    with pytest.raises(CheckpointError) as caught:
        chain_of(_Described(spec))
    assert "decoder could grow a text more than 64-fold" in caught.value.what
    assert "decoder[0] Replace alone grows it 2×" in caught.value.what


def test_a_wordpiece_reading_huge_words_refuses_long_texts(minilm):
    """max_input_chars_per_word 10⁹ makes a 40,000-letter word take hours (time cubic in the
    word's length): a long text is refused up front, naming the field."""
    import json

    from attnviz.errors import CheckpointError
    from attnviz.sources.hf.tokenizer_bound import chain_of, check_text_bound

    spec = json.loads((minilm / "tokenizer.json").read_text())
    check_text_bound(chain_of(_Described(spec)), 40_000, "sentence 1", "m")  # BERT's own: 100
    spec["model"]["max_input_chars_per_word"] = 10**9
    steps = chain_of(_Described(spec))
    check_text_bound(steps, 1000, "sentence 1", "m")  # short texts still pass
    with pytest.raises(CheckpointError) as caught:
        check_text_bound(steps, 40_000, "sentence 1", "m")
    assert "max_input_chars_per_word 1000000000" in caught.value.what
    assert "max_input_chars_per_word to 100" in caught.value.fix


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NAN_PATHS))
def test_a_models_non_finite_weight_is_named_on_every_path(cli, zoo_model, tmp_path, path):
    """A NaN in one of a --model's attention tensors: the non-finite maps name the tensor (its
    attention tensors are scanned only once the maps come out non-finite)."""
    from safetensors.torch import load_file, save_file

    folder = _config_copy(zoo_model("llama"), tmp_path / "model", max_position_embeddings=4096)
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    weights.unlink()  # a link to the zoo's file: written anew below
    key = next(k for k in sorted(state) if k.endswith("layers.0.self_attn.q_proj.weight"))
    state[key][0, 0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    out = tmp_path / "maps.safetensors"
    args = [a.replace("{out}", str(out)) for a in NAN_PATHS[path]]
    result = cli("heatmap", "--model", folder, *args)
    assert_clean_error(result, 1, f"tensor '{key}' holds 1 non-finite values",
                       "maps came out non-finite")
    assert not out.exists()
    # control: a finite copy runs (the NaN, not the copy, made the maps non-finite)
    state[key][0, 0] = 0.0
    save_file(state, str(weights), metadata={"format": "pt"})
    assert cli("heatmap", "--model", folder, *args).exit_code == 0
