"""The chat page at GET / in a real headless browser (Debian's chromium, driven by selenium):
a prompt streams a reply whose tokens are shaded by provenance, the figures fill in, and the
stop button aborts the request (its blocks come back). On failure the page's screenshot is
saved beside the test's temporary files and its path is in the message.

Needs `chromium` and `chromedriver` on PATH (Debian: `apt-get install chromium
chromium-driver`; .ci/run installs them), and selenium (the dev extra)."""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest

from tests.server.conftest import wait_until

BROWSER, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (BROWSER and DRIVER),
                                reason="no chromium/chromedriver on PATH (apt-get install chromium chromium-driver)")


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@contextlib.contextmanager
def screenshot_on_failure(driver, path):
    """On any failure inside, save the page as it is and name the file in the message."""
    try:
        yield
    except Exception as e:
        driver.save_screenshot(str(path))
        raise AssertionError(f"{e} (screenshot: {path})") from e


def ask(driver, prompt: str, max_tokens: int) -> None:
    """Type a prompt with this reply length and press send."""
    driver.find_element("id", "max-tokens").clear()
    driver.find_element("id", "max-tokens").send_keys(str(max_tokens))
    driver.find_element("id", "prompt").send_keys(prompt)
    driver.find_element("id", "send").click()


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def test_a_prompt_streams_a_shaded_reply_and_the_figures_update(server, browser, tmp_path):
    browser.get(server.base + "/")
    with screenshot_on_failure(browser, tmp_path / "chat_page.png"):
        assert browser.title == "specserve"
        ask(browser, "Once upon a time", max_tokens=60)
        assert wait_until(lambda: text(browser, "status").startswith("done"), timeout=60), text(browser, "status")
        spans = browser.find_elements("css selector", "#log .assistant span")
        assert spans, "no streamed text appeared"
        kinds = {s.get_attribute("class") for s in spans}
        assert kinds == {"draft", "target"}, f"expected both accepted draft and target tokens, got {kinds}"
        assert int(text(browser, "ntokens")) == 60
        assert float(text(browser, "tps")) > 0
        assert 1.0 <= float(text(browser, "tpp")) <= 4.0   # static depth 3: at most 4 tokens a pass
        # The server figures poll /stats once a second.
        assert wait_until(lambda: text(browser, "plan") == "static, depth 3", timeout=5), text(browser, "plan")
        assert wait_until(lambda: len(browser.find_elements("css selector", "#acceptance .bar")) == 3, timeout=5)
        assert float(text(browser, "server-tpp")) > 1.0


def test_stop_aborts_the_request_and_frees_its_blocks(server, browser, tmp_path):
    engine = server.engine
    real_step = engine.step

    def slow_step():   # about 20 steps a second: a 200-token reply takes seconds, time to press stop
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step
    try:
        browser.get(server.base + "/")
        with screenshot_on_failure(browser, tmp_path / "chat_page_stop.png"):
            ask(browser, "Tell me a long story", max_tokens=200)
            assert wait_until(lambda: browser.find_elements("css selector", "#log .assistant span"), timeout=30)
            assert wait_until(lambda: engine.scheduler.running, timeout=10)
            browser.find_element("id", "stop").click()
            assert wait_until(lambda: text(browser, "status") == "stopped", timeout=10), text(browser, "status")
            assert wait_until(lambda: not engine.has_unfinished_requests(), timeout=10), "the request was not aborted"
            assert int(text(browser, "ntokens")) < 200
            engine.pool.check_all_free()
    finally:
        engine.step = real_step


def test_the_page_asks_for_the_api_key_of_a_server_that_has_one(server_target, browser, tmp_path):
    from specserve.engine import LLMEngine
    from tests.server.conftest import ServerThread, engine_config

    cfg = engine_config(server_target, "none", api_key="s3cret")
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        browser.get(srv.base + "/")
        with screenshot_on_failure(browser, tmp_path / "chat_page_key.png"):
            ask(browser, "Once upon a time", max_tokens=8)
            assert wait_until(lambda: _alert(browser) is not None, timeout=10), "the page did not ask for the key"
            alert = _alert(browser)
            alert.send_keys("s3cret")
            alert.accept()
            assert wait_until(lambda: text(browser, "status").startswith("done"), timeout=30), text(browser, "status")
            assert int(text(browser, "ntokens")) == 8
            # Kept for the tab: the next message asks nothing.
            browser.find_element("id", "prompt").send_keys("And then")
            browser.find_element("id", "send").click()
            assert wait_until(lambda: text(browser, "status") == "streaming…" or text(browser, "status").startswith(
                "done"), timeout=10)
            assert _alert(browser) is None
            assert wait_until(lambda: text(browser, "status").startswith("done"), timeout=30), text(browser, "status")
    finally:
        srv.stop()


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
        alert.text   # raises when there is none
        return alert
    except NoAlertPresentException:
        return None


def test_a_page_of_an_allowed_origin_streams_from_the_api_and_others_cannot(server_target, browser, tmp_path):
    """CORS in a real browser: a page served from another port (another origin) fetches a
    stream with an API key (a preflighted request); the same page on an origin not allowed
    gets a network error."""
    import functools
    import http.server
    import threading

    from specserve.engine import LLMEngine
    from tests.server.conftest import ServerThread, engine_config

    (tmp_path / "app.html").write_text("""<pre id="out">waiting</pre><script>
      fetch(location.hash.slice(1) + "/v1/completions", {method: "POST",
        headers: {"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
        body: JSON.stringify({prompt: "Once upon a time", max_tokens: 5, temperature: 0, stream: true})})
      .then(r => r.text()).then(t => { document.getElementById("out").textContent = t; })
      .catch(e => { document.getElementById("out").textContent = "failed: " + e; });
    </script>""")
    pages = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    allowed = f"http://127.0.0.1:{pages.server_address[1]}"
    cfg = engine_config(server_target, "none", api_key="s3cret", allowed_origins=[allowed])
    srv = ServerThread(LLMEngine(cfg, progress=False), cfg)
    try:
        with screenshot_on_failure(browser, tmp_path / "cors.png"):
            for origin, works in ((allowed, True), (allowed.replace("127.0.0.1", "localhost"), False)):
                browser.get(f"{origin}/app.html#{srv.base}")
                assert wait_until(lambda: text(browser, "out") != "waiting", timeout=20)
                out = text(browser, "out")
                assert out.rstrip().endswith("data: [DONE]") if works else out.startswith("failed"), (origin, out)
    finally:
        srv.stop()
        pages.shutdown()
