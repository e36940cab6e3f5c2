"""The HTML timeline of `teacherq trace --html` in a real headless Chromium: it loads without
script errors, draws a bar per span, and renders to a screenshot with the bars visible.

Needs Debian's `chromium` package (`apt-get install -y --no-install-recommends chromium`); the
tests fail, naming that command, when it is missing.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from shared.settings import Settings
from tests.processes import run_cli as cli
from tests.timing import scaled
from tests.trace_stand_in import JOB_PHASES, traced_jobs

pytestmark = pytest.mark.integration

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL = "apt-get update && apt-get install -y --no-install-recommends chromium"
WIDTH, HEIGHT = 1400, 900


def chromium() -> str:
    """The browser binary; a missing browser is a failed setup, not a skipped test."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"headless Chromium not found (tried {CHROMIUM_NAMES}); install it: {INSTALL}")


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    cmd = [
        chromium(),
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
        f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars",
        *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120))


def console_errors(stderr: str) -> list[str]:
    """Console messages that report a script error (Chromium logs them as CONSOLE lines)."""
    return [
        line
        for line in stderr.splitlines()
        if "CONSOLE" in line and re.search(r"Uncaught|Error|error", line)
    ]


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGBA/RGB bytes) of an 8-bit non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 4 if color == 6 else 3
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def pixel_counts(png: bytes) -> dict[tuple[int, int, int], int]:
    width, _, rows = decode_png(png)
    bpp = len(rows[0]) // width
    counts: dict[tuple[int, int, int], int] = {}
    for row in rows:
        for x in range(0, len(row), bpp):
            rgb = (row[x], row[x + 1], row[x + 2])
            counts[rgb] = counts.get(rgb, 0) + 1
    return counts


def _near(counts: dict[tuple[int, int, int], int], rgb: tuple[int, int, int]) -> int:
    # Bars are drawn at 90 % opacity over white: allow that blend.
    return sum(n for c, n in counts.items() if all(abs(c[i] - rgb[i]) <= 30 for i in range(3)))


def test_html_timeline_renders_in_headless_chromium(
    settings: Settings, producer_sink, tmp_path: Path
) -> None:
    ids, batches = traced_jobs(settings, producer_sink, 3)
    page = tmp_path / "job.html"
    res = cli(settings, "trace", ids[0], "--html", str(page))
    assert res.returncode == 0, res.stderr
    html = page.read_text()
    assert "http://" not in html and "https://" not in html and " src=" not in html

    dom = run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert console_errors(dom.stderr) == [], console_errors(dom.stderr)
    assert "data-js-error" not in dom.stdout
    assert 'data-rendered="1"' in dom.stdout, "the page script did not finish"
    # One job row (8 phases) and its batch (batch, pack, 2 ranks x (rank, forward, head)).
    assert 'data-bars="16"' in dom.stdout
    bars = re.findall(
        r'<div class="bar[^"]*" data-span="[0-9a-f]+" data-name="([a-z_0-9]+)"', dom.stdout
    )
    assert len(bars) == 16 and set(JOB_PHASES) <= set(bars)
    assert bars.count("forward") == 3  # the job's link span and each rank's
    assert 'class="row job"' in dom.stdout and 'class="row batch"' in dom.stdout
    titles = re.findall(r'title="(forward [^"]*)"', dom.stdout)
    assert any("batch_id" in t for t in titles), "hover details missing"

    shot = tmp_path / "job.png"
    res = run_chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr[-3000:]
    png = shot.read_bytes()
    width, height, _ = decode_png(png)
    assert (width, height) == (WIDTH, HEIGHT)
    counts = pixel_counts(png)
    assert len(counts) > 20, "a blank page"
    # Bars in the page's colours: submit (#4e79a7), forward (#e15759), the batch (#9c755f).
    for rgb in ((0x4E, 0x79, 0xA7), (0xE1, 0x57, 0x59), (0x9C, 0x75, 0x5F)):
        assert _near(counts, rgb) > 20, f"no bar drawn in colour {rgb}"


def test_batch_page_has_a_row_per_job(settings: Settings, producer_sink, tmp_path: Path) -> None:
    ids, batches = traced_jobs(settings, producer_sink, 3)
    page = tmp_path / "batch.html"
    res = cli(settings, "trace", "--batch", batches[0], "--html", str(page))
    assert res.returncode == 0, res.stderr
    dom = run_chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0 and console_errors(dom.stderr) == [], dom.stderr[-3000:]
    labels = re.findall(r'<div class="label" title="([^"]+)">', dom.stdout)
    assert labels == [f"job {j}" for j in ids] + [f"batch {batches[0]}"]
    assert 'data-bars="32"' in dom.stdout  # 3 jobs x 8 phases + the batch's 8 spans
    assert re.search(r'id="reset" style="visibility: hidden;?"', dom.stdout)

    zoomed = run_chromium(tmp_path, "--dump-dom", page.as_uri() + "#zoom=1,2")
    assert zoomed.returncode == 0 and console_errors(zoomed.stderr) == [], zoomed.stderr[-3000:]
    ticks = [
        float(t) for t in re.findall(r'<div class="tick"[^>]*>([0-9.]+) ms</div>', zoomed.stdout)
    ]
    assert len(ticks) >= 3 and all(1 <= t <= 2 for t in ticks), ticks
    assert re.search(r'id="reset" style="visibility: visible;?"', zoomed.stdout)
