// The npm package imported into a plain ES-module page with exactly the README's snippet.
import { test } from "node:test";
import assert from "node:assert/strict";
import { serve, launch, stage } from "./lib.mjs";

const page = `<!doctype html>
<meta charset="utf-8">
<pre id="out"></pre>
<script type="module">
const out = document.getElementById("out");
try {
  const url = "./model.gguf";
  const t0 = performance.now();
  import { Engine } from "./pkg/index.js";
} catch (e) {}
</script>`;

test("the README snippet streams a chat completion from the built package", { timeout: 900_000 }, async () => {
  const html = `<!doctype html>
<meta charset="utf-8">
<pre id="out"></pre>
<script type="module">
import { Engine } from "./pkg/index.js";
const out = document.getElementById("out");
const url = "./model.gguf";
try {
  const engine = await Engine.load(url, { onProgress: ({ loaded, total }) => {} });
  for await (const ev of engine.chat([{ role: "user", content: "Hi" }], { temperature: 0.7, topP: 0.9, maxTokens: 128 })) {
    out.textContent += ev.text;                      // ev = { id, text }
    window.tokens = (window.tokens ?? 0) + 1;
  }
  window.stats = engine.stats();
  window.info = engine.info();
} catch (e) {
  window.failure = String(e && e.message || e);
}
window.finished = true;
</script>`;
  void page;
  const dir = stage("package", { "index.html": html });
  const server = await serve(dir);
  const browser = await launch();
  try {
    const tab = await browser.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    await tab.goto(`${server.url}/index.html`);
    await tab.waitForFunction(() => window.finished, null, { timeout: 880_000, polling: 500 });
    const result = await tab.evaluate(() => ({ failure: window.failure, text: document.getElementById("out").textContent, tokens: window.tokens, stats: window.stats, info: window.info }));
    console.log(JSON.stringify(result));
    assert.equal(result.failure, undefined);
    assert.ok(result.tokens > 0 && result.text.length > 0, "streamed some text");
    assert.equal(result.stats.generatedTokens, result.tokens);
    assert.equal(result.info.architecture, "llama");
  } finally {
    await browser.close();
    server.close();
  }
});
