"""What attnviz checks before and around transformers.

transformers builds whatever config.json describes: `num_hidden_layers: 100000` creates 100,000
layers and `max_position_embeddings: 10**8` a 12 GB table before any weight is compared, a
tokenizer written in Rust can panic (`pyo3_runtime.PanicException`, a BaseException), and the
libraries print warnings and load reports on stderr. Here, before transformers allocates
anything: the layer counts of config.json are checked against the layers the weights number,
the model is built on the meta device (no memory) and every parameter's shape compared with the
checkpoint's, the model must take text (or have a text tower, which then runs alone), and the
folder must hold tokenizer files. Around every call into the libraries, `silenced()` keeps their
messages off the terminal (Python warnings, logging, and the Rust panic hook's writes to file
descriptor 2), and failures become attnviz's own errors.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnviz.core import crash_note
from attnviz.errors import (
    AttnvizError,
    CheckpointError,
    Interrupted,
    UsageError,
    option,
    printable,
    printable_path,
    quoted,
)
from attnviz.load.store import TensorStore
from attnviz.sources.hf.config_guard import check_config_values

LAYER_COUNT_FIELDS = frozenset({"num_hidden_layers", "n_layer", "n_layers", "num_layers",
                                "encoder_layers", "decoder_layers", "num_decoder_layers",
                                "num_encoder_layers"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")
# Parameters and buffers the checkpoint does not hold (position ids, masks, an unused pooler)
# may add at most this many elements, or as many as the checkpoint holds.
UNMATCHED_ELEMENTS = 1 << 24
TEXT_TOWERS = ("text_model", "language_model", "text_encoder")
NON_TEXT_INPUTS = {"pixel_values": "images (pixel_values)",
                   "input_features": "audio (input_features)",
                   "input_values": "audio (input_values)"}
NOT_FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit, Interrupted)


def numbered_layers(store: TensorStore) -> int:
    """One more than the largest number in any tensor name (`h.11.attn…` → 12): no config can
    describe more layers than the names of the weights number."""
    best = -1
    for key in store.keys():
        for part in key.split("."):
            if part.isascii() and part.isdigit() and len(part) < 10:
                best = max(best, int(part))
    return best + 1


def _fields(config: dict[str, Any], names: frozenset[str]) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every field named in `names`, in nested configs too."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if key in names:
                    yield child, item
                elif isinstance(item, dict) and child.count(".") < 8:
                    stack.append((child, item))


def check_folder(folder: Path, store: TensorStore) -> None:
    """Before transformers: config.json present, and its layer counts against the weights."""
    where = printable_path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError("the model folder has no config.json", fix="copy it from the model's "
                              "hub page; attnviz never guesses the architecture", where=where)
    check_config_values(store.config, where)
    if "num_hidden_groups" in store.config:  # ALBERT: its layers reuse a few weight groups
        return
    bound = numbered_layers(store)
    for path, value in _fields(store.config, LAYER_COUNT_FIELDS):
        if type(value) is int and value > max(bound, 1):
            raise CheckpointError(f"config.json field {quoted(path)} is {value}, but the weights "
                                  f"number at most {bound} layers",
                                  fix="config.json and the weights must describe the same model: "
                                  "fix config.json", where=where)


def check_tokenizer_files(folder: Path) -> None:
    """Tokenizer files present: a model without them would run on [UNK] tokens, or not at
    all."""
    where = printable_path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError("the model folder has no tokenizer files (tokenizer.json, "
                              "vocab.txt, …)", fix="copy them from the model's hub page into the "
                              "folder; attnviz never runs a model on guessed tokens", where=where)


@contextlib.contextmanager
def silenced(stderr: bool = False) -> Iterator[None]:
    """transformers, huggingface_hub and Python warnings say nothing on the terminal: their
    logging is raised past ERROR and warnings are dropped. With `stderr` (loading, tokenizing),
    file descriptor 2 — where Rust's panic hook and C code write — also goes to a temporary file
    that is thrown away; without it (a forward pass), attnviz's own progress on stderr goes on."""
    import transformers

    tlog = transformers.utils.logging
    level = tlog.get_verbosity()
    hub = logging.getLogger("huggingface_hub")
    logger = logging.getLogger("transformers")
    hub_level, logger_level = hub.level, logger.level
    tlog.set_verbosity_error()
    if stderr:
        tlog.disable_progress_bar()
    hub.setLevel(logging.CRITICAL)
    logger.setLevel(logging.CRITICAL)  # whatever the verbosity transformers sets meanwhile
    try:
        with contextlib.ExitStack() as stack:
            if stderr:
                stack.enter_context(_stderr_dropped())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
    finally:
        tlog.set_verbosity(level)
        hub.setLevel(hub_level)
        logger.setLevel(logger_level)


@contextlib.contextmanager
def _stderr_dropped() -> Iterator[None]:
    """File descriptor 2 into a thrown-away file. Under the command line's supervisor that is
    the file it shares (the parent quotes its last line if the process dies of a signal inside);
    from the Python API a temporary file, with faulthandler saying so on the real stderr."""
    shared = crash_note.shared_sink()
    try:
        sink = None if shared is not None else tempfile.TemporaryFile()
        target = sink.fileno() if sink is not None else int(shared or 0)
        if sink is None:  # the supervisor's file: only this step's words in it
            os.ftruncate(target, 0)
            os.lseek(target, 0, os.SEEK_SET)
        saved_fd = os.dup(2)
        os.dup2(target, 2)
    except OSError:  # no file descriptor 2 to redirect: Python-level silence only
        yield
        return
    try:
        with contextlib.ExitStack() as stack:
            if sink is not None:
                stack.enter_context(_fatal_signals_to(saved_fd))
            yield
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        if sink is not None:
            sink.close()


@contextlib.contextmanager
def _fatal_signals_to(fd: int) -> Iterator[None]:
    """While fd 2 is silenced and no supervisor watches (the Python API): a fatal signal (an
    allocator abort in Rust) is reported by faulthandler on the real stderr, `fd`, instead of
    the process dying without a word."""
    import faulthandler

    was_enabled = faulthandler.is_enabled()
    real = os.fdopen(os.dup(fd), "w", closefd=True)
    faulthandler.enable(file=real, all_threads=False)
    try:
        yield
    finally:
        faulthandler.disable()
        real.close()
        if was_enabled:
            with contextlib.suppress(ValueError, OSError, AttributeError):
                faulthandler.enable()


class contained(contextlib.AbstractContextManager):  # noqa: N801 - used as `with contained(…)`
    """`with contained(what, fix, where)`: any third-party failure inside (a Rust panic
    included, which is a BaseException) becomes a CheckpointError naming `what`; attnviz's own
    errors, interrupts and exits pass through."""

    def __init__(self, what: str, fix: str, where: str) -> None:
        self.what, self.fix, self.where = what, fix, where
        self._note = crash_note.doing(what, fix, where)

    def __enter__(self) -> contained:
        self._note.__enter__()  # what a supervising parent reports if the process dies here
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self._note.__exit__(None, None, None)
        if exc is None or isinstance(exc, (AttnvizError, *NOT_FATAL)):
            return
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        detail = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        raise CheckpointError(f"{self.what} ({printable(detail, 200)})", fix=self.fix,
                              where=self.where) from None


def meta_model(transformers: Any, config: Any) -> Any:
    """The model transformers would build, on the meta device: shapes, no memory."""
    import torch

    with torch.device("meta"):
        return transformers.AutoModel.from_config(config, attn_implementation="eager")


def _accepts(module: Any) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return set()


def text_runner(meta: Any, config: Any) -> str | None:
    """Which part runs on text: None for the model itself (or an encoder-decoder's encoder),
    or the attribute of its text tower (CLIP's text_model); a model that takes no text is a
    usage error saying what the command needs."""
    encoder = getattr(config, "is_encoder_decoder", False)
    runner = meta.get_encoder() if encoder else meta
    accepts = _accepts(runner)
    other = [NON_TEXT_INPUTS[name] for name in NON_TEXT_INPUTS if name in accepts]
    if "input_ids" in accepts and not other:
        return None
    for tower in TEXT_TOWERS:
        sub = getattr(meta, tower, None)
        sub_accepts = _accepts(sub) if sub is not None else set()
        if "input_ids" in sub_accepts and not any(n in sub_accepts for n in NON_TEXT_INPUTS):
            return tower
    kind = getattr(config, "model_type", "?")
    takes = " and ".join(other) or ", ".join(sorted(accepts)[:4]) or "no known inputs"
    raise UsageError(f"model_type {quoted(str(kind))} takes {takes}, not text, and has no text "
                     "tower attnviz can run alone",
                     fix=f"{option('model')} needs a text model: one whose forward takes "
                         "input_ids (token ids from its tokenizer)", option="model")


def _key_for(name: str, keys: set[str], prefix: str) -> str | None:
    """The checkpoint key of a model parameter: the same name, or with or without the base
    model prefix (`transformer.h.0…` for GPT2Model's `h.0…`)."""
    for candidate in (name, f"{prefix}.{name}" if prefix else None,
                      name.removeprefix(f"{prefix}.") if prefix else None):
        if candidate and candidate in keys:
            return candidate
    return None


def check_sizes(meta: Any, store: TensorStore, where: str) -> None:
    """Every parameter config.json describes must have the checkpoint's shape, and what the
    checkpoint does not hold must stay small: no config value sizes an allocation the weights
    do not back."""
    import math

    keys = set(store.keys())
    prefix = getattr(meta, "base_model_prefix", "") or ""
    held = sum(math.prod(store.info(key).shape) for key in keys)
    unmatched = 0
    for name, param in meta.named_parameters():
        key = _key_for(name, keys, prefix)
        if key is None:
            unmatched += param.numel()
            continue
        stored = tuple(store.info(key).shape)
        if tuple(param.shape) != stored:
            raise CheckpointError(f"config.json describes {quoted(name)} as "
                                  f"{tuple(param.shape)}, but the weights hold {stored}",
                                  fix="config.json and the weights describe different models: fix "
                                  "config.json", where=where)
    unmatched += sum(buffer.numel() for _, buffer in meta.named_buffers())
    if unmatched > max(UNMATCHED_ELEMENTS, held):
        raise CheckpointError(f"config.json describes {unmatched} parameter and buffer values "
                              f"that the weights do not hold ({held} values)",
                              fix="config.json and the weights describe different models: fix "
                              "config.json", where=where)


def computed_tables(model: Any) -> set[str]:
    """Parameters the model computes instead of learning, which a checkpoint need not hold:
    sinusoidal position tables (Marian, Pegasus, RoFormer; transformers 5 saves none of them,
    and its ignore list names them with a prefix a base model's keys lack), each kept only
    where the loaded table equals what its module's own `create_weight` builds."""
    import torch

    names = set()
    for prefix, module in model.named_modules():
        make = getattr(module, "create_weight", None)
        weight = getattr(module, "weight", None)
        if "Sinusoidal" not in type(module).__name__ or not callable(make) or \
                not isinstance(weight, torch.Tensor) or weight.device.type == "meta":
            continue
        with torch.no_grad():
            expected = make().to(dtype=weight.dtype, device=weight.device)
        if expected.shape == weight.shape and torch.equal(expected, weight.detach()):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def check_loaded(info: dict[str, Any], runner_names: set[str], where: str) -> None:
    """transformers' loading report in attnviz's words: weights of the part that runs must
    all come from the checkpoint (none left at random initialization), none resized."""
    mismatched = [str(item[0] if isinstance(item, tuple | list) else item)
                  for item in info.get("mismatched_keys") or []]
    missing = [str(name) for name in info.get("missing_keys") or []
               if name in runner_names and ".pooler." not in f".{name}"]
    if mismatched:
        raise CheckpointError(f"the weights of {quoted(mismatched[0])} do not have the shape "
                              "config.json describes", fix="fix config.json", where=where)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"the weights lack {quoted(missing[0])}{more}, which the model "
                              "runs (transformers would fill them with random numbers)",
                              fix="use the complete checkpoint", where=where)
