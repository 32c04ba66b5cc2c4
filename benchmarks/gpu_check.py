"""CPU/GPU agreement and timing of attnviz's attention paths. Run on a machine with a GPU:

    python benchmarks/gpu_check.py [--device cuda] [--length 1024]

Checks, for a torch-expressible layer (nn.MultiheadAttention path) and a grouped-query layer
(explicit per-head path), that the per-head maps on the GPU equal the CPU's to 1e-4, and prints
median times of each. Exits 1 if a check fails, 0 with a notice if no GPU is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from attnviz.attention import layer_attention
from attnviz.checkpoint import DictStore
from attnviz.forward import load_weights
from attnviz.layer import AttentionLayer, TensorRef
from attnviz.layouts import find_layers
from attnviz.layouts.base import HeadHints


def mha_layer(E: int, H: int) -> tuple[AttentionLayer, DictStore]:
    torch.manual_seed(0)
    store = DictStore(torch.nn.MultiheadAttention(E, H).state_dict())
    return find_layers(store, HeadHints(H)).layers[0], store


def gqa_layer(E: int, H: int, H_kv: int) -> tuple[AttentionLayer, DictStore]:
    d = E // H
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (H * d, E), "k": (H_kv * d, E), "v": (H_kv * d, E), "o": (E, H * d)}
    tensors = {k: torch.randn(*s, generator=gen) / E**0.5 for k, s in shapes.items()}
    refs = {k: TensorRef(k, s, "F32") for k, s in shapes.items()}
    layer = AttentionLayer("gqa", "bench", E, E, E, H, H_kv, d, refs["q"], refs["k"], refs["v"],
                           refs["o"])
    return layer, DictStore(tensors)


def timed(fn, device: torch.device, repeats: int = 5) -> tuple[float, torch.Tensor]:
    times, result = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check")
        return 0
    gpu = torch.device(args.device)
    failures = 0
    print(f"{'layer':<22} {'cpu s':>8} {'gpu s':>8} {'speed-up':>9} {'max |Δ|':>9}")
    for name, (layer, store) in {"nn.MHA E=1024 H=16": mha_layer(1024, 16),
                                 "GQA E=1024 H=16 Hkv=4": gqa_layer(1024, 16, 4)}.items():
        x = torch.randn(2, args.length, layer.embed_dim, generator=torch.Generator().manual_seed(1))
        pad = torch.zeros(2, args.length, dtype=torch.bool)
        pad[1, args.length // 2:] = True
        results = {}
        for device in (torch.device("cpu"), gpu):
            weights = load_weights(layer, store, device=str(device))
            xd, padd = x.to(device), pad.to(device)
            def step(lay=layer, w=weights, xd=xd, padd=padd):
                return layer_attention(lay, w, xd, xd, xd, padd, True)

            seconds, (_, attn, _) = timed(step, device)
            results[device.type] = (seconds, attn.float().cpu())
        diff = (results["cpu"][1] - results[gpu.type][1]).abs().max().item()
        ok = diff <= 1e-4
        failures += not ok
        cpu_s, gpu_s = results["cpu"][0], results[gpu.type][0]
        print(f"{name:<22} {cpu_s:8.3f} {gpu_s:8.3f} {cpu_s / gpu_s:8.1f}x {diff:9.1e} "
              f"{'ok' if ok else 'FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
