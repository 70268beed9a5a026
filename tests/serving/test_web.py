"""The web page at "/": served with its element ids, and driven end to end in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import hamburger
from hamburger.serving.server import BackgroundServer, Service

KEY = "sk-web"
CONFIDENCE = 0.5  # on the tiny random model, low enough for steps of several tokens
PROMPT = "w3 w14 w15 w9"
IDS = ["prompt", "run", "mode", "confidence", "max-tokens", "api-key", "base-output", "ham-output", "base-figures",
       "ham-figures", "speedup"]
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "web-demo-tiny.png"


@pytest.fixture(scope="module")
def server():
    # The default confidence is not the one the test picks, so moving the slider is what makes the difference.
    service = Service(hamburger("llama", k=4), "tiny", max_batch_size=4, max_len=128, default_confidence=0.8,
                      api_key=KEY)
    with BackgroundServer(service) as srv:
        yield srv


def test_page_is_served_with_its_ids(server):
    resp = httpx.get(server.url + "/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    for element in IDS:
        assert f'id="{element}"' in resp.text, element
    assert httpx.get(server.url + "/health").json() | {"running": 0} == {
        "status": "ok", "running": 0, "waiting": 0, "default_mode": "trust", "default_confidence": 0.8,
        "api_key_required": True}


def test_streamed_chunks_carry_their_token_counts(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "stream": True,
            "confidence": CONFIDENCE, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    steps, usage = [c["hamburger"] for c in chunks if c["choices"]], chunks[-1]["usage"]
    assert sum(s["tokens"] for s in steps) == usage["completion_tokens"] and len(steps) == usage["macro_steps"]
    assert {s["prompt_tokens"] for s in steps} == {usage["prompt_tokens"]} and max(s["tokens"] for s in steps) > 1


def _browser():
    """Headless Chromium through selenium, or a skip naming what is missing and how to install it."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is missing: pip install selenium")
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH: apt-get install -y chromium chromium-driver "
                    "(`make setup` does it when run as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=options, service=service)


def _figure(driver, lane: str, key: str) -> float:
    text = driver.find_element("id", f"{lane}-{key}").text
    assert re.fullmatch(r"\d+(\.\d+)?", text), f"{lane}-{key} shows {text!r}"
    return float(text)


def test_browser_runs_both_lanes_side_by_side(server, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    driver = _browser()
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        assert driver.find_element("id", "confidence").get_attribute("value") == "0.8"  # the server's default
        assert driver.find_element("id", "mode").get_attribute("value") == "trust"  # the server's default mode
        assert driver.find_element("id", "api-key").is_displayed()
        driver.find_element("id", "api-key").send_keys(KEY)
        prompt = driver.find_element("id", "prompt")
        prompt.clear()
        prompt.send_keys(PROMPT)
        max_tokens = driver.find_element("id", "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("32")
        driver.execute_script("const s = document.getElementById('confidence'); s.value = arguments[0];"
                              "s.dispatchEvent(new Event('input'));", str(CONFIDENCE))
        driver.find_element("id", "run").click()
        wait.until(lambda d: all(d.find_element("id", f"{lane}-output").get_attribute("data-done") == "1"
                                 for lane in ("base", "ham")))
        wait.until(lambda d: d.find_element("id", "speedup").text)

        for lane in ("base", "ham"):
            output = driver.find_element("id", f"{lane}-output")
            assert output.text.strip() and not output.find_elements("class name", "error"), output.text
        assert _figure(driver, "base", "tokens-per-step") == 1.0
        assert _figure(driver, "ham", "tokens-per-step") > 1.0
        assert _figure(driver, "ham", "kv") < _figure(driver, "base", "kv")
        for lane in ("base", "ham"):
            for key in ("tokens", "steps", "speed"):
                _figure(driver, lane, key)
        # Coloured spans only in HAMburger's lane, one per step of several tokens.
        assert driver.find_elements("css selector", "#ham-output .step")
        assert not driver.find_elements("css selector", "#base-output .step")
        assert re.fullmatch(r"HAMburger: \d+\.\d\d× the base's tokens/s, 0\.\d\d× its KV entries, "
                            r"(the base's text|a text of its own)", driver.find_element("id", "speedup").text)

        # verify mode: the base's own text, one KV entry per token (as many as the base's)
        driver.execute_script("document.getElementById('mode').value = 'verify';")
        driver.find_element("id", "run").click()
        wait.until(lambda d: d.find_element("id", "speedup").text.endswith("the base's text"))
        assert _figure(driver, "ham", "kv") == _figure(driver, "base", "kv")

        driver.save_screenshot(str(tmp_path / "web-demo.png"))
        if os.environ.get("HAMBURGER_SAVE_SCREENSHOT"):  # only on request, so a test run leaves the tree clean
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(SCREENSHOT))
    finally:
        driver.quit()
