"""Train the bundled `attnviz-tiny` sample model: a 2-layer, attention-only causal transformer.

The model is trained on next-token prediction over sequences of uniformly random ids in
[0, vocab_size) (the range `attnviz.core.words.hashed_ids` maps words into) in which a random span
of 2-24 ids is repeated at random offsets.  The loss is taken only where the next id is predictable,
i.e. inside a repeat, and the only way to predict it is in-context copying, which a 2-layer
attention-only model learns as a *previous-token head* in layer 0 composed with *induction heads*
in layer 1 (Olsson et al., 2022, "In-context Learning and Induction Heads").  A short length
curriculum (16, then 32, then 64 ids) makes the circuit form early; the position embedding is
learned but initialised from a sin/cos table.  See NOTES_induction.md for the measured heads.

Run with no arguments to (re)create ``attnviz/data/induction.safetensors`` (package data: the
bundled model that `attnviz heatmap` runs by default)::

    python sample_weights/train_induction.py            # defaults used for the committed file
    python sample_weights/train_induction.py --steps 500 --seed 1 --out /tmp/m.safetensors

Training is seeded and runs on one CPU thread with deterministic algorithms, so the same
arguments give the same weights on the same torch build.  At the end an evaluation prints the
per-head induction / previous-token / self / first-token scores (see ``evaluate``).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "attnviz" / "data" / "induction.safetensors"
SENTENCE = "the cat sat on the mat the cat sat on the mat"

# Model shape (kept in the safetensors metadata so the attnviz runtime can rebuild it).
NUM_LAYERS = 2
NUM_HEADS = 2
EMBED_DIM = 64
VOCAB_SIZE = 1024
MAX_POSITIONS = 64

EVAL_SPANS = (4, 6, 8, 11, 16)


class Layer(nn.Module):
    """Pre-LayerNorm causal self-attention block with a residual connection (no MLP)."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(embed_dim, eps=1e-5)
        self.self_attn = nn.MultiheadAttention(embed_dim, num_heads, bias=True, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, need_weights: bool = False):
        h = self.ln(x)
        a, w = self.self_attn(
            h, h, h, attn_mask=mask, need_weights=need_weights, average_attn_weights=False
        )
        return x + a, w


class TinyAttnModel(nn.Module):
    """Exactly the forward the attnviz runtime reimplements for the `attnviz-tiny` family."""

    def __init__(self, vocab: int, positions: int, embed_dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.pos_embed = nn.Embedding(positions, embed_dim)
        self.layers = nn.ModuleList(Layer(embed_dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embed_dim, eps=1e-5)
        self.unembed = nn.Linear(embed_dim, vocab, bias=False)

    def residual(self, ids: torch.Tensor, weights: list | None = None) -> torch.Tensor:
        """The residual stream after the last layer (appends per-head attention to `weights`)."""
        length = ids.shape[1]
        x = self.embed(ids) + self.pos_embed(torch.arange(length, device=ids.device))
        mask = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
        for layer in self.layers:
            x, w = layer(x, mask, weights is not None)
            if weights is not None:
                weights.append(w)
        return x

    def forward(self, ids: torch.Tensor, need_weights: bool = False):
        weights: list | None = [] if need_weights else None
        logits = self.ln_f(self.residual(ids, weights)) @ self.unembed.weight.T
        return (logits, weights) if need_weights else logits


def sinusoidal(positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Classic sin/cos position table, used only to initialise the (learned) position embedding."""
    pos = torch.arange(positions, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(base) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    table = torch.zeros(positions, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


def make_batch(
    gen: torch.Generator,
    batch: int,
    length: int,
    vocab: int,
    min_span: int,
    max_span: int,
    p_single: float = 0.5,
    p_adjacent: float = 0.3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids in which a random span of n ids occurs c + 1 times (c >= 1 copies).

    Per sequence: n ~ U[min_span, max_span]; c = 1 with probability `p_single`, else uniform in
    [2, length // n - 1]; the first occurrence starts at a uniformly random offset and the copies
    follow after random gaps (or immediately, with probability `p_adjacent`), so neither the
    positions nor the distance between occurrences give the answer away: only the token does.

    Returns (ids, predictable): predictable[b, t] is True when ids[b, t + 1] can be predicted by
    copying, i.e. both t and t + 1 are inside the same later occurrence of the span.
    """
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    rand = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    n = min_span + (rand(batch) * (max_span - min_span + 1)).long()
    most = (length // n - 1).clamp(min=1)  # most copies that fit
    copies = 2 + (rand(batch) * (most - 1)).long()
    copies = torch.where((rand(batch) < p_single) | (most <= 1), 1, copies.clamp(max=most))
    free = length - n * (copies + 1)
    # The first occurrence starts anywhere (so every position is trained); the rest of the
    # free ids are split at random between the gaps and a suffix (sorted random cut points),
    # and with probability `p_adjacent` the copies follow immediately, as in the sentence
    # "the cat sat on the mat the cat sat on the mat".
    prefix = (rand(batch) * (free + 1)).long()
    rest = free - prefix
    kmax = int(copies.max())
    k = torch.arange(kmax)[None, :]
    cuts = (rand(batch, kmax) * (rest[:, None] + 1)).long()
    cuts = torch.where(k < copies[:, None], cuts, rest[:, None]).sort(dim=1).values
    cuts = torch.where((rand(batch) < p_adjacent)[:, None], 0, cuts)
    t = torch.arange(length)[None, :]
    src = t.expand(batch, length).clone()
    predictable = torch.zeros(batch, length, dtype=torch.bool)
    for c in range(1, kmax + 1):  # occurrence c starts after c spans and cuts[c - 1] gap ids
        start = (prefix + c * n + cuts[:, c - 1])[:, None]
        inside = (t >= start) & (t < start + n[:, None]) & (c <= copies)[:, None]
        src = torch.where(inside, prefix[:, None] + t - start, src)
        predictable |= inside & (t < start + n[:, None] - 1)
    ids = torch.gather(ids, 1, src)
    return ids, predictable


def eval_batch(gen: torch.Generator, batch: int, span: int, length: int, vocab: int):
    """Random prefix, a random span of length `span`, then the same span again (total `length`)."""
    prefix = length - 2 * span
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[:, prefix + span :] = ids[:, prefix : prefix + span]
    return ids, prefix


@torch.no_grad()
def head_scores(weights: list[torch.Tensor], span: int, prefix: int) -> dict[str, torch.Tensor]:
    """Per-(layer, head) scores from attention weights of shape (B, H, L, L)."""
    w = torch.stack(weights, 1)  # (B, layers, H, L, L)
    length = w.shape[-1]
    q = torch.arange(prefix + span, prefix + 2 * span)
    induction = w[..., q, q - span + 1].mean(dim=(0, -1))
    i = torch.arange(1, length)
    prev = w[..., i, i - 1].mean(dim=(0, -1))
    i2 = torch.arange(2, length)
    prev2 = w[..., i2, i2 - 2].mean(dim=(0, -1))
    j = torch.arange(length)
    self_ = w[..., j, j].mean(dim=(0, -1))
    first = w[..., j, 0].mean(dim=(0, -1))
    return {"induction": induction, "prev": prev, "prev2": prev2, "self": self_, "first": first}


@torch.no_grad()
def evaluate(model: TinyAttnModel, seed: int = 12345, batch: int = 256) -> dict:
    """Print and return per-head scores on fresh repeated-span sequences and on SENTENCE.

    For each span length n the test sequences are: a random prefix (so the total length is the
    model's max_positions), a random span of n ids, and the same span again.
      induction: mean attention from each query in the second copy to key (q - n + 1), the token
                 right after the earlier occurrence of the query's token;
      prev:      mean attention from query i to key i - 1 over all i >= 1;
      prev2:     mean attention from query i to key i - 2 over all i >= 2;
      self:      mean attention from query i to key i;  first: mean attention to key 0.
    prev/prev2/self/first are averaged over the five span lengths' test sets.  Also reports copy
    accuracy (argmax next-token prediction inside the second copy) and the same scores on
    SENTENCE (n = 6: its second half repeats the first).
    """
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = model.embed.num_embeddings
    length = model.pos_embed.num_embeddings
    layers, heads = len(model.layers), model.layers[0].self_attn.num_heads
    results: dict = {"spans": {}}
    for n in EVAL_SPANS:
        ids, prefix = eval_batch(gen, batch, n, length, vocab)
        logits, weights = model(ids, need_weights=True)
        scores = head_scores(weights, n, prefix)
        pred = logits[:, prefix + n : length - 1].argmax(-1)
        acc = (pred == ids[:, prefix + n + 1 :]).float().mean().item()
        scores["copy_acc"] = acc
        results["spans"][n] = scores

    # The CLI's default sentence, tokenised exactly like attnviz does it.
    sys.path.insert(0, str(HERE.parent))
    from attnviz.core.words import hashed_ids, split_words

    words = split_words(SENTENCE)
    ids = torch.tensor([hashed_ids(words, vocab)])
    _, weights = model(ids, need_weights=True)
    half = len(words) // 2
    results["sentence"] = head_scores(weights, half, 0)
    results["sentence_weights"] = [w[0] for w in weights]

    print(f"\nPer-head attention scores (fresh random ids, length {length}, batch {batch}):")
    print(
        "head | "
        + " ".join(f"ind n={n:<2d}" for n in EVAL_SPANS)
        + " | ind min |  prev  prev2   self  first | sentence: ind   prev"
    )
    sent = results["sentence"]
    for layer in range(layers):
        for head in range(heads):
            ind = [results["spans"][n]["induction"][layer, head].item() for n in EVAL_SPANS]
            avg = {
                k: sum(results["spans"][n][k][layer, head].item() for n in EVAL_SPANS)
                / len(EVAL_SPANS)
                for k in ("prev", "prev2", "self", "first")
            }
            print(
                f"{layer}.{head}  | "
                + " ".join(f"{v:8.3f}" for v in ind)
                + f" | {min(ind):7.3f} | "
                + " ".join(f"{avg[k]:5.3f}" for k in ("prev", "prev2", "self", "first"))
                + f" |        {sent['induction'][layer, head].item():5.3f}  "
                + f"{sent['prev'][layer, head].item():5.3f}"
            )
    accs = " ".join(f"n={n}:{results['spans'][n]['copy_acc']:.3f}" for n in EVAL_SPANS)
    print(f"copy accuracy in the second copy: {accs}")
    return results


@torch.no_grad()
def quick_eval(model: TinyAttnModel) -> str:
    """Best layer-1 induction score and best layer-0 prev-token score at n=4 and n=16."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(999)
    out = []
    for n in (4, 16):
        length, vocab = model.pos_embed.num_embeddings, model.embed.num_embeddings
        ids, prefix = eval_batch(gen, 64, n, length, vocab)
        _, weights = model(ids, need_weights=True)
        sc = head_scores(weights, n, prefix)
        out.append(f"n={n} ind {sc['induction'][1].max():.2f} prev {sc['prev'][0].max():.2f}")
    model.train(was_training)
    return "  ".join(out)


def train(args: argparse.Namespace) -> TinyAttnModel:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = TinyAttnModel(VOCAB_SIZE, MAX_POSITIONS, args.embed_dim, NUM_LAYERS, args.heads)
    if not args.no_sin_init:
        # Learned positions, but started from a sin/cos table: a previous-token head is then
        # reachable at every position (a relative shift is linear in sin/cos features).
        with torch.no_grad():
            table = sinusoidal(MAX_POSITIONS, args.embed_dim)
            model.pos_embed.weight.copy_(table * args.pos_scale)
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = time.perf_counter()
    model.train()
    # Length curriculum: the induction circuit forms within a few hundred steps on short
    # sequences (on length 64 from scratch it takes ~2000 steps), then it is extended to all
    # MAX_POSITIONS positions.
    stages = [(int(a), float(b)) for a, b in (x.split(":") for x in args.curriculum.split(","))]

    def length_at(step: int) -> int:
        for length, until in stages:
            if step < until * args.steps:
                return length
        return MAX_POSITIONS

    for step in range(args.steps):
        length = length_at(step)
        ids, copy_mask = make_batch(
            gen,
            args.batch * MAX_POSITIONS // length,  # same number of ids per step
            length,
            VOCAB_SIZE,
            args.min_span,
            min(args.max_span, length // 2),
            args.p_single,
            args.p_adjacent,
        )
        # Only the copy positions are predictable; unembedding just those keeps steps cheap.
        resid = model.residual(ids)
        targets = torch.roll(ids, -1, dims=1)[copy_mask]
        logits = model.ln_f(resid[copy_mask]) @ model.unembed.weight.T
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:5d} L={length:3d} copy-loss {loss.item():.3f}"
                f"  lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - start:6.1f}s"
                + (f"  | {quick_eval(model)}" if args.quick_eval else ""),
                flush=True,
            )
    print(f"training took {time.perf_counter() - start:.1f}s")
    return model


def write_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], out: Path):
    """Write float32 tensors in the safetensors format with a byte-stable header.

    `safetensors.torch.save_file` writes the metadata in hash order, which changes from run to
    run; here keys are sorted so identical weights always give an identical file.
    """
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, offset = [], 0
    for name in sorted(tensors):
        data = tensors[name].detach().to(torch.float32).contiguous().numpy().astype("<f4")
        raw = data.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(data.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format pads the header to a multiple of 8 bytes
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for raw in chunks:
            f.write(raw)


def save(model: TinyAttnModel, out: Path) -> None:
    metadata = {
        "format": "pt",
        "attnviz_family": "attnviz-tiny",
        "num_layers": str(NUM_LAYERS),
        "num_heads": str(model.layers[0].self_attn.num_heads),
        "embed_dim": str(model.embed.embedding_dim),
        "vocab_size": str(VOCAB_SIZE),
        "max_positions": str(MAX_POSITIONS),
        "causal": "true",
        "tokenizer": "attnviz.core.words.hashed_ids",
        "description": (
            "A 2-layer attention-only causal transformer trained on repeated spans of random "
            "hashed ids: layer 0 has a previous-token head, layer 1 has induction heads."
        ),
    }
    state = model.state_dict()
    write_safetensors(state, metadata, out)
    # Round-trip check with the real safetensors reader.
    loaded = load_file(str(out))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k].float()) for k in state)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == metadata
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3500, help="optimizer steps (default 3500)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and data (default 0)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .safetensors path")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step at length 64")
    parser.add_argument("--lr", type=float, default=5e-3, help="peak AdamW learning rate")
    parser.add_argument("--wd", type=float, default=0.01, help="AdamW weight decay (matrices)")
    parser.add_argument("--heads", type=int, default=NUM_HEADS, help="heads per layer")
    parser.add_argument("--embed-dim", type=int, default=EMBED_DIM, help="model width")
    parser.add_argument("--min-span", type=int, default=2, help="shortest repeated span")
    parser.add_argument("--max-span", type=int, default=24, help="longest repeated span")
    parser.add_argument("--p-single", type=float, default=0.5, help="P(span repeated once)")
    parser.add_argument("--p-adjacent", type=float, default=0.3, help="P(copies follow at once)")
    parser.add_argument("--pos-scale", type=float, default=2.0, help="scale of sin/cos init")
    parser.add_argument("--no-sin-init", action="store_true", help="random position init")
    parser.add_argument(
        "--curriculum",
        default="16:0.1,32:0.2",
        help="length schedule LENGTH:UNTIL_FRACTION,... then MAX_POSITIONS (default 16:0.1,32:0.2)",
    )
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--quick-eval", action="store_true", help="log head scores while training")
    parser.add_argument("--no-save", action="store_true", help="train and evaluate only")
    args = parser.parse_args(argv)
    model = train(args)
    evaluate(model)
    if not args.no_save:
        save(model, args.out)


if __name__ == "__main__":
    main()
