// The page's UI: checks a model before downloading it (what it is, what it needs, whether this
// GPU can hold it), loads it in a worker through the package's WorkerEngine (from a URL, the list of known models, a picked or
// dropped file, or the browser's cache), lists and deletes cached models, keeps the conversation,
// streams tokens into the chat, shows stats and the "inside the engine" panel. Model output and
// everything read from a model file are inserted as text, never as HTML.

import { WorkerEngine } from "./pkg/worker.js";

const DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const $ = (id) => document.getElementById(id);

const ui = {
  status: $("load-status"), progress: $("load-progress"), error: $("error"), file: $("file-input"),
  source: $("source"), known: $("known-models"), url: $("model-url"), check: $("check"), load: $("load"),
  modelInfo: $("model-info"), modelTitle: $("model-info-title"), cached: $("cached-models"), cacheEmpty: $("cache-empty"),
  cacheSummary: $("cache-summary"),
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  clear: $("clear"), stats: $("stats"), system: $("system"), temperature: $("temperature"),
  temperatureValue: $("temperature-value"), topP: $("top-p"), topPValue: $("top-p-value"), topK: $("top-k"),
  maxTokens: $("max-tokens"), jsonSchema: $("json-schema"), allowedText: $("allowed-text"), inside: $("inside"), phase: $("phase"), kvText: $("kv-text"), kvMeter: $("kv-meter"),
  candidates: $("candidates"), adapter: $("adapter"), speculate: $("speculate"), drafts: $("drafts"),
  draftsText: $("drafts-text"),
};
const facts = Object.fromEntries(["architecture", "parameters", "quant", "size", "memory", "context", "fits", "note"].map((f) => [f, $(`fact-${f}`)]));

// The engine, in a Web Worker of the page (WorkerEngine), once a model is loaded; `started` once
// the page found a WebGPU adapter.
let engine = null;
let started = false;
let info = null;
let conversation = [];
let generating = false;
let reply = null;
let replyText = "";
// The model being checked ({id, source, andLoad}), the one checked and ready to load
// ({source, model}), whether a load is under way, and the loaded model's URL (marked in the
// cache list) and facts (shown again when checking another model fails).
let checking = null;
let checked = null;
let loading = false;
let loadedUrl = null;
let loadedFacts = null;
// What the last load was given (a URL, a File, the parts of a split model), to load it again
// after the GPU device is lost.
let loadedSource = null;

const absolute = (url) => new URL(url, location.href).href;

/** A model's file name, from its URL or File (a split model's: its first part's, and the count). */
function sourceName(source) {
  if (Array.isArray(source)) return source.length > 1 ? `${[...source].map((f) => f.name).sort()[0]} and ${source.length - 1} more parts` : source[0].name;
  if (typeof source !== "string") return source.name;
  try {
    return decodeURIComponent(new URL(source, location.href).pathname.split("/").pop()) || source;
  } catch {
    return source;
  }
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

/** Enables what can be done now: nothing that loads while a model loads or an answer streams. */
function setControls() {
  ui.send.disabled = generating || loading || !info;
  ui.stop.disabled = !generating;
  ui.check.disabled = loading;
  ui.load.disabled = loading || generating || !checked;
  ui.file.disabled = loading || generating;
  for (const button of ui.cached.querySelectorAll("button.load")) button.disabled = loading || generating;
  for (const button of ui.cached.querySelectorAll("button.delete")) button.disabled = loading;
}

function setBusy(busy) {
  generating = busy;
  setControls();
}

function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = role;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  ui.messages.append(li);
  li.scrollIntoView({ block: "end" });
  return body;
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 ** 2) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

function formatCount(n) {
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} billion`;
  return `${(n / 1e6).toFixed(1)} million`;
}

/**
 * The KV pool's blocks as squares: free, held by a sequence (its number in the title), or kept
 * by the prefix cache for a later prompt that starts the same way (the conversation's blocks
 * between two turns; handed out when nothing else is free).
 */
function showPool(pool) {
  const box = $("kv-pool");
  if (!pool) return;
  const held = pool.owners.filter((seqs) => seqs.length > 0).length;
  const idle = pool.owners.filter((seqs, i) => seqs.length === 0 && pool.cached[i]).length;
  $("kv-pool-text").textContent =
    `${held + idle} of ${pool.blocks} blocks of ${pool.blockTokens} tokens held (${idle} kept by the prefix cache)`;
  box.replaceChildren(
    ...pool.owners.map((seqs, i) => {
      const cell = document.createElement("span");
      const idleCached = seqs.length === 0 && pool.cached[i];
      cell.className = idleCached ? "cached" : seqs.length === 0 ? "free" : seqs.length > 1 ? "shared" : `seq seq-${seqs[0] % 4}`;
      cell.title = idleCached ? `block ${i}: prefix cache` : seqs.length === 0 ? `block ${i}: free` : `block ${i}: sequence ${seqs.join(", ")}`;
      return cell;
    }),
  );
}

function showKv(tokens) {
  if (!info) return;
  const bytes = 2 * info.nLayers * info.nKvHeads * info.headDim * info.kvBytesPerValue * tokens;
  ui.kvText.textContent = `${tokens} / ${info.contextLength} tokens, ${formatBytes(bytes)}`;
  ui.kvMeter.value = tokens / info.contextLength;
}

/** A model's facts (from Engine.inspect) under `title`. */
function showModel(title, model) {
  ui.modelTitle.textContent = title;
  ui.modelInfo.hidden = false;
  const tensorBytes = Object.values(model.typeBytes).reduce((a, b) => a + b, 0);
  facts.architecture.textContent = model.architecture;
  facts.parameters.textContent = `${formatCount(model.parameters)} (${model.parameters.toLocaleString("en-US")})`;
  // A mixture of experts uses its chosen experts' share of them for a token.
  if (model.activeParameters < model.parameters) facts.parameters.textContent += `, ${formatCount(model.activeParameters)} active per token`;
  facts.quant.textContent = Object.entries(model.typeBytes)
    .sort((a, b) => b[1] - a[1])
    .map(([type, bytes]) => `${type} ${((100 * bytes) / tensorBytes).toFixed(1)}%`)
    .join(", ");
  facts.size.textContent = formatBytes(model.fileBytes);
  facts.memory.textContent =
    `${formatBytes(model.gpuBytes)}: weights ${formatBytes(model.weightBytes)} + KV cache ${formatBytes(model.kvBytes)} ` +
    (model.stateBytes ? `+ recurrent state ${formatBytes(model.stateBytes)} ` : "") +
    `(${model.kvBytesPerValue === 2 ? "f16" : "f32"}, ${model.context} tokens)`;
  facts.context.textContent =
    `${model.context} tokens (trained for ${model.maxContext}); this GPU can afford about ${model.affordableContext}`;
  facts.fits.textContent = !model.adapter
    ? "No WebGPU adapter"
    : `${model.fits ? "Fits" : "May not fit"}: ${model.adapter.name}, ${model.adapter.f16 ? "with" : "without"} shader-f16, ` +
      `buffers up to ${formatBytes(Math.min(model.adapter.maxBufferSize, model.adapter.maxStorageBufferBindingSize))}`;
  facts.note.textContent = model.note;
}

/** Reads a model's header in the worker and shows what it is; `andLoad`: true, or "cached" (only when it needs no download). */
function check(source, andLoad = false) {
  if (loading || !started) return;
  ui.error.hidden = true;
  ui.modelInfo.hidden = true;
  checked = null;
  checking = { id: (checking?.id ?? 0) + 1, source, andLoad };
  ui.load.textContent = "Download and load";
  setControls();
  ui.status.textContent = `Checking ${sourceName(source)}…`;
  const id = checking.id;
  WorkerEngine.inspect(source).then(
    (model) => id === checking?.id && inspected(model),
    (e) => failed({ during: "inspect", id, message: e.message, code: e.code }),
  );
}

function inspected(model) {
  const { source, andLoad } = checking;
  checking = null;
  checked = { source, model };
  const where = { cache: "in this browser's cache", file: "a file on this device", network: "before downloading" }[model.source];
  showModel(`${model.name} (${sourceName(source)}), ${where}`, model);
  ui.load.textContent = model.source === "network" ? `Download ${formatBytes(model.fileBytes)} and load` : "Load";
  if (andLoad === true || (andLoad === "cached" && model.source === "cache")) return load(source);
  ui.status.textContent = info ? `Ready: ${info.modelName}. Checked ${sourceName(source)}: load it when you want.` : `Checked ${sourceName(source)}: load it when you want.`;
  setControls();
}

function load(source) {
  ui.error.hidden = true;
  info = null;
  loading = true;
  loadedUrl = null;
  loadedFacts = null;
  delete document.body.dataset.modelLoaded;
  setControls();
  if (typeof source === "string") loadedUrl = absolute(source);
  loadedSource = source;
  ui.status.textContent = "Loading the model…";
  ui.progress.value = 0;
  startLoad(source);
}

/** Frees the engine (and its worker) before the next load. */
async function drop() {
  const previous = engine;
  engine = null;
  await previous?.unload().catch(() => {});
}

async function startLoad(source) {
  try {
    await drop();
    engine = await WorkerEngine.load(source, { onProgress: showProgress });
    // The same facts as before the download, now at the context the engine holds (and read from
    // the cache or the file: no network).
    const model = await WorkerEngine.inspect(source, { contextLength: engine.info().contextLength }).catch(() => null);
    loaded(engine.info(), model);
  } catch (e) {
    failed({ during: "load", message: e.message, code: e.code });
  }
  await listCache();
}

async function listCache(remove) {
  try {
    if (remove) await WorkerEngine.deleteCached(remove);
    showCache(await WorkerEngine.cachedModels());
  } catch (e) {
    failed({ during: "cache", message: e.message, code: e.code });
  }
}

function showCache(models) {
  ui.cached.replaceChildren(
    ...models.map((m) => {
      const li = document.createElement("li");
      const name = document.createElement("span");
      name.className = "name";
      name.textContent = sourceName(m.url);
      name.title = m.url;
      const size = document.createElement("span");
      size.className = "size";
      size.textContent = `${formatBytes(m.bytes)}${m.of ? `, ${m.parts} of ${m.of} parts` : ""}${m.url === loadedUrl && info ? ", loaded" : ""}`;
      const loadButton = document.createElement("button");
      loadButton.type = "button";
      loadButton.className = "load";
      loadButton.textContent = "Load";
      loadButton.addEventListener("click", () => {
        selectUrl(m.url);
        check(m.url, true);
      });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "Delete";
      remove.setAttribute("aria-label", `Delete ${sourceName(m.url)} from this browser`);
      remove.addEventListener("click", () => listCache(m.url));
      li.append(name, size, loadButton, remove);
      return li;
    }),
  );
  ui.cacheEmpty.hidden = models.length > 0;
  ui.cacheSummary.textContent = models.length ? `(${models.length}, ${formatBytes(models.reduce((sum, m) => sum + m.bytes, 0))})` : "";
  // A checked model that was in the cache is one to download again once deleted.
  if (checked?.model?.source === "cache" && !models.some((m) => m.url === absolute(checked.source))) check(checked.source);
  setControls();
}

/** Puts a URL in the URL box and picks its entry in the list of known models, if it has one. */
function selectUrl(url) {
  ui.url.value = url;
  const option = [...ui.known.options].find((o) => o.value && absolute(o.value) === url);
  ui.known.value = option ? option.value : "";
}

function showCandidates(candidates) {
  ui.candidates.replaceChildren(
    ...candidates.map((c) => {
      const li = document.createElement("li");
      li.className = c.kept ? "kept" : "dropped";
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.max(1, c.prob * 100)}%`;
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = `${JSON.stringify(c.text)} ${(c.prob * 100).toFixed(1)}%${c.kept ? "" : " (cut)"}`;
      li.append(bar, label);
      return li;
    }),
  );
}

/** Speculative decoding, token by token: the drafts the model rejected (struck out), then the
 * token (marked when it was a draft the model accepted), the last 80 kept. */
let drafts = { accepted: 0, rejected: 0 };
function showDraft(text, { accepted, rejected = [] }) {
  const span = (cls, t) => {
    const s = document.createElement("span");
    s.className = cls;
    s.textContent = t;
    return s;
  };
  ui.drafts.append(...rejected.map((t) => span("rejected", t)), span(accepted ? "accepted" : "own", text));
  while (ui.drafts.childElementCount > 80) ui.drafts.firstElementChild.remove();
  drafts.accepted += accepted ? 1 : 0;
  drafts.rejected += rejected.length;
  const all = drafts.accepted + drafts.rejected;
  ui.draftsText.textContent = `${drafts.accepted} of ${all} drafted tokens accepted${all ? ` (${Math.round((100 * drafts.accepted) / all)}%)` : ""}`;
}

function showProgress({ phase, loaded: done, total }) {
  const pct = total ? Math.round((100 * done) / total) : 0;
  ui.progress.max = 1;
  ui.progress.value = total ? done / total : 0;
  ui.status.textContent = {
    download: `Downloading the model… ${pct}%`,
    prepare: "Reading the model's header and opening the GPU…",
  }[phase] ?? `Uploading weights to the GPU… ${pct}%`;
}

function loaded(engineInfo, model) {
  info = engineInfo;
  loading = false;
  ui.status.textContent = `Ready: ${info.modelName}${info.fromCache ? " (from the browser cache)" : ""}`;
  ui.progress.value = 1;
  ui.adapter.textContent = `Running on ${info.backend}.`;
  loadedFacts = model && [`${info.modelName} (${checked ? sourceName(checked.source) : "loaded"}), loaded`, model];
  if (loadedFacts) showModel(...loadedFacts);
  checked = null;
  ui.load.textContent = "Download and load";
  document.body.dataset.modelLoaded = "true";
  document.body.dataset.fromCache = String(info.fromCache);
  document.body.dataset.kvBytesPerValue = String(info.kvBytesPerValue);
  showKv(0);
  showPool(info.kvPool);
  setControls();
}

function token(ev) {
  if (ui.phase.textContent !== "decode") ui.phase.textContent = "decode";
  replyText += ev.text;
  reply.textContent = replyText;
  showKv(ev.position);
  if (ev.candidates) showCandidates(ev.candidates);
  if (ev.speculation) showDraft(ev.text, ev.speculation);
  if (ev.allowed != null) {
    ui.allowedText.textContent = `${ev.allowed} of ${info.vocabSize} tokens allowed for “${ev.text}”`;
  }
}

function done(s, engineInfo) {
  showPool(engineInfo && engineInfo.kvPool);
  conversation.push({ role: "assistant", content: replyText });
  ui.stats.textContent =
    `TTFT ${s.ttftMs.toFixed(0)} ms · prefill ${s.prefillTokS.toFixed(1)} tok/s · decode ${s.decodeTokS.toFixed(1)} tok/s · ` +
    `${s.promptTokens} prompt${s.prefilledTokens < s.promptTokens ? ` (${s.promptTokens - s.prefilledTokens} from the KV cache)` : ""} + ${s.generatedTokens} generated tokens (${s.stopReason})` +
    (s.hostMsPerToken == null ? "" : ` · host ${s.hostMsPerToken.toFixed(2)} ms per decode step`);
  finish();
}

// The page's chat goes through OpenAI's API on the engine (`engine.chat.completions.create`),
// as code written for the server would: each turn resends the conversation, and the engine
// reuses the KV blocks of the turn before (only the new messages are prefilled).
async function chat(messages, options) {
  document.body.dataset.lastRequest = JSON.stringify(options);
  const request = {
    messages,
    stream: true,
    temperature: options.temperature,
    top_p: options.topP,
    top_k: options.topK,
    min_p: options.minP,
    max_tokens: options.maxTokens,
    ...(options.candidates > 0 && { logprobs: true, top_logprobs: options.candidates }),
    ...(options.speculate && { speculate: options.speculate }),
    ...(options.responseFormat && { response_format: options.responseFormat }),
  };
  try {
    for await (const chunk of await engine.chat.completions.create(request)) {
      const choice = chunk.choices[0];
      if (!choice || choice.finish_reason) continue;
      const entry = choice.logprobs?.content?.[0];
      const candidates = entry?.top_logprobs.map((t) => ({ text: t.token, prob: Math.exp(t.logprob), kept: t.kept }));
      token({ text: choice.delta.content ?? "", position: chunk.position, candidates, speculation: chunk.speculation, allowed: chunk.allowed });
    }
    done(engine.stats(), engine.info());
  } catch (e) {
    failed({ during: "chat", message: e.message, code: e.code });
  }
}

function failed({ during, message, code, id }) {
  if (code === "device-lost" && during !== "inspect") return deviceLost(message);
  switch (during) {
    case "inspect":
      if (id !== checking?.id) return;
      showError(`The model could not be ${checking.andLoad === true ? "loaded" : "checked"}: ${message}`);
      checking = null;
      ui.status.textContent = info ? `Ready: ${info.modelName}` : "No model is loaded.";
      if (info && loadedFacts) showModel(...loadedFacts);
      break;
    case "load":
      // The checked model stays ready to load again (a cut download is worth a retry).
      info = null;
      loading = false;
      delete document.body.dataset.modelLoaded;
      ui.progress.value = 0;
      ui.status.textContent = "The model could not be loaded.";
      showError(`The model could not be loaded: ${message}`);
      break;
    case "cache":
      showError(`The browser's cache could not be read: ${message}`);
      break;
    default:
      showError(`Generation failed: ${message}`);
      if (reply) conversation.push({ role: "assistant", content: replyText });
      finish();
  }
  setControls();
}

/** The GPU device is gone: the engine (and its worker) goes, and the page offers to load the model again. */
function deviceLost(message) {
  drop();
  if (reply) conversation.push({ role: "assistant", content: replyText });
  if (generating) finish();
  info = null;
  loading = false;
  delete document.body.dataset.modelLoaded;
  ui.progress.value = 0;
  if (loadedSource) {
    checked = { source: loadedSource, model: loadedFacts?.[1] ?? checked?.model };
    ui.load.textContent = "Load again";
  }
  ui.status.textContent = "The GPU device was lost: the model is no longer loaded.";
  showError(
    `The GPU stopped working for this page: ${message}. The conversation is kept: ` +
      (loadedSource ? "press “Load again” to load the model again and go on." : "load a model to go on."),
  );
  setControls();
}

function finish() {
  ui.phase.textContent = "idle";
  reply = null;
  setBusy(false);
  document.body.dataset.generating = "false";
}

function send(text) {
  if (!info || generating || !text.trim()) return;
  ui.error.hidden = true;
  // A schema that is not JSON is said here, before the turn is taken (one the engine refuses
  // comes back as the generation's error).
  let schema = null;
  if (ui.jsonSchema.value.trim()) {
    try {
      schema = JSON.parse(ui.jsonSchema.value);
    } catch (e) {
      showError(`The JSON schema is not JSON: ${e.message}`);
      return;
    }
  }
  const system = ui.system.value.trim();
  if (conversation.length === 0 && system) conversation.push({ role: "system", content: system });
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  reply = addMessage("assistant", "");
  replyText = "";
  ui.phase.textContent = "prefill";
  document.body.dataset.generating = "true";
  setBusy(true);
  const options = {
    temperature: Number(ui.temperature.value),
    topP: Math.max(Number(ui.topP.value), 0.01),
    topK: Math.max(0, Math.floor(Number(ui.topK.value) || 0)),
    minP: 0,
    maxTokens: Math.max(1, Math.floor(Number(ui.maxTokens.value) || 1)),
    // Speculation checks several tokens per pass: no per-token candidates with it.
    candidates: ui.inside.open && !ui.speculate.value ? 10 : 0,
    ...(ui.speculate.value && { speculate: ui.speculate.value }),
    ...(schema && { responseFormat: { type: "json_schema", json_schema: { name: "page", schema } } }),
  };
  ui.allowedText.textContent = schema ? "compiling…" : "off";
  drafts = { accepted: 0, rejected: 0 };
  ui.drafts.replaceChildren();
  ui.draftsText.textContent = ui.speculate.value ? "drafting…" : "off";
  chat(conversation, options);
}

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.prompt.value;
  ui.prompt.value = "";
  send(text);
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.stop.addEventListener("click", () => engine?.abort());
ui.clear.addEventListener("click", () => {
  if (generating) return;
  conversation = [];
  ui.messages.replaceChildren();
  ui.stats.textContent = "";
});
for (const [input, output, digits] of [[ui.temperature, ui.temperatureValue, 2], [ui.topP, ui.topPValue, 2]]) {
  const show = () => (output.textContent = Number(input.value).toFixed(digits));
  input.addEventListener("input", show);
  show();
}
ui.source.addEventListener("submit", (e) => {
  e.preventDefault();
  check(ui.url.value.trim());
});
ui.known.addEventListener("change", () => {
  if (!ui.known.value) {
    ui.url.value = "";
    ui.url.focus();
    return;
  }
  ui.url.value = absolute(ui.known.value);
  check(ui.url.value);
});
ui.url.addEventListener("input", () => {
  checked = null;
  setControls();
});
ui.load.addEventListener("click", () => checked && load(checked.source));
/** One picked or dropped file, or all the parts of a split model. */
const picked = (files) => (files.length > 1 ? Array.from(files) : files[0]);
ui.file.addEventListener("change", () => ui.file.files.length && check(picked(ui.file.files), true));
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  const files = e.dataTransfer?.files;
  if (!files?.length) return;
  if (loading || generating) showError("Wait until the model has loaded and the answer is finished, then drop the file again.");
  else check(picked(files), true);
});

/** Checks the default model (in the engine's worker), unless this browser has no WebGPU adapter. */
async function start() {
  const adapter = "gpu" in navigator ? await navigator.gpu.requestAdapter().catch(() => null) : null;
  if (!adapter) {
    ui.status.textContent = "WebGPU is not available.";
    setControls();
    ui.check.disabled = true;
    ui.file.disabled = true;
    showError(
      "gpu" in navigator
        ? "This browser offers WebGPU but found no GPU it can use (the GPU may be blocklisted or its driver too old), and the model needs one. Try updating the browser or the graphics driver."
        : "This browser does not offer WebGPU, which the model needs to run on your GPU. Try a recent Chrome, Edge or Safari (or enable WebGPU in the browser's settings).",
    );
    return;
  }
  started = true;
  selectUrl(absolute(DEFAULT_MODEL));
  listCache();
  check(ui.url.value, "cached");
}

start();
