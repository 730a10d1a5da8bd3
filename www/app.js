// The page's UI: loads the default model (or a picked/dropped GGUF) in the worker, keeps the
// conversation, streams tokens into the chat, shows stats and the "inside the engine" panel.
// Model output is always inserted as text, never as HTML.

const DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const $ = (id) => document.getElementById(id);

const ui = {
  status: $("load-status"), progress: $("load-progress"), error: $("error"), file: $("file-input"),
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  clear: $("clear"), stats: $("stats"), system: $("system"), temperature: $("temperature"),
  temperatureValue: $("temperature-value"), topP: $("top-p"), topPValue: $("top-p-value"), topK: $("top-k"),
  maxTokens: $("max-tokens"), inside: $("inside"), phase: $("phase"), kvText: $("kv-text"), kvMeter: $("kv-meter"),
  candidates: $("candidates"), adapter: $("adapter"),
};

let worker = null;
let info = null;
let conversation = [];
let generating = false;
let reply = null;
let replyText = "";

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function setBusy(busy) {
  generating = busy;
  ui.send.disabled = busy || !info;
  ui.stop.disabled = !busy;
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
  return `${(n / 1024 ** 2).toFixed(1)} MiB`;
}

function showKv(tokens) {
  if (!info) return;
  const bytes = 2 * info.nLayers * info.nKvHeads * info.headDim * info.kvBytesPerValue * tokens;
  ui.kvText.textContent = `${tokens} / ${info.contextLength} tokens, ${formatBytes(bytes)}`;
  ui.kvMeter.value = tokens / info.contextLength;
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

function startWorker() {
  worker = new Worker("./worker.js", { type: "module" });
  worker.onerror = (e) => showError(`The engine failed to start: ${e.message || "unknown error"}`);
  worker.onmessage = ({ data }) => {
    switch (data.type) {
      case "progress": {
        const pct = data.total ? Math.round((100 * data.loaded) / data.total) : 0;
        ui.progress.max = 1;
        ui.progress.value = data.total ? data.loaded / data.total : 0;
        ui.status.textContent = data.phase === "download" ? `Downloading the model… ${pct}%` : `Uploading weights to the GPU… ${pct}%`;
        break;
      }
      case "loaded":
        info = data.info;
        ui.status.textContent = `Ready: ${info.modelName}${info.fromCache ? " (from the browser cache)" : ""}`;
        ui.progress.value = 1;
        ui.adapter.textContent = `Running on ${info.backend}.`;
        document.body.dataset.modelLoaded = "true";
        document.body.dataset.fromCache = String(info.fromCache);
        showKv(0);
        setBusy(false);
        break;
      case "started":
        document.body.dataset.lastRequest = JSON.stringify(data.options);
        break;
      case "token": {
        const ev = data.ev;
        if (ui.phase.textContent !== "decode") ui.phase.textContent = "decode";
        replyText += ev.text;
        reply.textContent = replyText;
        showKv(ev.position);
        if (ev.candidates) showCandidates(ev.candidates);
        break;
      }
      case "done": {
        const s = data.stats;
        conversation.push({ role: "assistant", content: replyText });
        ui.stats.textContent =
          `TTFT ${s.ttftMs.toFixed(0)} ms · prefill ${s.prefillTokS.toFixed(1)} tok/s · decode ${s.decodeTokS.toFixed(1)} tok/s · ` +
          `${s.promptTokens} prompt + ${s.generatedTokens} generated tokens (${s.stopReason})`;
        finish();
        break;
      }
      case "error":
        if (data.during === "load") {
          info = null;
          delete document.body.dataset.modelLoaded;
          ui.status.textContent = "The model could not be loaded.";
          showError(`The model could not be loaded: ${data.message}`);
        } else {
          showError(`Generation failed: ${data.message}`);
          if (reply) conversation.push({ role: "assistant", content: replyText });
          finish();
        }
        setBusy(false);
        break;
    }
  };
}

function finish() {
  ui.phase.textContent = "idle";
  reply = null;
  setBusy(false);
  document.body.dataset.generating = "false";
}

function load(source) {
  ui.error.hidden = true;
  info = null;
  setBusy(false);
  ui.send.disabled = true;
  ui.status.textContent = "Loading the model…";
  ui.progress.value = 0;
  worker.postMessage(typeof source === "string" ? { type: "load", url: source } : { type: "load", file: source });
}

function send(text) {
  if (!info || generating || !text.trim()) return;
  ui.error.hidden = true;
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
    candidates: ui.inside.open ? 10 : 0,
  };
  worker.postMessage({ type: "chat", messages: conversation, options });
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
ui.stop.addEventListener("click", () => worker.postMessage({ type: "abort" }));
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
ui.file.addEventListener("change", () => ui.file.files[0] && load(ui.file.files[0]));
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  const file = e.dataTransfer?.files?.[0];
  if (file) load(file);
});

if (!("gpu" in navigator)) {
  ui.status.textContent = "WebGPU is not available.";
  showError("This browser does not offer WebGPU, which the model needs to run on your GPU. Try a recent Chrome, Edge or Safari (or enable WebGPU in the browser's settings).");
} else {
  startWorker();
  load(DEFAULT_MODEL);
}
