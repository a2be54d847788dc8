"use strict";
// chatstream's page: create a job, read its events with EventSource, resume after a reload.
// sessionStorage keeps {key, model, prompt, job, events, last, text, refusal, finished,
// status}: `last` is the id of the last event applied to `text` and `refusal` (the model's
// refusal, streamed in fragments like the text), so a reload resumes right after it.
const STORE = "chatstream";
const $ = (id) => document.getElementById(id);
let state = load();
let source = null;

function load() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE)) || {};
  } catch (error) {
    return {};
  }
}

function save() {
  sessionStorage.setItem(STORE, JSON.stringify(state));
}

function takeHash() {
  // #key=...&model=... hands the page its settings without sending them to any server
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("key")) state.key = params.get("key");
  if (params.get("model")) state.model = params.get("model");
  if (location.hash) history.replaceState(null, "", location.pathname + location.search);
}

function render() {
  $("reply").textContent = state.text || "";
  $("refusal").textContent = state.refusal || "";
  $("refusal").hidden = !state.refusal;
  $("status").textContent = state.status || "";
  const running = Boolean(state.job && !state.finished);
  $("send").disabled = running;
  $("stop").disabled = !running;
}

async function send(event) {
  event.preventDefault();
  closeSource();
  state.key = $("key").value;
  state.model = $("model").value;
  state.prompt = $("prompt").value;
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: {
      "Authorization": "Bearer " + state.key,
      "Content-Type": "application/json",
      "Prefer": "respond-async",
    },
    body: JSON.stringify({
      model: state.model,
      messages: [{ role: "user", content: state.prompt }],
      stream: true,
      stream_options: { include_usage: true },
    }),
  });
  const body = await response.json();
  if (!response.ok) {
    state.status = "error: " + body.error.message;
    save();
    render();
    return;
  }
  Object.assign(state, {
    job: body.id, events: body.events_url, last: "0-0", text: "", refusal: "", finishReason: "",
    finished: false,
    status: "queued (job " + body.id + ")",
  });
  save();
  render();
  connect();
}

function connect() {
  const url = state.events + "&progress=events&after=" + encodeURIComponent(state.last);
  source = new EventSource(url);
  source.onmessage = receive;
  source.addEventListener("waiting", waiting);
  source.onerror = () => {
    if (!state.finished) {
      state.status = "connection lost; resuming…";
      render();
    }
  };
}

function closeSource() {
  if (source) source.close();
  source = null;
}

function receive(event) {
  if (event.data === "[DONE]") {
    finish("done" + (state.finishReason ? " (" + state.finishReason + ")" : ""));
    return;
  }
  const chunk = JSON.parse(event.data);
  if (chunk.chatstream && chunk.chatstream.reset) {  // the reply starts over
    state.text = "";
    state.refusal = "";
  }
  for (const choice of chunk.choices || []) {
    if (choice.index !== 0) continue;  // the page asks for one choice
    const delta = choice.delta || {};
    if (delta.content) state.text += delta.content;
    if (delta.refusal) state.refusal = (state.refusal || "") + delta.refusal;
    if (choice.finish_reason) state.finishReason = choice.finish_reason;
  }
  if (event.lastEventId) state.last = event.lastEventId;
  if (chunk.error) {
    finish(chunk.error.code === "cancelled" ? "cancelled" : "error: " + chunk.error.message);
    return;
  }
  state.status = "streaming (job " + state.job + ")";
  save();
  render();
}

function waiting(event) {  // the job waits for its upstream (docs/events.md, waiting)
  const data = JSON.parse(event.data);
  const upstream = "upstream '" + data.upstream + "' ";
  const why = data.reason === "upstream_down" ? upstream + "down" : upstream + "rate-limited";
  state.status = "waiting: " + why + " for " + data.for_s + " s" +
    (data.detail ? " (" + data.detail + ")" : "") + " (job " + state.job + ")";
  save();
  render();
}

function finish(status) {
  closeSource();
  state.finished = true;
  state.status = status;
  save();
  render();
}

async function stop() {
  await fetch("/v1/jobs/" + encodeURIComponent(state.job) + "/cancel", {
    method: "POST",
    headers: { "Authorization": "Bearer " + state.key },
  });
}

takeHash();
$("key").value = state.key || "";
$("model").value = state.model || "";
$("prompt").value = state.prompt || "";
$("ask").addEventListener("submit", send);
$("stop").addEventListener("click", stop);
render();
if (state.job && !state.finished) connect();
