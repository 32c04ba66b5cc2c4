"""`--generate` on long inputs, in bounded memory.

When one layer's full maps over prompt + generated tokens would exceed the memory budget
(`--memory-budget`, else the default), the generation runs in two passes:
1. the model's own `generate` with attnviz's attention function active but keeping nothing:
   every attention call still goes through the module's own eager attention, in blocks of
   query rows within the budget, so a long prompt's prefill never holds a full map;
2. one teacher-forced forward over prompt + generated tokens, captured as `heatmap --model`
   captures a long input: each block of rows reduced at once to display maps and statistics
   (or, with --export, written to the file block by block). The rows of that forward are the
   rows the model computed while generating (the tests check both equal transformers' own
   `generate(output_attentions=True)` to 1e-5), so the maps are the same.
Decoder and cross-attention maps of an encoder-decoder are kept whole, as `--model` keeps them;
only its encoder's maps stream.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from attnviz.errors import CheckpointError, printable

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.results import AttentionRun
    from attnviz.core.request import GenerateSpec, HeatmapRequest
    from attnviz.sources.generate_spec import Generation
    from attnviz.sources.hf.load import LoadedModel

METHOD = ("model.generate (its own KV cache and generation settings) with attnviz's attention "
          "function active, in blocks of query rows, keeping nothing; then the maps from one "
          "teacher-forced forward over prompt + generated tokens, reduced block by block "
          "(long input: bounded memory)")


def streams(loaded: LoadedModel, prompts: list[list[int]], spec: GenerateSpec,
            memory_budget: int | None) -> bool:
    """Whether one layer's full maps over the longest prompt + `spec.max_new` tokens exceed
    the budget (then the generation takes the two passes above)."""
    from attnviz.core import memory
    from attnviz.sources.hf.layers import HEAD_FIELDS, config_count

    heads = config_count(loaded.config, HEAD_FIELDS) or 1
    n = max(len(p) for p in prompts) + spec.max_new
    return memory.model_plan(len(prompts), n, heads, 1, memory_budget, keep=True).streamed


def run_streamed(loaded: LoadedModel, request: HeatmapRequest, sentences: list[str],
                 prompts: list[list[int]], spec: GenerateSpec
                 ) -> tuple[AttentionRun, Generation]:
    """The two passes of the module docstring, for the request's layers, token limit and
    memory budget; with its --export, the maps go to that file block by block (with the
    generation's metadata)."""
    from attnviz.app.export import run_model_exporting
    from attnviz.core import memory
    from attnviz.sources.hf.generate import generate
    from attnviz.sources.hf.generate_maps import generation_record
    from attnviz.sources.hf.generate_settings import aside_note
    from attnviz.sources.hf.inputs import Encoded
    from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run
    from attnviz.sources.hf.run import run_plan

    layer, max_tokens = request.selection.layer, request.limits.max_tokens
    memory_budget, export_path = request.limits.memory_budget, request.outputs.export

    steps = generate(loaded, prompts, spec, keep=False,
                     block_bytes=memory.eager_block_bytes(memory_budget))
    record = generation_record(loaded, steps, prompts, spec)
    record.method = METHOD
    targets = None
    if loaded.encoder_decoder:
        start = getattr(loaded.config, "decoder_start_token_id", None)
        if start != int(steps.sequences[0, 0]):
            raise CheckpointError(f"generate started the decoder with id "
                                  f"{int(steps.sequences[0, 0])}, config.json names "
                                  f"{start!r}: the teacher-forced forward would differ",
                                  fix="set decoder_start_token_id in config.json to the "
                                  "generation config's", where=printable(str(loaded.folder)))
        encoded = Encoded([{"input_ids": p} for p in prompts],
                          [{"input_ids": g} for g in record.generated_ids])
        targets = record.texts
    else:
        encoded = Encoded([{"input_ids": p + g} for p, g in zip(prompts, record.generated_ids,
                                                                 strict=True)])
    plan = plan_run(loaded, RunInputs(sentences, targets, max_tokens, encoded), layer,
                    ModelRun(export_path is None, memory_budget=memory_budget,
                             views=request.outputs.views))
    run = None
    if export_path is not None:
        run = run_model_exporting(loaded, plan, export_path, record.export_metadata())
    if run is None:
        run = run_plan(loaded, plan)
    note = aside_note(steps.set_aside, spec.sample)
    notes = (f"generation: {record.method}",) + (() if note is None else (note,))
    return replace(run, notes=(*run.notes, *notes)), record
