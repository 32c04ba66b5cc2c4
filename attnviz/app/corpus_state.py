"""--state / --resume: a corpus run's partial sums in a safetensors file (data only, never a
pickle), written atomically (a temporary file beside it, then os.replace), with what the run
was in its metadata: the model's identity (a hash of its files' names, sizes and headers), the
corpus's (path, size, modification time; the hash of the examples read checks a stream), the
options that change the numbers, and how many examples it had consumed. A resumed run must find
all of them unchanged, and says which changed when one did. Under torchrun each rank keeps its
own file (STATE.rankR), since each sums its own share."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnviz.compute.corpus.corpus_sums import CorpusSums
from attnviz.errors import AttnvizError, UsageError, option, printable_path

FORMAT = "attnviz-corpus-state"
VERSION = 1


@dataclass
class RunState:
    """What a state file holds besides the sums."""

    model: dict[str, Any]
    corpus: dict[str, Any]
    options: dict[str, Any]
    consumed: int  # examples (ordinals) read and done: the next run starts at this ordinal
    prefix: str  # hash of the texts of those examples
    layers: list[dict[str, Any]]
    counts: dict[str, int]  # skipped, truncated, batches …


def state_path(path: Path, rank: int, world: int) -> Path:
    return path if world == 1 else path.with_name(f"{path.name}.rank{rank}")


def save_state(path: Path, sums: CorpusSums, state: RunState) -> None:
    """Atomically: a crash while writing leaves the previous state whole."""
    from safetensors.torch import save_file

    from attnviz.app.outputs import write_output

    meta = {"format": FORMAT, "version": str(VERSION),
            "state": json.dumps(state.__dict__, sort_keys=True)}
    tensors = {k: v.contiguous() for k, v in sums.tensors().items()}
    write_output(path, lambda tmp: save_file(tensors, str(tmp), meta))


def load_state(path: Path) -> tuple[CorpusSums, RunState]:
    from safetensors import safe_open

    where = printable_path(path)
    if not path.is_file():
        raise UsageError("there is no state file to resume from", where=where,
                         fix=f"drop {option('resume')} to start afresh, or name the file "
                         f"the interrupted run wrote with {option('state')}", option="resume")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise ValueError("not a corpus state file")
        state = RunState(**json.loads(meta["state"]))
        return CorpusSums.from_tensors(tensors), state
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AttnvizError(f"the state file cannot be read: {exc}", where=where,
                           fix=f"drop {option('resume')} to start afresh") from None


def check_resumable(saved: RunState, now: RunState) -> None:
    """Refuse a resume whose model, corpus or options changed, naming what changed."""
    changes: list[str] = []
    if saved.model != now.model:
        changes.append("the model (its files' names, sizes or headers)")
    for key in sorted(set(saved.corpus) | set(now.corpus)):
        if saved.corpus.get(key) != now.corpus.get(key):
            changes.append(f"the corpus's {key} ({saved.corpus.get(key)} → {now.corpus.get(key)})")
    for key in sorted(set(saved.options) | set(now.options)):
        if saved.options.get(key) != now.options.get(key):
            changes.append(f"{option(key)} ({saved.options.get(key)} → "
                           f"{now.options.get(key)})")
    if changes:
        raise UsageError("cannot resume: " + "; ".join(changes) + " changed since the state "
                         "file was written", fix=f"restore them, or drop {option('resume')} "
                         "to start afresh", option="resume")
