"""Which torch device a run uses: --device parsed and checked against this machine."""

from __future__ import annotations

import torch

from attnviz.errors import UsageError, option


def resolve_device(spec: str) -> torch.device:
    """auto → the first CUDA GPU, else MPS, else the CPU; an absent device is a usage error."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}", fix="use auto, cpu, cuda, cuda:N or mps",
                         option="device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("CUDA is not available on this machine (or this torch build)",
                             fix=f"use {option('device')} cpu or auto", option="device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"there is no GPU {device.index}; this machine has "
                             f"{torch.cuda.device_count()}", fix="choose another index",
                             option="device")
    elif device.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise UsageError("MPS is not available on this machine",
                             fix=f"use {option('device')} cpu",
                             option="device")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {spec!r}", fix="use auto, cpu, cuda, cuda:N or mps",
                         option="device")
    return device
