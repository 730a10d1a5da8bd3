// The Web Worker that owns the engine, so the page stays responsive while it loads and
// generates. Messages in: inspect {id, url | file}, load {url | file}, chat {messages, options},
// abort, cache {remove?}. Messages out: inspected {id, model}, progress, loaded {info, model},
// started {options}, token {ev}, done {stats, info}, cache {models}, error {during, message, code?, id?}.
// An error with code "device-lost" means the engine is gone: the worker drops it, and the page
// offers to load the model again.
import { Engine } from "./pkg/index.js";

let engine = null;

function fail(during, e, id) {
  const code = e?.code;
  if (code === "device-lost") drop();
  postMessage({ type: "error", during, id, code, message: String((e && e.message) || e) });
}

/** Frees the engine (and its GPU memory, unless the device is gone already). */
function drop() {
  try {
    engine?.unload();
  } catch {
    // A generation still holds it; it ends with the same error and drops it then.
  }
  engine = null;
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
    drop();
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

// The page's chat goes through OpenAI's API on the engine (`engine.chat.completions.create`),
// as code written for the server would: each turn resends the conversation, and the engine
// reuses the KV blocks of the turn before (only the new messages are prefilled).
async function chat(messages, options) {
  if (!engine) return fail("chat", new Error("no model is loaded"));
  postMessage({ type: "started", options });
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
      postMessage({ type: "token", ev: { text: choice.delta.content ?? "", position: chunk.position, candidates, speculation: chunk.speculation, allowed: chunk.allowed } });
    }
    postMessage({ type: "done", stats: engine.stats(), info: engine.info() });
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
