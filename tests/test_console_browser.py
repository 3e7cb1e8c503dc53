"""The console in a real browser (headless Chromium, selenium): sign in, load the list,
open a conversation, watch a turn complete live, approve a paused call and see the next
turn start; screenshots of the three pages go to build/screenshots/ (not checked in)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from browser import chromium, need_browser, screenshot
from console_server import served_in_thread
from mail_agent import mail_worker

TOKEN = "console-test-token"


def wait_for(condition: Callable[[], object], timeout_s: float = 90.0, what: str = "the page") -> object:
    """Polls a browser condition (selenium calls block; the server runs in its own thread).
    A deadline, not a timing: generous, since the machines are shared and Chromium is slow
    to start pages under load."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout_s} s")
        time.sleep(0.1)


def test_list_conversation_live_turn_approval_and_the_next_turn_in_chromium(tmp_path: Path) -> None:
    need_browser()
    from selenium.webdriver.common.by import By

    sent: list[str] = []
    with served_in_thread(lambda: mail_worker(tmp_path, sent, delay_s=1.0), TOKEN) as url, chromium() as driver:
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        api.post("/conversations/support-7/messages", json={"message_id": "m1", "content": "hello there"})

        # Sign in, then the list.
        driver.get(f"{url}/ui")
        assert driver.current_url.endswith("/ui/login")
        driver.find_element(By.NAME, "token").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "form.login button").click()
        wait_for(lambda: driver.current_url.endswith("/ui"), what="signed in")

        def listed() -> bool:
            driver.refresh()
            return bool(driver.find_elements(By.CSS_SELECTOR, 'tr[data-conversation="support-7"]'))

        wait_for(listed, what="support-7 in the list")
        screenshot(driver, "list")

        # A conversation, following live: a second message's turn completes on the open page.
        driver.find_element(By.CSS_SELECTOR, 'tr[data-conversation="support-7"] a').click()
        wait_for(lambda: "(scripted reply to) hello there" in driver.find_element(By.TAG_NAME, "main").text,
                 what="the first reply in the history")
        wait_for(lambda: driver.find_element(By.TAG_NAME, "body").get_attribute("data-following") == "1",
                 what="the live feed open")
        refreshed = int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed") or 0)
        api.post("/conversations/support-7/messages", json={"message_id": "m2", "content": "and the refund rules?"})
        wait_for(lambda: driver.find_element(By.TAG_NAME, "body").get_attribute("data-status") == "active",
                 what="the turn seen active")
        wait_for(lambda: "(scripted reply to) and the refund rules?" in driver.find_element(By.TAG_NAME, "main").text,
                 what="the second reply, live")
        assert int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed") or 0) > refreshed

        # A paused call: approve it from the page and see the next turn start and finish.
        api.post("/conversations/mail-1/messages", json={"message_id": "m1", "content": "mail the invoice"})
        # Opened at once: before the worker has folded the message the page waits for it live.
        driver.get(f"{url}/ui/conversations/mail-1")
        approve = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "button.approve"), what="the approve button")
        args = driver.find_element(By.CSS_SELECTOR, "pre.args").text
        assert "a@b.c" in args and "k-123" not in args and "[redacted]" in args
        screenshot(driver, "conversation-paused")
        driver.find_element(By.NAME, "note").send_keys("ok, send it")
        approve[0].click()  # type: ignore[index]
        result = wait_for(lambda: driver.find_element(By.CSS_SELECTOR, ".op-result").get_attribute("data-turn"),
                          what="the new turn id")
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, f'.turns [data-copy="{result}"]'),
                 what="the new turn in the turns table")
        wait_for(lambda: "Sent." in driver.find_element(By.TAG_NAME, "main").text, what="the approved turn's answer")
        assert sent == ["a@b.c"]
        screenshot(driver, "conversation")

        # The turn page: the waterfall of the approved turn, its tool call with a redacted secret.
        driver.find_element(By.CSS_SELECTOR, f'.turns a [data-copy="{result}"]').click()
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "table.waterfall tr.k-tool"), what="the waterfall")
        rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "table.waterfall tbody tr")]
        assert any(r.startswith("attempt 1") for r in rows) and any(r.startswith("tool send_email") for r in rows)
        driver.find_element(By.CSS_SELECTOR, "tr.k-tool summary").click()
        tool = driver.find_element(By.CSS_SELECTOR, "tr.k-tool").text
        assert "sent to a@b.c" in tool and "k-123" not in tool
        local = driver.find_elements(By.CSS_SELECTOR, "time + .local")
        assert local and local[0].text.endswith("local")
        screenshot(driver, "turn")
