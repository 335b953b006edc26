// gptmini's page: streams a completion from /v1/completions (or, in chat mode, a reply from
// /v1/chat/completions, the whole rendered conversation as the text), shows every token as a chip,
// and draws what a token attends to (/gptmini/attention), the model's next-token
// candidates, and the attention in three views (the maps of a layer's heads, bertviz's head
// view, the model view), the checkpoint and the heads' roles. Plain JavaScript, no build
// step, nothing fetched from elsewhere; one module per view.
import { allowed, decodeAttention, rowMax, SCALES, shade, weight } from "./weights.js";
import { showCheckpoint, showRoles } from "./panels.js";
import { chipText, visibleText } from "./tokens.js";
import { smallMap } from "./maps.js";
import { HeadView } from "./headview.js";
import { ModelView } from "./modelview.js";
import { Conversation } from "./chat.js";

const $ = (id) => document.getElementById(id);
const view = {
  ids: [], names: [], promptLength: 0,  // the text: token ids and their names
  streamed: [],      // per generated token: {token, logprob, top: {name: logprob}}
  attention: null,   // the last /gptmini/attention answer, decoded
  selected: -1, pinned: -1, layer: 0, head: "avg",
  scale: "row",      // the colour scale (weights.js's SCALES)
  tab: "maps",       // the view under the candidates: maps, headview or modelview
  mode: "complete",  // complete a text, or chat (chat.js)
  controller: null, fetching: false, stale: false,
  timings: {},
};
window.gptmini = view;  // for tests and benchmarks

function message(text) {
  const box = $("message");
  box.textContent = text || "";
  box.hidden = !text;
}

function setState(state) { document.body.dataset.state = state; }

function headers() {
  const out = { "content-type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) out.authorization = `Bearer ${key}`;
  return out;
}

async function call(path, body) {
  const init = body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const answer = await fetch(path, init);
  const data = await answer.json().catch(() => ({}));
  if (!answer.ok) throw apiError(answer.status, data);
  return data;
}

function apiError(status, data) {
  if (status === 401) $("key-form").hidden = false;
  const text = (data && data.error && data.error.message) || `HTTP ${status}`;
  const err = new Error(status === 401 ? `${text} (type the key above)` : text);
  err.status = status;
  return err;
}

// --- tokens ------------------------------------------------------------------------------

function renderTokens() {
  const box = $("tokens");
  while (box.children.length > view.ids.length) box.lastChild.remove();
  for (let i = box.children.length; i < view.ids.length; i++) {
    const chip = document.createElement("span");
    chip.className = "chip" + (i >= view.promptLength ? " generated" : " prompt");
    chip.dataset.index = i;
    chip.textContent = chipText(view.names[i]);
    chip.addEventListener("mouseenter", () => select(i, false));
    chip.addEventListener("click", () => select(i, true));
    box.appendChild(chip);
  }
}

// The prompt's chips take their names from the attention answer (the stream names only
// the generated tokens).
function relabel(a) {
  const chips = $("tokens").children;
  for (let i = 0; i < Math.min(view.promptLength, a.num_tokens, chips.length); i++) {
    if (view.ids[i] === a.token_ids[i] && view.names[i] !== a.tokens[i]) {
      view.names[i] = a.tokens[i];
      chips[i].textContent = chipText(a.tokens[i]);
    }
  }
}

function select(i, pin) {
  if (pin) view.pinned = view.pinned === i ? -1 : i;
  else if (view.pinned >= 0) return;  // a pinned token stays until clicked again
  view.selected = pin && view.pinned < 0 ? -1 : i;
  drawSelection();
}

function drawSelection() {
  const started = performance.now();
  const a = view.attention, i = view.selected;
  const chips = $("tokens").children;
  const most = a && i >= 0 && i < a.num_tokens ? rowMax(a, view.layer, view.head, i) : 0;
  for (let j = 0; j < chips.length; j++) {
    const chip = chips[j];
    chip.classList.toggle("selected", j === i);
    const known = a && i >= 0 && i < a.num_tokens && j < a.num_tokens;
    const open = known && allowed(a, i, j);
    chip.classList.toggle("masked", known && !open);
    const w = open ? weight(a, view.layer, view.head, i, j) : 0;
    chip.style.setProperty("--w", known ? shade(w, most, view.scale).toFixed(3) : "0");
    chip.dataset.weight = known ? w.toFixed(6) : "";
    chip.title = known ? `${open ? "weight " + w.toFixed(4) : "masked"} (query ${i}, key ${j})` : "";
  }
  renderCandidates();
  drawViews();
  view.timings.drawMs = performance.now() - started;
}

// The model's next-token candidates after token i: from the attention answer when it
// covers i, else from the stream's logprobs of the token after i.
function candidatesAfter(i) {
  const a = view.attention;
  if (a && i < a.num_tokens && a.token_ids[i] === view.ids[i]) {
    return { source: "/gptmini/attention",
             rows: a.top_logprobs[i].map(([id, name, lp]) => ({ id, name, lp })) };
  }
  const k = i + 1 - view.promptLength;
  if (k >= 0 && k < view.streamed.length) {
    const top = Object.entries(view.streamed[k].top).sort((x, y) => y[1] - x[1]);
    return { source: view.mode === "chat" ? "/v1/chat/completions logprobs" : "/v1/completions logprobs",
             rows: top.map(([name, lp]) => ({ id: null, name, lp })) };
  }
  return null;
}

function renderCandidates() {
  const box = $("candidates"), i = view.selected;
  box.replaceChildren();
  if (i < 0) return;
  const found = candidatesAfter(i);
  if (!found) return;
  const next = i + 1 < view.ids.length ? view.ids[i + 1] : null;
  const caption = document.createElement("div");
  caption.className = "hint";
  caption.textContent = `after token ${i} (${JSON.stringify(view.names[i])}), from ${found.source}:`;
  const table = document.createElement("table");
  for (const row of found.rows) {
    const tr = table.insertRow();
    const p = Math.exp(row.lp);
    const actual = row.id === null ? row.name === view.names[i + 1] : row.id === next;
    tr.className = "candidate" + (actual ? " actual" : "");
    tr.dataset.logprob = row.lp;
    const name = tr.insertCell();  // spaces as marks: "  " and " " must not look alike
    name.className = "name";
    name.textContent = visibleText(row.name);
    name.title = JSON.stringify(row.name);
    tr.insertCell().textContent = `${(100 * p).toFixed(2)}%`;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, 120 * p)}px`;
    tr.insertCell().appendChild(bar);
  }
  box.append(caption, table);
}

// --- the views: every head of the layer, the head view, the model view ---------------

const headView = new HeadView($("headview-body"), (l) => openHead(l, view.head));
const modelView = new ModelView($("modelview-body"), (l, h) => openHead(l, h));

// Only the view on show is drawn (the others wait until their tab is opened).
function drawViews() {
  for (const tab of document.querySelectorAll("#tabs button")) {
    const on = tab.dataset.view === view.tab;
    tab.classList.toggle("current", on);
    $(tab.dataset.view).hidden = !on;
  }
  const a = view.attention;
  if (view.tab === "maps") drawGrid();
  else if (a && view.tab === "headview") headView.show(a, view.layer, view.version);
  else if (a && view.tab === "modelview") modelView.show(a, view.scale, view.version);
}

function drawGrid() {
  const a = view.attention, box = $("grid");
  if (!a) { box.replaceChildren(); return; }
  if (box.children.length !== a.n_heads || box.dataset.tokens !== String(a.num_tokens)
      || box.dataset.layer !== String(view.layer) || box.dataset.values !== view.version
      || box.dataset.scale !== view.scale) {
    box.replaceChildren();
    for (let h = 0; h < a.n_heads; h++) box.appendChild(headCanvas(a, h));
    box.dataset.tokens = a.num_tokens;
    box.dataset.layer = view.layer;
    box.dataset.values = view.version;
    box.dataset.scale = view.scale;
  }
  for (const cell of box.children) {
    const h = Number(cell.dataset.head);
    cell.classList.toggle("current", view.head === h);
    const canvas = cell.querySelector("canvas"), ctx = canvas.getContext("2d");
    ctx.putImageData(canvas.image, 0, 0);
    if (view.selected >= 0 && view.selected < a.num_tokens) {
      ctx.fillStyle = "rgba(0, 90, 255, 0.35)";
      ctx.fillRect(0, view.selected, a.num_tokens, 1);
    }
  }
}

function headCanvas(a, h) {
  const cell = document.createElement("div");
  cell.className = "head";
  cell.dataset.head = h;
  const label = document.createElement("div");
  label.textContent = `L${view.layer} H${h}`;
  cell.append(smallMap(a, view.layer, h, view.scale, $("grid-caption")), label);
  cell.addEventListener("click", () => { view.head = h; $("head").value = String(h); drawSelection(); });
  return cell;
}

function showLegend() {
  $("legend-scale").textContent = SCALES[view.scale];
  $("legend-top").textContent = view.scale === "row" ? "its largest" : "1";
}

// --- attention of the text so far --------------------------------------------------------

async function refreshAttention() {
  if (view.fetching) { view.stale = true; return; }
  view.fetching = true;
  try {
    do {
      view.stale = false;
      const started = performance.now();
      const data = await call("/gptmini/attention", { prompt: view.ids.slice(), top_logprobs: 10 });
      show(data, started);
    } while (view.stale);
  } catch (err) {
    if (!$("message").textContent) message(`attention: ${err.message}`);  // the stream's says more
  } finally {
    view.fetching = false;
  }
}

// Decode and draw an attention answer; the timings say where the time went.
function show(data, started) {
  const arrived = performance.now();
  const decoded = decodeAttention(data);
  view.attention = decoded;
  view.version = String(arrived);
  relabel(decoded);
  fillPickers(decoded.n_layers, decoded.n_heads);
  const decodedAt = performance.now();
  drawSelection();
  const drawn = performance.now();
  view.timings = { tokens: decoded.num_tokens, fetchMs: arrived - started,
                   decodeMs: decodedAt - arrived, drawMs: drawn - decodedAt,
                   totalMs: drawn - started };
  document.body.dataset.attentionTokens = decoded.num_tokens;
}

// The prompt alone, without generating: its tokens, attention and candidates.
async function inspectPrompt() {
  message("");
  const prompt = $("prompt").value;
  if (!prompt.trim()) { message(EMPTY); return; }
  delete document.body.dataset.attentionTokens;
  try {
    const started = performance.now();
    const data = await call("/gptmini/attention", { prompt, top_logprobs: 10 });
    Object.assign(view, { ids: data.token_ids.slice(), names: data.tokens.slice(),
                          promptLength: data.num_tokens, streamed: [], pinned: -1,
                          selected: data.num_tokens - 1 });
    $("tokens").replaceChildren();
    renderTokens();
    show(data, started);
    $("status").textContent = `the prompt's ${data.num_tokens} tokens inspected`;
    setState("done");
  } catch (err) {
    message(err.message);
    setState("error");
  }
}

function fillPickers(layers, heads) {
  const layer = $("layer"), head = $("head");
  if (layer.options.length !== layers) {
    layer.replaceChildren(...Array.from({ length: layers }, (_, l) => new Option(`${l}`, l)));
    layer.value = String(view.layer);
  }
  if (head.options.length !== heads + 1) {
    head.replaceChildren(new Option("average", "avg"),
                         ...Array.from({ length: heads }, (_, h) => new Option(`${h}`, h)));
    head.value = String(view.head);
  }
}

// --- generating --------------------------------------------------------------------------

const EMPTY = "The prompt is empty: type some text to continue (or <|endoftext|> to start from nothing).";

function settings() {
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const body = { prompt: $("prompt").value, max_tokens: number("max_tokens"),
                 temperature: number("temperature"), top_k: number("top_k"),
                 top_p: number("top_p"), seed: number("seed"), stream: true, logprobs: 10,
                 return_token_ids: true };
  for (const key of Object.keys(body)) if (body[key] === null) delete body[key];
  return body;
}

const conversation = new Conversation($("conversation"));

async function generate(event) {
  event.preventDefault();
  message("");
  const chatting = view.mode === "chat";
  let body = settings();
  if (chatting) {
    const text = $("chat-input").value;
    if (!text.trim()) { message("The message is empty: type something to say."); return; }
    body = conversation.body($("system").value.trim(), text, body);
    $("chat-input").value = "";
  } else if (!body.prompt.trim()) {
    message(EMPTY);
    return;
  }
  view.controller = new AbortController();
  Object.assign(view, { ids: [], names: [], streamed: [], promptLength: 0, attention: null,
                        selected: -1, pinned: -1 });
  $("tokens").replaceChildren();
  $("status").textContent = "";
  renderCandidates();
  drawViews();
  setState("streaming");
  $("generate").disabled = true;
  $("stop").disabled = false;
  let finished = false;
  try {
    const answer = await fetch(chatting ? "/v1/chat/completions" : "/v1/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: view.controller.signal });
    if (!answer.ok) throw apiError(answer.status, await answer.json().catch(() => ({})));
    const reader = answer.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const line of events) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") { finished = true; continue; }
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chatting ? conversation.choices(chunk) : chunk.choices || []) addChunk(choice);
      }
    }
    if (!finished) {
      throw new Error(`the server stopped mid-stream after ${view.streamed.length} tokens; ` +
                      "what arrived is shown. Restart serve.py and generate again.");
    }
    if (chatting) conversation.finish(true);
    setState("done");
  } catch (err) {
    if (chatting && err.name !== "AbortError") $("chat-input").value = conversation.pending;
    if (chatting) conversation.finish(err.name === "AbortError");  // a stopped reply stays
    if (err.name === "AbortError") {
      setState("done");
      $("status").textContent = "stopped";
    } else {
      const lost = err instanceof TypeError;  // fetch's network failure
      message(lost ? `the server stopped mid-stream after ${view.streamed.length} tokens (${err.message}); what arrived is shown`
                   : err.message);
      setState("error");
    }
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    if (view.ids.length && document.body.dataset.state !== "error") refreshAttention();
  }
}

function addChunk(choice) {
  if (choice.prompt_token_ids) {
    view.ids = choice.prompt_token_ids.slice();
    view.promptLength = view.ids.length;
    view.names = view.ids.map(() => "\u2026");  // named when their attention arrives
  }
  const ids = choice.token_ids || [], lp = choice.logprobs;
  ids.forEach((id, k) => {
    view.ids.push(id);
    view.names.push(lp ? lp.tokens[k] : String(id));
    view.streamed.push({ token: id, logprob: lp ? lp.token_logprobs[k] : null,
                         top: lp ? lp.top_logprobs[k] : {} });
  });
  $("status").textContent = `${view.streamed.length} tokens generated`;
  renderTokens();
  if (ids.length || choice.prompt_token_ids) refreshAttention();
}

// --- the head roles open a head ----------------------------------------------------------

function openHead(l, h) {
  view.layer = l;
  view.head = h;
  $("layer").value = String(l);
  $("head").value = String(h);
  for (const td of document.querySelectorAll("#roles td.role")) {
    td.classList.toggle("current", Number(td.dataset.layer) === l && Number(td.dataset.head) === h);
  }
  drawSelection();
}

async function loadPanels() {
  try {
    const info = await call("/gptmini/checkpoint");
    showCheckpoint(info);
    fillPickers(info.settings.n_layers, info.settings.n_heads);
    showRoles(await call("/gptmini/heads"), openHead);
    setState("idle");
  } catch (err) {
    message(err.message);
    setState("error");
  }
}

// Complete a text, or chat: the form's settings serve both.
function setMode(mode) {
  view.mode = mode;
  for (const button of document.querySelectorAll("#modes button")) {
    button.classList.toggle("current", button.dataset.mode === mode);
  }
  const chatting = mode === "chat";
  $("chat").hidden = !chatting;
  $("new-chat").hidden = !chatting;
  $("prompt").hidden = chatting;
  $("inspect").hidden = chatting;
  $("generate").textContent = chatting ? "Send" : "Generate";
}

$("form").addEventListener("submit", generate);
for (const button of document.querySelectorAll("#modes button")) {
  button.addEventListener("click", () => setMode(button.dataset.mode));
}
$("new-chat").addEventListener("click", () => { conversation.reset(); message(""); });
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("generate").click(); }
});
$("inspect").addEventListener("click", inspectPrompt);
$("stop").addEventListener("click", () => view.controller && view.controller.abort());
$("layer").addEventListener("change", () => { view.layer = Number($("layer").value); drawSelection(); });
$("head").addEventListener("change", () => {
  const value = $("head").value;
  view.head = value === "avg" ? "avg" : Number(value);
  drawSelection();
});
$("scale").addEventListener("change", () => { view.scale = $("scale").value; showLegend(); drawSelection(); });
for (const tab of document.querySelectorAll("#tabs button")) {
  tab.addEventListener("click", () => { view.tab = tab.dataset.view; drawViews(); });
}
$("api_key").addEventListener("change", loadPanels);
showLegend();
loadPanels();
