"""The /debug page in headless Chromium: loads clean, shows requests live, draws a timeline.

Skips when Chromium is not installed (``make ci-deps`` installs it). The screenshot goes
to ``$LIFECYCLE_ARTIFACTS`` when set, else to the test's tmp dir.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lifecycle.core.states import Cause, Event
from tests.cdp import chromium_page, chromium_path
from tests.debug_helpers import debug_server

pytestmark = pytest.mark.anyio

CHROMIUM = chromium_path()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("LIFECYCLE_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def chip(state: str, id: int) -> str:
    return f"!!document.querySelector('.col[data-state={state}] .req[data-id=\"{id}\"]')"


@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make ci-deps)")
async def test_debug_page_live(artifacts: Path) -> None:
    assert CHROMIUM is not None
    async with debug_server(feed_interval=0.1) as srv, chromium_page(CHROMIUM) as page:
        await page.send("Page.navigate", {"url": f"{srv.url}/debug"})
        await page.wait_for("document.getElementById('status')?.textContent === 'live'", 30)

        # A request appears, moves, and finishes, over the feed.
        rec = srv.start("page-req", upto=2)
        await page.wait_for(chip("queued", rec.id))
        rec.fire(Event.DISPATCH)
        await page.wait_for(chip("running", rec.id))
        assert not await page.eval(chip("queued", rec.id))
        srv.finish(rec, Cause.DEADLINE)
        await page.wait_for(f"!!document.querySelector('.fin[data-id=\"{rec.id}\"]')")
        assert not await page.eval(chip("running", rec.id))
        text = await page.eval(f"document.querySelector('.fin[data-id=\"{rec.id}\"]').textContent")
        assert "page-req" in text and "error(deadline)" in text

        # Its timeline: one bar per state it passed through.
        await page.eval(f"document.querySelector('.fin[data-id=\"{rec.id}\"]').click()")
        bars = await page.wait_for(
            f"document.querySelector('#timeline[data-id=\"{rec.id}\"]') && "
            "[...document.querySelectorAll('#timeline .bar')].map(b => b.dataset.state)"
        )
        assert bars == ["received", "validated", "queued", "running"]
        heading = await page.eval("document.querySelector('#timeline h2').textContent")
        assert "error(deadline) 504" in heading

        # A few hundred live requests: counts and columns keep up, chips are capped.
        many = [srv.start(f"bulk-{i}", upto=1 + i % 4) for i in range(400)]
        await page.wait_for(
            "document.querySelector('.col[data-state=streaming] h2 span')?.textContent === '100'"
        )
        counts = await page.eval(
            "Object.fromEntries([...document.querySelectorAll('.count')]"
            ".map(c => [c.dataset.state, c.textContent]))"
        )
        assert counts["queued"] == "queued 100" and counts["streaming"] == "streaming 100"
        assert counts["error"] == "error 1" and counts["done"] == "done 0"
        chips = await page.eval(
            "document.querySelectorAll('.col[data-state=validated] .req').length"
        )
        assert chips == 60
        await page.screenshot(artifacts / "debug-page.png")

        # Reopened, the page lists what finished before it from the server's ring.
        await page.send("Page.reload")
        await page.wait_for(f"!!document.querySelector('.fin[data-id=\"{rec.id}\"]')", 30)
        for r in many:
            srv.finish(r, Cause.CLIENT_GONE)
        await page.wait_for("document.querySelectorAll('.req').length === 0")
        assert page.errors == []
    assert (artifacts / "debug-page.png").stat().st_size > 10_000
