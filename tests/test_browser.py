"""The headless-Chromium page checker passes a good page and catches broken images and JS errors."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

from tests.browser import BrowserError, check_page, chromium_path

pytestmark = pytest.mark.skipif(
    chromium_path() is None, reason="chromium not installed (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def png_b64() -> str:
    """A real matplotlib plot as base64 PNG, like the reports embed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2), dpi=50)
    ax.plot([1, 3, 2])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _page(tmp_path: Path, body: str, title: str = "Report") -> Path:
    html = tmp_path / "report.html"
    html.write_text(
        f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title></head>'
        f"<body><h1>{title}</h1>{body}</body></html>"
    )
    return html


def test_good_plot_renders(tmp_path: Path, png_b64: str) -> None:
    html = _page(tmp_path, f'<img alt="loss" src="data:image/png;base64,{png_b64}">', "Good")
    shot = tmp_path / "shots" / "report.png"
    r = check_page(html, screenshot=shot)
    assert r.errors == []
    assert (r.images_total, r.images_rendered) == (1, 1)
    assert r.title == "Good" and r.ok
    assert r.screenshot == shot and shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_corrupt_images_not_rendered(tmp_path: Path, png_b64: str) -> None:
    # Valid base64, intact PNG header, scrambled pixel data: the URL parses, decoding fails.
    raw = base64.b64decode(png_b64)
    scrambled = base64.b64encode(raw[:100] + bytes(b ^ 0xFF for b in raw[100:])).decode()
    html = _page(
        tmp_path,
        f'<img alt="good" src="data:image/png;base64,{png_b64}">'
        f'<img alt="scrambled" src="data:image/png;base64,{scrambled}">'
        '<img alt="bad-base64" src="data:image/png;base64,iVBORw0KGgo!!not-base64">',
    )
    r = check_page(html)
    assert (r.images_total, r.images_rendered) == (3, 1)
    assert sorted(r.broken_images) == ["bad-base64", "scrambled"]
    assert not r.ok


def test_uncaught_exception_reported(tmp_path: Path) -> None:
    r = check_page(_page(tmp_path, '<script>throw new Error("boom")</script>'))
    assert len(r.errors) == 1 and "Error: boom" in r.errors[0], r.errors
    assert not r.ok


def test_console_error_and_async_exception_reported(tmp_path: Path) -> None:
    body = (
        '<script>console.error("plot data missing", 42);setTimeout(() => { null.x; }, 0);</script>'
    )
    r = check_page(_page(tmp_path, body))
    assert any(e == "console.error: plot data missing 42" for e in r.errors), r.errors
    assert any("TypeError" in e for e in r.errors), r.errors


def test_page_that_never_loads_times_out(tmp_path: Path) -> None:
    with pytest.raises(BrowserError, match="timed out"):
        check_page(_page(tmp_path, "<script>for (;;) {}</script>"), timeout_s=3)


def test_network_fetch_flagged(tmp_path: Path) -> None:
    # A self-contained report must not fetch anything; port 9 refuses at once, no DNS needed.
    r = check_page(_page(tmp_path, '<img alt="remote" src="http://127.0.0.1:9/plot.png">'))
    assert r.external_requests == ["http://127.0.0.1:9/plot.png"]
    assert r.broken_images == ["remote"] and not r.ok
