"""Render a report's HTML to a PNG with headless Chromium (``mixrl report DIR --png``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def screenshot(html: Path, png: Path, width: int = 1400, height: int = 4000) -> Path:
    exe = next((b for b in BROWSERS if shutil.which(b)), None)
    if exe is None:
        raise FileNotFoundError(f"no headless browser found (tried {', '.join(BROWSERS)}); apt-get install chromium")
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png.resolve()}", html.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    return png
