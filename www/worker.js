// The Web Worker that owns the engine, so the page stays responsive while it loads and
// generates. Messages in: inspect {id, url | file}, load {url | file}, chat {messages, options},
// abort, cache {remove?}. Messages out: inspected {id, model}, progress, loaded {info, model},
// started {options}, token {ev}, done {stats}, cache {models}, error {during, message, id?}.
import { Engine } from "./pkg/index.js";

let engine = null;

function fail(during, e, id) {
  postMessage({ type: "error", during, id, message: String((e && e.message) || e) });
}

async function inspect(id, source) {
  try {
    postMessage({ type: "inspected", id, model: await Engine.inspect(source) });
  } catch (e) {
    fail("inspect", e, id);
  }
}

async function load(source) {
  try {
    if (engine) {
      engine.unload();
      engine = null;
    }
    engine = await Engine.load(source, { onProgress: (p) => postMessage({ type: "progress", ...p }) });
    const info = engine.info();
    // The same facts as before the download, now at the context the engine holds (and read from
    // the cache or the file: no network).
    const model = await Engine.inspect(source, { contextLength: info.contextLength }).catch(() => null);
    postMessage({ type: "loaded", info, model });
  } catch (e) {
    fail("load", e);
  }
  await listCache();
}

async function listCache(remove) {
  try {
    if (remove) await Engine.deleteCached(remove);
    postMessage({ type: "cache", models: await Engine.cachedModels() });
  } catch (e) {
    fail("cache", e);
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
    case "inspect":
      inspect(data.id, data.file ?? data.url);
      break;
    case "load":
      load(data.file ?? data.url);
      break;
    case "chat":
      chat(data.messages, data.options);
      break;
    case "abort":
      engine?.abort();
      break;
    case "cache":
      listCache(data.remove);
      break;
  }
};
