"""--export: the maps, inputs, mask and tokens of a run in one safetensors file, in memory or,
for long inputs, written block by block as the maps stream."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from attnviz.compute.forward_pass.inputs import Batch
from attnviz.errors import option

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from attnviz.compute.forward_pass.results import AttentionRun, LayerAttention
    from attnviz.core.layer import AttentionLayer
    from attnviz.sources.hf.layers import Plan
    from attnviz.sources.hf.load import LoadedModel

EXPORT_NAMES = {"self": ("attn", "inputs"), "decoder-self": ("decoder", "inputs.decoder"),
                "cross": ("cross", "inputs.cross")}


def export_key(captured: LayerAttention) -> tuple[str, str]:
    """(maps key, inputs key) of a layer: attn.N / inputs.N, decoder.N / inputs.decoder.N and
    cross.N / inputs.cross.N, N its number within its stack."""
    return keys_for(captured.kind, captured.label)


def keys_for(kind: str, label: str) -> tuple[str, str]:
    """(maps key, inputs key) of a layer of `kind` labelled `label` ('3', 'enc 3', 'cross 1')."""
    maps, inputs = EXPORT_NAMES[kind]
    number = label.split()[-1]
    return f"{maps}.{number}", f"{inputs}.{number}"


def export(run: AttentionRun, path: Path, extra_metadata: dict[str, str] | None = None) -> None:
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E) where captured, mask (B, L),
    metadata tokens; with a decoder run also decoder.{layer} (B, H, T, T), cross.{layer}
    (B, H, T, S), inputs.decoder.{layer} / inputs.cross.{layer}, target_mask (B, T) and
    metadata target_tokens."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.compute.forward_pass.inputs import padding_mask

    if run.exported == path:  # a streamed run wrote the file as it went
        return
    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    metadata = _export_metadata(run.batch, run.source, run.inputs_described, run.causal)
    if run.target is not None:
        tensors["target_mask"] = (~padding_mask(run.target)).to(torch.int64).contiguous()
        metadata["target_tokens"] = json.dumps(run.target.tokens)
        check_metadata_size(metadata)
    if run.path is not None:
        metadata["path"] = run.path
    if run.weighting != "attention":
        metadata["weighting"] = run.weighting
    metadata.update(extra_metadata or {})  # --generate: generated_ids, prompt_length, ...
    for captured in run.layers:
        maps_key, inputs_key = export_key(captured)
        # full maps: a streamed run wrote its file as it went (above)
        weighting = captured.weighting
        attention = weighting.attention_weights if weighting is not None and \
            weighting.attention_weights is not None else captured.weights
        tensors[maps_key] = cast("torch.Tensor", attention).float().contiguous()
        if weighting is not None and attention is not None \
                and weighting.attention_weights is not None:
            from attnviz.compute.measures.value_norms import norm_maps

            # --weighting norm: the raw α_ij · ‖W_O^h v_j‖ beside the attention maps
            tensors[norm_key(maps_key)] = norm_maps(attention, weighting.value_norms).float() \
                .contiguous()
        if captured.inputs is not None:
            tensors[inputs_key] = captured.inputs.float().contiguous()
    check_free_space(path, sum(t.numel() * t.element_size() for t in tensors.values()))
    # the header is UTF-8 JSON: a source path that is not UTF-8 (surrogate escapes) is kept
    # as its escapes (`caf\\udce9`), as messages show it, instead of failing the write
    metadata = {k: v.encode("utf-8", "backslashreplace").decode("utf-8")
                for k, v in metadata.items()}
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError:  # the writer's own I/O error (a full disk, a size limit)
            raise OSError(errno.EIO, "the safetensors writer failed (a full disk or a file "
                          "size limit?)") from None


def norm_key(maps_key: str) -> str:
    """norm.3 beside attn.3; norm.decoder.3, norm.cross.3 beside decoder.3, cross.3."""
    kind, number = maps_key.rsplit(".", 1)
    return f"norm.{number}" if kind == "attn" else f"norm.{kind}.{number}"


MAX_METADATA_BYTES = 16 * 2**20  # of the header's __metadata__, as written (safetensors: 100 MB)


def _export_metadata(batch: Batch, source: str, inputs: str, causal: bool) -> dict[str, str]:
    metadata = {"tokens": json.dumps(batch.tokens), "source": source, "inputs": inputs,
                "causal": str(causal).lower()}
    check_metadata_size(metadata)
    return metadata


def check_metadata_size(metadata: dict[str, str]) -> None:
    """The tokens are JSON inside the header's JSON (escaped twice: a quote or a non-ASCII
    character grows up to 12-fold): bounded before anything is written."""
    from attnviz.errors import UsageError

    size = len(json.dumps(metadata))
    if size > MAX_METADATA_BYTES:
        raise UsageError(f"the export's metadata (every sentence's tokens, escaped) would take "
                         f"{size / 2**20:.1f} MB, more than {MAX_METADATA_BYTES // 2**20} MB",
                         fix=f"pass fewer or shorter sentences, or drop {option('export')}",
                         option="export")


class StreamedExport:
    """The --export file of a streamed standalone layer, written as the maps are computed: the
    safetensors header first (every shape is known before the run), then the mask, the inputs
    and attn.N (B, H, L, S) row block by row block in layout order, so that no full map is
    ever held. Rows are laid out as `export` lays out the full maps: real keys, zeros at padded
    keys (and at keys a causal block never computed), then the bias_k column; padded queries'
    rows are computed like any other (as torch does)."""

    def __init__(self, file: BinaryIO, batch: Batch, layer: AttentionLayer, source: str,
                 causal: bool, index: int = 0) -> None:
        extra_keys = layer.extra_keys
        self.file, self.batch, self.heads = file, batch, layer.num_heads or 0
        self.maps_key, self.inputs_key = f"attn.{index}", f"inputs.{index}"  # as `export` names
        self.source, self.causal = source, causal
        self.width = batch.max_len + extra_keys
        self._next = (0, 0, 0)  # the (sentence, head, row) the file expects next
        self._row_buf: torch.Tensor | None = None

    def begin(self, inputs_described: str, inputs: torch.Tensor) -> None:
        import struct

        import torch

        from attnviz.compute.forward_pass.inputs import padding_mask

        B, L = len(self.batch.tokens), self.batch.max_len
        mask = (~padding_mask(self.batch)).to(torch.int64).contiguous()
        x = inputs.float().contiguous()
        sizes = {"mask": mask.numel() * 8, self.inputs_key: x.numel() * 4,
                 self.maps_key: B * self.heads * L * self.width * 4}
        shapes = {"mask": ["I64", [B, L]], self.inputs_key: ["F32", list(x.shape)],
                  self.maps_key: ["F32", [B, self.heads, L, self.width]]}
        header: dict[str, Any] = {"__metadata__": _export_metadata(
            self.batch, self.source, inputs_described, self.causal)}
        offset = 0
        for name in ("mask", self.inputs_key, self.maps_key):  # the data's order in the file
            dtype, shape = shapes[name]
            header[name] = {"dtype": dtype, "shape": shape,
                            "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.write(mask.numpy().data)
        self.file.write(x.numpy().data)

    def rows(self, sentence: int, head: int, row_start: int, attn: torch.Tensor, keys: int) -> None:
        """attn (r, keys + extra) on any device: rows row_start.. of (sentence, head)."""
        import torch

        if (sentence, head, row_start) != self._next:
            raise ValueError(f"rows {(sentence, head, row_start)} arrived out of order; "
                             f"expected {self._next}")
        r, L = attn.shape[0], self.batch.max_len
        if self._row_buf is None or self._row_buf.shape[0] < r:
            self._row_buf = torch.empty(r, self.width)
        out = self._row_buf[:r]
        out[:, :keys] = attn[:, :keys]
        out[:, keys:L] = 0.0
        out[:, L:] = attn[:, keys:]
        self.file.write(out.numpy().data)
        row = row_start + r
        if row < L:
            self._next = (sentence, head, row)
        elif head + 1 < self.heads:
            self._next = (sentence, head + 1, 0)
        else:
            self._next = (sentence + 1, 0, 0)

    def close(self) -> None:
        if self._next != (len(self.batch.tokens), 0, 0):
            raise ValueError(f"the export stopped at {self._next}")


class ModelExport:
    """The --export file of a long `--model` run, written as the captured blocks arrive, so that
    no full map is held: the header's room is reserved first, the masks written, the file
    extended to its full size (unwritten bytes read as zeros: padded rows and keys), each
    block's rows written in place (os.pwrite) as the model's eager attention computes them,
    and at the end the inputs (O(L · E), held) and the final header. Keys, shapes and layout
    are `export`'s: attn.N (B, H, n, n), decoder.N, cross.N, inputs.*, mask, target_mask."""

    HEADER_SLACK = 512

    def __init__(self, file: BinaryIO, layers: Sequence[tuple[int, str, str, tuple[int, ...]]],
                 small: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """layers: (call index, maps key, inputs key, (B, H, rows, cols)) per shown layer;
        small: the masks (int64 tensors) written at once."""
        self.file, self.metadata = file, metadata
        self.small = {name: t.contiguous() for name, t in small.items()}
        self.entries: dict[str, tuple[str, list[int], int, int]] = {}  # name: dtype, shape, span
        offset = 0
        for name, tensor in self.small.items():
            size = tensor.numel() * tensor.element_size()
            self.entries[name] = ("I64", list(tensor.shape), offset, offset + size)
            offset += size
        self.layers = {index: (maps_key, inputs_key, shape)
                       for index, maps_key, inputs_key, shape in layers}
        for maps_key, _, shape in self.layers.values():
            size = 4 * shape[0] * shape[1] * shape[2] * shape[3]
            self.entries[maps_key] = ("F32", list(shape), offset, offset + size)
            offset += size
        self.maps_end = offset
        self.room = self._header_room()
        self.data_start = 8 + self.room
        file.truncate(self.data_start + self.maps_end)
        for name, tensor in self.small.items():
            os.pwrite(file.fileno(), tensor.numpy().tobytes(),
                      self.data_start + self.entries[name][2])
        self._row_buf: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Bytes of the file before the inputs are added."""
        return self.data_start + self.maps_end

    def _header_room(self) -> int:
        """Room for the final header, whatever the inputs' shapes turn out to be."""
        big = 10 ** 15
        header = self._header({inputs_key: [big, big, big] for _, inputs_key, _ in
                               self.layers.values()}, big)
        return len(header) + self.HEADER_SLACK + (-len(header) % 8)

    def _header(self, inputs_shapes: dict[str, list[int]], start: int) -> bytes:
        header: dict[str, Any] = {"__metadata__": self.metadata}
        for name, (dtype, shape, begin, end) in self.entries.items():
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = start
        for name, shape in inputs_shapes.items():
            size = 4 * math.prod(shape)
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        return json.dumps(header).encode()

    def rows(self, index: int, sentence: int, row_start: int, block: torch.Tensor) -> None:
        """block (H, r, m): rows row_start.. of every head of one sentence in layer `index`,
        its m real keys (the rest of each row stays zero)."""
        import torch

        maps_key, _, (_, heads, rows, cols) = self.layers[index]
        r, m = block.shape[1], block.shape[2]
        if self._row_buf is None or self._row_buf.shape[0] < r or self._row_buf.shape[1] != cols:
            self._row_buf = torch.zeros(r, cols)
        buf = self._row_buf[:r]
        buf[:, m:] = 0.0
        base = self.data_start + self.entries[maps_key][2]
        for head in range(heads):
            buf[:, :m] = block[head]
            offset = base + 4 * cols * ((sentence * heads + head) * rows + row_start)
            # the buffer itself, no copy
            os.pwrite(self.file.fileno(), cast("Buffer", buf.numpy()), offset)

    def finish(self, inputs: dict[str, torch.Tensor]) -> None:
        """Append the inputs (inputs key: (B, n, E) tensor) and write the final header."""
        tensors = {name: x.float().contiguous() for name, x in inputs.items()}
        self.file.seek(self.data_start + self.maps_end)
        for x in tensors.values():
            self.file.write(x.numpy().tobytes())
        header = self._header({name: list(x.shape) for name, x in tensors.items()},
                              self.maps_end)
        if len(header) > self.room:
            raise ValueError("the export header outgrew its reserved room")
        header += b" " * (self.room - len(header))  # safetensors allows trailing spaces
        os.pwrite(self.file.fileno(), struct.pack("<Q", self.room) + header, 0)


def run_model_exporting(loaded: LoadedModel, plan: Plan, path: Path,
                        extra_metadata: dict[str, str] | None = None) -> AttentionRun | None:
    """A long `--model` run whose --export is written block by block as the model computes
    (ModelExport), the display maps and statistics reduced at once; None when the run does
    not stream (a short input: `export` writes its full maps after the run). The plan's `how`
    gives the --query and the memory budget. extra_metadata: more metadata fields
    (--generate's)."""
    from dataclasses import replace

    import torch

    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.compute.forward_pass.inputs import padding_mask
    from attnviz.sources.hf.layers import cols_tokens, rows_tokens
    from attnviz.sources.hf.load import PATHS
    from attnviz.sources.hf.run import DESCRIBED_INPUTS, memory_plan, run_plan

    if plan.shown is None or not memory_plan(plan, plan.how.memory_budget, keep=True).streamed \
            or any(layer.num_heads is None for layer in plan.shown):
        return None
    prepared = plan.prepared
    batch = prepared.batch
    layers = []
    for layer in plan.shown:
        label = layer.label if layer.stack else str(layer.index)
        maps_key, inputs_key = keys_for(layer.kind.value, label)
        shape = (len(batch.tokens), cast(int, layer.num_heads),
                 max(map(len, rows_tokens(plan, layer))), max(map(len, cols_tokens(plan, layer))))
        layers.append((layer.index, maps_key, inputs_key, shape))
    small = {"mask": (~padding_mask(batch)).to(torch.int64)}
    if prepared.target is not None:
        small["target_mask"] = (~padding_mask(prepared.target)).to(torch.int64)
    # every metadata field is known before the run but `causal` ("false" is the longer value)
    metadata = _export_metadata(batch, str(loaded.folder), DESCRIBED_INPUTS, False)  # exact
    metadata["path"] = PATHS[loaded.path]
    if prepared.target is not None:
        metadata["target_tokens"] = json.dumps(prepared.target.tokens)
    metadata.update(extra_metadata or {})
    with atomic_output(path) as tmp, open(tmp, "w+b") as file:
        writer = ModelExport(file, layers, small, metadata)
        check_free_space(path, writer.size)
        run = run_plan(loaded, plan, replace(plan.how, allow_stream=True, values=False),
                        writer.rows)
        writer.metadata["causal"] = str(run.causal).lower()
        writer.finish({keys_for(c.kind, c.label)[1]: c.inputs for c in run.layers
                       if c.inputs is not None})
    return replace(run, exported=path)
