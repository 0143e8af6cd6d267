"""The chat page at `/`, driven in a real headless Chromium (Debian's, through playwright).

One `weld serve --api-key` on a tiny random llama serves the module. The streamed reply the page
shows must equal the server's own non-streamed reply to the same greedy request; the page's files
load without the key, its API calls need it, and a 401 or another API error is shown in the page.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import httpx
import pytest

from tests.server.conftest import run_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's: `playwright install` cannot download here
API_KEY = "sk-page-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
PROMPT_FIRST_LINE, PROMPT_SECOND_LINE = "<b>Once upon</b>", "a time"  # markup must stay text
WAIT_MS = 60_000  # the first request compiles


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb",
                    "0.01", "--steps-per-call", "4", "--served-model-name", "tiny", "--api-key", API_KEY,
                    tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make install-test` (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make install-test` (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@contextlib.contextmanager
def open_page(browser, server, key: str | None = None):
    """A fresh browser context (empty localStorage, or holding `key`) on the chat page. Yields the
    page, its console errors and the requests it made to anywhere but the server."""
    context = browser.new_context()
    if key is not None:
        context.add_init_script(f"localStorage.setItem('weld.apiKey', {json.dumps(key)})")
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors, foreign = [], []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("request", lambda r: r.url.startswith((server.url + "/", "data:")) or foreign.append(r.url))
    try:
        page.goto(server.url + "/")
        yield page, errors, foreign
    finally:
        context.close()


def send(page, first_line: str, second_line: str):
    """Types a two-line message (Shift+Enter between the lines), sends it with Enter, returns the
    JSON body of the chat request the page made."""
    prompt = page.locator("#prompt")
    prompt.fill(first_line)
    prompt.press("End")
    prompt.press("Shift+Enter")
    prompt.press_sequentially(second_line)
    assert prompt.input_value() == f"{first_line}\n{second_line}"
    with page.expect_request("**/v1/chat/completions") as request:
        prompt.press("Enter")
    return json.loads(request.value.post_data)


def expect_text(page, selector: str, pattern):
    from playwright.sync_api import expect

    expect(page.locator(selector)).to_have_text(pattern, timeout=WAIT_MS)


def test_page_files_load_without_the_key_and_the_api_needs_it(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for path, media_type in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        response = httpx.get(server.url + path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type), path
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/static/other.js").status_code == 401  # only the page's own files are open


def test_page_streams_the_greedy_reply(browser, server):
    with open_page(browser, server, key=API_KEY) as (page, errors, foreign):
        expect_text(page, "#model", "tiny")
        expect_text(page, "#kv-cache", re.compile(r"^\d+\.\d %$"))
        expect_text(page, "#running", "0")
        page.locator("#temperature").fill("0")
        page.locator("#max_tokens").fill("16")
        # every text the reply shows while it streams
        page.evaluate("""() => {
            window.replyTexts = [];
            new MutationObserver(() => {
                const reply = document.querySelector('.message.assistant .text');
                if (reply) window.replyTexts.push(reply.textContent);
            }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
        }""")
        body = send(page, PROMPT_FIRST_LINE, PROMPT_SECOND_LINE)
        assert body["stream"] is True and body["model"] == "tiny"
        assert body["temperature"] == 0 and body["max_tokens"] == 16
        assert body["messages"] == [{"role": "user", "content": f"{PROMPT_FIRST_LINE}\n{PROMPT_SECOND_LINE}"}]

        reference = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                               json={k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        expected = reference.json()["choices"][0]["message"]["content"]
        assert expected, "the tiny model's greedy reply to this prompt is empty: pick another prompt"
        expect_text(page, ".message.assistant[data-state=done] .text", expected)
        texts = [t for t in page.evaluate("window.replyTexts") if t]
        assert len(set(texts)) >= 2 and texts[-1] == expected and all(expected.startswith(t) for t in texts), texts
        assert page.locator(".message.user .text").text_content() == f"{PROMPT_FIRST_LINE}\n{PROMPT_SECOND_LINE}"
        assert page.locator(".message b").count() == 0  # the markup was shown as text
        expect_text(page, ".message.assistant .meta", re.compile(r"^\d+ tokens · [\d.]+ tok/s · (stop|length)$"))
        expect_text(page, "#tok-per-s", re.compile(r"^\d+\.\d$"))

        page.locator("#regenerate").click()  # greedy again: the same reply, in place of the first
        expect_text(page, ".message.assistant[data-state=done] .text", expected)
        assert page.locator(".message.assistant").count() == 1 and page.locator(".message.user").count() == 1
        assert not errors, f"console errors: {errors}"

        page.locator("#max_tokens").fill(str(10 * MAX_MODEL_LEN))  # beyond the context: a 400
        page.locator("#regenerate").click()
        expect_text(page, "#error", re.compile("max_tokens|context|maximum", re.IGNORECASE))
        assert page.locator(".message.assistant").count() == 0  # the user's message stays, for a retry
        assert [e for e in errors if "status of 400" not in e] == [], errors  # Chromium logs the 400 itself
        assert not foreign, f"the page fetched from elsewhere: {foreign}"


def test_stop_aborts_the_stream(browser, server):
    with open_page(browser, server, key=API_KEY) as (page, errors, foreign):
        expect_text(page, "#model", "tiny")
        page.locator("#max_tokens").fill("")  # up to the context: long enough to stop midway
        page.evaluate("""() => {  // click Stop at the first token
            new MutationObserver((_, observer) => {
                if (document.querySelector('.message.assistant .text')?.textContent) {
                    observer.disconnect();
                    document.getElementById('stop').click();
                }
            }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
        }""")
        # A random model may sample its end-of-sequence token within a few tokens, and a reply that
        # short can arrive whole in one read, before the click: the request as sent gets ignore_eos.
        page.route("**/v1/chat/completions", lambda route: route.continue_(
            post_data=json.dumps({**json.loads(route.request.post_data), "ignore_eos": True})))
        body = send(page, "The quick brown fox", "jumps")
        assert "max_tokens" not in body
        expect_text(page, ".message.assistant[data-state=stopped] .meta", re.compile("stopped$"))
        assert page.locator("#stop").is_disabled() and not page.locator("#send").is_disabled()
        assert page.locator("#error").is_hidden()
        assert not foreign
    assert not errors, f"console errors: {errors}"


def test_without_the_key_the_page_asks_for_it(browser, server):
    with open_page(browser, server) as (page, _, foreign):
        expect_text(page, "#error", re.compile("needs an API key"))
        expect_text(page, "#model", "…")
        send(page, "Hello", "there")
        expect_text(page, "#error", re.compile("needs an API key"))
        assert page.locator(".message.assistant").count() == 0

        page.locator("#api-key").fill("sk-wrong")
        page.locator("#api-key").press("Tab")  # `change`: saved, then the model is asked for again
        expect_text(page, "#error", re.compile("refused this API key"))

        page.locator("#api-key").fill(API_KEY)
        page.locator("#api-key").press("Tab")
        expect_text(page, "#model", "tiny")
        assert page.locator("#error").is_hidden()
        page.locator("#max_tokens").fill("4")
        page.locator("#regenerate").click()  # the message the 401 refused, sent again with the key
        expect_text(page, ".message.assistant[data-state=done] .meta", re.compile("tokens"))

        page.reload()  # the key is kept in localStorage
        expect_text(page, "#model", "tiny")
        assert page.locator("#api-key").input_value() == API_KEY
        assert not foreign
