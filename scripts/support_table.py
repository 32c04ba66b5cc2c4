"""Regenerate docs/models.md's table of supported architectures from the test suite.

Runs tests/test_zoo_support.py (every architecture of tests/zoo.py through `inspect` and
`split --weights`, checked against the model's own config and forward) and tests/test_model.py
(`heatmap --model` against transformers' own maps, `--query`, the `--verify` proofs,
cross-attention), collects what each test established, and rewrites the block between the two
markers in docs/models.md. The block is never edited by hand: the last test of test_zoo_support.py
fails when it differs from what this script writes.

    python scripts/support_table.py           # run the tests, rewrite docs/models.md
    python scripts/support_table.py --check   # run the tests, exit 1 if docs/models.md is stale
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"  # the page that holds the table
TESTS = ("tests/test_zoo_support.py", "tests/test_model.py")
BEGIN = "<!-- support-table:begin (written by scripts/support_table.py from the test suite) -->"
END = "<!-- support-table:end -->"
HEADER = ("| architecture (transformers class) | model_type | attnviz family | attention "
          "layers | inspect | split | heatmap --model (path) | --query | --verify (proofs) | "
          "cross-attention |\n|---|---|---|---|---|---|---|---|---|---|")


def render(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table for these outcomes, in the zoo's order."""
    rows = [HEADER]
    for _, facts in sorted(results.items(), key=lambda item: item[1].get("index", 0)):
        families = ", ".join(f"`{family}`" for family in facts.get("families", [])) or "—"
        if "heatmap" not in facts:  # weights only (ViT): no text to run
            run = query = verify = cross = "—"
        else:
            run = f"{_mark(facts['heatmap'])} ({facts.get('path', '?')})"
            query = _mark(facts.get("query")) if "query" in facts else "—"
            verify = facts.get("verify", "✗")
            cross = "✓" if facts.get("cross") else "—"
        rows.append(f"| {facts['model_class']} | `{facts.get('model_type', '?')}` | {families} | "
                    f"{facts.get('layers', '—')} | {_mark(facts.get('inspect'))} | "
                    f"{_mark(facts.get('split'))} | {run} | {query} | {verify} | {cross} |")
    return "\n".join(rows)


def _mark(passed: Any) -> str:
    return "✓" if passed else "✗"


def splice(readme: str, table: str) -> str:
    """The page text with the block between the markers replaced by `table`."""
    start, stop = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + table + "\n" + readme[stop:]


def block(readme: str) -> str:
    """The table currently between the markers."""
    return readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip()


def collect() -> dict[str, dict[str, Any]]:
    """Run the zoo tests and read back what they established."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "support.json"
        env = {**os.environ, "ATTNVIZ_SUPPORT_JSON": str(out)}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                       cwd=ROOT, env=env, check=False)
        if not out.exists():
            raise SystemExit(f"{TESTS} wrote no results (is transformers installed?)")
        results: dict[str, dict[str, Any]] = json.loads(out.read_text(encoding="utf-8"))
        return results


def main(argv: list[str]) -> int:
    table = render(collect())
    readme = PAGE.read_text(encoding="utf-8")
    if "--check" in argv:
        if block(readme) != table:
            print("docs/models.md's support table is stale: run python scripts/support_table.py")
            return 1
        return 0
    PAGE.write_text(splice(readme, table), encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
