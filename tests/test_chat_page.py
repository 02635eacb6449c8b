"""The chat page (llmscratch/deployment/chat.html) in a real browser: Debian's Chromium, headless, driven by Selenium,
against a server under test on loopback (tests/serving.py).

What the page must do, seen from outside: show the model's name, stream a reply into the conversation as it comes,
send the whole conversation each turn, stop a reply, start a new chat, send the API key, and show the server's error
messages. Every wait is bounded (WebDriverWait, at most 60 s); the browser quits before the server stops.

The server under test is the real one (``llmscratch.deployment.server.create_app`` over the bundled model, greedy by
the page's default temperature 0), so the page's final text is compared with the server's own non-streamed answer.
Set CHAT_PAGE_SCREENSHOT=/some/file.png to keep a screenshot of the page with a conversation in it.
"""

import contextlib
import json
import os
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from serving import running_server

from llmscratch.cli import DEFAULT_MODELS
from llmscratch.deployment.engine import Engine
from llmscratch.deployment.server import create_app
from llmscratch.model.weights import load_model_and_tokenizer

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # a browser and a model: about 10 s a test

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
API_KEY = "sk-test-0123456789"
WAIT_S = 60  # the longest any single wait may take


# ----------------------------------------------------------------------------------------------------------------
# The server under test


def make_app(api_key: str | None = None):
    """The real server over the bundled model; with ``api_key``, it refuses requests that do not bring it."""
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    engine = Engine(model.float().eval(), tokenizer, max_slots=4)
    return create_app(engine, model_name="base", api_keys=[api_key] if api_key else ())


class Recorder:
    """Wraps any ASGI app and keeps each chat-completion request's JSON body and headers: what the page sent."""

    def __init__(self, app):
        self.app = app
        self.requests: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        chunks = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.requests.append({"headers": headers, "body": json.loads(b"".join(chunks) or b"null")})
            return message

        await self.app(scope, recording_receive, send)

    def from_page(self) -> list[dict]:
        """The streamed requests (the page's; the test's own reference requests are not streamed)."""
        return [r for r in self.requests if isinstance(r["body"], dict) and r["body"].get("stream")]


def reference_reply(url: str, sent: dict, headers: dict | None = None) -> str:
    """What the server answers, not streamed, to the request the page sent: the text the page must end up showing
    (deterministic at temperature 0)."""
    response = httpx.post(f"{url}/v1/chat/completions", json={**sent, "stream": False}, headers=headers, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# ----------------------------------------------------------------------------------------------------------------
# The browser


@contextlib.contextmanager
def chromium():
    """Headless Chromium under chromedriver; quits however the block ends."""
    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), (
        f"these tests need Chromium and chromedriver ({CHROMIUM}, {CHROMEDRIVER}; Debian: apt install chromium "
        "chromium-driver; or set CHROMIUM and CHROMEDRIVER)")
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(WAIT_S)
        driver.set_script_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, message: str, timeout: float = WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message)


def by_id(driver, element_id: str):
    return driver.find_element(By.ID, element_id)


def content(element) -> str:
    """An element's text exactly (textContent: no layout, no CSS labels, whitespace as sent)."""
    return element.get_attribute("textContent")


def turns(driver, role: str) -> list:
    return driver.find_elements(By.CSS_SELECTOR, f"#conversation .turn.{role}")


def watch_lengths(driver) -> None:
    """Record, in the page, the length of the streaming reply's text at every change of the conversation. A
    MutationObserver sees every change, however fast; polling over WebDriver (tens of ms a round trip) could miss a
    quick stream entirely. Read back with ``driver.execute_script("return window.lengths")``."""
    driver.execute_script("""
        window.lengths = [];
        if (!window.lengthObserver) {
            window.lengthObserver = new MutationObserver(() => {
                const turn = document.querySelector("#conversation .turn.assistant.streaming");
                if (turn) window.lengths.push(turn.textContent.length);
            });
            window.lengthObserver.observe(document.getElementById("conversation"),
                                          {subtree: true, childList: true, characterData: true, attributes: true});
        }""")


def wait_for_reply(driver, count: int) -> str:
    """Wait for the reply just asked for (the ``count``-th assistant turn) to end; its text. Called right after
    sending: Send is disabled, and the streaming turn added, before the click or key press returns."""
    wait(driver, lambda d: by_id(d, "send").is_enabled()
         and not d.find_elements(By.CSS_SELECTOR, "#conversation .turn.streaming"), f"reply {count} never ended")
    replies = turns(driver, "assistant")
    assert len(replies) >= count, f"no reply {count}; the page says {content(by_id(driver, 'status'))!r}"
    return content(replies[count - 1])


def wait_for_model(driver, model: str) -> None:
    wait(driver, lambda d: content(by_id(d, "model-name")) == model, f"the page never showed the model {model!r}")


# ----------------------------------------------------------------------------------------------------------------
# The tests


@pytest.mark.timeout(180)
def test_the_page_streams_replies_and_sends_the_whole_conversation():
    recorder = Recorder(make_app())
    with running_server(recorder) as url, chromium() as driver:
        model = httpx.get(f"{url}/v1/models", timeout=WAIT_S).json()["data"][0]["id"]
        driver.get(url + "/")
        wait_for_model(driver, model)
        assert by_id(driver, "max-tokens").get_attribute("value") == ""  # none sent: all the room the context leaves
        assert by_id(driver, "temperature").get_attribute("value") == "0"
        assert not by_id(driver, "stop").is_enabled()
        # Short replies: the conversation must fit a small model's context (the bundled one's is 256 tokens).
        max_tokens = by_id(driver, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("32")

        # A first message, sent with the button: the reply streams in, then matches the server's own answer.
        first = "Hello there, how are you today?"
        watch_lengths(driver)
        by_id(driver, "message").send_keys(first)
        by_id(driver, "send").click()
        reply = wait_for_reply(driver, 1)
        lengths = driver.execute_script("return window.lengths")
        assert len({n for n in lengths if n > 0}) >= 2, f"the reply did not stream (lengths seen: {lengths})"
        sent = recorder.from_page()[-1]["body"]
        assert sent["messages"] == [{"role": "user", "content": first}]
        assert (sent["model"], sent["stream"], sent["max_tokens"], sent["temperature"]) == (model, True, 32, 0)
        assert reply == reference_reply(url, sent)
        assert [content(t) for t in turns(driver, "user")] == [first]
        assert content(by_id(driver, "status")) == ""

        # A second, with Enter, two lines (Shift+Enter), markup and non-ASCII text: the whole conversation goes.
        second = "And <b>this</b> & café ☕?\nSecond line."
        line_one, line_two = second.split("\n")
        box = by_id(driver, "message")
        (ActionChains(driver).click(box).send_keys(line_one).key_down(Keys.SHIFT).send_keys(Keys.ENTER)
         .key_up(Keys.SHIFT).send_keys(line_two).send_keys(Keys.ENTER).perform())
        second_reply = wait_for_reply(driver, 2)
        sent = recorder.from_page()[-1]["body"]
        assert sent["messages"] == [{"role": "user", "content": first}, {"role": "assistant", "content": reply},
                                    {"role": "user", "content": second}]
        assert second_reply == reference_reply(url, sent)
        # Text, never markup: no turn holds an element (a <b> from the user or the model stays characters).
        assert not driver.find_elements(By.CSS_SELECTOR, "#conversation .turn *")
        assert box.get_attribute("value") == ""

        # New chat: an empty page, and the next request carries only the new message.
        by_id(driver, "new-chat").click()
        wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, "#conversation .turn"), "New chat left turns")
        by_id(driver, "message").send_keys("Fresh start" + Keys.ENTER)
        wait_for_reply(driver, 1)
        assert recorder.from_page()[-1]["body"]["messages"] == [{"role": "user", "content": "Fresh start"}]

        # Stop, in a new chat with max tokens left blank (none sent: the reply may fill the context), so a long
        # reply: it ends where it was, is kept, and the page is ready.
        by_id(driver, "new-chat").click()
        max_tokens.clear()
        by_id(driver, "message").send_keys("Tell me about the sea.")
        by_id(driver, "send").click()
        wait(driver, lambda d: (turns(d, "assistant") and content(turns(d, "assistant")[0]) != "")
             or not by_id(d, "stop").is_enabled(), "the reply never began")  # or already ended
        by_id(driver, "stop").click()
        stopped = wait_for_reply(driver, 1)
        assert not by_id(driver, "stop").is_enabled()
        assert "max_tokens" not in recorder.from_page()[-1]["body"]
        full = reference_reply(url, recorder.from_page()[-1]["body"])
        assert 0 < len(stopped) < len(full) and full.startswith(stopped), (stopped, full)
        assert content(by_id(driver, "status")) == "Stopped."
        if os.environ.get("CHAT_PAGE_SCREENSHOT"):
            driver.save_screenshot(os.environ["CHAT_PAGE_SCREENSHOT"])


@pytest.mark.timeout(180)
def test_errors_show_in_the_page_and_the_api_key_is_sent_and_kept():
    recorder = Recorder(make_app(api_key=API_KEY))
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with running_server(recorder) as url, chromium() as driver:
        model = httpx.get(f"{url}/v1/models", headers=auth, timeout=WAIT_S).json()["data"][0]["id"]
        # Without the key, the server refuses: the model list (as OpenAI's does), or else the chat request.
        refusal = httpx.get(f"{url}/v1/models", timeout=WAIT_S)
        if refusal.status_code != 401:
            refusal = httpx.post(f"{url}/v1/chat/completions", timeout=WAIT_S,
                                 json={"model": model, "messages": [{"role": "user", "content": "Hi"}]})
        assert refusal.status_code == 401, refusal.text
        missing_key = refusal.json()["error"]["message"]

        driver.get(url + "/")
        by_id(driver, "message").send_keys("Hi" + Keys.ENTER)
        status = by_id(driver, "status")
        wait(driver, lambda d: content(status) == missing_key and "error" in status.get_attribute("class"),
             "the page did not show the server's 401 message")
        assert not driver.find_elements(By.CSS_SELECTOR, "#conversation .turn.streaming")
        assert by_id(driver, "send").is_enabled()
        assert by_id(driver, "message").get_attribute("value") == "Hi"  # given back, to be sent again

        # The key, typed in (it is kept when the field changes): the model list now answers.
        by_id(driver, "api-key").send_keys(API_KEY + Keys.TAB)
        wait_for_model(driver, model)
        assert content(status) == ""

        # A request the server refuses (400, or 422): its message shows, nothing stays in the conversation.
        temperature = by_id(driver, "temperature")
        temperature.clear()
        temperature.send_keys("5")
        by_id(driver, "send").click()
        wait(driver, lambda d: len(recorder.from_page()) == 1 and "error" in status.get_attribute("class"),
             "the page did not show an error for temperature 5")
        sent = recorder.from_page()[-1]["body"]
        assert sent["temperature"] == 5
        refusal = httpx.post(f"{url}/v1/chat/completions", json=sent, headers=auth, timeout=WAIT_S)
        assert refusal.status_code in (400, 422), refusal.text
        assert content(status) == refusal.json()["error"]["message"]
        assert not driver.find_elements(By.CSS_SELECTOR, "#conversation .turn")

        # Greedy again: the reply comes, and the page sent the key as a bearer token.
        temperature.clear()
        temperature.send_keys("0")
        by_id(driver, "send").click()
        reply = wait_for_reply(driver, 1)
        request = recorder.from_page()[-1]
        assert request["headers"]["authorization"] == f"Bearer {API_KEY}"
        assert request["body"]["messages"] == [{"role": "user", "content": "Hi"}]
        assert reply == reference_reply(url, request["body"], auth)
        assert content(status) == ""

        # The key outlives a reload (sessionStorage: this tab only), and the page loads the model with it.
        driver.refresh()
        wait_for_model(driver, model)
        assert by_id(driver, "api-key").get_attribute("value") == API_KEY
        assert driver.execute_script("return window.localStorage.length") == 0  # never written to disk


@pytest.mark.timeout(180)
def test_the_pages_event_parser_takes_a_stream_cut_anywhere():
    """The page's own parser (sseParser) fed a stream cut in two at every character: the same events each time,
    whatever the line ends (\n; \r\n as sse-starlette writes; a lone \r), with comments and other fields ignored."""
    stream = (': a comment\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata: two\r\ndata:lines\r\n\r\n'
              'id: 7\rdata: café ☕\r\rdata: [DONE]\n\n')
    expected = ['{"a": 1}', "two\nlines", "café ☕", "[DONE]"]
    with running_server(make_app()) as url, chromium() as driver:
        driver.get(url + "/")
        results = driver.execute_script("""
            const stream = arguments[0], results = [];
            for (let cut = 0; cut <= stream.length; cut++) {
                const seen = [], parser = sseParser((data) => seen.push(data));
                parser.push(stream.slice(0, cut));
                parser.push(stream.slice(cut));
                parser.end();
                results.push(seen);
            }
            return results;""", stream)
    assert len(results) == len(stream) + 1
    assert [cut for cut, events in enumerate(results) if events != expected] == []
