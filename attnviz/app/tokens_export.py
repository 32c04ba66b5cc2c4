"""`attnviz tokens --export`: every vector and matrix of the result in one .safetensors file.

Per sentence s (0-based):
- `s{s}.{method}`: the chain (n + 1, L) (row 0: the inputs, row n: the output position's
  one-hot; flow's rows between are NaN: it is computed for the inputs only);
- `s{s}.rollout_matrix.{l}`: rollout's mixed Ã_l (L, L);
- `s{s}.norms_matrix.{l}`, `s{s}.alti_matrix.{l}`: their per-layer contribution matrices
  (L, L) (rows the output does not reach are 0);
- `s{s}.effects`: the leave-one-out effects (L,) (NaN where a token was not erased);
- the decoder's view (--target): `s{s}.{method}.decoder_share` (T,), what each method leaves
  on the decoder's own tokens (flow: each one's max flow), and the decoder's tokens, which the
  positions index, in the metadata's `decoder_tokens`.
Metadata: the tokens, positions, methods, correlations, measure and erasure in words, and the
settings."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnviz.compute.tokenflow.token_result import TokensResult


def write_export(result: TokensResult, path: Path) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from attnviz.app.export import check_metadata_size
    from attnviz.app.outputs import atomic_output, check_free_space
    from attnviz.core.choices import TokenMethod

    tensors: dict[str, torch.Tensor] = {}
    for s, sentence in enumerate(result.sentences):
        for m in result.methods:
            tensors[f"s{s}.{m}"] = sentence.chains[m].double().contiguous()
        for m in result.methods:
            if m in (TokenMethod.NORMS, TokenMethod.ALTI):
                for layer, M in enumerate(sentence.matrices[m]):
                    tensors[f"s{s}.{m}_matrix.{layer}"] = M.double().contiguous()
        for layer, M in enumerate(sentence.mixed):
            tensors[f"s{s}.rollout_matrix.{layer}"] = M.double().contiguous()
        if sentence.effects is not None:
            tensors[f"s{s}.effects"] = sentence.effects.double().contiguous()
        for m, share in sentence.decoder_shares.items():
            tensors[f"s{s}.{m}.decoder_share"] = share.double().contiguous()
    metadata = {
        "tokens": json.dumps([s.tokens for s in result.sentences]),
        "positions": json.dumps([s.position for s in result.sentences]),
        "methods": json.dumps([str(m) for m in result.methods]),
        "correlations": json.dumps([{str(m): c for m, c in s.correlations.items()}
                                    for s in result.sentences]),
        "source": result.source, "causal": str(result.causal).lower(),
        "heads": str(result.heads), "residual_weight": repr(result.residual_weight),
        "measure": result.measure or "", "erased": result.erased_how or "",
    }
    if any(s.output_tokens is not None for s in result.sentences):
        metadata["decoder_tokens"] = json.dumps([s.output_tokens for s in result.sentences])
    check_metadata_size(metadata)
    metadata = {k: v.encode("utf-8", "backslashreplace").decode("utf-8")
                for k, v in metadata.items()}
    check_free_space(path, sum(t.numel() * t.element_size() for t in tensors.values()))
    with atomic_output(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError:
            raise OSError(errno.EIO, "the safetensors writer failed (a full disk or a file "
                          "size limit?)") from None
