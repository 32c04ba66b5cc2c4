"""The generation settings attnviz's capture needs, given to `model.generate` explicitly so that
the model's generation_config.json cannot change them.

The capture reads one query row per step for one sequence per prompt, fed back through the KV
cache (attnviz.sources.hf.generate). A generation_config.json asking for beam search
(`num_beams: 3`), several sequences per prompt (`num_return_sequences: 2`), no cache
(`use_cache: false`), a static cache (its keys padded to its full length), chunked prefill,
assisted or contrastive decoding, or sampling when greedy decoding was asked (and the reverse)
would make generate run differently from what the rows are read as, or fail. Every such field
is passed to generate as a keyword, which transformers ranks above the model's
generation_config. The model's other settings stay its own: its end-of-sequence, pad, start and
forced tokens, and its logits processors (repetition penalty, suppressed and bad words, minimum
length). Fields the model's file set to something else are listed in one note (`set_aside`).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from attnviz.core.request import GenerateSpec
from attnviz.errors import CheckpointError, option, printable
from attnviz.load.checkpoint import read_json
from attnviz.sources.hf import guard

# decoding-mode fields: one sequence per prompt, greedy or sampled, one token per forward
_ONE_SEQUENCE: dict[str, Any] = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "use_cache": True,
    "cache_implementation": None, "cache_config": None, "prefill_chunk_size": None,
    "constraints": None, "force_words_ids": None, "penalty_alpha": None, "dola_layers": None,
    "prompt_lookup_num_tokens": None, "assistant_early_exit": None, "use_mtp": False,
    "guidance_scale": None, "token_healing": False, "low_memory": None, "max_time": None,
    "stop_strings": None, "max_length": None, "early_stopping": False, "length_penalty": 1.0,
    "diversity_penalty": 0.0, "disable_compile": True, "output_hidden_states": False,
    "output_scores": False, "output_logits": False, "return_dict_in_generate": True,
}
# logits warpers: --sample draws from softmax(logits / T) within top-p, nothing else
_WARPERS_OFF: dict[str, Any] = {"top_k": None, "min_p": None, "typical_p": None,
                                "epsilon_cutoff": None, "eta_cutoff": None, "top_h": None,
                                "temperature": None, "top_p": None}


# set by attnviz at each call: not a choice of the model's, never named as set aside
_PLUMBING = {"pad_token_id", "output_attentions", "output_hidden_states", "output_scores",
             "output_logits", "return_dict_in_generate", "disable_compile"}
OVERRIDDEN = set(_ONE_SEQUENCE) | set(_WARPERS_OFF) | {"max_new_tokens", "do_sample"}
# per model loaded by `load_lm`: the fields of its generation_config.json that attnviz sets
# itself, as the file gave them (they are left out of the config transformers builds, so that
# a combination transformers refuses at load, such as num_return_sequences 2 without beams,
# does not stop a model attnviz would decode greedily anyway)
_FILE_FIELDS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def generation_config_of(folder: Path, where: str) -> tuple[Any, dict[str, Any]]:
    """(the GenerationConfig to load the model with, or None: transformers' own, from
    config.json, when the folder has no generation_config.json; the file's fields attnviz
    overrides). A field transformers still refuses is named in one error."""
    import transformers

    path = folder / "generation_config.json"
    if not path.is_file():
        return None, {}
    raw = read_json(path, "generation_config.json")
    kept = {name: value for name, value in raw.items() if name not in OVERRIDDEN}
    try:
        with guard.silenced():
            config = transformers.GenerationConfig.from_dict(kept)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise CheckpointError(f"transformers refuses the model's generation_config.json: "
                              f"{printable(str(exc), 200)}", fix="fix or remove that field",
                              where=where) from None
    return config, {name: value for name, value in raw.items() if name in OVERRIDDEN}


def settle_loaded_generation(model: Any, fields: dict[str, Any]) -> None:
    """Keep the file's overridden fields for `settings`, and mark the loaded config unmodified."""
    _FILE_FIELDS[model] = fields
    # transformers 4.x's from_pretrained copies a given generation_config through from_dict,
    # which drops the "unmodified" mark its generate then reads when the file says
    # `_from_model_config`; mark it as GenerationConfig.from_pretrained would
    config = getattr(model, "generation_config", None)
    if config is not None and not hasattr(config, "_original_object_hash"):
        config._original_object_hash = hash(config)


def settings(model: Any, spec: GenerateSpec, pad: int,
             output_attentions: bool) -> tuple[dict[str, Any], list[str]]:
    """(generate's keywords, the model's generation settings they set aside as 'name value'),
    for the fields this transformers' GenerationConfig knows. The model's settings: its
    generation_config, and the fields of its generation_config.json `load_lm` left out."""
    import transformers

    wanted = {**_ONE_SEQUENCE, **_WARPERS_OFF, "max_new_tokens": spec.max_new,
              "do_sample": spec.sample, "pad_token_id": pad,
              "output_attentions": output_attentions}
    if spec.sample:
        wanted.update(temperature=spec.temperature, top_p=spec.top_p, top_k=0, typical_p=1.0,
                      epsilon_cutoff=0.0, eta_cutoff=0.0)
    fresh = transformers.GenerationConfig()
    known = set(fresh.to_dict())
    wanted = {name: value for name, value in wanted.items() if name in known}
    theirs = {**model.generation_config.to_dict(), **_FILE_FIELDS.get(model, {})}
    defaults = _defaults(fresh)
    aside = []
    for name, value in wanted.items():
        given = theirs.get(name)
        if name not in _PLUMBING and given is not None and given != value \
                and given != defaults.get(name):
            aside.append(f"{printable(name, 40)} {printable(_shown(given), 40)}")
    return wanted, aside


def _defaults(fresh: Any) -> dict[str, Any]:
    """transformers' own defaults (a fresh config's, and generate's fallbacks where a fresh
    config leaves a field unset, as transformers 5 does)."""
    found = {name: value for name, value in fresh.to_dict().items() if value is not None}
    fallback = getattr(type(fresh), "_get_default_generation_params", None)
    if callable(fallback):
        try:
            found = {**fallback(), **found}
        except TypeError:  # another signature: a fresh config's values only
            pass
    return found


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def aside_note(aside: list[str], sample: bool) -> str | None:
    """The header's note naming what the model's generation_config asked and attnviz did not."""
    if not aside:
        return None
    how = f"sampled as {option('sample')} asks" if sample else "greedy"
    return (f"generation: the model's generation_config asks for {', '.join(aside)}; set aside: "
            f"attnviz decodes one sequence per prompt, {how}, one token per step through the "
            "KV cache")
