"""The /debug page in headless Chromium: loads clean, shows requests live, draws a timeline.

Skips when Chromium is not installed (``make ci-deps`` installs it). The screenshot goes
to ``$LIFECYCLE_ARTIFACTS`` when set, else to the test's tmp dir.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.fsm import RequestRecord
from lifecycle.core.sampling import SamplingRequest
from lifecycle.core.states import Cause, Event
from lifecycle.tracing.probes import default_probe
from tests.cdp import Page, chromium_page, chromium_path
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


def probe(rec: RequestRecord) -> dict[str, Any]:
    """What the app's probe adds from a request's call (``call_probe``), made up here."""
    out = default_probe(rec)
    if rec.route is not None:
        out.update(client="127.0.0.1:5555", prompt_tokens=12, cached_tokens=4,
                   sampling=SamplingRequest(), worker_index=1)  # fmt: skip
    return out


async def field(page: Page, name: str) -> Any:
    return await page.eval(f"document.querySelector('#details dd[data-field=\"{name}\"]')"
                           "?.textContent")  # fmt: skip


async def fin_rows(page: Page) -> Any:
    return await page.eval("[...document.querySelectorAll('.fin')].map(f => +f.dataset.id)")


async def wait_rows(page: Page, ids: list[int]) -> None:
    """Until the finished list shows exactly ``ids`` (the page redraws on its next frame)."""
    await page.wait_for("[...document.querySelectorAll('.fin')].map(f => f.dataset.id).join()"
                        f" === {','.join(map(str, ids))!r}", 10)  # fmt: skip


async def choose(page: Page, id: str, value: str) -> None:
    await page.eval(f"(() => {{ const e = document.getElementById('{id}'); e.value = {value!r};"
                    "e.dispatchEvent(new Event('input')); })()")  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make ci-deps)")
async def test_debug_page_live(artifacts: Path) -> None:
    assert CHROMIUM is not None
    async with debug_server(feed_interval=0.1, probe=probe) as srv, chromium_page(CHROMIUM) as page:
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
        await explain_search_and_follow(srv, page)

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
        assert counts["error"] == "error 2" and counts["done"] == "done 1"
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


async def explain_search_and_follow(srv: Any, page: Page) -> None:
    """A request's details, its permalink, search and filters, and a live timeline that
    follows the request to its end."""
    route = "/v1/chat/completions"
    lv = srv.start(None, upto=3, request_id="rq-live", route=route)  # running
    lv.tokens = 9
    other = srv.start("other-1", upto=2, request_id="rq-other", route="/generate")
    # The permalink opens the request, by any of its ids (here a reply id made from it).
    await page.send("Page.navigate", {"url": f"{srv.url}/debug?request=chatcmpl-rq-live"})
    await page.wait_for(f"document.querySelector('#timeline')?.dataset.id === '{lv.id}'", 30)
    assert await page.eval("document.querySelector('#timeline').dataset.live") == "1"
    bars = await page.eval("[...document.querySelectorAll('#timeline .bar')]"
                           ".map(b => b.dataset.state + (b.classList.contains('current') ? '*' : ''))")  # fmt: skip
    assert bars == ["received", "validated", "queued", "running*"]
    assert await field(page, "route") == route
    assert await field(page, "request id") == "rq-live"
    assert await field(page, "client") == "127.0.0.1:5555"
    assert await field(page, "prompt tokens") == "12" and await field(page, "cached tokens") == "4"
    assert await field(page, "output tokens") == "9"
    assert await field(page, "worker") == "1: worker"
    assert '"max_new_tokens":128' in await field(page, "params")
    assert await field(page, "prompt") is None  # only with --trace-prompts
    href = await page.eval("document.querySelector('#timeline .permalink').getAttribute('href')")
    assert href == f"/debug?request={lv.id}"
    # It moves on: the open timeline follows (polling) with its new current state.
    lv.fire(Event.FIRST_TOKEN)
    await page.wait_for("document.querySelector('#timeline .bar.current')?.dataset.state"
                        " === 'streaming'", 10)  # fmt: skip
    srv.finish(lv)
    await page.wait_for("document.querySelector('#timeline').dataset.state === 'done'", 10)
    assert not await page.eval("document.querySelector('#timeline .bar.current')")
    assert await page.eval("document.querySelector('#timeline').dataset.live") == ""
    srv.finish(other, Cause.INVALID)
    await page.wait_for(f"!!document.querySelector('.fin[data-id=\"{other.id}\"]')")

    # Filters: by route, by cause, by state; search by any id.
    everything = await fin_rows(page)
    assert lv.id in everything and other.id in everything and len(everything) >= 3
    await choose(page, "f-route", route)
    await wait_rows(page, [lv.id])
    await choose(page, "f-route", "")
    await choose(page, "f-cause", "invalid")
    await wait_rows(page, [other.id])
    await choose(page, "f-cause", "")
    await choose(page, "f-state", "error")
    await wait_rows(page, [i for i in everything if i != lv.id])
    await choose(page, "f-state", "")
    await choose(page, "search", "rq-oth")
    await wait_rows(page, [other.id])
    # Enter opens what the search names, by a reply id too.
    await choose(page, "search", "chatcmpl-rq-other")
    await page.eval("document.getElementById('filters').requestSubmit()")
    await page.wait_for(f"document.querySelector('#timeline')?.dataset.id === '{other.id}'")
    assert "error(invalid) 400" in await page.eval(
        "document.querySelector('#timeline h2').textContent"
    )
    await choose(page, "search", "")
    await wait_rows(page, everything)


@pytest.mark.timeout(60)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make ci-deps)")
async def test_debug_page_shows_each_ray_replica() -> None:
    """With ``--ray`` the page lists each replica's state, node, actor and address, as
    ``/server_info``'s ``ray_replicas`` gives them (a stand-in route here: the real
    list is tests/test_ray.py's); without them the panel stays hidden."""
    from transport import JSONResponse, Request, Response, Router

    replicas = [
        {"index": 0, "state": "ready", "node_id": "n0", "actor_id": "a0",
         "address": "tcp:127.0.0.1:4100", "restarts": 0},
        {"index": 1, "state": "draining", "node_id": "n1", "actor_id": "a1",
         "address": "tcp:127.0.0.1:4101", "restarts": 2},
    ]  # fmt: skip
    served: dict[str, Any] = {}

    async def server_info(request: Request) -> Response:
        return JSONResponse(served)

    def routes(router: Router) -> None:
        router.add("GET", "/server_info", server_info)

    assert CHROMIUM is not None
    async with debug_server(routes=routes) as srv, chromium_page(CHROMIUM) as page:
        await page.send("Page.navigate", {"url": f"{srv.url}/debug"})
        await page.wait_for("document.getElementById('status')?.textContent === 'live'", 30)
        assert await page.eval("document.getElementById('replicas').hidden") is True
        served["ray_replicas"] = replicas
        await page.wait_for("document.querySelectorAll('#replicas .replica').length === 2", 10)
        rows = await page.eval("[...document.querySelectorAll('#replicas .replica')]"
                               ".map(r => r.textContent)")  # fmt: skip
        assert rows == [
            "#0 ready · node n0 · actor a0 · tcp:127.0.0.1:4100 · restarts 0",
            "#1 draining · node n1 · actor a1 · tcp:127.0.0.1:4101 · restarts 2",
        ]
