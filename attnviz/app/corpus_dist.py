"""Data parallelism through torch.distributed alone: under torchrun (or any launcher that sets
torch's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) the process group starts from the
environment (env://), gloo on CPUs and NCCL on GPUs; each rank takes the examples whose ordinal
% world is its rank, and the partial sums are all-reduced (float64) at the end. Without those
variables (or WORLD_SIZE=1) the run is one process and nothing here touches torch.distributed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed

from attnviz.errors import UsageError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    backend: str | None = None  # None: one process, no group

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join_world(device: str) -> World:
    """This process's place in the launcher's group (started here when torch's variables say
    there is more than one process)."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return World()
    if not torch.distributed.is_available():
        raise UsageError("this torch has no torch.distributed", fix="run one process")
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if gpu and torch.distributed.is_nccl_available() else "gloo"
    if not torch.distributed.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend, init_method="env://")
    return World(torch.distributed.get_rank(), torch.distributed.get_world_size(), backend)


def local_device(world: World, device: str) -> str:
    """Each rank's device: with NCCL, cuda:LOCAL_RANK (unless the user named one)."""
    if world.backend == "nccl" and device in ("auto", "cuda"):
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def all_reduce(world: World, tensors: list[torch.Tensor]) -> None:
    """Sum each tensor over the ranks, in place (float64; on the GPU under NCCL)."""
    if world.backend is None:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    if world.backend == "nccl":
        flat = flat.cuda()
    torch.distributed.all_reduce(flat)
    flat = flat.cpu()
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def all_max(world: World, value: int) -> int:
    if world.backend is None:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    if world.backend == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def leave_world(world: World) -> None:
    if world.backend is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
