// weld's chat page: /v1/chat/completions streamed, /v1/models for the name, /metrics for the figures.
// Plain JS, no build step, nothing fetched from anywhere but this server. Model output only ever
// reaches the page through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "weld.apiKey";
const SETTINGS_STORE = "weld.settings";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens"];
const METRICS_EVERY_MS = 1000;

const chat = {
  model: null,       // the served model's id, once /v1/models answered
  messages: [],      // {role, content, node}: the conversation, each with its element in #log
  controller: null,  // the AbortController of the reply in flight
  metricsTimer: null,
  lastTokens: null,  // {count, at}: weld:generation_tokens_total at the previous poll
};

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function authHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// An OpenAI-shaped error body ({"error": {"message": ...}}) as an ApiError; a 401 says what to do.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) {
    message = $("api-key").value.trim()
      ? `The server refused this API key (401): ${message}`
      : `This server needs an API key: enter it in the API key field (401): ${message}`;
  }
  return new ApiError(response.status, message);
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: authHeaders(init.headers) });
  if (!response.ok) throw await errorOf(response);
  return response;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").textContent = "";
  $("error").hidden = true;
}

// ---- the model's name ----

async function loadModel() {
  try {
    const body = await (await api("/v1/models")).json();
    chat.model = body.data[0].id;
    $("model").textContent = chat.model;
    clearError();
  } catch (err) {
    chat.model = null;
    $("model").textContent = "…";
    showError(err.message);
  }
}

// ---- server figures from /metrics (Prometheus text) ----

// {name: value} for every sample, summed over its labels (a weld server serves one model).
function parseMetrics(text) {
  const values = {};
  const sample = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)/;
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = sample.exec(line);
    if (m) values[m[1]] = (values[m[1]] || 0) + Number(m[3]);
  }
  return values;
}

function showFigures(values, now) {
  const tokens = values["weld:generation_tokens_total"];
  if (tokens !== undefined && chat.lastTokens) {
    const rate = (tokens - chat.lastTokens.count) / ((now - chat.lastTokens.at) / 1000);
    $("tok-per-s").textContent = rate.toFixed(1);
  }
  if (tokens !== undefined) chat.lastTokens = { count: tokens, at: now };
  const show = (id, v, format) => { $(id).textContent = v === undefined ? "–" : format(v); };
  show("running", values["weld:num_requests_running"], String);
  show("waiting", values["weld:num_requests_waiting"], String);
  show("kv-cache", values["weld:kv_cache_usage_perc"], (v) => `${(100 * v).toFixed(1)} %`);
}

async function pollMetrics() {
  chat.metricsTimer = null;
  try {
    const response = await api("/metrics");
    showFigures(parseMetrics(await response.text()), performance.now());
  } catch (err) {
    if (err.status === 401) return;  // loadModel shows the message; polling resumes with a new key
  }
  chat.metricsTimer = setTimeout(pollMetrics, METRICS_EVERY_MS);
}

function restartMetrics() {
  if (chat.metricsTimer !== null) clearTimeout(chat.metricsTimer);
  chat.lastTokens = null;
  pollMetrics();
}

// ---- the conversation ----

function addMessage(role, text) {
  const node = document.createElement("article");
  node.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  node.append(body, meta);
  $("log").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function sampling() {
  const fields = {};
  for (const id of ["temperature", "top_p", "max_tokens"]) {
    const raw = $(id).value.trim();
    if (raw !== "") fields[id] = Number(raw);
  }
  return fields;
}

function requestMessages() {
  const system = $("system").value.trim();
  const messages = chat.messages.map(({ role, content }) => ({ role, content }));
  return system ? [{ role: "system", content: system }, ...messages] : messages;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || chat.messages.length === 0;
  $("clear").disabled = busy;
}

// The events of a text/event-stream body: each `data:` payload, parsed, until [DONE].
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// Streams the assistant's reply to chat.messages into a new message element.
async function complete() {
  clearError();
  const node = addMessage("assistant", "");
  const text = node.querySelector(".text");
  node.dataset.state = "streaming";
  const body = {
    messages: requestMessages(), stream: true, stream_options: { include_usage: true }, ...sampling(),
  };
  if (chat.model) body.model = chat.model;
  chat.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let reply = "";
  let finish = null;
  let usage = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: chat.controller.signal,
    });
    for await (const event of serverSentEvents(response)) {
      if (event.error) throw new ApiError(event.error.code, event.error.message);
      for (const choice of event.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          reply += delta;
          text.textContent = reply;
          node.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (event.usage) usage = event.usage;
    }
    node.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      finish = "stopped";
      node.dataset.state = "stopped";
    } else {
      node.dataset.state = "error";
      showError(err.message);
    }
  }
  chat.controller = null;
  if (reply) {
    chat.messages.push({ role: "assistant", content: reply, node });
    const seconds = (performance.now() - started) / 1000;
    const parts = [];
    if (usage) {
      parts.push(`${usage.completion_tokens} tokens`, `${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    }
    if (finish) parts.push(finish);
    node.querySelector(".meta").textContent = parts.join(" · ");
  } else {
    node.remove();  // nothing came: the user's message stays, so Regenerate retries it
  }
  setBusy(false);
}

function send() {
  const content = $("prompt").value;
  if (!content.trim() || chat.controller) return;
  $("prompt").value = "";
  chat.messages.push({ role: "user", content, node: addMessage("user", content) });
  complete();
}

function regenerate() {
  if (chat.controller || chat.messages.length === 0) return;
  const last = chat.messages[chat.messages.length - 1];
  if (last.role === "assistant") {
    chat.messages.pop();
    last.node.remove();
  }
  complete();
}

function newChat() {
  if (chat.controller) return;
  chat.messages = [];
  $("log").replaceChildren();
  clearError();
  setBusy(false);
}

// ---- settings, kept in localStorage ----

function loadSettings() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {};
  } catch (_) { /* a damaged entry: start from the defaults */ }
  for (const id of SETTINGS) if (typeof saved[id] === "string") $(id).value = saved[id];
}

function saveSettings() {
  const saved = {};
  for (const id of SETTINGS) saved[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(saved));
}

function onKeyChange() {
  localStorage.setItem(KEY_STORE, $("api-key").value.trim());
  loadModel();
  restartMetrics();
}

function start() {
  loadSettings();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", newChat);
  $("api-key").addEventListener("change", onKeyChange);
  for (const id of SETTINGS) $(id).addEventListener("change", saveSettings);
  loadModel();
  pollMetrics();
}

start();
