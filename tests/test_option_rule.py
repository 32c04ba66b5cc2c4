"""One rule for options (#36): every option of every command either applies to the run or is
refused, exit 2, naming it — never silently dropped.

The walker reads each command's options from the Typer app itself (a new option is walked, or
this file fails until it is given a value), runs the command on each source with the option set
to a value that differs from its default in effect, once plain and once with --json, and compares
what came out (stdout and the files written) with the same run without it: a run that succeeds and
shows nothing different dropped the option. Runs are in-process (CliRunner), one base run per
source and mode. Negative controls: with one refusal taken out of the rule table, and with a
command that ignores one of its options, the walker reports exactly that option.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main
from helpers import SAMPLES
from typer.testing import CliRunner

from attnviz.cli.main import app

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["the cat sat on the mat the cat sat", "a small dog ran far away"]
MODEL_SENTENCES = ["the cat sat on the mat", "a small dog ran far away"]  # the zoo's words
OUT = "{out}"  # replaced by the run's output folder
# the walk's axes, not options to walk: the source, the mode and the inputs themselves
AXES = {"sentences", "clean", "checkpoint", "weights", "model", "random", "as_json", "corpus",
        "against"}
# what no output shows by design: they change how the run is done, never what it shows
UNOBSERVABLE = {
    "device": "auto is the CPU on a machine without a GPU: the same device, the same maps",
    "device_map": "one CPU: accelerate places every layer on it",
    "memory_budget": "the maps are the same whatever the budget (tests/test_long.py)",
    "max_memory": "offloading changes where the weights wait, not the maps (test_model.py)",
    "budget:memory": "the maps are the same whatever the budget (tests/test_long.py)",
}

# a value per option, differing from the default in effect; (command, source) may override.
# An option holding several settings (--spec E=…,kdim=…) is walked once per setting, each named
# `option:setting`.
VALUES: dict[str, dict[str, list[str]]] = {
    "heatmap": {
        "file": ["--file", f"{OUT}/../extra.txt"], "layer": ["--layer", "1"],
        "head": ["--head", "1"], "head:mean": ["--head", "mean"],
        "out": ["--out", f"{OUT}/f.png"], "query": ["--query", "cat"],
        "query:sentence": ["--query", "cat@2"],
        "export": ["--export", f"{OUT}/x.safetensors"], "html": ["--html", f"{OUT}/p.html"],
        "stats": ["--no-stats"], "maps": ["--no-maps"], "quiet": ["--quiet"],
        "rank": ["--rank"], "overview": ["--overview", "entropy"],
        "probe": ["--probe", "induction"], "causal": ["--causal"],
        "spec:positions": ["--spec", "positions=sinusoidal"], "device": ["--device", "cpu"],
        "dtype": ["--dtype", "bfloat16"], "device_map": ["--device-map", "auto"],
        "max_memory": ["--max-memory", "1GB"],
        "target": ["--target", "the cat", "--target", "a dog"],
        "spec:E": ["--spec", "E=32"], "num_heads": ["-H", "2"],
        "spec:kv": ["--spec", "kv=2"], "spec:d": ["--spec", "d=2"],
        "spec:kdim": ["--spec", "kdim=8"], "spec:vdim": ["--spec", "vdim=8"],
        "spec:seed": ["--spec", "seed=3"],
        "budget:tokens": ["--budget", "tokens=3"], "budget:sentences": ["--budget", "sentences=1"],
        "budget:panels": ["--budget", "panels=1"], "budget:memory": ["--budget", "memory=1MB"],
        "figure:size": ["--figure", "size=3"], "figure:dpi": ["--figure", "dpi=50"],
        "scale": ["--scale", "log"], "weighting": ["--weighting", "norm"],
    },
    "generate": {
        "file": ["--file", f"{OUT}/../extra.txt"], "probe": ["--probe", "induction"],
        "device": ["--device", "cpu"], "dtype": ["--dtype", "bfloat16"],
        "max_new_tokens": ["--max-new-tokens", "3"], "sample": ["--sample"],
        "temperature": ["--temperature", "0.5"], "top_p": ["--top-p", "0.5"],
        "seed": ["--seed", "3"], "layer": ["--layer", "1"], "head": ["--head", "1"],
        "head:mean": ["--head", "mean"], "out": ["--out", f"{OUT}/f.png"],
        "export": ["--export", f"{OUT}/x.safetensors"], "html": ["--html", f"{OUT}/p.html"],
        "stats": ["--no-stats"], "maps": ["--no-maps"], "overview": ["--overview", "entropy"],
        "rank": ["--rank"], "quiet": ["--quiet"], "scale": ["--scale", "log"],
        "figure:size": ["--figure", "size=3"], "figure:dpi": ["--figure", "dpi=50"],
        "budget:tokens": ["--budget", "tokens=3"], "budget:sentences": ["--budget", "sentences=1"],
        "budget:panels": ["--budget", "panels=1"], "budget:memory": ["--budget", "memory=1MB"],
    },
    "ablate": {
        "file": ["--file", f"{OUT}/../extra.txt"], "probe": ["--probe", "induction"],
        "causal": ["--causal"], "spec:positions": ["--spec", "positions=sinusoidal"],
        "device": ["--device", "cpu"], "dtype": ["--dtype", "bfloat16"],
        "device_map": ["--device-map", "auto"], "max_memory": ["--max-memory", "1GB"],
        "spec:E": ["--spec", "E=32"], "num_heads": ["-H", "2"],
        "spec:kv": ["--spec", "kv=2"], "spec:d": ["--spec", "d=2"],
        "spec:kdim": ["--spec", "kdim=8"], "spec:vdim": ["--spec", "vdim=8"],
        "spec:seed": ["--spec", "seed=3"],
        "layer": ["--layer", "1"], "head": ["--head", "1"], "mode": ["--mode", "mean"],
        "out": ["--out", f"{OUT}/f.png"], "stats": ["--no-stats"], "maps": ["--no-maps"],
        "overview": ["--overview", "entropy"], "rank": ["--rank"], "quiet": ["--quiet"],
        "figure:size": ["--figure", "size=3"], "figure:dpi": ["--figure", "dpi=50"],
        "budget:tokens": ["--budget", "tokens=3"], "budget:sentences": ["--budget", "sentences=1"],
        "budget:panels": ["--budget", "panels=1"], "budget:memory": ["--budget", "memory=1MB"],
    },
    "split": {
        "layer": ["--layer", "1"], "spec:E": ["--spec", "E=32"], "num_heads": ["-H", "2"],
        "spec:kv": ["--spec", "kv=2"], "spec:d": ["--spec", "d=4"],
        "spec:kdim": ["--spec", "kdim=8"], "spec:vdim": ["--spec", "vdim=8"],
        "bias": ["--no-bias"],
        "spec:seed": ["--spec", "seed=3"], "out": ["--out", f"{OUT}/f.png"],
        "png": ["--png", f"{OUT}/g.png"], "verify": ["--verify"],
    },
    "inspect": {
        "layer": ["--layer", "1"], "num_heads": ["-H", "2"],
        "spec:kv": ["--spec", "kv=1"], "spec:d": ["--spec", "d=8"],
        "scan": ["--scan"],
    },
    "circuits": {
        "layer": ["--layer", "1"], "spec:E": ["--spec", "E=32"], "num_heads": ["-H", "2"],
        "spec:kv": ["--spec", "kv=2"], "spec:d": ["--spec", "d=2"],
        "spec:kdim": ["--spec", "kdim=8"], "spec:vdim": ["--spec", "vdim=8"],
        "spec:seed": ["--spec", "seed=3"],
        "composition": ["--no-composition"], "out": ["--out", f"{OUT}/f.png"],
        "device": ["--device", "cpu"],
    },
    "attribute": {
        "answer": ["--answer", "cat"], "wrong": ["--answer", "mat", "--wrong", "cat"],
        "position": ["--position", "2"], "top": ["--top", "2"],
        "corrupt": ["--corrupt", "the dog sat", "--corrupt", "a cat ran"],
        "pairs": ["--pairs", f"{OUT}/../extra.txt"], "target": ["--target", "the cat"],
        "html": ["--html", f"{OUT}/p.html"],
        "export": ["--export", f"{OUT}/x.safetensors"],
        "out": ["--out", f"{OUT}/f.png"], "dtype": ["--dtype", "bfloat16"],
    },
    "lens": {
        "answer": ["--answer", "cat"], "position": ["--position", "1"], "top": ["--top", "5"],
        "out": ["--out", f"{OUT}/f.png"], "dtype": ["--dtype", "bfloat16"],
        "export": ["--export", f"{OUT}/x.json"], "target": ["--target", "the cat"],
        "html": ["--html", f"{OUT}/p.html"],
    },
    "patch": {
        "corrupt": ["-c", "the cat"], "answer": ["-a", "cat"], "wrong": ["--wrong", "cat"],
        "pairs": ["--pairs", f"{OUT}/../extra.txt"], "metric": ["--metric", "logprob"],
        "direction": ["--direction", "noising"], "site": ["--site", "q"],
        "per_position": ["--no-per-position"], "receivers": ["--receivers", "1.0"],
        "receiver_input": ["--receiver-input", "k"], "device": ["--device", "cpu"],
        "dtype": ["--dtype", "bfloat16"], "memory_budget": ["--memory-budget", "1MB"],
        "out": ["--out", f"{OUT}/f.png"], "export": ["--export", f"{OUT}/x.json"],
        "html": ["--html", f"{OUT}/p.html"], "target": ["--target", "the"],
    },
    "tokens": {
        "file": ["--file", f"{OUT}/../extra.txt"], "position": ["--position", "0"],
        "method": ["--method", "rollout"], "heads": ["--heads", "max"],
        "residual_weight": ["--residual-weight", "0.3"], "check": ["--no-check"],
        "erase": ["--erase", "baseline"], "baseline": ["--baseline", "dog"],
        "out": ["--out", f"{OUT}/f.png"], "html": ["--html", f"{OUT}/p.html"],
        "export": ["--export", f"{OUT}/x.safetensors"], "dpi": ["--dpi", "50"],
        "device": ["--device", "cpu"], "dtype": ["--dtype", "bfloat16"],
        "max_tokens": ["--max-tokens", "3"], "max_sentences": ["--max-sentences", "1"],
        "memory_budget": ["--memory-budget", "1MB"],
        "target": ["--target", "the cat", "--target", "a dog"],
    },
    "compare": {
        "num_heads": ["-H", "2"], "spec:kv": ["--spec", "kv=2"],
        "spec:d": ["--spec", "d=8"], "field": ["--field", "text"], "limit": ["--limit", "1"],
        "sample": ["--sample", "1"], "seed": ["--seed", "3"], "long": ["--long", "skip"],
        "max_tokens": ["--max-tokens", "3"], "memory_budget": ["--memory-budget", "1MB"],
        "weighting": ["--weighting", "norm"], "device": ["--device", "cpu"],
        "dtype": ["--dtype", "bfloat16"], "overview": ["--overview", "max"],
        "out": ["--out", f"{OUT}/f.png"], "csv": ["--csv", f"{OUT}/h.csv"],
        "html": ["--html", f"{OUT}/p.html"],
    },
    "corpus": {
        "field": ["--field", "text"], "limit": ["--limit", "10"], "sample": ["--sample", "10"],
        "seed": ["--seed", "3"], "long": ["--long", "skip"], "device": ["--device", "cpu"],
        "dtype": ["--dtype", "bfloat16"], "device_map": ["--device-map", "auto"],
        "max_memory": ["--max-memory", "1GB"], "weighting": ["--weighting", "norm"],
        "resamples": ["--resamples", "7"], "overview": ["--overview", "entropy"],
        "out": ["--out", f"{OUT}/f.png"], "csv": ["--csv", f"{OUT}/h.csv"],
        "html": ["--html", f"{OUT}/p.html"], "max_tokens": ["--max-tokens", "3"],
        "memory_budget": ["--memory-budget", "1MB"], "state": ["--state", f"{OUT}/s.state"],
        "resume": ["--resume"], "save_every": ["--save-every", "1"],
    },
}
OVERRIDES: dict[tuple[str, str], dict[str, list[str]]] = {
    # a --model run shows the overview in place of maps and table: asking for them is the change
    ("heatmap", "model"): {"stats": ["--stats"], "maps": ["--maps"]},
    ("generate", "model"): {"stats": ["--stats"], "maps": ["--maps"]},
    ("ablate", "model"): {"stats": ["--stats"], "maps": ["--maps"]},
    ("split", "weights"): {"spec:d": ["--spec", "d=8"]},  # bert-tiny's own d is 4
    ("split", "model"): {"spec:kv": ["--spec", "kv=1"]},  # the zoo llama's is 2
    # a --model run gives its own pair: another corrupted prompt, answer and wrong answer
    ("patch", "model"): {"corrupt": ["-c", "the cat sat on a mat"], "answer": ["-a", "mat"],
                         "wrong": ["--wrong", "mat"]},
}
# beside --json: --no-maps asks for what --json does anyway (it prints no map), so it is
# accepted; --maps asks for what it cannot do
JSON_VALUES = {command: {"maps": ["--maps"]} for command in ("heatmap", "generate", "ablate")}
WEIGHTS = ["--weights", str(SAMPLES / "bert-tiny")]  # 2 layers of 4 heads, not causal
SOURCES: dict[str, dict[str, list[str]]] = {
    "heatmap": {"bundled": [*SENTENCES], "random": ["--random", *SENTENCES],
                "weights": [*WEIGHTS, "--layer", "0", *SENTENCES]},
    "generate": {"bundled": [*SENTENCES]},
    "ablate": {"bundled": [*SENTENCES], "random": ["--random", *SENTENCES],
               "weights": [*WEIGHTS, "--layer", "0", *SENTENCES]},
    "split": {"random": ["--random"], "weights": [*WEIGHTS, "--layer", "0"]},
    "inspect": {"checkpoint": [str(SAMPLES / "llama-gqa-tiny")]},
    "circuits": {"bundled": [], "random": ["--random"], "weights": WEIGHTS},
    "attribute": {"bundled": [*SENTENCES]},
    "lens": {"bundled": [*SENTENCES]},
    "patch": {"bundled": []},
    "tokens": {"bundled": [*SENTENCES]},
    "compare": {"weights": [*WEIGHTS, "--against", str(SAMPLES / "gpt2-tiny")]},
    "corpus": {"bundled": [str(SAMPLES / "english.txt"), "--limit", "30"]},
}
MODEL_SOURCES: dict[str, list[str]] = {  # {model}: the zoo's llama with its LM head
    "heatmap": ["--model", "{model}", *MODEL_SENTENCES],
    "generate": ["--model", "{model}", *MODEL_SENTENCES],
    "ablate": ["--model", "{model}", *MODEL_SENTENCES],
    "split": ["--model", "{model}", "--layer", "0"],
    "circuits": ["--model", "{model}"],
    "attribute": ["--model", "{model}", *MODEL_SENTENCES],
    "lens": ["--model", "{model}", *MODEL_SENTENCES],
    "patch": ["--model", "{model}", "the cat sat on the mat", "-c", "the dog sat on the mat",
              "-a", "cat", "--wrong", "dog"],
    "tokens": ["--model", "{model}", *MODEL_SENTENCES],
    # the corpus: extra.jsonl's three lines of the zoo's words (the model against itself)
    "compare": [f"{OUT}/../extra.jsonl", "--model", "{model}", "--against", "{model}"],
    "corpus": ["--model", "{model}", str(SAMPLES / "english.txt"), "--limit", "8"],
}
# options a command may drop on a source: none (the walk fails on any)
KNOWN: dict[str, set[tuple[str, str]]] = {}


def commands() -> dict[str, Any]:
    """Every command of the app, by name."""
    return typer.main.get_command(app).commands  # type: ignore[attr-defined, no-any-return]


def option_of(name: str) -> str:
    """The option a VALUES entry sets (`spec` for `spec:kv`)."""
    return name.partition(":")[0]


def flags(command: str, name: str) -> list[str]:
    """Every spelling of an option a refusal may name it by (--stats and --no-stats)."""
    param = next(p for p in commands()[command].params if p.name == option_of(name))
    return [flag for flag in [*param.opts, *param.secondary_opts] if flag.startswith("--")]


@dataclass(frozen=True)
class Seen:
    """What a run showed: its exit code, last stderr line, stdout and the files it wrote."""

    code: int
    error: str
    shown: tuple[str, tuple[tuple[str, str], ...]]


class Walker:
    """Runs a command in-process with its output folder emptied between runs."""

    def __init__(self, folder: Path, model: Path | None = None) -> None:
        self.out = folder / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        (folder / "extra.txt").write_text("the red barn\n")
        # a corpus for compare: JSON lines (for --field), the last longer than 128 tokens
        texts = ["the cat sat on the mat", "a small dog ran far away", "the cat sat " * 50]
        (folder / "extra.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
        self.model = model
        self.runner = CliRunner()

    def run(self, args: list[str]) -> Seen:
        for old in self.out.iterdir():
            old.unlink()
        argv = [a.replace(OUT, str(self.out)).replace("{model}", str(self.model))
                for a in args]
        result = self.runner.invoke(app, argv, env={"COLUMNS": "100", "NO_COLOR": "1"})
        files = tuple(sorted((f.name, hashlib.sha1(f.read_bytes()).hexdigest())
                             for f in self.out.iterdir()))
        lines = result.stderr.strip().splitlines()
        return Seen(result.exit_code, lines[-1] if lines else "", (result.stdout, files))

    def walk(self, command: str, source: str, base: list[str], json: bool
             ) -> dict[str, str]:
        """Each option's fate on this source and mode, for the ones not applied or refused."""
        mode = ["--json"] if json else []
        before = self.run([command, *base, *mode])
        assert before.code == 0, (command, source, before.error)
        values = {**VALUES[command], **OVERRIDES.get((command, source), {}),
                  **(JSON_VALUES.get(command, {}) if json else {})}
        found = {}
        for name, value in values.items():
            if name in UNOBSERVABLE:
                continue
            seen = self.run([command, *base, *mode, *value])
            if seen.code == 2 and any(flag in seen.error for flag in flags(command, name)):
                continue  # refused, naming it (or a limit it sets, binding)
            if seen.code == 0 and seen.shown != before.shown:
                continue  # applied: the output shows it
            found[name] = "dropped" if seen.code == 0 else f"exit {seen.code}: {seen.error}"
        return found


def walk_pairs(walker: Walker, base: list[str], json: bool) -> dict[tuple[str, str], str]:
    """heatmap with two options: (a, b) when the run with both shows what the run with a alone
    shows (b dropped beside a), or fails otherwise than by refusing one of them."""
    mode = ["--json"] if json else []
    values = {name: value for name, value in {**VALUES["heatmap"],
                                               **(JSON_VALUES["heatmap"] if json else {})}.items()
              if name not in UNOBSERVABLE}
    alone = {name: walker.run(["heatmap", *base, *mode, *value])
             for name, value in values.items()}
    # (--quiet alone writes no file and is refused; tests/test_volume.py pairs it with files)
    ran = [name for name, seen in alone.items() if seen.code == 0]
    found = {}
    for a in ran:
        for b in ran:
            if a == b:
                continue
            seen = walker.run(["heatmap", *base, *mode, *values[a], *values[b]])
            named = flags("heatmap", a) + flags("heatmap", b)
            if seen.code == 2 and any(flag in seen.error for flag in named):
                continue
            if seen.code == 0 and seen.shown != alone[a].shown:
                continue
            found[a, b] = "dropped" if seen.code == 0 else f"exit {seen.code}: {seen.error}"
    return found


def test_every_option_of_every_command_is_walked():
    """A new option is walked, or named here as unobservable by design, before it ships
    (heatmap's `old_*` options are old spellings, refused whatever their value: see the tests
    below)."""
    for name, command in commands().items():
        options = {p.name for p in command.params} - AXES
        old = {p.name for p in command.params if p.name.startswith("old_")}
        walked = {option_of(entry) for entry in VALUES[name]}
        missing = options - old - walked - set(UNOBSERVABLE)
        assert not missing, f"{name}: give {sorted(missing)} a value in VALUES"
        assert walked <= options, f"{name}: VALUES names options it lacks"


@pytest.fixture(scope="module")
def walker(tmp_path_factory: Any) -> Walker:
    return Walker(tmp_path_factory.mktemp("walk"))


def test_heatmap_json_on_the_bundled_model_drops_no_option(walker: Walker):
    """The quick walk: every heatmap option, --json, on the bundled model."""
    assert walker.walk("heatmap", "bundled", SOURCES["heatmap"]["bundled"], True) == {}


WALKS = [(command, source, json) for command, sources in SOURCES.items() for source in sources
         for json in (False, True) if (command, source, json) != ("heatmap", "bundled", True)]


@pytest.mark.slow
@pytest.mark.parametrize("command, source, json", WALKS,
                         ids=[f"{c}-{s}{'-json' if j else ''}" for c, s, j in WALKS])
def test_no_option_is_dropped(walker: Walker, command: str, source: str, json: bool):
    found = walker.walk(command, source, SOURCES[command][source], json)
    known = KNOWN.get(command, set())
    assert {name: fate for name, fate in found.items() if (source, name) not in known} == {}


@pytest.mark.slow
@pytest.mark.parametrize("json", [False, True], ids=["plain", "json"])
def test_no_option_drops_another(walker: Walker, json: bool):
    """Every pair of heatmap options on the bundled model (--query with --weighting norm, --ablate
    with --ablate-mean and --json with --maps were such pairs): each pair applies or is refused."""
    assert walk_pairs(walker, SOURCES["heatmap"]["bundled"], json) == {}


@pytest.fixture(scope="module")
def model_walker(tmp_path_factory: Any) -> Walker:
    pytest.importorskip("transformers")
    import zoo

    folder = zoo.build_lm("llama", tmp_path_factory.mktemp("lm_llama"))
    return Walker(tmp_path_factory.mktemp("walk_model"), folder)


MODEL_WALKS = [(command, json) for command in MODEL_SOURCES for json in (False, True)]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("command, json", MODEL_WALKS,
                         ids=[f"{c}-model{'-json' if j else ''}" for c, j in MODEL_WALKS])
def test_no_option_is_dropped_on_a_model(model_walker: Walker, command: str, json: bool):
    found = model_walker.walk(command, "model", MODEL_SOURCES[command], json)
    known = KNOWN.get(command, set())
    assert {name: fate for name, fate in found.items() if ("model", name) not in known} == {}


# --- negative controls: the walker catches a dropped option ---------------------------------

def test_the_walker_catches_a_refusal_taken_away(walker: Walker, monkeypatch):
    """With --causal's rule gone from the table, --causal on the bundled model (causal already)
    is dropped, and the walk says so."""
    from attnviz.core import option_rules

    kept = tuple(rule for rule in option_rules.RULES if rule.options != "causal")
    assert len(kept) == len(option_rules.RULES) - 1
    monkeypatch.setattr(option_rules, "RULES", kept)
    found = walker.walk("heatmap", "bundled", SOURCES["heatmap"]["bundled"], True)
    assert found == {"causal": "dropped"}


@pytest.mark.parametrize("command", ["heatmap", "generate"])
def test_the_walker_catches_an_option_the_command_ignores(walker: Walker, monkeypatch,
                                                          command: str):
    """A command that ignores --rank (as if a new option were wired to nothing) is caught on its
    walk; with the command intact the walk is clean (test_no_option_is_dropped)."""
    info = next(c for c in app.registered_commands if c.callback.__name__ == command)
    real = info.callback

    @functools.wraps(real)
    def ignoring_rank(*args: Any, **kwargs: Any) -> Any:
        kwargs["rank"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(info, "callback", ignoring_rank)
    found = walker.walk(command, "bundled", SOURCES[command]["bundled"], True)
    assert found == {"rank": "dropped"}


# --- the contradictions #36 names, each with the run that used to pass ----------------------

def test_head_is_one_head_or_their_mean(cli):
    """One option says which head or their mean (--head and --average used to be two options
    that excluded each other): anything else is refused; the control: N and mean both run, and
    show different maps."""
    from helpers import assert_clean_error

    assert_clean_error(cli("heatmap", *SENTENCES, "--head", "all"), 2,
                       "--head takes a head number or 'mean'")
    shown = [cli("heatmap", *SENTENCES, "--head", head, "--no-stats") for head in ("0", "mean")]
    assert [result.exit_code for result in shown] == [0, 0]
    assert "mean of heads" in shown[1].stdout and "mean of heads" not in shown[0].stdout


def test_query_names_its_sentence(cli):
    """--query TOKEN@S picks the sentence the breakdown is of (--sentence S without --query used
    to be a contradiction to refuse); a sentence past the batch is refused."""
    import json

    from helpers import assert_clean_error

    docs = [json.loads(cli("heatmap", *SENTENCES, "--query", f"0@{n}", "--json").stdout)["query"]
            for n in (1, 2)]
    assert docs[0] != docs[1]
    assert docs[0] == json.loads(cli("heatmap", *SENTENCES, "--query", "0", "--json").stdout)[
        "query"]  # no @S: the first sentence
    assert_clean_error(cli("heatmap", *SENTENCES, "--query", "0@3"), 2,
                       "sentence 3 is out of range", "choose 1..2")


def test_query_with_norm_weighting_is_refused(cli):
    """It used to end in 'recomputing query 1 from the slices differs from the run' (exit 1):
    the breakdown recomputes α, the maps then hold ‖α·W_O v‖."""
    from helpers import assert_clean_error

    assert_clean_error(cli("heatmap", *SENTENCES, "--query", "cat", "--weighting", "norm"), 2,
                       "--query breaks down the attention weights", "--weighting norm")
    for alone in (["--query", "cat"], ["--weighting", "norm"]):  # control: each alone runs
        assert cli("heatmap", *SENTENCES, *alone).exit_code == 0


@pytest.mark.parametrize("args, flag", [(["--maps"], "--maps"), (["--stats"], "--stats"),
                                        (["--no-stats"], "--stats"), (["--quiet"], "--quiet"),
                                        (["--head", "mean"], "--head mean"),
                                        (["--scale", "log"], "--scale")])
def test_json_refuses_what_it_cannot_show(cli, args, flag):
    from helpers import assert_clean_error

    assert_clean_error(cli("heatmap", *SENTENCES, "--json", *args), 2, flag)


def test_json_keeps_what_a_figure_shows(cli, tmp_path):
    """Control: --average and --scale apply to an --out figure beside --json."""
    out = tmp_path / "f.png"
    for args in (["--head", "mean"], ["--scale", "log"]):
        assert cli("heatmap", *SENTENCES, "--json", "--out", out, *args).exit_code == 0
    assert cli("heatmap", *SENTENCES, "--json", "--no-maps").exit_code == 0


# --- old spellings: one error line naming the command that does the job now ------------------

MOVED = [(["--generate", "4"], "--generate", "generate"), (["--sample"], "--sample", "generate"),
         (["--temperature", "0.5"], "--temperature", "generate"),
         (["--top-p", "0.5"], "--top-p", "generate"), (["--ablate"], "--ablate", "ablate"),
         (["--ablate-mean"], "--ablate-mean", "ablate")]


@pytest.mark.parametrize("args, flag, command", MOVED, ids=[m[1] for m in MOVED])
def test_old_spellings_on_heatmap_name_the_new_command(cli, tmp_path, args, flag, command):
    """Exactly one line on stderr, exit 2, nothing written (the figure asked for is not drawn);
    the control: the same run in the new command's spelling succeeds and writes it."""
    out = tmp_path / "f.png"
    result = cli("heatmap", *SENTENCES, "--out", out, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {flag} moved to its own command — use 'attnviz {command} …' "
        f"(see 'attnviz {command} --help')"]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
    spelled = {"--generate": ["--max-new-tokens", "4"], "--sample": ["--sample"],
               "--temperature": ["--sample", "--temperature", "0.5"],
               "--top-p": ["--sample", "--top-p", "0.5"], "--ablate": [],
               "--ablate-mean": ["--mode", "mean"]}[flag]
    assert cli(command, *SENTENCES, "--out", out, *spelled).exit_code == 0
    assert out.exists()


def test_heatmap_help_lists_no_old_spelling(cli):
    shown = cli("heatmap", "--help", env={"COLUMNS": "200"}).stdout
    for _args, flag, _ in MOVED:
        assert f"{flag} " not in shown.replace("--max-new-tokens", ""), flag
    assert "--weighting" in shown  # control: a visible option is listed


def test_overview_ablation_names_the_scorecard_command(cli):
    """heatmap and generate have no scorecard to show: --overview ablation names ablate (it
    used to say 'add --ablate'); the control: ablate shows it."""
    from helpers import assert_clean_error

    for command in ("heatmap", "generate"):
        assert_clean_error(cli(command, *SENTENCES, "--overview", "ablation"), 2,
                           "--overview ablation", "attnviz ablate")
    shown = cli("ablate", *SENTENCES, "--overview", "ablation", "--json")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.count('"ablation"') >= 1


# --- renamed options: the old spellings still work, as the new ones ---------------------------

GQA = ["--weights", str(SAMPLES / "llama-gqa-tiny"), "--layer", "0"]
BERT = ["--weights", str(SAMPLES / "bert-tiny"), "--layer", "0"]
FIG = ["--out", "{out}/f.png"]
# command, the run's other options, the old spelling, the new one
RENAMED = [
    ("heatmap", ["--random"], ["-E", "32"], ["--spec", "E=32"]),
    ("heatmap", ["--random"], ["--kdim", "8"], ["--spec", "kdim=8"]),
    ("heatmap", ["--random"], ["--vdim", "8"], ["--spec", "vdim=8"]),
    ("heatmap", ["--random"], ["--seed", "3"], ["--spec", "seed=3"]),
    ("heatmap", GQA, ["--num-kv-heads", "2"], ["--spec", "kv=2"]),
    ("heatmap", BERT, ["--head-dim", "4"], ["--spec", "d=4"]),
    ("heatmap", ["--random"], ["--positions", "sinusoidal"], ["--spec", "positions=sinusoidal"]),
    ("heatmap", [], ["--max-tokens", "30"], ["--budget", "tokens=30"]),
    ("heatmap", [], ["--max-sentences", "5"], ["--budget", "sentences=5"]),
    ("heatmap", FIG, ["--max-panels", "99"], ["--budget", "panels=99"]),
    ("heatmap", ["--random"], ["--memory-budget", "1GB"], ["--budget", "memory=1GB"]),
    ("heatmap", FIG, ["--size", "3"], ["--figure", "size=3"]),
    ("heatmap", FIG, ["--dpi", "50"], ["--figure", "dpi=50"]),
    ("heatmap", [], ["--average"], ["--head", "mean"]),
    ("heatmap", ["--query", "cat"], ["--sentence", "1"], []),
    ("generate", [], ["--average"], ["--head", "mean"]),
    ("generate", [], ["--max-tokens", "30"], ["--budget", "tokens=30"]),
    ("generate", FIG, ["--dpi", "50"], ["--figure", "dpi=50"]),
    ("ablate", ["--random"], ["-E", "32"], ["--spec", "E=32"]),
    ("ablate", ["--random"], ["--memory-budget", "1GB"], ["--budget", "memory=1GB"]),
    ("ablate", FIG, ["--size", "3"], ["--figure", "size=3"]),
]


@pytest.mark.parametrize("command, base, old, new", RENAMED,
                         ids=[f"{c}{' '.join(o)}" for c, _, o, _ in RENAMED])
def test_old_spellings_still_work_as_the_new_ones(tmp_path, command, base, old, new):
    """Scripts written for the old spellings keep running: the old option shows exactly what
    the new one shows (stdout and the files written); the control: a different value of the new
    spelling shows something else (so equal output is not the option being dropped)."""
    walker = Walker(tmp_path)
    sentences = ["the cat sat on the mat the cat sat"]
    with_old = walker.run([command, *sentences, *base, *old])
    with_new = walker.run([command, *sentences, *base, *new])
    assert with_old.code == 0, with_old.error
    assert with_new.code == 0, with_new.error
    assert with_old.shown == with_new.shown


def test_an_old_and_a_new_spelling_of_one_setting_are_given_twice(cli):
    result = cli("heatmap", "the cat sat", "--max-tokens", "30", "--budget", "tokens=40")
    assert result.exit_code == 2 and "given twice" in result.stderr, result.output
    result = cli("heatmap", "the cat sat", "--average", "--head", "1")
    assert result.exit_code == 2 and "exclude each other" in result.stderr, result.output
    result = cli("heatmap", "the cat sat", "--sentence", "1")
    assert result.exit_code == 2 and "--query" in result.stderr, result.output


def test_an_old_spelling_is_not_dropped(tmp_path):
    """The negative control of the equality above: the old spelling with another value shows
    something different from the default run (the rewrite is not a no-op)."""
    walker = Walker(tmp_path)
    plain = walker.run(["heatmap", "--random", "the cat sat"])
    wider = walker.run(["heatmap", "--random", "the cat sat", "-E", "32"])
    assert plain.code == 0 and wider.code == 0
    assert plain.shown != wider.shown


def test_renamed_options_are_hidden(cli):
    shown = cli("heatmap", "--help", env={"COLUMNS": "200"}).stdout
    for flag in ("--embed-dim", "--kdim", "--max-tokens", "--memory-budget", "--average",
                 "--sentence ", "--dpi", "--head-dim", "--positions"):
        assert flag not in shown, flag
    for flag in ("--spec", "--budget", "--figure", "--head"):  # control: the new spellings are
        assert flag in shown, flag


# `split`, `circuits`, `inspect` and `compare` size a layer with the same --spec (no sentences)
LAYER_RENAMED = [
    ("split", [], ["-E", "32"], ["--spec", "E=32"]),
    ("split", [], ["--kdim", "8", "--vdim", "16"], ["--spec", "kdim=8,vdim=16"]),
    ("split", [], ["--seed", "3"], ["--spec", "seed=3"]),
    ("split", ["--weights", str(SAMPLES / "bert-tiny"), "--layer", "0"], ["--head-dim", "8"],
     ["--spec", "d=8"]),
    ("circuits", ["--random"], ["-E", "32", "--seed", "2"], ["--spec", "E=32,seed=2"]),
    ("inspect", [str(SAMPLES / "llama-gqa-tiny")], ["--num-kv-heads", "4"], ["--spec", "kv=4"]),
    ("compare", ["--weights", str(SAMPLES / "bert-tiny"), "--against",
                 str(SAMPLES / "bert-tiny")], ["--head-dim", "8"], ["--spec", "d=8"]),
]


@pytest.mark.parametrize("command, base, old, new", LAYER_RENAMED,
                         ids=[f"{c}{' '.join(o)}" for c, _, o, _ in LAYER_RENAMED])
def test_old_layer_spellings_still_work_as_spec(tmp_path, command, base, old, new):
    """As above, for the commands without sentences; the control: the run without the option
    shows something else (the setting was applied, not dropped)."""
    walker = Walker(tmp_path)
    with_old = walker.run([command, *base, *old])
    with_new = walker.run([command, *base, *new])
    plain = walker.run([command, *base])
    assert with_old.code == with_new.code, (with_old.error, with_new.error)
    assert (with_old.shown, with_old.error) == (with_new.shown, with_new.error)
    assert (plain.code, plain.shown, plain.error) != (with_new.code, with_new.shown,
                                                      with_new.error)


@pytest.mark.parametrize("command", ["split", "circuits", "inspect", "compare"])
def test_layer_spellings_are_hidden(cli, command):
    shown = cli(command, "--help", env={"COLUMNS": "200"}).stdout
    for flag in ("--embed-dim", "--kdim", "--vdim", "--head-dim", "--num-kv-heads"):
        assert flag not in shown, flag
    assert "--spec" in shown  # control: the new spelling is listed
