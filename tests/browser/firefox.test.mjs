// The npm package and the page in Debian's Firefox ESR, headless, with WebGPU turned on by
// preference (dom.webgpu.enabled; gfx.webgpu.ignore-blocklist, without which Firefox gives no
// adapter on Mesa's lavapipe), driven through geckodriver from selenium-webdriver (classic
// WebDriver for the page's scripts, WebDriver BiDi for its console and uncaught errors).
// Firefox runs WebGPU on lavapipe through its own wgpu (Vulkan), not SwiftShader as Chromium
// does: its adapter offers shader-f16 (so the engine takes its f16 path, which Chromium's tests
// never reach) and no `subgroups`, a 128 MiB storage binding, 1 GiB buffers, and it answers
// mapAsync and onSubmittedWorkDone only on its 100 ms device poll (a decode step waits for one).
// What the tiny model must say comes from the crate's CPU reference on the same file (lib.mjs).
// Needs firefox-esr (apt), geckodriver (cargo install) and selenium-webdriver (npm): a missing
// one fails the test in words, it is never skipped.
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { Builder, By } from "selenium-webdriver";
import firefox from "selenium-webdriver/firefox.js";
import LogInspector from "selenium-webdriver/bidi/logInspector.js";
import { serve, stage, packageHtml as html, modelPath, defaultModel, root, artifacts, cpu, CHAT_A, CHAT_B, RAW_A, tinyAnswers, cacheKeys, opfsFiles } from "./lib.mjs";

const FIREFOX = process.env.FIREFOX ?? "/usr/bin/firefox-esr";
const GECKODRIVER = process.env.GECKODRIVER ?? findOnPath("geckodriver") ?? path.join(os.homedir(), ".cargo/bin/geckodriver");
/** What turns WebGPU on in Firefox ESR on lavapipe: the first alone gives navigator.gpu and a null adapter (blocklisted). */
const WEBGPU_PREFS = { "dom.webgpu.enabled": true, "gfx.webgpu.ignore-blocklist": true };
const CHUNK_BYTES = 32 << 20;

const { chatA, chatB, rawA } = tinyAnswers();

function findOnPath(name) {
  for (const dir of (process.env.PATH ?? "").split(":")) {
    const file = path.join(dir, name);
    if (dir && fs.existsSync(file)) return file;
  }
  return null;
}

/**
 * Headless Firefox ESR with a fresh profile: {driver, evaluate, goto, errors, close}. `prefs`:
 * Firefox preferences (WEBGPU_PREFS by default); `env`: more environment for Firefox (e.g. a
 * Vulkan ICD that does not exist). `evaluate(fn, arg)` runs `fn(arg)` in the page and awaits it
 * (classic WebDriver's execute awaits a returned promise). The page's console is forwarded;
 * its uncaught exceptions are collected in `errors`.
 */
async function launchFirefox({ prefs = WEBGPU_PREFS, env = {} } = {}) {
  for (const [what, file, how] of [["Firefox ESR", FIREFOX, "apt-get install firefox-esr"], ["geckodriver", GECKODRIVER, "cargo install geckodriver --version 0.37.1 --locked"]]) {
    assert.ok(fs.existsSync(file), `${what} is not at ${file} (scripts/install-deps: ${how})`);
  }
  const options = new firefox.Options().setBinary(FIREFOX).addArguments("-headless").enableBidi();
  for (const [name, value] of Object.entries(prefs)) options.setPreference(name, value);
  // Mesa wants a private runtime dir (else "XDG_RUNTIME_DIR is invalid" on every start).
  const xdg = fs.mkdtempSync(path.join(os.tmpdir(), "firefox-xdg-"));
  fs.chmodSync(xdg, 0o700);
  const service = new firefox.ServiceBuilder(GECKODRIVER).setEnvironment({ ...process.env, MOZ_HEADLESS: "1", XDG_RUNTIME_DIR: xdg, ...env });
  const driver = await new Builder().forBrowser("firefox").setFirefoxOptions(options).setFirefoxService(service).build();
  const errors = [];
  try {
    await driver.manage().setTimeouts({ script: 300_000, pageLoad: 60_000 });
    const logs = await LogInspector(driver);
    await logs.onConsoleEntry((e) => console.log(`page ${e.level}:`, e.text));
    await logs.onJavascriptException((e) => errors.push(e.text));
  } catch (e) {
    await driver.quit();
    throw e;
  }
  return {
    driver,
    errors,
    goto: (url) => driver.get(url),
    evaluate: (fn, arg) => driver.executeScript(`return (${fn})(arguments[0]);`, arg ?? null),
    close: async () => {
      await driver.quit();
      fs.rmSync(xdg, { recursive: true, force: true });
    },
  };
}

/**
 * Waits until `done()` is true in the page, failing as soon as `progress()` has not changed for
 * `stall` ms with what the page last reported (lib.mjs's waitWithProgress, for WebDriver).
 */
async function waitFor(ff, done, progress, { stall = 240_000, poll = 1000 } = {}) {
  let last;
  let changed = Date.now();
  for (;;) {
    const state = await ff.evaluate(([d, p]) => ({ done: !!(0, eval)(d)(), progress: JSON.stringify((0, eval)(p)() ?? null) }), [done.toString(), progress.toString()]);
    if (state.done) return;
    if (state.progress !== last) [last, changed] = [state.progress, Date.now()];
    if (Date.now() - changed > stall) throw new Error(`the page made no progress for ${stall / 1000} s; it last reported ${last}`);
    await new Promise((resolve) => setTimeout(resolve, poll));
  }
}

const ggufGets = (server) => server.requests.filter((r) => r.path.endsWith(".gguf") && r.method === "GET");

test("Firefox ESR gives a WebGPU adapter on lavapipe only with both its preferences, and the package says so in words without them, downloading nothing", { timeout: 300_000 }, async () => {
  const dir = stage("firefox-nogpu", { "index.html": html(`import { Engine } from "./pkg/index.js"; window.Engine = Engine; window.ready = true;`) });
  const server = await serve(dir);
  try {
    const load = `async () => { try { await window.Engine.load("./model.gguf"); return null; } catch (e) { return String(e && e.message); } }`;
    const open = async (options) => {
      const ff = await launchFirefox(options);
      await ff.goto(`${server.url}index.html`);
      await waitFor(ff, () => window.ready, () => 0, { stall: 60_000 });
      return ff;
    };
    // No preference: no navigator.gpu (Firefox ESR ships WebGPU off on Linux).
    let ff = await open({ prefs: {} });
    try {
      assert.equal(await ff.evaluate(() => "gpu" in navigator), false);
      assert.match(await ff.evaluate(load), /^WebGPU is not available in this browser/);
    } finally {
      await ff.close();
    }
    // dom.webgpu.enabled alone: navigator.gpu, but Firefox's blocklist refuses lavapipe.
    ff = await open({ prefs: { "dom.webgpu.enabled": true } });
    try {
      assert.equal(await ff.evaluate(async () => (await navigator.gpu.requestAdapter()) === null), true);
      assert.match(await ff.evaluate(load), /^WebGPU is enabled but found no usable GPU adapter/);
    } finally {
      await ff.close();
    }
    // Both preferences but no Vulkan driver: a null adapter again; with lavapipe, an adapter.
    ff = await open({ env: { VK_ICD_FILENAMES: "/nonexistent/icd.json" } });
    try {
      assert.equal(await ff.evaluate(async () => (await navigator.gpu.requestAdapter()) === null), true);
      assert.match(await ff.evaluate(load), /^WebGPU is enabled but found no usable GPU adapter/);
      assert.deepEqual(ff.errors, []);
    } finally {
      await ff.close();
    }
    ff = await open();
    try {
      assert.equal(await ff.evaluate(async () => (await navigator.gpu.requestAdapter())?.info.isFallbackAdapter), true);
    } finally {
      await ff.close();
    }
    assert.deepEqual(ggufGets(server), [], "a load without a GPU downloaded the model");
  } finally {
    server.close();
  }
});

test("the package in Firefox ESR on lavapipe: f16, greedy chats and ids as the CPU reference, SmolLM2 as transformers, seeds, batches, beams, Cache Storage and OPFS", { timeout: 900_000 }, async () => {
  const dir = stage("firefox-package", { "index.html": html(`import { Engine } from "./pkg/index.js"; window.Engine = Engine; window.ready = true;`) });
  // The page's default model (98 MB: 3 chunks of Cache Storage, one OPFS file), only downloaded and cached.
  fs.symlinkSync(defaultModel, path.join(dir, "default.gguf"));
  const server = await serve(dir);
  const ff = await launchFirefox();
  try {
    await ff.goto(`${server.url}index.html`);
    await waitFor(ff, () => window.ready, () => 0, { stall: 60_000 });
    const adapter = await ff.evaluate(async () => {
      const a = await navigator.gpu.requestAdapter();
      return { features: [...a.features], fallback: a.info.isFallbackAdapter, binding: a.limits.maxStorageBufferBindingSize, invocations: a.limits.maxComputeInvocationsPerWorkgroup };
    });
    console.log("adapter:", JSON.stringify(adapter));

    const t0 = Date.now();
    const loaded = await ff.evaluate(async () => {
      window.engine = await window.Engine.load("./model.gguf");
      return window.engine.info();
    });
    console.log(`load: ${Date.now() - t0} ms; ${loaded.backend}`);
    assert.equal(loaded.architecture, "llama");
    assert.equal(loaded.fromCache, false);
    // The engine takes f16 and subgroups where the adapter offers them (src/gpu/device.rs).
    assert.equal(loaded.f16, adapter.features.includes("shader-f16"));
    assert.equal(loaded.subgroups, adapter.features.includes("subgroups"));

    // Greedy chat: the CPU reference's tokens, ending at its end-of-sequence token.
    const chat = async (messages) => {
      const ids = [];
      let text = "";
      for await (const ev of window.engine.chat(messages, { temperature: 0, maxTokens: 64 })) {
        ids.push(ev.id);
        text += ev.text;
      }
      return { ids, text, stats: window.engine.stats() };
    };
    const greedy = await ff.evaluate(`async (m) => (${chat})(m)`, [{ role: "user", content: CHAT_A }]);
    console.log(`greedy: ${greedy.ids.length} tokens, TTFT ${greedy.stats.ttftMs} ms, decode ${greedy.stats.decodeTokS.toFixed(1)} tok/s`);
    assert.equal(chatA.stats.stop_reason, "Eos");
    assert.deepEqual(greedy.ids, chatA.ids);
    assert.equal(greedy.text, chatA.text);
    assert.equal(greedy.stats.finishReason, "stop");

    // The same seed samples the same tokens.
    const seeded = await ff.evaluate(async () => {
      const run = async () => {
        let text = "";
        for await (const ev of window.engine.chat([{ role: "user", content: "Hi" }], { temperature: 0.7, topP: 0.9, maxTokens: 24, seed: 42 })) text += ev.text;
        return text;
      };
      return [await run(), await run()];
    });
    assert.ok(seeded[0].length > 0);
    assert.equal(seeded[1], seeded[0]);

    // Two chat completions streamed at once (one batch) each give the CPU reference's text; raw ids too.
    const both = await ff.evaluate(async (conversations) => {
      const run = async (messages) => {
        let text = "";
        for await (const chunk of await window.engine.chat.completions.create({ messages, stream: true, temperature: 0, max_tokens: 64 })) {
          for (const c of chunk.choices) text += c.delta.content ?? "";
        }
        return text;
      };
      return Promise.all(conversations.map(run));
    }, [[{ role: "user", content: CHAT_A }], [{ role: "user", content: CHAT_B }]]);
    assert.deepEqual(both, [chatA.text, chatB.text]);
    const raw = await ff.evaluate(async (prompt) => {
      const ids = [];
      for await (const ev of window.engine.generate(prompt, { temperature: 0, maxTokens: 10, ignoreEos: true })) ids.push(ev.id);
      return ids;
    }, RAW_A);
    assert.deepEqual(raw, rawA.ids);

    // Beam search: the CPU reference's beams and scores.
    const cpuBeams = cpu(modelPath, "Once upon a time", { beams: 2, maxTokens: 8, ignoreEos: true });
    const beams = await ff.evaluate((prompt) => window.engine.beamSearch(prompt, { beams: 2, maxTokens: 8, ignoreEos: true }), "Once upon a time");
    beams.forEach((b, i) => assert.deepEqual(b.ids, cpuBeams[i].ids, `beam ${i}`));
    beams.forEach((b, i) => assert.ok(Math.abs(b.score - cpuBeams[i].score) < 1e-3, `beam ${i}: ${b.score} vs ${cpuBeams[i].score}`));

    // After a reload the model comes from Cache Storage (no download) and says the same.
    await ff.evaluate(() => window.engine.unload());
    const downloads = ggufGets(server).length;
    await ff.goto(`${server.url}index.html`);
    await waitFor(ff, () => window.ready, () => 0, { stall: 60_000 });
    const again = await ff.evaluate(`async (m) => { window.engine = await window.Engine.load("./model.gguf"); const r = await (${chat})(m); r.fromCache = window.engine.info().fromCache; window.engine.unload(); return r; }`, [{ role: "user", content: CHAT_A }]);
    assert.equal(again.fromCache, true);
    assert.equal(again.text, chatA.text);
    assert.equal(ggufGets(server).length, downloads, "a cached model went to the network");

    // A 98 MB model: stored in Cache Storage as 32 MiB chunks within Firefox's quota, and in the
    // Origin Private File System (the default where the browser has it) as one file; listed,
    // inspected from the cache, deleted.
    const size = fs.statSync(defaultModel).size;
    const quota = await ff.evaluate(() => navigator.storage.estimate());
    console.log("storage estimate:", JSON.stringify(quota));
    assert.ok(quota.quota > 2 * size, `quota ${quota.quota}`);
    const t1 = Date.now();
    await ff.evaluate(async () => (await window.Engine.load("./default.gguf", { cache: "cache-storage" })).unload());
    console.log(`98 MB download and load: ${Date.now() - t1} ms`);
    const url = `${server.url}default.gguf`;
    const models = await ff.evaluate(() => window.Engine.cachedModels());
    assert.deepEqual(models.find((m) => m.url === url), { url, bytes: size, store: "cache-storage" });
    const chunks = Array.from({ length: Math.ceil(size / CHUNK_BYTES) }, (_, i) => `${url}?webgpu-llm-chunk=${i}`);
    assert.deepEqual((await cacheKeys(ff)).filter((k) => k.startsWith(url)).sort(), [url, ...chunks].sort());
    // Loaded from OPFS, SmolLM2 gives transformers' greedy tokens (the golden file's
    // raw_primes case: its top-two logit margins stay above 0.29 over these 24 steps, far beyond
    // the f16 path's 0.05 bound, so every id must match).
    const golden = JSON.parse(fs.readFileSync(path.join(root, "../shared/golden/generations.json"), "utf8")).cases.find((c) => c.name === "raw_primes");
    const smol = await ff.evaluate(async (prompt) => {
      const engine = await window.Engine.load("./default.gguf?copy");
      const ids = [];
      for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: 24, ignoreEos: true })) ids.push(ev.id);
      const info = engine.info();
      engine.unload();
      return { ids, f16: info.f16, stats: engine.stats() };
    }, golden.prompt_text);
    console.log(`SmolLM2 golden greedy: f16 ${smol.f16}, decode ${smol.stats.decodeTokS.toFixed(1)} tok/s`);
    assert.deepEqual(smol.ids, golden.generated_ids.slice(0, 24));
    assert.deepEqual((await ff.evaluate(() => window.Engine.cachedModels())).find((m) => m.url === `${url}?copy`), { url: `${url}?copy`, bytes: size, store: "opfs" });
    const count = ggufGets(server).length;
    assert.equal((await ff.evaluate(() => window.Engine.inspect("./default.gguf"))).source, "cache");
    assert.equal((await ff.evaluate(() => window.Engine.inspect("./default.gguf?copy"))).source, "cache");
    assert.equal(ggufGets(server).length, count, "inspect of a cached model went to the network");
    assert.equal(await ff.evaluate(() => window.Engine.deleteCached("./default.gguf")), true);
    assert.equal(await ff.evaluate(() => window.Engine.deleteCached("./default.gguf?copy")), true);
    assert.equal(await ff.evaluate(() => window.Engine.deleteCached("./model.gguf")), true);
    assert.deepEqual(await ff.evaluate(() => window.Engine.cachedModels()), []);
    assert.deepEqual(await cacheKeys(ff), []);
    assert.deepEqual(await opfsFiles(ff), []);
    assert.deepEqual(ff.errors, []);
  } finally {
    await ff.close();
    server.close();
  }
});

test("WorkerEngine in Firefox ESR: a dedicated worker and a shared one give the CPU reference's tokens", { timeout: 600_000 }, async () => {
  const dir = stage("firefox-worker", { "index.html": html(`import { WorkerEngine } from "./pkg/worker.js"; window.WorkerEngine = WorkerEngine; window.ready = true;`) });
  const server = await serve(dir);
  const ff = await launchFirefox();
  try {
    await ff.goto(`${server.url}index.html`);
    await waitFor(ff, () => window.ready, () => 0, { stall: 60_000 });
    for (const shared of [false, true]) {
      const got = await ff.evaluate(async ([content, shared]) => {
        try {
          const engine = await window.WorkerEngine.load("./model.gguf", { shared });
          const ids = [];
          for await (const ev of engine.chat([{ role: "user", content }], { temperature: 0, maxTokens: 64 })) ids.push(ev.id);
          const info = engine.info();
          await engine.unload();
          return { ids, shared: info.shared };
        } catch (e) {
          return { error: String(e && e.message), code: e && e.code };
        }
      }, [CHAT_A, shared]);
      console.log(`worker (shared ${shared}):`, JSON.stringify({ ...got, ids: got.ids?.length }));
      assert.equal(got.error, undefined, `shared ${shared}: ${got.error}`);
      assert.deepEqual(got.ids, chatA.ids, `shared ${shared}`);
      assert.equal(got.shared, shared);
    }
    assert.deepEqual(ff.errors, []);
  } finally {
    await ff.close();
    server.close();
  }
});

test("the page (dist/) in Firefox ESR: its worker loads the tiny model, the greedy answer is the CPU reference's, and a reload takes it from the cache", { timeout: 900_000 }, async () => {
  const dist = path.join(root, "dist");
  assert.ok(fs.existsSync(path.join(dist, "index.html")), "dist/ is not built (scripts/build-page)");
  // A copy of dist/ whose default model is the tiny one (as page.test.mjs stages it).
  const dir = path.join(artifacts, "firefox-page");
  fs.rmSync(dir, { recursive: true, force: true });
  fs.mkdirSync(path.join(dir, "models"), { recursive: true });
  for (const entry of fs.readdirSync(dist)) if (entry !== "models") fs.symlinkSync(path.join(dist, entry), path.join(dir, entry));
  fs.symlinkSync(modelPath, path.join(dir, "models", path.basename(defaultModel)));
  const answer = cpu(modelPath, { chat: CHAT_A }, { maxTokens: 256 });
  const server = await serve(dir);
  const ff = await launchFirefox();
  try {
    const loadModel = async (fromCache) => {
      await ff.goto(server.url);
      await waitFor(ff, () => !document.getElementById("model-info").hidden, () => 0, { stall: 120_000 });
      await ff.driver.findElement(By.id("load")).click();
      await waitFor(ff, () => document.body.dataset.modelLoaded === "true" || !document.getElementById("error").hidden, () => document.getElementById("load-status").textContent);
      assert.equal(await ff.evaluate(() => document.getElementById("error").hidden || document.getElementById("error").textContent), true);
      assert.equal(await ff.evaluate(() => document.body.dataset.fromCache), String(fromCache));
    };
    await loadModel(false);
    const ask = async () => {
      await ff.evaluate(() => {
        const set = (id, v) => {
          const el = document.getElementById(id);
          el.value = String(v);
          el.dispatchEvent(new Event("input", { bubbles: true }));
        };
        set("temperature", 0);
        set("top-p", 0.5);
      });
      await ff.driver.findElement(By.id("prompt")).sendKeys(CHAT_A);
      await ff.driver.findElement(By.id("send")).click();
      await waitFor(ff, () => document.body.dataset.generating === "false" && document.querySelector("#messages li.assistant .text"), () => document.querySelector("#messages li.assistant:last-child .text")?.textContent ?? null);
      assert.equal(await ff.evaluate(() => document.getElementById("error").hidden || document.getElementById("error").textContent), true);
      return ff.evaluate(() => [...document.querySelectorAll("#messages li.assistant .text")].at(-1).textContent);
    };
    const t0 = Date.now();
    assert.equal(await ask(), answer.text);
    console.log(`page answer: ${Date.now() - t0} ms; ${await ff.evaluate(() => document.getElementById("stats").textContent)}`);
    assert.equal(ggufGets(server).filter((r) => !r.range).length, 1);
    await loadModel(true);
    assert.equal(await ask(), answer.text);
    assert.equal(ggufGets(server).filter((r) => !r.range).length, 1, "a reload downloaded the model again");
    assert.deepEqual(ff.errors, []);
  } finally {
    await ff.close();
    server.close();
  }
});
