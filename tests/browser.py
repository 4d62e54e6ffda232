"""Load a local HTML page in headless Chromium; report JS errors, image rendering, a screenshot."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Chromium's executable names across distros; Debian's package installs `chromium`.
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Caps the full-page screenshot so a runaway page cannot produce a gigantic PNG.
_MAX_SHOT_HEIGHT = 16_000

# Runs in the page after `load`. Lazy images are forced eager: offscreen ones would otherwise
# never load and decode() would never settle. Awaiting decode() makes the verdict final (a big
# image may still be decoding at `load`); its rejection also counts as "not rendered". Caveat:
# Chromium draws a truncated PNG progressively (top rows only) and counts it as decoded, so only
# undecodable data (bad base64, corrupt IDAT, wrong format) is caught, not truncation. Two frames
# then paint, and a short settle lets errors thrown from setTimeout(0)/rAF callbacks arrive.
_INSPECT_JS = """
(async (settleMs) => {
  const imgs = Array.from(document.images);
  imgs.forEach((i) => { if (i.loading === "lazy") i.loading = "eager"; });
  const decoded = await Promise.all(imgs.map((i) => i.decode().then(() => true, () => false)));
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  await new Promise((r) => setTimeout(r, settleMs));
  return {
    title: document.title,
    images: imgs.map((i, k) => ({
      src: i.getAttribute("src") || "",
      alt: i.getAttribute("alt") || "",
      rendered: decoded[k] && i.complete && i.naturalWidth > 0,
    })),
  };
})
"""


class BrowserError(RuntimeError):
    """Chromium could not be started, died, or the page did not load in time."""


@dataclass
class PageCheck:
    """What a headless load of one page showed."""

    url: str
    title: str
    errors: list[str] = field(default_factory=list)  # JS exceptions, console.error, browser log
    images_total: int = 0
    images_rendered: int = 0  # img.decode() resolved, complete, naturalWidth > 0
    broken_images: list[str] = field(default_factory=list)  # alt or src prefix of each unrendered
    external_requests: list[str] = field(default_factory=list)  # http(s)/ws fetches: not offline
    screenshot: Path | None = None

    @property
    def ok(self) -> bool:
        """No errors, every image rendered, nothing fetched from the network."""
        return (
            not self.errors
            and self.images_rendered == self.images_total
            and not self.external_requests
        )


def chromium_path() -> str | None:
    """Path of a Chromium/Chrome executable ($CHROMIUM overrides), or None if none is installed."""
    override = os.environ.get("CHROMIUM")
    if override:
        return shutil.which(override)
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _Cdp:
    """Chrome DevTools Protocol over --remote-debugging-pipe: NUL-terminated JSON on fds 3/4."""

    def __init__(self, write_fd: int, read_fd: int, proc: subprocess.Popen, deadline: float):
        self._w, self._r, self._proc, self.deadline = write_fd, read_fd, proc, deadline
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("timed out waiting for Chromium (page never loaded?)")
            ready, _, _ = select.select([self._r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed the pipe (exit {self._proc.poll()})")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Call `method` and return its result; events that arrive meanwhile go to .events."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        """Block until an event named `method` arrives (or has already been buffered)."""
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if ev["method"] == method:
                    return ev
            seen = len(self.events)
            reply = self._read_message()
            if "method" in reply:
                self.events.append(reply)


def _remote_object_text(obj: dict) -> str:
    """Readable text of a console argument (strings unquoted, Errors by their description)."""
    if "value" in obj:
        return str(obj["value"])
    return str(obj.get("description") or obj.get("unserializableValue") or obj.get("type"))


def _collect(events: list[dict], url: str) -> tuple[list[str], list[str]]:
    """Errors and external requests from the CDP events of the page session."""
    errors: list[str] = []
    external: list[str] = []
    for ev in events:
        method, p = ev["method"], ev.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            # description carries "Error: boom\n    at ..."; text alone is just "Uncaught".
            desc = (d.get("exception") or {}).get("description") or d.get("text", "")
            where = f" ({d.get('url') or url}:{d.get('lineNumber', 0) + 1})"
            errors.append(f"exception: {desc.splitlines()[0] if desc else d.get('text')}{where}")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            text = " ".join(_remote_object_text(a) for a in p.get("args", []))
            errors.append(f"console.{p['type']}: {text}")
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            # Browser-side errors: failed resource loads, CSP/CORS violations, etc.
            e = p["entry"]
            errors.append(f"log.{e.get('source', '?')}: {e.get('text', '')} {e.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            req_url = p["request"]["url"]
            if req_url.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp"):
                external.append(req_url)
    return errors, external


def check_page(
    html: Path,
    screenshot: Path | None = None,
    timeout_s: float = 60,
    *,
    width: int = 1280,
    height: int = 900,
    settle_ms: int = 100,
) -> PageCheck:
    """Load `html` (a local file) in headless Chromium and report what went wrong on the page.

    Raises BrowserError if Chromium is missing, crashes, or the page does not finish loading
    within `timeout_s`. A full-page PNG is written to `screenshot` when given.
    """
    exe = chromium_path()
    if exe is None:
        raise BrowserError("no chromium executable found (apt-get install chromium)")
    url = Path(html).resolve().as_uri()
    deadline = time.monotonic() + timeout_s
    with (
        tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile,
        tempfile.TemporaryFile() as log,
    ):
        proc, to_chrome, from_chrome = _launch(exe, profile, log, width, height)
        cdp = _Cdp(to_chrome, from_chrome, proc, deadline)
        try:
            return _drive(cdp, url, screenshot, width, height, settle_ms)
        except BrowserError as exc:
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            raise BrowserError(f"{url}: {exc}\n--- chromium output ---\n{tail}") from None
        finally:
            # Fresh deadline: after a page timeout the browser itself still answers Browser.close.
            cdp.deadline = time.monotonic() + 5
            with contextlib.suppress(BrowserError, OSError):
                cdp.send("Browser.close")
            os.close(to_chrome)
            os.close(from_chrome)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            # Chromium's pid leads its own session: this reaps a hung browser and any renderer,
            # GPU or zygote helper that outlived it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _launch(
    exe: str, profile: str, log: IO[bytes], width: int, height: int
) -> tuple[subprocess.Popen, int, int]:
    """Start headless Chromium with a CDP pipe; return it and our (write, read) pipe ends."""
    # We write to `to_chrome`, read `from_chrome`; Chromium expects them as its fds 3 and 4.
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    args = [
        exe,
        "--headless",
        "--no-sandbox",  # root in a container: the setuid/namespace sandbox is unavailable
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--hide-scrollbars",
        "--mute-audio",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--remote-debugging-pipe",
        "about:blank",
    ]
    # The shell maps our pipe ends onto fds 3/4 without a (thread-unsafe) preexec_fn; bash, not
    # sh, because dash's redirections only take single-digit fds. from_chrome_w > to_chrome_r >= 3
    # (created later), so filling fd 3 first cannot clobber it. The originals are then closed so
    # Chromium holds one copy of each and its exit reliably gives us EOF.
    redirs = [f"3<&{to_chrome_r}", f"4>&{from_chrome_w}"]
    redirs += [f"{fd}>&-" for fd in (to_chrome_r, from_chrome_w) if fd not in (3, 4)]
    shell = 'exec "$@" ' + " ".join(redirs)
    try:
        proc = subprocess.Popen(
            ["bash", "-c", shell, "bash", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(to_chrome_r, from_chrome_w),
            start_new_session=True,  # so a hung browser can be killed with its renderers
        )
    except BaseException:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        raise
    finally:
        os.close(to_chrome_r)
        os.close(from_chrome_w)
    return proc, to_chrome_w, from_chrome_r


def _drive(
    cdp: _Cdp, url: str, screenshot: Path | None, width: int, height: int, settle_ms: int
) -> PageCheck:
    """Open a fresh tab, enable event domains, navigate, inspect, screenshot."""
    target = cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    sid = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    # Domains are enabled before navigating so errors thrown by inline scripts are seen.
    for domain in ("Page", "Runtime", "Log", "Network"):
        cdp.send(f"{domain}.enable", session=sid)
    cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        session=sid,
    )
    cdp.events.clear()
    nav = cdp.send("Page.navigate", {"url": url}, session=sid)
    if nav.get("errorText"):
        raise BrowserError(f"navigation to {url} failed: {nav['errorText']}")
    cdp.wait_event("Page.loadEventFired")
    res = cdp.send(
        "Runtime.evaluate",
        {
            "expression": f"({_INSPECT_JS})({int(settle_ms)})",
            "awaitPromise": True,
            "returnByValue": True,
        },
        session=sid,
    )
    if "exceptionDetails" in res:
        raise BrowserError(f"inspection script failed: {res['exceptionDetails'].get('text')}")
    info = res["result"]["value"]
    errors, external = _collect(cdp.events, url)
    images = info["images"]
    broken = [img["alt"] or img["src"][:60] for img in images if not img["rendered"]]
    shot_path = None
    if screenshot is not None:
        size = cdp.send("Page.getLayoutMetrics", session=sid)["cssContentSize"]
        clip = {
            "x": 0,
            "y": 0,
            "width": max(1, min(size["width"], 4 * width)),
            "height": max(1, min(size["height"], _MAX_SHOT_HEIGHT)),
            "scale": 1,
        }
        png = cdp.send(
            "Page.captureScreenshot",
            {"format": "png", "clip": clip, "captureBeyondViewport": True},
            session=sid,
        )["data"]
        shot_path = Path(screenshot)
        shot_path.parent.mkdir(parents=True, exist_ok=True)
        shot_path.write_bytes(base64.b64decode(png))
    return PageCheck(
        url=url,
        title=info["title"],
        errors=errors,
        images_total=len(images),
        images_rendered=len(images) - len(broken),
        broken_images=broken,
        external_requests=external,
        screenshot=shot_path,
    )
