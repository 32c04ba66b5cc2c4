"""Train the bundled `attnviz-tiny` sample model: a 2-layer, attention-only causal transformer.

The model is trained on next-token prediction over sequences of random hashed ids in which a
random span is repeated (at a random offset, after a random prefix).  The only way to predict the
repeated tokens is in-context copying, which a 2-layer attention-only model learns as a
*previous-token head* in layer 0 composed with an *induction head* in layer 1 (Olsson et al.,
2022, "In-context Learning and Induction Heads").

Run with no arguments to (re)create ``sample_weights/induction.safetensors``::

    python sample_weights/train_induction.py            # defaults used for the committed file
    python sample_weights/train_induction.py --steps 500 --seed 1 --out /tmp/m.safetensors

Training is seeded and runs on one CPU thread with deterministic algorithms, so the same
arguments give the same weights on the same torch build.  At the end an evaluation prints the
per-head induction / previous-token / self / first-token scores (see ``evaluate``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "induction.safetensors"
SENTENCE = "the cat sat on the mat the cat sat on the mat"

# Model shape (kept in the safetensors metadata so the attnviz runtime can rebuild it).
NUM_LAYERS = 2
NUM_HEADS = 4
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

    def forward(self, ids: torch.Tensor, need_weights: bool = False):
        length = ids.shape[1]
        x = self.embed(ids) + self.pos_embed(torch.arange(length, device=ids.device))
        mask = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
        weights = []
        for layer in self.layers:
            x, w = layer(x, mask, need_weights)
            weights.append(w)
        logits = self.ln_f(x) @ self.unembed.weight.T
        return (logits, weights) if need_weights else logits


def sinusoidal(positions: int, dim: int) -> torch.Tensor:
    """Classic sin/cos position table, used only to initialise the (learned) position embedding."""
    pos = torch.arange(positions, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    table = torch.zeros(positions, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


def make_batch(
    gen: torch.Generator, batch: int, length: int, vocab: int, min_span: int, max_span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids in which a random span [s, s+n) is repeated periodically from s+n up to an end.

    Returns (ids, copy_mask) where copy_mask marks the positions whose *next* token is
    predictable by copying (the targets inside the repeats).
    """
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    n = torch.randint(min_span, max_span + 1, (batch, 1), generator=gen)
    # Number of copies after the original: 1 most of the time, sometimes 2 or more if it fits.
    max_total = length // n  # original + copies that fit
    copies = 1 + (torch.rand(batch, 1, generator=gen) * (max_total - 1).clamp(min=1)).long()
    copies = torch.minimum(copies, (max_total - 1).clamp(min=1))
    total = n * (1 + copies)
    start = (torch.rand(batch, 1, generator=gen) * (length - total + 1)).long()
    # Optional random tail after the repeats: end somewhere in the last copy or after it.
    end = start + total
    t = torch.arange(length)[None, :]
    in_copy = (t >= start + n) & (t < end)
    src = torch.where(in_copy, start + (t - start) % n, t)
    ids = torch.gather(ids, 1, src)
    # Target at position t is ids[t+1]; predictable if t+1 is inside a copy.
    copy_mask = torch.zeros(batch, length, dtype=torch.bool)
    copy_mask[:, :-1] = in_copy[:, 1:]
    return ids, copy_mask


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
    j = torch.arange(length)
    self_ = w[..., j, j].mean(dim=(0, -1))
    first = w[..., j, 0].mean(dim=(0, -1))
    return {"induction": induction, "prev": prev, "self": self_, "first": first}


@torch.no_grad()
def evaluate(model: TinyAttnModel, seed: int = 12345, batch: int = 256) -> dict:
    """Print and return per-head scores on fresh repeated-span sequences and on SENTENCE.

    For each span length n the test sequences are: a random prefix (so the total length is the
    model's max_positions), a random span of n ids, and the same span again.
      induction: mean attention from each query in the second copy to key (q - n + 1), the token
                 right after the earlier occurrence of the query's token;
      prev:      mean attention from query i to key i - 1 over all i >= 1;
      self:      mean attention from query i to key i;  first: mean attention to key 0.
    Also reports copy accuracy (argmax next-token prediction inside the second copy).
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
    from attnviz.tokenize import hashed_ids, split_words

    words = split_words(SENTENCE)
    ids = torch.tensor([hashed_ids(words, vocab)])
    _, weights = model(ids, need_weights=True)
    half = len(words) // 2
    results["sentence"] = head_scores(weights, half, 0)
    results["sentence_weights"] = [w[0] for w in weights]

    print(f"\nPer-head scores (fresh random ids, total length {length}, batch {batch}):")
    header = "layer.head | " + " ".join(f"ind@{n:<3d}" for n in EVAL_SPANS)
    header += " | ind_min |  prev   self  first | sentence ind prev"
    print(header)
    for layer in range(layers):
        for head in range(heads):
            ind = [results["spans"][n]["induction"][layer, head].item() for n in EVAL_SPANS]
            avg = {
                k: sum(results["spans"][n][k][layer, head].item() for n in EVAL_SPANS)
                / len(EVAL_SPANS)
                for k in ("prev", "self", "first")
            }
            sent = results["sentence"]
            print(
                f"   {layer}.{head}     | "
                + " ".join(f"{v:6.3f}" for v in ind)
                + f" |  {min(ind):5.3f}  | {avg['prev']:5.3f}  {avg['self']:5.3f}  "
                + f"{avg['first']:5.3f} |        {sent['induction'][layer, head].item():5.3f} "
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
        ids, prefix = eval_batch(gen, 64, n, model.pos_embed.num_embeddings, model.embed.num_embeddings)
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

    model = TinyAttnModel(VOCAB_SIZE, MAX_POSITIONS, EMBED_DIM, NUM_LAYERS, NUM_HEADS)
    with torch.no_grad():
        if args.sin_init:
            model.pos_embed.weight.copy_(sinusoidal(MAX_POSITIONS, EMBED_DIM) * args.pos_scale)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
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
    for step in range(args.steps):
        ids, copy_mask = make_batch(
            gen, args.batch, MAX_POSITIONS, VOCAB_SIZE, args.min_span, args.max_span
        )
        logits = model(ids)
        loss_all = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1), reduction="none"
        )
        m = copy_mask[:, :-1].reshape(-1).float()
        loss = (loss_all * m).sum() / m.sum().clamp(min=1)
        if args.all_weight > 0:
            loss = loss + args.all_weight * loss_all.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  copy-loss {(loss_all * m).sum().item() / m.sum().item():.3f}"
                f"  lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - start:6.1f}s"
                + (f"  | {quick_eval(model)}" if args.quick_eval else ""),
                flush=True,
            )
    print(f"training took {time.perf_counter() - start:.1f}s")
    return model


def save(model: TinyAttnModel, out: Path) -> None:
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "format": "pt",
        "attnviz_family": "attnviz-tiny",
        "num_layers": str(NUM_LAYERS),
        "num_heads": str(NUM_HEADS),
        "embed_dim": str(EMBED_DIM),
        "vocab_size": str(VOCAB_SIZE),
        "max_positions": str(MAX_POSITIONS),
        "causal": "true",
        "tokenizer": "attnviz.tokenize.hashed_ids",
        "description": (
            "A 2-layer attention-only causal transformer trained on repeated random spans; "
            "layer 0 has previous-token heads and layer 1 has induction heads."
        ),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata=metadata)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--min-span", type=int, default=2)
    parser.add_argument("--max-span", type=int, default=24)
    parser.add_argument("--all-weight", type=float, default=0.0)
    parser.add_argument("--sin-init", type=int, default=1)
    parser.add_argument("--pos-scale", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--quick-eval", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    model = train(args)
    evaluate(model)
    if not args.no_save:
        save(model, args.out)


if __name__ == "__main__":
    main()
