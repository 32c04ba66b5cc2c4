"""CPU/GPU agreement and timing of attnviz's attention paths. Run on a machine with a GPU:

    python benchmarks/gpu_check.py [--device cuda] [--length 512] [--long 16384]

Checks, for a torch-expressible layer (nn.MultiheadAttention path) and a grouped-query layer
(explicit per-head path), that the per-head maps on the GPU equal the CPU's to 1e-4, and the same
for the streamed path (display maps and head statistics); then, for a long input (--long tokens,
E=1024, H=16, blocks of query rows), that the GPU's display maps and statistics equal the CPU's
to 1e-5, with the time of each and of F.scaled_dot_product_attention on the same q, k, v on the
GPU. Exits 1 if a check fails, 0 with a notice if no GPU is present. `--device cpu` runs the
script against the CPU itself (with --long 2048 unless given): a smoke test of the script, not
of a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from attnviz.compute.forward_pass.attention import layer_attention
from attnviz.compute.forward_pass.forward import load_weights
from attnviz.compute.forward_pass.inputs import Batch
from attnviz.compute.forward_pass.layer_stream import LayerRun, stream_layer
from attnviz.core.layer import AttentionLayer
from attnviz.core.request import HeadHints
from attnviz.core.tensor_ref import TensorRef
from attnviz.load.store import DictStore
from attnviz.recognize import find_layers


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
    parser.add_argument("--long", type=int, default=None,
                        help="tokens of the long-input check (default 16384; 2048 on --device cpu)")
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
                return layer_attention(lay, w, (xd, xd, xd), padd, True)

            seconds, (_, attn, _) = timed(step, device)
            results[device.type] = (seconds, attn.float().cpu())
        diff = (results["cpu"][1] - results[gpu.type][1]).abs().max().item()
        ok = diff <= 1e-4
        failures += not ok
        cpu_s, gpu_s = results["cpu"][0], results[gpu.type][0]
        print(f"{name:<22} {cpu_s:8.3f} {gpu_s:8.3f} {cpu_s / gpu_s:8.1f}x {diff:9.1e} "
              f"{'ok' if ok else 'FAILED'}")
    failures += streamed_agreement(gpu, args.length)
    long = args.long or (2048 if gpu.type == "cpu" else 16384)
    failures += long_agreement(gpu, long)
    return 1 if failures else 0


def streamed_on_both(gpu: torch.device, run, repeats: int, keys: tuple[str, ...]
                     ) -> tuple[float, float, float, float]:
    """run(device) on the CPU and on the GPU, timed: (cpu s, gpu s, max |Δ| of the display
    maps, max relative Δ of the statistics `keys`)."""
    (cpu_s, cpu), (gpu_s, on_gpu) = (timed(lambda d=device: run(d), device, repeats=repeats)
                                     for device in (torch.device("cpu"), gpu))
    maps = max(float(abs(a.values - b.values).max())
               for a, b in zip(cpu.streamed.views, on_gpu.streamed.views, strict=True))
    stats = max(abs(getattr(a, k) - getattr(b, k)) / max(1.0, abs(getattr(a, k)))
                for a, b in zip(cpu.streamed.stats, on_gpu.streamed.stats, strict=True)
                for k in keys)
    return cpu_s, gpu_s, maps, stats


def streamed_agreement(gpu: torch.device, length: int) -> int:
    """stream_layer (one head and sentence at a time, display maps + statistics) on both."""
    layer, store = gqa_layer(1024, 16, 4)
    batch = Batch(["long", "half"], [[f"w{i % 97}" for i in range(n)]
                                     for n in (length, length // 2)])
    x = torch.randn(2, length, 1024, generator=torch.Generator().manual_seed(2))
    cpu_s, gpu_s, diff, stats = streamed_on_both(
        gpu, lambda device: stream_layer(layer, store, batch, (x, x), LayerRun(device, True)),
        3,
        ("entropy", "max_weight", "distance", "previous", "first"))
    ok = diff <= 1e-4 and stats <= 1e-4
    print(f"{'streamed GQA, 2 sents':<22} {cpu_s:8.3f} {gpu_s:8.3f} {cpu_s / gpu_s:8.1f}x "
          f"{diff:9.1e} {'ok' if ok else 'FAILED'} (stats rel Δ {stats:.1e})")
    return int(not ok)


def long_agreement(gpu: torch.device, length: int) -> int:
    """A long input in blocks of query rows (stream_layer, the default memory budget) on the CPU
    and on the GPU: display maps and statistics to 1e-5, and times against SDPA's forward on
    the same q, k, v on the GPU."""
    import torch.nn.functional as F

    from attnviz.core import memory

    layer, store = mha_layer(1024, 16)
    words = [f"w{(i * 7919) % 1009}" for i in range(length)]  # repeats: copy statistics
    batch = Batch(["long"], [words])
    x = torch.randn(1, length, 1024, generator=torch.Generator().manual_seed(3))
    cpu_s, gpu_s, maps, stats = streamed_on_both(
        gpu, lambda device: stream_layer(layer, store, batch, (x, x), LayerRun(device, False)),
        1,
        ("entropy", "max_weight", "distance", "first", "previous", "self", "duplicate",
         "induction"))
    weights = load_weights(layer, store, device=str(gpu))
    xg = x.to(gpu)
    W = torch.cat([weights.W_q, weights.W_k, weights.W_v])
    b = torch.cat([weights.b_q, weights.b_k, weights.b_v])

    def sdpa():
        with torch.no_grad():
            q, k, v = F.linear(xg, W, b).view(1, length, 3, 16, 64).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v)

    sdpa_s, _ = timed(sdpa, gpu, repeats=3)
    ok = maps <= 1e-5 and stats <= 1e-5
    rows = memory.block_rows(None, length, gpu.type == "cpu")
    print(f"{f'long {length} tok, H=16':<22} {cpu_s:8.3f} {gpu_s:8.3f} {cpu_s / gpu_s:8.1f}x "
          f"{maps:9.1e} {'ok' if ok else 'FAILED'} (stats rel Δ {stats:.1e}; {rows} rows per "
          f"block; SDPA forward on the {gpu.type}: {sdpa_s:.3f} s, attnviz "
          f"{gpu_s / sdpa_s:.1f}x)")
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
