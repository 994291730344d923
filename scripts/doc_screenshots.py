#!/usr/bin/env python
"""Screenshots of the documentation as a reader sees it (headless Chromium).

    python scripts/doc_screenshots.py [OUT_DIR]   # default docs/artifacts/

Writes ``site_config_reference.png`` (the configuration reference's ``[rollout]``
page of a fresh ``mkdocs build``) and ``readme_benchmarks.png`` (the README's
benchmark table rendered to HTML by the ``markdown`` package, as GitHub renders
tables). Needs mkdocs (the dev extra) and Chromium (``apt-get install chromium``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

import gen_docs  # noqa: E402

from mixrl.lab.study.screenshot import screenshot  # noqa: E402

STYLE = ("body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;font-size:14px;max-width:1560px;"
         "margin:16px auto;color:#1f2328}table{border-collapse:collapse}th,td{border:1px solid #d1d9e0;"
         "padding:5px 10px}tr:nth-child(2n){background:#f6f8fa}code{background:#eff1f3;padding:1px 4px;"
         "border-radius:4px;font-size:12px}a{color:#0969da}")


def readme_benchmarks_html() -> str:
    """The README's "Benchmarks" subsection as a standalone HTML page."""
    import markdown

    results = gen_docs.section((ROOT / "README.md").read_text(), "Results on this kind of machine (2 CPU cores, no GPU)")
    bench = gen_docs.section(results, "Benchmarks", level=3)
    body = markdown.markdown("### Benchmarks (README.md)\n\n" + bench, extensions=["tables"])
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{STYLE}</style></head><body>{body}</body></html>"


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "docs" / "artifacts"
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                       check=True, env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ})
        print(screenshot(site / "reference" / "config" / "rollout" / "index.html",
                         out / "site_config_reference.png", width=1500, height=1900))
        page = Path(tmp) / "readme_benchmarks.html"
        page.write_text(readme_benchmarks_html())
        print(screenshot(page, out / "readme_benchmarks.png", width=1600, height=900))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
