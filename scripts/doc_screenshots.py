#!/usr/bin/env python
"""Screenshots of the documentation as a reader sees it, and a check that the
configuration reference fits a 1280 px window (headless Chromium).

    python scripts/doc_screenshots.py [OUT_DIR]      # default docs/artifacts/
    python scripts/doc_screenshots.py --check-only   # only the 1280 px check, no screenshots

Builds the site (``mkdocs build --strict``), then:

- measures every configuration page (``reference/config/*/index.html``) in a
  1280 px wide window: the document must not scroll sideways
  (``document.documentElement.scrollWidth <= 1280``), and every table's right
  edge must be inside the content column with nothing hidden in its scroll
  wrapper. It prints one line per page and exits with status 1 if one does not fit;
- writes ``site_config_reference.png`` (the ``[loss]`` page, 1280 px wide) and
  ``readme_benchmarks.png`` (the README's results section rendered to HTML by
  the ``markdown`` package, as GitHub renders tables).

Needs mkdocs (the dev extra) and Chromium (``apt-get install chromium``); the
tests do not run it, as CI has no browser.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

import gen_docs  # noqa: E402

from mixrl.lab.study.screenshot import BROWSERS, screenshot  # noqa: E402

WIDTH = 1280

STYLE = ("body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;font-size:14px;max-width:1560px;"
         "margin:16px auto;color:#1f2328}table{border-collapse:collapse}th,td{border:1px solid #d1d9e0;"
         "padding:5px 10px}tr:nth-child(2n){background:#f6f8fa}code{background:#eff1f3;padding:1px 4px;"
         "border-radius:4px;font-size:12px}a{color:#0969da}")

# appended to a copy of a page: once it has loaded, write its layout into the DOM for --dump-dom
MEASURE_JS = """<script>window.addEventListener('load', () => {
  const content = document.querySelector('.md-content').getBoundingClientRect();
  const out = {viewport: window.innerWidth, scroll_width: document.documentElement.scrollWidth,
               content_right: Math.round(content.right), tables: []};
  for (const t of document.querySelectorAll('.md-content table')) {
    const wrap = t.closest('.md-typeset__scrollwrap') || t.parentElement;
    out.tables.push({right: Math.round(t.getBoundingClientRect().right),
                     hidden: wrap.scrollWidth - wrap.clientWidth});
  }
  const pre = document.createElement('pre');
  pre.id = 'layout-metrics';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});</script>"""


def layout(html: Path, width: int = WIDTH) -> dict:
    """The page's width, its content column's right edge and each table's, in a ``width`` px window."""
    exe = next((b for b in BROWSERS if shutil.which(b)), None)
    if exe is None:
        raise FileNotFoundError(f"no headless browser found (tried {', '.join(BROWSERS)}); apt-get install chromium")
    probe = html.with_name("_layout_probe.html")  # beside the page, so its assets resolve
    probe.write_text(html.read_text().replace("</body>", MEASURE_JS + "</body>"))
    try:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={width},900", "--virtual-time-budget=5000", "--dump-dom",
                            probe.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="layout-metrics">(.*?)</pre>', r.stdout, re.S)
    if m is None:
        raise RuntimeError(f"no layout measured for {html}: {r.stderr[-500:]}")
    return json.loads(m.group(1).replace("&quot;", '"'))


def check_config_pages(site: Path, width: int = WIDTH) -> list[str]:
    """One line per configuration page; the lines of the pages that do not fit start with FAIL."""
    lines = []
    for page in sorted((site / "reference" / "config").glob("**/index.html")):
        m = layout(page, width)
        right = max((t["right"] for t in m["tables"]), default=0)
        hidden = max((t["hidden"] for t in m["tables"]), default=0)
        ok = m["scroll_width"] <= width and right <= m["content_right"] and hidden <= 0
        lines.append(f"{'ok  ' if ok else 'FAIL'} {page.relative_to(site).parent}: window {m['viewport']} px, "
                     f"document {m['scroll_width']} px, widest table's right edge {right} px "
                     f"(content column ends at {m['content_right']} px), hidden in its scroll wrapper {hidden} px")
    return lines


def readme_benchmarks_html() -> str:
    """The README's results section (held-out evaluation and the headline benchmarks) as a standalone page."""
    import markdown

    results = gen_docs.section((ROOT / "README.md").read_text(), "Results (2 CPU cores, no GPU)")
    body = markdown.markdown("## Results (README.md)\n\n" + results, extensions=["tables"])
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{STYLE}</style></head><body>{body}</body></html>"


def main(argv: list[str]) -> int:
    check_only = "--check-only" in argv
    args = [a for a in argv if a != "--check-only"]
    out = Path(args[0]) if args else ROOT / "docs" / "artifacts"
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                       check=True, env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ})
        lines = check_config_pages(site)
        print("\n".join(lines))
        if not check_only:
            print(screenshot(site / "reference" / "config" / "loss" / "index.html",
                             out / "site_config_reference.png", width=WIDTH, height=1900))
            page = Path(tmp) / "readme_benchmarks.html"
            page.write_text(readme_benchmarks_html())
            print(screenshot(page, out / "readme_benchmarks.png", width=1600, height=1100))
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    if failed:
        print(f"{len(failed)} configuration page(s) do not fit a {WIDTH} px window", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
