// End-to-end test of the web page (dist/, built by scripts/build-page) in Debian's headless
// Chromium: load, streamed chat with the golden greedy answer, sliders reaching the request,
// Stop, the browser cache on reload, and a corrupted GGUF shown as an error in words.
// Screenshots go to target/browser-tests/.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { launch, root, golden, artifacts, modelPath } from "./lib.mjs";

const LOAD_TIMEOUT = 600_000;
const GEN_TIMEOUT = 900_000;

/** Serves dist/ and records the paths requested (python's http.server logs them on stderr). */
function serveDist() {
  return new Promise((resolve, reject) => {
    const proc = spawn("python3", ["-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", path.join(root, "dist")], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    const requests = [];
    let out = "";
    proc.stderr.on("data", (d) => {
      for (const m of String(d).matchAll(/"GET ([^ ]+) HTTP/g)) requests.push(m[1]);
    });
    proc.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/port (\d+)/);
      if (m) resolve({ url: `http://127.0.0.1:${m[1]}/`, requests, close: () => proc.kill() });
    });
    proc.on("exit", (code) => reject(new Error(`server exited with ${code}`)));
  });
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

test("the page loads the model, chats, stops, caches the model and reports a bad file", { timeout: 3_000_000 }, async () => {
  const chatCase = golden.cases.find((c) => c.name === "chat_capital_france");
  const server = await serveDist();
  const browser = await launch();
  try {
    const context = await browser.newContext({ viewport: { width: 1100, height: 900 } });
    const page = await context.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(server.url);
    await page.screenshot({ path: path.join(artifacts, "page-loading.png") });
    await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
    assert.equal(await page.getAttribute("body", "data-from-cache"), "false");

    // Greedy chat: the answer grows over several DOM updates and equals the golden text.
    await setSlider(page, "temperature", 0);
    await setSlider(page, "top-p", 0.5);
    assert.equal(await page.textContent("#temperature-value"), "0.00");
    assert.equal(await page.textContent("#top-p-value"), "0.50");
    await page.fill("#prompt", chatCase.prompt_text.match(/<\|im_start\|>user\n([\s\S]*?)<\|im_end\|>/)[1]);
    await page.click("#send");
    const seen = new Set();
    let shot = false;
    while ((await page.getAttribute("body", "data-generating")) !== "false") {
      const text = await lastReply(page);
      if (text) seen.add(text);
      if (seen.size >= 2 && !shot) {
        await page.screenshot({ path: path.join(artifacts, "page-generating.png") });
        shot = true;
      }
      await page.waitForTimeout(100);
    }
    const answer = await lastReply(page);
    assert.equal(answer, chatCase.greedy_text_before_first_eos);
    assert.ok(seen.size >= 3, `the answer should appear over several updates, saw ${seen.size}`);
    const request = JSON.parse(await page.getAttribute("body", "data-last-request"));
    assert.equal(request.temperature, 0);
    assert.equal(request.topP, 0.5);
    assert.match(await page.textContent("#stats"), /TTFT .* tok\/s/);

    // Stop mid-generation, then the page can send again.
    await setSlider(page, "temperature", 0.8);
    await page.fill("#max-tokens", "200");
    await page.fill("#prompt", "Tell me a long story about a dragon who learns to sing.");
    await page.click("#send");
    await page.waitForFunction(() => (document.querySelector("#messages li.assistant:last-child .text")?.textContent ?? "").length > 0, null, {
      timeout: GEN_TIMEOUT,
      polling: 250,
    });
    await page.click("#stop");
    await waitIdle(page);
    assert.match(await page.textContent("#stats"), /aborted/);
    assert.equal(JSON.parse(await page.getAttribute("body", "data-last-request")).temperature, 0.8);
    await page.fill("#max-tokens", "2");
    await page.fill("#prompt", "Thanks!");
    assert.equal(await page.isEnabled("#send"), true);
    await page.click("#send");
    await waitIdle(page);
    assert.ok((await page.$$("#messages li.assistant")).length === 3);
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
    // 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (f32 cache in this browser) per token.
    assert.match(kv, new RegExp(`${(held * 2 * 30 * 3 * 64 * 4 / 1024 ** 2).toFixed(1)} MiB`));
    await setSlider(page, "top-p", 1);
    await page.fill("#prompt", "And another?");
    await page.click("#send");
    await waitIdle(page);
    const wide = await page.$$eval("#candidates li", (lis) => lis.filter((li) => li.className === "kept").length);
    assert.ok(wide > narrow.filter((c) => c === "kept").length, "a higher top-p keeps more candidates");
    assert.equal(await page.textContent("#phase"), "idle");
    await page.screenshot({ path: path.join(artifacts, "page-inside-engine.png") });

    // Reload: the model comes from Cache Storage, not the network.
    const before = server.requests.filter((r) => r.endsWith(".gguf")).length;
    assert.equal(before, 1);
    await page.reload();
    await page.waitForFunction(() => document.body.dataset.modelLoaded === "true", null, { timeout: LOAD_TIMEOUT, polling: 500 });
    assert.equal(await page.getAttribute("body", "data-from-cache"), "true");
    assert.equal(server.requests.filter((r) => r.endsWith(".gguf")).length, 1, "the GGUF was downloaded again");
    assert.match(await page.textContent("#load-status"), /browser cache/);

    // A corrupted GGUF: the error is shown in words, the page keeps working.
    const bad = path.join(artifacts, "corrupted.gguf");
    const head = fs.readFileSync(modelPath).subarray(0, 3_000_000);
    fs.writeFileSync(bad, head);
    await page.setInputFiles("#file-input", bad);
    await page.waitForSelector("#error:not([hidden])", { timeout: LOAD_TIMEOUT });
    const message = await page.textContent("#error");
    assert.match(message, /could not be loaded/);
    assert.match(message, /GGUF/);
    await page.screenshot({ path: path.join(artifacts, "page-error.png") });
    assert.deepEqual(errors, []);

    // Phone width: nothing overflows horizontally.
    await page.setViewportSize({ width: 375, height: 800 });
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    assert.ok(overflow <= 0, `the page is ${overflow}px wider than a phone screen`);
    await page.screenshot({ path: path.join(artifacts, "page-phone.png"), fullPage: true });
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
    assert.equal(server.requests.filter((r) => r.endsWith(".gguf")).length, 0);
    assert.deepEqual(errors, []);
  } finally {
    await browser.close();
    server.close();
  }
});
