"""The chat page in a real browser: Playwright drives Debian's headless Chromium, which loads the
UI from a live server on 127.0.0.1, sends a message to a tiny model and sees the reply stream in;
then regenerates it, edits-and-resends the question and asks one of the example prompts."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright
from test_chat_model import write_tiny_checkpoint
from test_server import live_server

from lockstep.infer.chat import load_backend
from lockstep.infer.server import create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Chromium not found (Debian: apt-get install -y chromium); the browser test needs it",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, not a browser Playwright downloads (`playwright install` is never run).
    Playwright adds the headless, no-sandbox and quiet-profile switches itself."""
    # A reply waited for on a loaded 2-core machine can take longer than the default 5 s.
    expect.set_options(timeout=30_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-gpu", "--disable-quic"])
        yield browser
        browser.close()


def open_chat(browser: Browser, url: str) -> Page:
    page = browser.new_page()
    page.goto(url + "/")
    return page


def send(page: Page, text: str) -> None:
    page.locator("#input").fill(text)
    page.locator("#send").click()


def expect_reply(page: Page, text: str) -> Locator:
    """The last reply once it has streamed in: done (neither streaming nor failed) and exactly
    `text`. Its textContent property is compared as is, where to_have_text would collapse
    whitespace."""
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done")
    expect(reply.locator(".body")).to_have_js_property("textContent", text)
    return reply


@pytest.mark.slow
def test_browser_sends_a_message_and_sees_the_streamed_reply(tmp_path, browser):
    import httpx

    ckpt, tok_dir = write_tiny_checkpoint(tmp_path / "model")
    backend = load_backend(ckpt, tok_dir)
    app = create_app(backend)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:

        def expected(messages: list[dict], seed: int) -> str:
            # What the page asks for by default: its settings fields' initial values (max tokens
            # empty: the server's default, fitted to the room the context has left).
            r = http.post("/v1/chat/completions", json={"messages": messages, "seed": seed, "temperature": 0.6,
                                                        "top_k": 50})
            return r.json()["choices"][0]["message"]["content"]

        page = open_chat(browser, url)
        # The model name is fetched from the API once the page has loaded.
        expect(page.locator("#model")).to_have_js_property("textContent", backend.model_id)
        examples = page.locator(".examples button.example")
        expect(examples).to_have_count(2)  # the empty page offers prompts the model was trained on

        send(page, "Hello ☃")
        reply = expect_reply(page, expected([{"role": "user", "content": "Hello ☃"}], seed=0))
        assert int(reply.get_attribute("data-chunks")) >= 2, "the reply should arrive as several streamed events"
        assert reply.get_attribute("data-finish") in ("stop", "length")

        # Regenerate: the last reply is replaced by one sampled with the next seed.
        page.locator(".msg.assistant .regenerate").click()
        expect_reply(page, expected([{"role": "user", "content": "Hello ☃"}], seed=1))
        expect(page.locator(".msg.assistant")).to_have_count(1)
        expect(page.locator(".msg.assistant .regenerate")).to_be_visible()

        # Edit and resend: the question changes, the old reply is dropped, a new one streams in.
        page.locator(".msg.user .edit").click()
        page.locator(".msg.user textarea").fill("Bye")
        page.locator(".msg.user .resend").click()
        expect(page.locator(".msg.user .body")).to_have_js_property("textContent", "Bye")
        expect_reply(page, expected([{"role": "user", "content": "Bye"}], seed=1))
        expect(page.locator(".msg.assistant .regenerate")).to_be_visible()
        expect(page.locator(".msg.assistant")).to_have_count(1)
        expect(page.locator(".msg")).to_have_count(2)

        # A new chat shows the example prompts again, and one click asks the first of them.
        page.locator("#new").click()
        expect(examples).to_have_count(2)
        first_example = examples.first.text_content()
        examples.first.click()
        expect(page.locator(".msg.user .body")).to_have_js_property("textContent", first_example)
        expect(page.locator(".examples")).to_have_count(0)
        expect_reply(page, expected([{"role": "user", "content": first_example}], seed=0))


@pytest.mark.slow
def test_browser_chat_runs_past_the_context_with_one_notice_and_marks_a_cut_reply(browser):
    from test_chat import ScriptedEngine, byte_tokenizer, script_for
    from test_chat_context import ANSWER, QUESTION

    from lockstep.data.records import text_message
    from lockstep.infer.chat import EngineBackend

    tok = byte_tokenizer()
    engine = ScriptedEngine(script_for(tok, ANSWER))
    # As in test_chat_context: the latest question and one earlier exchange fit, two do not.
    backend = EngineBackend(engine, tok, model_id="scripted", context_tokens=256)
    with live_server(create_app(backend)) as url:
        page = open_chat(browser, url)
        done = page.locator(".msg.assistant[data-state=done]")
        for i in range(1, 5):
            send(page, QUESTION.format(i))
            expect(done).to_have_count(i)
            expect(page.locator(".msg.assistant[data-state=streaming]")).to_have_count(0)
        expect(page.locator(".notice")).to_have_text(
            ["the 2 oldest exchanges no longer fit the model's 256-token context and are left out"])
        expect(page.locator(".msg.left-out")).to_have_count(4)
        expect(page.locator(".msg.left-out button")).to_have_count(0)
        # The page sends only what the context holds: the last request asked about exchange 3 and 4.
        kept = [text_message("user", QUESTION.format(3)), text_message("assistant", ANSWER),
                text_message("user", QUESTION.format(4))]
        assert engine.calls[-1]["prompt_ids"] == tok.render_for_completion({"messages": kept})
        expect(page.locator(".msg .cut")).to_have_count(0)

        page.locator("#settings summary").click()  # as a user does: the fields sit in a closed <details>
        page.locator("#max_tokens").fill("5")
        send(page, QUESTION.format(5))
        expect(done).to_have_count(5)
        cut = expect_reply(page, ANSWER[:5])
        expect(cut).to_have_attribute("data-finish", "length")
        expect(page.locator(".msg .cut")).to_have_count(1)
        expect(page.locator(".notice")).to_have_count(1)
