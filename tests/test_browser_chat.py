"""The chat page in a real browser: headless Chromium, driven over the DevTools protocol on a pipe,
loads the UI from a live server on 127.0.0.1, sends a message to a tiny model and sees the reply
stream in; then regenerates it and edits-and-resends the question."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_chat_model import write_tiny_checkpoint
from test_server import live_server

from lockstep.infer.chat import load_backend
from lockstep.infer.server import create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Chromium not found (Debian: apt-get install -y chromium); the browser test needs it",
)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio"]


class PipeBrowser:
    """Chromium with `--remote-debugging-pipe`: DevTools messages are NUL-terminated JSON, written
    to the browser's fd 3 and read from its fd 4. No websocket client and no open port needed."""

    def __init__(self, user_data_dir: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # bash (dash takes single-digit fds only) moves the pipe ends onto fds 3 and 4, where
        # Chromium looks for them.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe",
             "about:blank"],
            pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0

    def call(
        self, method: str, params: dict | None = None, *, session: str | None = None, timeout_s: float = 15
    ) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"no DevTools reply to {method} within {timeout_s} s")
            ready, _, _ = select.select([self._from_browser], [], [], left_s)
            if ready:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (code {self.proc.poll()}) during {method}")
                self._buffer += chunk

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_browser)
        os.close(self._from_browser)


class Page:
    def __init__(self, browser: PipeBrowser, url: str):
        self.browser = browser
        target = browser.call("Target.createTarget", {"url": url})["targetId"]
        self.session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def eval(self, expression: str):
        result = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   session=self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"page never satisfied: {expression}")


LAST_ASSISTANT = """(() => {
  const all = document.querySelectorAll('.msg.assistant');
  if (!all.length) return null;
  const el = all[all.length - 1];
  if (el.dataset.state === 'streaming') return null;
  return {state: el.dataset.state, chunks: Number(el.dataset.chunks || 0), finish: el.dataset.finish,
          text: el.querySelector('.body').textContent, count: all.length};
})()"""


@pytest.mark.slow
def test_browser_sends_a_message_and_sees_the_streamed_reply(tmp_path):
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

        browser = PipeBrowser(tmp_path / "profile")
        try:
            page = Page(browser, url + "/")
            # The new tab starts on about:blank; wait for our page and its model name fetched from the API.
            page.wait_for("location.protocol === 'http:' && document.readyState === 'complete' && "
                          "(document.getElementById('model')?.textContent || '').length > 0")
            assert page.eval("document.getElementById('model').textContent") == backend.model_id
            examples = "[...document.querySelectorAll('.examples button.example')].map((b) => b.textContent)"
            assert len(page.eval(examples)) == 2  # the empty page offers prompts the model was trained on

            page.eval("document.getElementById('input').value = 'Hello ☃'; document.getElementById('send').click(); 1")
            reply = page.wait_for(LAST_ASSISTANT)
            assert reply["state"] == "done", reply
            first = expected([{"role": "user", "content": "Hello ☃"}], seed=0)
            assert reply["text"] == first
            assert reply["chunks"] >= 2, "the reply should arrive as several streamed events"
            assert reply["finish"] in ("stop", "length")

            # Regenerate: the last reply is replaced by one sampled with the next seed.
            page.eval("document.querySelector('.msg.assistant .regenerate').click(); 1")
            page.wait_for("document.querySelector('.msg.assistant[data-state=streaming]') === null && "
                          "document.querySelectorAll('.msg.assistant').length === 1 && "
                          "!!document.querySelector('.msg.assistant .regenerate')")
            again = page.eval(LAST_ASSISTANT)
            assert again["text"] == expected([{"role": "user", "content": "Hello ☃"}], seed=1)

            # Edit and resend: the question changes, the old reply is dropped, a new one streams in.
            page.eval("document.querySelector('.msg.user .edit').click(); 1")
            page.eval("document.querySelector('.msg.user textarea').value = 'Bye'; "
                      "document.querySelector('.msg.user .resend').click(); 1")
            page.wait_for("document.querySelector('.msg.user .body') && "
                          "document.querySelector('.msg.user .body').textContent === 'Bye' && "
                          "!!document.querySelector('.msg.assistant .regenerate')")
            edited = page.eval(LAST_ASSISTANT)
            assert edited["count"] == 1 and page.eval("document.querySelectorAll('.msg').length") == 2
            assert edited["text"] == expected([{"role": "user", "content": "Bye"}], seed=1)

            # A new chat shows the example prompts again, and one click asks the first of them.
            page.eval("document.getElementById('new').click(); 1")
            first_example = page.eval(examples)[0]
            page.eval("document.querySelector('.examples button.example').click(); 1")
            asked = page.wait_for(LAST_ASSISTANT)
            assert page.eval("document.querySelector('.msg.user .body').textContent") == first_example
            assert page.eval("document.querySelectorAll('.examples').length") == 0
            assert asked["text"] == expected([{"role": "user", "content": first_example}], seed=0)
        finally:
            browser.close()


@pytest.mark.slow
def test_browser_chat_runs_past_the_context_with_one_notice_and_marks_a_cut_reply(tmp_path):
    from test_chat import ScriptedEngine, byte_tokenizer, script_for
    from test_chat_context import ANSWER, QUESTION

    from lockstep.data.records import text_message
    from lockstep.infer.chat import EngineBackend

    tok = byte_tokenizer()
    engine = ScriptedEngine(script_for(tok, ANSWER))
    # As in test_chat_context: the latest question and one earlier exchange fit, two do not.
    backend = EngineBackend(engine, tok, model_id="scripted", context_tokens=256)
    count_done = ("document.querySelectorAll('.msg.assistant[data-state=done]').length === {} && "
                  "!document.querySelector('.msg.assistant[data-state=streaming]')")
    with live_server(create_app(backend)) as url:
        browser = PipeBrowser(tmp_path / "profile")
        try:
            page = Page(browser, url + "/")
            page.wait_for("location.protocol === 'http:' && document.readyState === 'complete'")
            for i in range(1, 5):
                page.eval(f"document.getElementById('input').value = {json.dumps(QUESTION.format(i))}; "
                          "document.getElementById('send').click(); 1")
                page.wait_for(count_done.format(i))
            notices = page.eval("[...document.querySelectorAll('.notice')].map((n) => n.textContent)")
            assert notices == ["the 2 oldest exchanges no longer fit the model's 256-token context and are left out"]
            assert page.eval("document.querySelectorAll('.msg.left-out').length") == 4
            assert page.eval("document.querySelectorAll('.msg.left-out button').length") == 0
            # The page sends only what the context holds: the last request asked about exchange 3 and 4.
            kept = [text_message("user", QUESTION.format(3)), text_message("assistant", ANSWER),
                    text_message("user", QUESTION.format(4))]
            assert engine.calls[-1]["prompt_ids"] == tok.render_for_completion({"messages": kept})
            assert page.eval("document.querySelectorAll('.msg .cut').length") == 0

            page.eval("document.getElementById('max_tokens').value = '5'; "
                      f"document.getElementById('input').value = {json.dumps(QUESTION.format(5))}; "
                      "document.getElementById('send').click(); 1")
            page.wait_for(count_done.format(5))
            cut = page.eval(LAST_ASSISTANT)
            assert cut["finish"] == "length" and cut["text"] == ANSWER[:5]
            assert page.eval("document.querySelectorAll('.msg .cut').length") == 1
            assert page.eval("document.querySelectorAll('.notice').length") == 1
        finally:
            browser.close()
