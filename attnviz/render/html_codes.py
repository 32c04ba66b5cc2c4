"""The page's 8-bit weights (the scheme is described in `attnviz.render.html_document`): codes
0..LEVELS per row's maximum, MASKED for a weight that is exactly 0."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

LEVELS = 254  # codes 0..254 are weights
MASKED = 255  # the reserved code of a masked (exactly 0) weight


def quantize(values: ArrayLike) -> tuple[NDArray[np.uint8], NDArray[np.float32]]:
    """(codes uint8 (..., R, C), scales float32 (..., R)) of weights (..., R, C); see above."""
    import numpy as np

    values = np.asarray(values, dtype=np.float32)
    masked = values == 0.0
    scales = values.max(axis=-1, initial=0.0).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))[..., None]
    codes = np.clip(np.rint(values / safe * LEVELS), 0, LEVELS).astype(np.uint8)
    codes[masked] = MASKED
    return codes, scales


def dequantize(codes: ArrayLike, scales: ArrayLike) -> NDArray[np.float32]:
    """float32 weights of codes and row scales, NaN where masked (what the page decodes)."""
    import numpy as np

    codes = np.asarray(codes)
    values = codes.astype(np.float32) / LEVELS * np.asarray(scales, dtype=np.float32)[..., None]
    values[codes == MASKED] = np.nan
    return cast("NDArray[np.float32]", values)  # float32 / int stays float32


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
