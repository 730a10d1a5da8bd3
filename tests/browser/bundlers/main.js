// An app as a user of the npm package writes it: a bare import, resolved by the bundler through
// the installed package's `exports`. It streams a greedy chat answer into the page and leaves
// the result on window.result ({ids, text} or {error}) for tests/browser/bundlers.test.mjs.
// Query parameters: model (default ./model.gguf, served beside the app), chat (the user's
// message), maxTokens, worker (1: the engine in a Web Worker through webgpu-llm/worker).
import { Engine } from "webgpu-llm";
import { WorkerEngine } from "webgpu-llm/worker";

const params = new URLSearchParams(location.search);
const out = document.getElementById("out");

async function main() {
  const engine = await (params.get("worker") ? WorkerEngine : Engine).load(params.get("model") ?? "./model.gguf", { cache: false });
  const messages = [{ role: "user", content: params.get("chat") ?? "Hi" }];
  const ids = [];
  for await (const ev of engine.chat(messages, { temperature: 0, maxTokens: Number(params.get("maxTokens") ?? 64) })) {
    ids.push(ev.id);
    out.textContent += ev.text;
  }
  return { ids, text: out.textContent };
}

main().then(
  (result) => (window.result = result),
  (e) => (window.result = { error: String(e?.message ?? e) }),
);
