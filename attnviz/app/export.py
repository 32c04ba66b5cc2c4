"""--export: the maps, inputs, mask and tokens of a run in one safetensors file, in memory or,
for long inputs, written block by block as the maps stream."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from attnviz.compute.inputs import Batch

EXPORT_NAMES = {"self": ("attn", "inputs"), "decoder-self": ("decoder", "inputs.decoder"),
                "cross": ("cross", "inputs.cross")}


def export_key(captured: Any) -> tuple[str, str]:
    """(maps key, inputs key) of a layer: attn.N / inputs.N, decoder.N / inputs.decoder.N and
    cross.N / inputs.cross.N, N its number within its stack."""
    maps, inputs = EXPORT_NAMES[captured.kind]
    number = captured.display_label.split()[-1]
    return f"{maps}.{number}", f"{inputs}.{number}"


def export(run: Any, path: Path) -> None:
    """attn.{layer} (B, H, L, S), inputs.{layer} (B, L, E) where captured, mask (B, L),
    metadata tokens; with a decoder run also decoder.{layer} (B, H, T, T), cross.{layer}
    (B, H, T, S), inputs.decoder.{layer} / inputs.cross.{layer}, target_mask (B, T) and
    metadata target_tokens."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.compute.inputs import padding_mask

    if run.exported == path:  # a streamed run wrote the file as it went
        return
    tensors = {"mask": (~padding_mask(run.batch)).to(torch.int64).contiguous()}
    metadata = _export_metadata(run.batch, run.source, run.inputs_described, run.causal)
    if run.target is not None:
        tensors["target_mask"] = (~padding_mask(run.target)).to(torch.int64).contiguous()
        metadata["target_tokens"] = json.dumps(run.target.tokens)
    if run.path is not None:
        metadata["path"] = run.path
    for captured in run.layers:
        maps_key, inputs_key = export_key(captured)
        tensors[maps_key] = captured.weights.float().contiguous()
        if captured.inputs is not None:
            tensors[inputs_key] = captured.inputs.float().contiguous()
    check_free_space(path, sum(t.numel() * t.element_size() for t in tensors.values()))
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError:  # the writer's own I/O error (a full disk, a size limit)
            raise OSError(errno.EIO, "the safetensors writer failed (a full disk or a file "
                          "size limit?)") from None


def _export_metadata(batch: Batch, source: str, inputs: str, causal: bool) -> dict[str, str]:
    return {"tokens": json.dumps(batch.tokens), "source": source, "inputs": inputs,
            "causal": str(causal).lower()}


class StreamedExport:
    """The --export file of a streamed standalone layer, written as the maps are computed: the
    safetensors header first (every shape is known before the run), then the mask, the inputs
    and attn.N (B, H, L, S) row block by row block in layout order, so that no full map is
    ever held. Rows are laid out as `export` lays out the full maps: real keys, zeros at padded
    keys (and at keys a causal block never computed), then the bias_k column; padded queries'
    rows are computed like any other (as torch does)."""

    def __init__(self, file: Any, batch: Batch, num_heads: int, extra_keys: int, source: str,
                 causal: bool, index: int = 0) -> None:
        self.file, self.batch, self.heads = file, batch, num_heads
        self.maps_key, self.inputs_key = f"attn.{index}", f"inputs.{index}"  # as `export` names
        self.source, self.causal = source, causal
        self.width = batch.max_len + extra_keys
        self._next = (0, 0, 0)  # the (sentence, head, row) the file expects next
        self._row_buf: Any = None

    def begin(self, inputs_described: str, inputs: Any) -> None:
        import struct

        import torch

        from attnviz.compute.inputs import padding_mask

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

    def rows(self, sentence: int, head: int, row_start: int, attn: Any, keys: int) -> None:
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
