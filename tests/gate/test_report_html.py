"""The gate's report as a person sees it: report.html rendered by headless Chromium, and the screenshot looked at.

A real run (a passing fixture case, the same case with a planted failure, and an approximate backend's kernel rows)
is written, rendered to PNG, and the picture must show what the page promises: the limit line (orange), the
within-limit errors (blue), the failing one (red) with the first-failure marker, nothing cut off at the left edge
(the y label's pixels start inside the image), and a readable size. Needs Debian's chromium (`.ci/run` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch

from parity_tests.discovery import FIXTURES, find_dit_cases
from parity_tests.report import ReportCollector

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BLUE, RED, ORANGE = (0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28), (0xD0, 0x80, 0x00)


def _collector(tmp_path: Path) -> ReportCollector:
    from parity_tests.gate import run_dit_case
    from parity_tests.models import model as load_model

    cases, _ = find_dit_cases([FIXTURES])
    case = next(c for c in cases if c.compute == "bf16" and c.twin_fp32 is not None)
    rep = ReportCollector()
    rep.add_case(run_dit_case(case, mode="teacher"))
    layer = load_model(str(case.checkpoint), case.compute, "w4a16", "cpu").get_submodule("blocks.1.attn.out_proj")
    handle = layer.register_forward_hook(lambda m, a, out: out * 1.05)  # a planted h3direct bug
    try:
        bad = run_dit_case(case, mode="teacher")
    finally:
        handle.remove()
    assert bad.first_failure is not None
    rep.add_case(bad)
    rep.add_case(run_dit_case(case, mode="free"))
    return rep


def _pixels(png: Path):
    from PIL import Image

    img = Image.open(png).convert("RGB")
    return img, img.load()


def _near(c, target, tol=40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(c, target, strict=True))


def test_report_html_says_what_a_reader_needs(tmp_path):
    rep = _collector(tmp_path)
    folder = rep.write(tmp_path / "report")
    page = (folder / "report.html").read_text()
    assert page.count("<svg") == 3 and "first failure: blocks.1.attn.out_proj.out" in page
    assert "python -m oracle replay --trace" in page and "--ratio 1.5 --floor 1e-05" in page
    assert "margin a: exact rule" in page and "error (rel-L2, log)" in page
    assert ">1e-3<" in page or ">1e-2<" in page  # decade ticks, not fractions of a block
    md = (folder / "report.md").read_text()
    assert "FAIL at `blocks.1.attn.out_proj.out`" in md and "--ratio 1.5" in md
    rows = (folder / "results.jsonl").read_text().splitlines()
    assert len(rows) == sum(c["layers"] for c in rep.cases)


def test_report_html_screenshot(tmp_path):
    assert CHROMIUM, "the report's screenshot test needs Debian's chromium (apt-get install chromium; .ci/run does)"
    folder = _collector(tmp_path).write(tmp_path / "report")
    png = tmp_path / "report.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1240,2600", f"--screenshot={png}",
           (folder / "report.html").as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file(), r.stderr[-2000:]
    img, px = _pixels(png)
    assert img.size == (1240, 2600)
    colors = {"blue": 0, "red": 0, "orange": 0}
    leftmost_dark = img.size[0]
    for yy in range(0, img.size[1], 2):
        for xx in range(0, img.size[0], 2):
            c = px[xx, yy]
            colors["blue"] += _near(c, BLUE)
            colors["red"] += _near(c, RED)
            colors["orange"] += _near(c, ORANGE)
            if sum(c) < 200:
                leftmost_dark = min(leftmost_dark, xx)
    assert colors["blue"] > 50, colors  # within-limit errors drawn
    assert colors["orange"] > 50, colors  # the limit line
    assert colors["red"] > 20, colors  # the failing comparison, its marker and the FAIL labels
    assert leftmost_dark >= 8, "something is drawn against the left edge (a cut-off label)"
    shutil.copy(png, folder / "report.png")  # kept beside the page for whoever runs the test by hand
    assert torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).float().std() > 10  # not a blank page
