// lockstep chat page: keeps the conversation in the page, streams replies from
// /v1/chat/completions (server-sent events) and renders text only (never HTML from the model).
"use strict";

const state = {
  messages: [],       // [{role, content, finish?}]; role and content are sent to the API
  leftOut: 0,         // leading messages the model's context no longer holds: shown, not sent
  contextTokens: 0,   // the model's context, from the x-lockstep-context-tokens header
  controller: null,   // AbortController of the reply being streamed
  regenerations: 0,   // each regenerate asks with a new seed, so it can differ
};

const $ = (id) => document.getElementById(id);

function setStatus(text) { $("status").textContent = text || ""; }

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.querySelectorAll(".msg .actions button").forEach((b) => { b.disabled = busy; });
}

function settings() {
  const number = (id, fallback) => {
    const v = Number($(id).value);
    return Number.isFinite(v) && $(id).value !== "" ? v : fallback;
  };
  const out = {
    temperature: number("temperature", 0.6),
    top_k: Math.round(number("top_k", 50)),
  };
  // Left empty, the server picks a reply length that fits the room the context has left; a
  // number asked for explicitly is refused (with the room left) when it does not fit.
  const maxTokens = number("max_tokens", null);
  if (maxTokens !== null) out.max_tokens = Math.round(maxTokens);
  return out;
}

// Re-render the whole list from state: the conversation is short and this keeps the
// edit/regenerate buttons consistent with what will be sent.
function render() {
  const box = $("messages");
  box.textContent = "";
  if (!state.messages.length) box.appendChild(examplesElement());
  state.messages.forEach((m, i) => {
    box.appendChild(messageElement(m, i));
    if (i === state.leftOut - 1) box.appendChild(noticeElement(state.leftOut / 2));
  });
  box.scrollTop = box.scrollHeight;
}

// The one notice of what the context no longer holds, under the exchanges left out. Worded as
// lockstep.infer.context.dropped_notice words it for the terminal chat.
function noticeElement(exchanges) {
  const el = document.createElement("div");
  el.className = "notice muted";
  const context = state.contextTokens ? ` ${state.contextTokens}-token` : "";
  el.textContent = exchanges === 1
    ? `the oldest exchange no longer fits the model's${context} context and is left out`
    : `the ${exchanges} oldest exchanges no longer fit the model's${context} context and are left out`;
  return el;
}

// What the empty page offers: prompts phrased as the synthetic chats every preset trains on
// (identity, letter counting with the calculator), which even the 20-minute tiny model answers.
const EXAMPLES = ["Who are you?", "How many times does the letter 'r' appear in 'strawberry'?"];

function examplesElement() {
  const el = document.createElement("div");
  el.className = "examples muted";
  el.appendChild(document.createTextNode("A small model answers best what it was trained on. Try: "));
  EXAMPLES.forEach((text) => el.appendChild(button(text, "example", () => send(text))));
  return el;
}

function messageElement(m, index) {
  const el = document.createElement("div");
  el.className = "msg " + m.role + (index < state.leftOut ? " left-out" : "");
  el.dataset.index = String(index);
  el.dataset.state = "done";
  if (m.finish) el.dataset.finish = m.finish;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = m.content;
  el.appendChild(body);
  if (m.finish === "length") {
    const cut = document.createElement("div");
    cut.className = "cut";
    cut.textContent = "cut off: the reply reached its token limit (max tokens, or the room the context had left)";
    el.appendChild(cut);
  }
  const actions = document.createElement("div");
  actions.className = "actions";
  // A message left out of the context has no buttons: editing it could not change what the model is asked.
  if (index < state.leftOut) {
    el.appendChild(actions);
    return el;
  }
  if (m.role === "user") {
    actions.appendChild(button("edit", "edit", () => startEdit(el, index)));
  } else if (index === state.messages.length - 1) {
    actions.appendChild(button("regenerate", "regenerate", regenerate));
  }
  el.appendChild(actions);
  return el;
}

function button(label, cls, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function startEdit(el, index) {
  if (state.controller) return;
  const body = el.querySelector(".body");
  const editor = document.createElement("textarea");
  editor.value = state.messages[index].content;
  editor.rows = Math.max(2, editor.value.split("\n").length);
  body.replaceWith(editor);
  const actions = el.querySelector(".actions");
  actions.textContent = "";
  actions.appendChild(button("send", "resend", () => {
    const text = editor.value.trim();
    if (!text) return;
    // Everything after the edited message is dropped: the reply is asked for again.
    state.messages = state.messages.slice(0, index);
    state.messages.push({ role: "user", content: text });
    render();
    ask();
  }));
  actions.appendChild(button("cancel", "cancel", render));
  editor.focus();
}

function regenerate() {
  if (state.controller) return;
  const last = state.messages[state.messages.length - 1];
  if (!last || last.role !== "assistant") return;
  state.messages.pop();
  state.regenerations += 1;
  render();
  ask();
}

function send(text) {
  if (state.controller || !text.trim()) return;
  // A failed turn leaves a user message with no reply; replace it rather than send two in a row.
  if (state.messages.length && state.messages[state.messages.length - 1].role === "user") {
    state.messages.pop();
  }
  state.messages.push({ role: "user", content: text });
  $("input").value = "";
  render();
  ask();
}

// Splits a server-sent event stream into the data of each event. Bytes are decoded with a
// streaming TextDecoder, so a character split across network chunks is joined before use.
function sseParser(onData) {
  const decoder = new TextDecoder("utf-8");
  let buffer = "";
  function drain(final) {
    buffer = buffer.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) !== -1) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length) onData(data.join("\n"));
    }
    if (final && buffer.trim()) { onData(buffer.replace(/^data: ?/, "")); buffer = ""; }
  }
  return {
    push(bytes) { buffer += decoder.decode(bytes, { stream: true }); drain(false); },
    end() { buffer += decoder.decode(); drain(true); },
  };
}

async function ask() {
  const assistant = { role: "assistant", content: "" };
  const el = messageElement(assistant, state.messages.length);
  el.dataset.state = "streaming";
  el.dataset.chunks = "0";
  el.querySelector(".actions").textContent = "";
  $("messages").appendChild(el);
  const body = el.querySelector(".body");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  setStatus("");
  let failed = null;
  let finish = null;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        messages: state.messages.slice(state.leftOut).map((m) => ({ role: m.role, content: m.content })),
        stream: true,
        seed: state.regenerations,
        ...settings(),
      }),
      signal: controller.signal,
    });
    if (!res.ok) {
      let message = res.status + " " + res.statusText;
      try { message = (await res.json()).error.message || message; } catch (e) { /* keep the status line */ }
      throw new Error(message);
    }
    // The server leaves out the oldest exchanges that no longer fit; so does the page from now on,
    // showing them dimmed above one notice.
    const dropped = Number(res.headers.get("x-lockstep-dropped-turns") || 0);
    if (dropped > 0) {
      state.leftOut += 2 * dropped;
      state.contextTokens = Number(res.headers.get("x-lockstep-context-tokens") || 0);
      render();
      $("messages").appendChild(el);
    }
    const parser = sseParser((data) => {
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) { failed = event.error.message; return; }
      const choice = event.choices && event.choices[0];
      if (!choice) return;
      if (choice.delta && choice.delta.content) {
        assistant.content += choice.delta.content;
        body.textContent = assistant.content;
        el.dataset.chunks = String(Number(el.dataset.chunks) + 1);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    });
    const reader = res.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      parser.push(value);
    }
    parser.end();
  } catch (e) {
    failed = e.name === "AbortError" ? null : String(e.message || e);
  } finally {
    state.controller = null;
  }
  if (failed) {
    el.classList.add("error");
    body.textContent = (assistant.content ? assistant.content + "\n\n" : "") + "error: " + failed;
    el.dataset.state = "error";
    setStatus("the reply failed; edit your message or send again");
    setBusy(false);
    return;
  }
  assistant.finish = finish || "stopped";
  state.messages.push(assistant);
  render();
  const last = $("messages").lastElementChild;
  last.dataset.chunks = el.dataset.chunks;
  setStatus(finish === "length" ? "the reply was cut off at its token limit" : "");
  setBusy(false);
}

async function showModel() {
  try {
    const res = await fetch("/v1/models");
    const models = await res.json();
    $("model").textContent = models.data.map((m) => m.id).join(", ");
  } catch (e) {
    $("model").textContent = "(model list unavailable)";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send($("input").value); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send($("input").value); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    state.leftOut = 0;
    state.regenerations = 0;
    render();
    setStatus("");
  });
  render();
  showModel();
});
