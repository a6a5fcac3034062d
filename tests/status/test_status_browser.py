"""The status page in a real browser: headless Chromium (the system's, `/usr/bin/chromium`),
driven with Playwright, against the example app under uvicorn and the fake Workers AI server.

The browser arrives without the token, gets the page that asks for it, gives it, and sees the
status; then the app goes through a fallback and an open breaker while the page stays open, and
the page shows them on its own (it refreshes in place: the same document, no navigation), on a
phone-sized screen, with no script error or CSP violation. A screenshot is written under the
test's temporary directory for people to look at.

Playwright never downloads a browser here: it launches the system's Chromium. On a machine
without Chromium or the `playwright` package the test is skipped, saying so; with
`GUARDS_REQUIRE_BROWSER=1` (set by `.ci/run`, which installs Chromium) it fails instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.service import create_app
from fixtures import Fail, FakeWorkersAI, Reply

from ..conftest import Serve, no_sleep
from .test_status import DOWN, TOKEN, A, B, settings_for

ROOT = Path(__file__).resolve().parents[2]
#: A phone's screen (CSS pixels).
PHONE = {"width": 390, "height": 844}
#: The longest the page may take to show a change: two refreshes of one second, with room for
#: a loaded machine.
SHOWN_MS = 10_000


def chromium() -> str:
    """The system's Chromium, and Playwright to drive it; else skip (or fail under CI)."""
    required = os.environ.get("GUARDS_REQUIRE_BROWSER") == "1"
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    problem = None
    if found is None:
        problem = "chromium is not installed (`apt-get install chromium`; .ci/run does)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is missing (`make install` installs it)"
    if problem is not None:
        if required:
            pytest.fail(f"a browser is required (GUARDS_REQUIRE_BROWSER=1): {problem}")
        pytest.skip(problem)
    assert found is not None
    return found


def test_the_page_shows_a_fallback_and_an_open_breaker_as_they_happen(
    fake_workers_ai: FakeWorkersAI, serve: Serve, tmp_path: Path
) -> None:
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    client = serve(create_app(settings_for(fake_workers_ai, status_refresh_s=1), sleep=no_sleep))
    url = str(client.base_url.join("/status"))
    fake_workers_ai.default = Reply("Thank you for your message.")
    problems: list[str] = []

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=PHONE, device_scale_factor=2, is_mobile=True)
            page.on(
                "console", lambda message: problems.append(message.text) if message.type == "error" else None
            )
            page.on("pageerror", lambda error: problems.append(str(error)))

            # No token: the page asks for it (a 401), and shows nothing of the status.
            answer = page.goto(url)
            assert answer is not None
            assert answer.status == 401
            expect(page.locator("#sign-in")).to_be_visible()
            assert A not in page.content()
            problems.clear()  # Chromium logs the 401 of the page itself as a console error.
            # A wrong token is refused; the right one shows the status.
            page.fill("#token", "wrong-token-0123456789")
            page.click("button[type=submit]")
            expect(page.locator("#summary")).to_have_text("That token was refused.", timeout=SHOWN_MS)
            problems.clear()  # and the 401 of that fetch
            page.fill("#token", TOKEN)
            page.click("button[type=submit]")
            expect(page.locator("#level")).to_have_text("full", timeout=SHOWN_MS)
            expect(page.locator(f'tr[data-model="{A}"]')).to_contain_text("closed")
            # From here on, the same document: a marker set now survives every refresh.
            page.evaluate("window.stillTheSamePage = true")
            refreshes = int(page.evaluate("document.body.dataset.refreshes"))

            # A fails for good: the first request falls back to B, and A's breaker opens.
            fake_workers_ai.script(A, *[DOWN] * 10)
            answered = client.post("/draft-reply", json={"message": "Where is my parcel?"})
            assert answered.headers["x-ai-model"] == B
            expect(page.locator("#level")).to_have_text("degraded", timeout=SHOWN_MS)
            row = page.locator(f'tr[data-model="{A}"]')
            expect(row).to_contain_text("down")
            expect(row).to_contain_text("open")
            expect(row).to_contain_text("model_temporarily_unavailable")
            expect(page.locator(f'tr[data-model="{B}"]')).to_contain_text("up")
            route = page.locator('tr[data-route="draft_reply"]')
            expect(route).to_contain_text("100 %")  # served by a fallback model

            # B is rate limited too: nothing is left.
            fake_workers_ai.script(B, Fail(status=429, retry_after="20"))
            assert client.post("/draft-reply", json={"message": "Hi"}).status_code == 503
            expect(page.locator("#level")).to_have_text("minimal", timeout=SHOWN_MS)
            expect(page.locator(f'tr[data-model="{B}"]')).to_contain_text("model_rate_limited")

            assert page.evaluate("window.stillTheSamePage") is True
            assert int(page.evaluate("document.body.dataset.refreshes")) > refreshes
            # Readable on a phone: nothing wider than the screen.
            width: Any = page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"]
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            assert (tmp_path / "status.png").stat().st_size > 0
            assert problems == []
        finally:
            browser.close()


def test_ci_installs_chromium_and_never_skips_this_test() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "need+=(chromium)" in script
    assert "export GUARDS_REQUIRE_BROWSER=1" in script
