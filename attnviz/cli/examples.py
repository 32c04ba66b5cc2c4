"""The examples each command's --help ends with: runnable as they stand from a clone (the
sample paths exist; tests/test_cli_help.py runs every one)."""

from __future__ import annotations

EXAMPLES = {
    "split": [
        ("attnviz split --spec E=32 -H 4", "random nn.MultiheadAttention(32, 4) and its proof"),
        ("attnviz split --spec E=32,kdim=16,vdim=24 -H 4", "W_k, W_v not square"),
        ("attnviz split --weights sample_weights/llama-gqa-tiny --layer 1",
         "a checkpoint layer (grouped-query)"),
        ("attnviz split --weights sample_weights/mha.safetensors --json", "as one JSON document"),
    ],
    "inspect": [
        ("attnviz inspect sample_weights/llama-gqa-tiny", "every attention layer, from headers"),
        ("attnviz inspect sample_weights/gpt2-tiny --layer 0", "per-head slices and norms"),
        ("attnviz inspect sample_weights/transformer_encoder.pt -H 4", "heads not stored"),
    ],
    "heatmap": [
        ('attnviz heatmap "the cat sat on the mat the cat sat"', "the bundled model"),
        ('attnviz heatmap "one sentence" "another one" --layer 1 --out maps.png',
         "a figure of every head"),
        ('attnviz heatmap "the cat sat on the mat" --query cat', "one query, head by head"),
        ("attnviz heatmap --probe induction --rank", "find the induction heads"),
    ],
    "generate": [
        ('attnviz generate "the cat sat on the mat the cat" --max-new-tokens 4',
         "the bundled model writes 4 tokens"),
        ('attnviz generate "the cat sat on the mat the" -n 6 --sample --seed 1',
         "sampled, reproducibly"),
        ('attnviz generate "the cat sat on the mat the cat" --rank',
         "what the top heads attend to"),
    ],
    "ablate": [
        ('attnviz ablate "the cat sat on the mat the cat sat"', "what removing each head costs"),
        ("attnviz ablate --probe induction --mode mean --rank", "mean-ablation, ranked"),
        ('attnviz ablate "the cat sat on the mat" --overview ablation --no-stats',
         "the scorecard as an overview grid"),
    ],
    "patch": [
        ("attnviz patch", "the bundled model's induction pair: which heads carry it"),
        ('attnviz patch "river cat stone window forest river cat stone" -c "river cat bird '
         'window forest river cat stone" -a window --wrong forest',
         "your own pair"),
        ("attnviz patch --site path,attribution --direction both", "path and attribution"),
    ],
    "circuits": [
        ("attnviz circuits", "the bundled model: its induction heads K-compose with layer 0"),
        ("attnviz circuits --weights sample_weights/llama-gqa-tiny --layer 1", "one layer (GQA)"),
        ("attnviz circuits --random --spec E=32 -H 4 --json", "a random layer, as JSON"),
    ],
    "attribute": [
        ("attnviz attribute", "the bundled model: which heads write its induction answer"),
        ('attnviz attribute "the cat sat on the mat the cat sat on the" --answer mat '
         "--wrong cat", "logit(mat) − logit(cat), part by part"),
        ('attnviz attribute "the cat sat on the mat the cat sat on the" '
         '--corrupt "the cat sat on the mat the dog sat on the" --answer mat',
         "clean − corrupted, per head"),
    ],
    "lens": [
        ("attnviz lens", "the bundled model's logit lens, every position"),
        ('attnviz lens "the cat sat on the mat the cat sat on the" --answer mat -p -1 -p -2',
         "the answer's rank, layer by layer"),
    ],
    "tokens": [
        ('attnviz tokens "the fox jumps over a dog the fox"',
         "the last fox draws on jumps, the token after its earlier occurrence"),
        ('attnviz tokens "the cat sat on the mat the cat" --method rollout --heads max',
         "rollout only, the strongest head per cell"),
        ('attnviz tokens "the cat sat on the mat the cat" --erase baseline --json',
         "erasure by a baseline token, as JSON"),
    ],
    "corpus": [
        ("attnviz corpus sample_weights/english.txt --limit 200",
         "head types over 200 real sentences, with their stability"),
        ("attnviz corpus sample_weights/english.txt --sample 100 --overview previous",
         "a uniform sample: each head's previous-token mean and interval"),
        ("attnviz corpus sample_weights/english.txt --limit 100 --out heads.png",
         "each statistic per head with its 95% error bars"),
    ],
    "compare": [
        ("attnviz compare -w sample_weights/bert-tiny -a sample_weights/gpt2-tiny",
         "two checkpoints of one head geometry, head by head"),
        ("attnviz compare -w sample_weights/bert-tiny -a sample_weights/gpt2-tiny --json",
         "the same as one JSON document"),
        ("attnviz compare sample_weights/english.txt --limit 50 "
         "-m sample_weights/models/phi3-tiny-lm -a sample_weights/models/phi3-tiny-model",
         "50 sentences through both: the same attention weights, no head differs"),
    ],
}


def summary(command: str, doc: str | None) -> str:
    """The command's help text with its first two examples right under the first line, so the
    first screen of `--help` shows how to run it (the rest close the help, after the panels)."""
    first, _, rest = (doc or "").strip().partition("\n")
    shown = "\n".join(f"  {cmd.replace('[', chr(92) + '[')}" for cmd, _ in EXAMPLES[command][:2])
    return (f"{first.strip()} {' '.join(rest.split())}".strip()
            + f"\n\n[bold]For example[/bold] (more at the end):\n\n{shown}")


def epilog(command: str) -> str:
    """Rich-markup epilog: what each example does, then the command on its own line (brackets
    escaped, so it shows as typed; no line is long enough to wrap in 80 columns)."""
    def shown(text: str) -> str:
        return text.replace("[", "\\[")

    lines = [f"[dim]# {shown(what)}[/dim]\n{shown(cmd)}" for cmd, what in EXAMPLES[command]]
    return "[bold]Examples[/bold]\n" + "\n".join(lines)
