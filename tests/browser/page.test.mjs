// End-to-end test of the web page (dist/, built by scripts/build-page) in Debian's headless
// Chromium: the model's facts before the download, load, streamed chat with the CPU reference's
// greedy answer, sliders reaching the request, Stop, the browser cache on reload, the list of
// cached models (delete), a cut download and a corrupted GGUF shown as errors in words, a lost
// GPU device, and unreachable models from the known list. Screenshots go to target/browser-tests/.
//
// The page generates with the tiny random Llama 3 of tests/data/arch (lib.mjs: modelPath), as a
// user gets a model to it: as the model served with the page (the test's copy of dist/ has it
// where the page's default model is, models/SmolLM2-135M-Instruct.Q4_1.gguf, so that the page
// checks it at start and loads it from the cache on reload), or by a pasted URL. The real
// default model is only checked before a download (its header is what travels), never loaded.
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { launch, root, artifacts, modelPath, defaultModel, serve, cpu, formatBytes, cacheKeys, opfsFiles } from "./lib.mjs";
import { readGguf } from "./gguf.mjs";

const LOAD_TIMEOUT = 300_000;
const GEN_TIMEOUT = 300_000;
const DEFAULT_NAME = path.basename(defaultModel);
const PASTED_NAME = "tiny-llama3.gguf";

/**
 * A copy of dist/ (links to its files) whose models/ holds `models` ({name: file}): served as
 * scripts/serve serves dist/.
 */
function stageDist(name, models) {
  const dist = path.join(root, "dist");
  const dir = path.join(artifacts, name);
  fs.rmSync(dir, { recursive: true, force: true });
  fs.mkdirSync(path.join(dir, "models"), { recursive: true });
  for (const entry of fs.readdirSync(dist)) if (entry !== "models") fs.symlinkSync(path.join(dist, entry), path.join(dir, entry));
  for (const [file, target] of Object.entries(models)) fs.symlinkSync(target, path.join(dir, "models", file));
  return dir;
}
const serveDist = (models = { [DEFAULT_NAME]: modelPath, [PASTED_NAME]: modelPath }) => serve(stageDist("page-dist", models));
const ggufGets = (server, name = null) => server.requests.filter((r) => r.path.endsWith(name ?? ".gguf") && r.method === "GET");
const fullDownloads = (server) => ggufGets(server).filter((r) => !r.range);

// A user message whose greedy answer on the tiny model ends at its end-of-sequence token (after
// 40 tokens), and the CPU reference's answer.
const QUESTION = "ran name red me";
const answer = cpu(modelPath, { chat: QUESTION }, { maxTokens: 256 });
assert.equal(answer.stats.stop_reason, "Eos");

/** The facts of `file` the page must show, from the file itself (tests/browser/gguf.mjs). */
function modelFacts(file = modelPath) {
  const { metadata: m, tensors } = readGguf(file);
  const arch = m["general.architecture"];
  const typeBytes = {};
  for (const t of tensors) typeBytes[t.type] = (typeBytes[t.type] ?? 0) + t.bytes;
  return {
    architecture: arch,
    parameters: tensors.reduce((sum, t) => sum + t.elements, 0),
    types: Object.keys(typeBytes),
    size: formatBytes(fs.statSync(file).size),
    maxContext: m[`${arch}.context_length`],
    layers: m[`${arch}.block_count`],
    kvHeads: m[`${arch}.attention.head_count_kv`],
    headDim: m[`${arch}.embedding_length`] / m[`${arch}.attention.head_count`],
  };
}

async function assertFacts(page, facts) {
  assert.equal(await page.textContent("#fact-architecture"), facts.architecture);
  assert.match(await page.textContent("#fact-parameters"), new RegExp(`\\(${facts.parameters.toLocaleString("en-US")}\\)`));
  const quant = await page.textContent("#fact-quant");
  for (const type of facts.types) assert.match(quant, new RegExp(`${type} \\d+\\.\\d%`));
  assert.equal(await page.textContent("#fact-size"), facts.size);
  assert.match(await page.textContent("#fact-context"), new RegExp(`^${Math.min(4096, facts.maxContext)} tokens \\(trained for ${facts.maxContext}\\)`));
  assert.match(await page.textContent("#fact-memory"), /weights .* \+ KV cache .* \(f(16|32), \d+ tokens\)/);
  assert.match(await page.textContent("#fact-fits"), /^Fits/);
  assert.match(await page.textContent("#fact-note"), /does not tell a page how much memory/);
}

async function setSlider(page, id, value) {
  await page.$eval(`#${id}`, (el, v) => {
    el.value = String(v);
    el.dispatchEvent(new Event("input", { bubbles: true }));
  }, value);
}

async function waitIdle(page, timeout = GEN_TIMEOUT) {
  await page.waitForFunction(() => document.body.dataset.generating === "false", null, { timeout, polling: 250 });
}

const lastReply = (page) => page.$$eval("#messages li.assistant .text", (els) => els.at(-1)?.textContent ?? "");

test("the page shows the model before downloading it, loads it, chats, stops, caches it and reports a bad file", { timeout: 1_200_000 }, async () => {
  const facts = modelFacts();
  const browser = await launch();
  try {
    // The page as built, with the real default model: checked at start from its header alone
    // (Range requests: 2 of its 98 MB), nothing downloaded.
    const real = await serve(path.join(root, "dist"));
    try {
      const page = await browser.newPage();
      await page.goto(real.url);
      await page.waitForSelector("#model-info:not([hidden])", { timeout: LOAD_TIMEOUT });
      assert.match(await page.textContent("#model-info-title"), /before downloading/);
      const realFacts = modelFacts(defaultModel);
      await assertFacts(page, realFacts);
      assert.deepEqual(fullDownloads(real), []);
      assert.ok(ggufGets(real).reduce((sum, r) => sum + r.sent, 0) < 4 << 20, "inspecting read more than the header");
      assert.match(await page.textContent("#load"), new RegExp(`Download ${realFacts.size} and load`));
      await page.screenshot({ path: path.join(artifacts, "page-before-download.png") });
      await page.close();
    } finally {
      real.close();
    }

    // From here on the page's default model is the tiny one (stageDist).
    const server = await serveDist();
    try {
      const context = await browser.newContext({ viewport: { width: 1100, height: 900 } });
      const page = await context.newPage();
      const errors = [];
      page.on("pageerror", (e) => errors.push(String(e)));
      await page.goto(server.url);

      // Before the download: what the model is and needs, read from its header with Range requests.
      await page.waitForSelector("#model-info:not([hidden])", { timeout: LOAD_TIMEOUT });
      assert.match(await page.textContent("#model-info-title"), /before downloading/);
      await assertFacts(page, facts);
      assert.deepEqual(fullDownloads(server), []);
      assert.match(await page.textContent("#load"), new RegExp(`Download ${facts.size} and load`));

      await page.click("#load");
      await page.screenshot({ path: path.join(artifacts, "page-loading.png") });
      await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
      assert.equal(await page.getAttribute("body", "data-from-cache"), "false");
      assert.equal(fullDownloads(server).length, 1);
      assert.match(await page.textContent("#model-info-title"), /loaded$/);
      await assertFacts(page, facts);
      await page.waitForSelector("#cached-models li");
      assert.deepEqual(await page.$$eval("#cached-models li .name", (els) => els.map((e) => e.textContent)), [DEFAULT_NAME]);
      assert.match(await page.textContent("#cached-models li .size"), new RegExp(`^${facts.size}`));

      // Greedy chat: the answer grows over several DOM updates (each one the page makes is
      // recorded) and equals the CPU reference's text.
      await setSlider(page, "temperature", 0);
      await setSlider(page, "top-p", 0.5);
      assert.equal(await page.textContent("#temperature-value"), "0.00");
      assert.equal(await page.textContent("#top-p-value"), "0.50");
      await page.evaluate(() => {
        window.replyStates = new Set();
        new MutationObserver(() => {
          const text = document.querySelector("#messages li.assistant:last-child .text")?.textContent;
          if (text) window.replyStates.add(text);
        }).observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
      });
      await page.fill("#prompt", QUESTION);
      await page.click("#send");
      await page.waitForFunction(() => window.replyStates.size >= 2, null, { timeout: GEN_TIMEOUT, polling: 50 });
      await page.screenshot({ path: path.join(artifacts, "page-generating.png") });
      await waitIdle(page);
      assert.equal(await lastReply(page), answer.text);
      const seen = await page.evaluate(() => window.replyStates.size);
      assert.ok(seen >= 3, `the answer should appear over several updates, saw ${seen}`);
      const request = JSON.parse(await page.getAttribute("body", "data-last-request"));
      assert.equal(request.temperature, 0);
      assert.equal(request.topP, 0.5);
      assert.match(await page.textContent("#stats"), /TTFT .* tok\/s/);

      // Stop mid-generation, then the page can send again. Stop is pressed as soon as the answer
      // shows its first text (the tiny model would finish 200 tokens in seconds); top-k 1 keeps the
      // answer from ending at a sampled end-of-sequence token first.
      await setSlider(page, "temperature", 0.8);
      await page.fill("#max-tokens", "200");
      await page.fill("#top-k", "1");
      await page.evaluate(() => {
        const observer = new MutationObserver(() => {
          if (document.querySelector("#messages li.assistant:last-child .text")?.textContent && document.body.dataset.generating === "true") {
            observer.disconnect();
            document.getElementById("stop").click();
          }
        });
        observer.observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
      });
      await page.fill("#prompt", "Tell me a long story about a dragon who learns to sing.");
      await page.click("#send");
      await waitIdle(page);
      assert.match(await page.textContent("#stats"), /aborted/);
      const stopped = JSON.parse(await page.getAttribute("body", "data-last-request"));
      assert.equal(stopped.temperature, 0.8);
      assert.equal(stopped.topK, 1);
      await page.fill("#top-k", "40");
      await page.fill("#max-tokens", "2");
      await page.fill("#prompt", "Thanks!");
      assert.equal(await page.isEnabled("#send"), true);
      await page.click("#send");
      await waitIdle(page);
      assert.ok((await page.$$("#messages li.assistant")).length === 3);
      // The page resends the conversation each turn: the engine forks the last turn's KV blocks.
      const reused = (await page.textContent("#stats")).match(/(\d+) prompt \((\d+) from the KV cache\)/);
      assert.ok(reused && Number(reused[2]) >= 16 && Number(reused[2]) < Number(reused[1]), await page.textContent("#stats"));
      assert.deepEqual(errors, []);

      // The "inside the engine" panel: phase, KV gauge and the candidates top-p kept.
      await page.click("#inside summary");
      await setSlider(page, "temperature", 1);
      await setSlider(page, "top-p", 0.3);
      await page.fill("#max-tokens", "1");
      await page.fill("#prompt", "Name a color.");
      await page.click("#send");
      await waitIdle(page);
      const narrow = await page.$$eval("#candidates li", (lis) => lis.map((li) => li.className));
      assert.equal(narrow.length, 10);
      assert.ok(narrow.includes("kept") && narrow.includes("dropped"), `top-p 0.3 keeps few: ${narrow}`);
      const kv = await page.textContent("#kv-text");
      const held = Number(kv.match(/^(\d+) \/ (\d+) tokens/)[1]);
      assert.ok(held > 40, kv);
      // 2 (K, V) x layers x KV heads x head dim x bytes per value (the engine's: 2 for f16, 4 for f32) per token.
      const bytesPerValue = Number(await page.getAttribute("body", "data-kv-bytes-per-value"));
      assert.ok(bytesPerValue === 2 || bytesPerValue === 4, `bytes per value ${bytesPerValue}`);
      assert.match(kv, new RegExp(`${formatBytes(held * 2 * facts.layers * facts.kvHeads * facts.headDim * bytesPerValue)}`));
      // The KV pool: the conversation's blocks, drawn one square each.
      const pool = (await page.textContent("#kv-pool-text")).match(/^(\d+) of (\d+) blocks of (\d+) tokens held/);
      assert.ok(pool, await page.textContent("#kv-pool-text"));
      const [usedBlocks, allBlocks, blockTokens] = pool.slice(1).map(Number);
      assert.ok(usedBlocks >= Math.ceil(held / blockTokens) && usedBlocks <= allBlocks, `${usedBlocks} blocks for ${held} tokens`);
      assert.equal(await page.$$eval("#kv-pool span", (s) => s.length), allBlocks);
      assert.equal(await page.$$eval("#kv-pool span:not(.free)", (s) => s.length), usedBlocks);
      await setSlider(page, "top-p", 1);
      await page.fill("#prompt", "And another?");
      await page.click("#send");
      await waitIdle(page);
      const wide = await page.$$eval("#candidates li", (lis) => lis.filter((li) => li.className === "kept").length);
      assert.ok(wide > narrow.filter((c) => c === "kept").length, "a higher top-p keeps more candidates");
      assert.equal(await page.textContent("#phase"), "idle");
      await page.screenshot({ path: path.join(artifacts, "page-inside-engine.png") });

      // Speculative decoding (prompt lookup) on a repetitive request: the panel shows each token,
      // accepted drafts marked and rejected drafts struck out, and counts them. In a new chat, so
      // that the greedy reply does not depend on the sampled and stopped turns above.
      await page.click("#clear");
      await page.selectOption("#speculate", "lookup");
      await setSlider(page, "temperature", 0);
      await page.fill("#max-tokens", "12");
      await page.fill("#prompt", "Repeat: red, green, blue, red, green, blue, red, green, blue, red, green, blue");
      await page.click("#send");
      await waitIdle(page);
      assert.equal(JSON.parse(await page.getAttribute("body", "data-last-request")).speculate, "lookup");
      const drafted = (await page.textContent("#drafts-text")).match(/^(\d+) of (\d+) drafted tokens accepted/);
      assert.ok(drafted && Number(drafted[2]) > 0, await page.textContent("#drafts-text"));
      const generated = Number((await page.textContent("#stats")).match(/\+ (\d+) generated tokens/)[1]);
      assert.equal(await page.$$eval("#drafts span.accepted, #drafts span.own", (s) => s.length), generated);
      assert.equal(await page.$$eval("#drafts span.accepted", (s) => s.length), Number(drafted[1]));
      assert.equal(await page.$$eval("#drafts span.rejected", (s) => s.length), Number(drafted[2]) - Number(drafted[1]));
      await page.screenshot({ path: path.join(artifacts, "page-speculation.png") });
      await page.selectOption("#speculate", "");

      // The JSON schema box: the reply is JSON the schema holds, and the panel counts the tokens
      // the constraint allowed; text that is not JSON is said before a turn is taken.
      await page.click("#clear");
      const schema = { type: "object", properties: { c: { enum: ["red", "blue"] }, n: { type: "integer", minimum: 0, maximum: 9 } },
        required: ["c", "n"], additionalProperties: false, "x-guidance": { whitespace_flexible: false } };
      await page.fill("#json-schema", JSON.stringify(schema));
      await page.fill("#max-tokens", "40");
      await page.fill("#prompt", "A color and a digit, as JSON.");
      await page.click("#send");
      await waitIdle(page);
      const json = JSON.parse(await lastReply(page));
      assert.ok(["red", "blue"].includes(json.c) && Number.isInteger(json.n) && json.n >= 0 && json.n <= 9, JSON.stringify(json));
      assert.equal(JSON.parse(await page.getAttribute("body", "data-last-request")).responseFormat.json_schema.schema.required.length, 2);
      assert.match(await page.textContent("#allowed-text"), /^\d+ of \d+ tokens allowed for /);
      await page.fill("#json-schema", "{not json");
      await page.fill("#prompt", "Again?");
      await page.click("#send");
      assert.match(await page.textContent("#error"), /JSON schema is not JSON/);
      assert.equal((await page.$$("#messages li.assistant")).length, 1, "no turn taken");
      await page.fill("#json-schema", "");
      assert.deepEqual(errors, []);

      // Reload: the model is checked and loaded from Cache Storage at once, nothing from the network.
      const before = ggufGets(server).length;
      await page.reload();
      await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
      assert.equal(await page.getAttribute("body", "data-from-cache"), "true");
      assert.equal(ggufGets(server).length, before, "the GGUF was fetched again");
      assert.match(await page.textContent("#load-status"), /browser cache/);
      await assertFacts(page, facts);

      // Delete it from the list: gone from the browser's storage, and the list says so.
      await page.waitForSelector("#cached-models li button.delete");
      await page.click("#cached-models li button.delete");
      await page.waitForSelector("#cache-empty:not([hidden])");
      assert.deepEqual(await cacheKeys(page), []);
      assert.deepEqual(await opfsFiles(page) ?? [], []);
      assert.equal(await page.$$eval("#cached-models li", (lis) => lis.length), 0);

      // A download cut off halfway: an error in words, nothing cached, and a second try works.
      await page.click("#check");
      await page.waitForSelector("#load:not([disabled])");
      server.cutNext();
      await page.click("#load");
      await page.waitForSelector("#error:not([hidden])", { timeout: LOAD_TIMEOUT });
      const cut = await page.textContent("#error");
      assert.match(cut, /could not be loaded: the model download from .* failed .*try again/);
      assert.ok(fullDownloads(server).at(-1).sent < fs.statSync(modelPath).size);
      await page.screenshot({ path: path.join(artifacts, "page-cut-download.png") });
      assert.deepEqual(await cacheKeys(page), []);
      assert.deepEqual(await opfsFiles(page) ?? [], []);
      assert.equal(await page.$$eval("#cached-models li", (lis) => lis.length), 0);
      await page.click("#load");
      await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
      assert.equal(await page.isHidden("#error"), true);
      assert.equal(await page.getAttribute("body", "data-from-cache"), "false");
      await page.waitForSelector("#cached-models li");
      // One model, in OPFS (Chromium has it): the whole file and its record beside it.
      assert.deepEqual(await cacheKeys(page), []);
      const files = await opfsFiles(page);
      assert.deepEqual(files.map((f) => path.extname(f)), [".gguf", ".json"], JSON.stringify(files));

      // The known models on Hugging Face: unreachable from this test machine, which the page says in words.
      const known = await page.$$eval("#known-models option", (os) => os.map((o) => o.value));
      for (const name of ["gemma-3-270m-it-Q4_K_M.gguf", "qwen2.5-0.5b-instruct-q4_k_m.gguf", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"]) {
        assert.ok(known.some((url) => url.startsWith("https://huggingface.co/") && url.endsWith(`/resolve/main/${name}`)), name);
      }
      await page.selectOption("#known-models", { index: 1 });
      await page.waitForSelector("#error:not([hidden])", { timeout: 120_000 });
      assert.match(await page.textContent("#error"), /could not be checked: could not reach https:\/\/huggingface\.co\//);
      assert.match(await page.textContent("#load-status"), /^Ready/);

      // A corrupted GGUF (the default model's first 3 MB): the error is shown in words, the page keeps working.
      const bad = path.join(artifacts, "corrupted.gguf");
      const head = fs.readFileSync(defaultModel).subarray(0, 3_000_000);
      fs.writeFileSync(bad, head);
      await page.setInputFiles("#file-input", bad);
      await page.waitForSelector("#error:not([hidden])", { timeout: LOAD_TIMEOUT });
      const message = await page.textContent("#error");
      assert.match(message, /could not be loaded: GGUF .* truncated or corrupt/);
      await page.screenshot({ path: path.join(artifacts, "page-error.png") });
      assert.deepEqual(errors, []);

      // Phone width: nothing overflows horizontally.
      await page.setViewportSize({ width: 375, height: 800 });
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
      assert.ok(overflow <= 0, `the page is ${overflow}px wider than a phone screen`);
      await page.screenshot({ path: path.join(artifacts, "page-phone.png"), fullPage: true });
    } finally {
      server.close();
    }
  } finally {
    await browser.close();
  }
});

test("after the GPU device is lost the page says so, keeps the conversation and loads the model again", { timeout: 600_000 }, async () => {
  // The real default model beside the page, and the tiny one at a URL the user pastes.
  const server = await serveDist({ [DEFAULT_NAME]: defaultModel, [PASTED_NAME]: modelPath });
  const browser = await launch();
  try {
    const context = await browser.newContext();
    // The worker's GPU device is out of reach of init scripts: the engine's worker script
    // (the package's engine-worker.js) is served, the first time, with a prologue that keeps
    // every device it creates and destroys them when the first chat request arrives (its
    // listener runs before the worker's own). The worker of the load after the loss is plain.
    const prologue = `
      const devices = [];
      const requestDevice = GPUAdapter.prototype.requestDevice;
      GPUAdapter.prototype.requestDevice = async function (...args) {
        const device = await requestDevice.apply(this, args);
        devices.push(device);
        return device;
      };
      let lose = true;
      addEventListener("message", ({ data }) => {
        if (data.op !== "create" || !lose) return;
        lose = false;
        for (const device of devices) device.destroy();
      });
    `;
    let injected = 0;
    await context.route("**/engine-worker.js", async (route) => {
      const response = await route.fetch();
      injected += 1;
      await route.fulfill({ response, body: (injected === 1 ? prologue : "") + (await response.text()) });
    });
    const page = await context.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(server.url);
    // The default model checked at start; then the pasted URL checked and loaded.
    await page.waitForSelector("#load:not([disabled])", { timeout: LOAD_TIMEOUT });
    assert.match(await page.textContent("#model-info-title"), new RegExp(DEFAULT_NAME.replaceAll(".", "\\.")));
    await page.fill("#model-url", `${server.url}models/${PASTED_NAME}`);
    await page.click("#check");
    await page.waitForFunction((name) => document.getElementById("model-info-title").textContent.includes(name) && !document.getElementById("load").disabled, PASTED_NAME, { timeout: LOAD_TIMEOUT });
    await assertFacts(page, modelFacts());
    assert.deepEqual(fullDownloads(server), []);
    await page.click("#load");
    await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
    assert.equal(injected, 1);
    assert.deepEqual(fullDownloads(server).map((r) => r.path), [`/models/${PASTED_NAME}`]);

    await setSlider(page, "temperature", 0);
    await page.fill("#prompt", QUESTION);
    await page.click("#send");
    await page.waitForSelector("#error:not([hidden])", { timeout: GEN_TIMEOUT });
    await waitIdle(page);
    assert.match(await page.textContent("#error"), /GPU stopped working for this page: the GPU device was lost .* press “Load again”/);
    assert.match(await page.textContent("#load-status"), /GPU device was lost/);
    assert.equal(await page.getAttribute("body", "data-model-loaded"), null);
    assert.equal(await page.isDisabled("#send"), true);
    assert.equal(await page.textContent("#load"), "Load again");
    assert.equal(await page.isEnabled("#load"), true);
    await page.screenshot({ path: path.join(artifacts, "page-device-lost.png") });

    // Load again (from the browser cache), and the same question gets the CPU reference's answer.
    await page.click("#load");
    await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
    assert.equal(await page.isHidden("#error"), true);
    assert.equal(await page.getAttribute("body", "data-from-cache"), "true");
    await page.click("#clear");
    await page.fill("#prompt", QUESTION);
    await page.click("#send");
    await waitIdle(page);
    assert.equal(await lastReply(page), answer.text);
    assert.deepEqual(errors, []);
  } finally {
    await browser.close();
    server.close();
  }
});

test("without WebGPU the page says so in plain words and downloads nothing", { timeout: 300_000 }, async () => {
  const server = await serveDist();
  const browser = await launch({ webgpu: false });
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(server.url);
    await page.waitForSelector("#error:not([hidden])", { timeout: 120_000 });
    assert.match(await page.textContent("#error"), /WebGPU/);
    assert.equal(await page.isDisabled("#send"), true);
    assert.equal(ggufGets(server).length, 0);
    assert.deepEqual(errors, []);
  } finally {
    await browser.close();
    server.close();
  }
});
