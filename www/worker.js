// The Web Worker that owns the engine, so the page stays responsive while it loads and
// generates. Messages in: load {url | file}, chat {messages, options}, abort. Messages out:
// progress, loaded {info}, started {options}, token {ev}, done {stats}, error {message, during}.
import { Engine } from "./pkg/index.js";

let engine = null;

function fail(during, e) {
  postMessage({ type: "error", during, message: String((e && e.message) || e) });
}

async function load(source) {
  try {
    if (engine) {
      engine.unload();
      engine = null;
    }
    engine = await Engine.load(source, { onProgress: (p) => postMessage({ type: "progress", ...p }) });
    postMessage({ type: "loaded", info: engine.info() });
  } catch (e) {
    fail("load", e);
  }
}

async function chat(messages, options) {
  if (!engine) return fail("chat", new Error("no model is loaded"));
  postMessage({ type: "started", options });
  try {
    for await (const ev of engine.chat(messages, options)) postMessage({ type: "token", ev });
    postMessage({ type: "done", stats: engine.stats() });
  } catch (e) {
    fail("chat", e);
  }
}

onmessage = ({ data }) => {
  switch (data.type) {
    case "load":
      load(data.file ?? data.url);
      break;
    case "chat":
      chat(data.messages, data.options);
      break;
    case "abort":
      engine?.abort();
      break;
  }
};
