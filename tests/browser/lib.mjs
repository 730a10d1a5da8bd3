// Shared by the browser tests: a static server on 127.0.0.1 (Range requests, a request log, and a
// download it can cut off midway) and Debian's Chromium with WebGPU (SwiftShader on a machine
// without a GPU). Never downloads a browser.
import http from "node:http";
import { Readable } from "node:stream";
import { chromium } from "playwright-core";
import { fileURLToPath } from "node:url";
import path from "node:path";
import fs from "node:fs";
import os from "node:os";
import { execFileSync } from "node:child_process";

export const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
/**
 * The model the tests generate with: the committed tiny random-weight Llama 3 (1 MB, F32, 2
 * layers, a 512-token byte-level BPE with ChatML tokens; tests/data/arch/README.md), so that a
 * token takes milliseconds in SwiftShader where SmolLM2's took most of a second. What it should
 * say comes from the crate's CPU reference on the same file (`cpu` below).
 */
export const modelPath = path.join(root, "tests/data/arch/llama3/model.gguf");
/**
 * The page's default model (scripts/fetch-model): read only where its size is the point (the
 * header read before a download, 32 MiB cache chunks, the 8B model's tokenizer), never decoded.
 */
export const defaultModel = path.join(root, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
export const artifacts = path.join(root, "target/browser-tests");
fs.mkdirSync(artifacts, { recursive: true });

const cli = process.env.WEBGPU_LLM_CLI ?? path.join(root, "target/release/webgpu-llm");

/**
 * The crate's CPU reference (`webgpu-llm generate --backend cpu`, built by scripts/test before
 * these tests) on `model`: the oracle for what the browser must generate from the same file.
 * `prompt` is raw text, or `{ chat: "user message" }` for the model's chat template. Greedy by
 * default; `beams: N` runs beam search. Returns {ids, text, stats} (stats as the CLI's JSON:
 * prompt_tokens, generated_tokens, stop_reason...) or, with beams, the CLI's [{ids, text, score}].
 */
export function cpu(model, prompt, { maxTokens = 64, ignoreEos = false, beams = null, regex = null, jsonSchema = null } = {}) {
  const args = ["generate", "--backend", "cpu", "--model", model, "--json", "--max-tokens", String(maxTokens), "--temperature", "0"];
  if (typeof prompt === "string") args.push("--prompt", prompt);
  else args.push("--chat", "--prompt", prompt.chat);
  if (ignoreEos) args.push("--ignore-eos");
  if (beams) args.push("--beams", String(beams));
  if (regex) args.push("--regex", regex);
  if (jsonSchema) {
    const file = path.join(os.tmpdir(), `schema-${process.pid}-${Date.now()}.json`);
    fs.writeFileSync(file, JSON.stringify(jsonSchema));
    args.push("--json-schema", file);
  }
  const lines = execFileSync(cli, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] }).trim().split("\n").map((l) => JSON.parse(l));
  if (beams) return lines[0].beams;
  const tokens = lines.filter((l) => "id" in l);
  return { ids: tokens.map((t) => t.id), text: tokens.map((t) => t.text).join(""), stats: lines.at(-1).stats };
}

/**
 * The tiny model's test prompts, one place: chat messages whose greedy answer ends at its
 * end-of-sequence token (after 40 and 32 tokens: the tests check the reference says so, so a
 * finish_reason "stop" is one) and raw prompts.
 */
export const CHAT_A = "ran name red me";
export const CHAT_B = "green red red on far";
export const RAW_A = "The Fibonacci numbers are 0, 1, 1, 2, 3, 5, 8,";
export const RAW_B = "The first prime numbers are 2, 3, 5, 7,";
let answers = null;
/** What the CPU reference generates from each of those (greedy: 64 tokens a chat, 10 raw tokens past EOS), made once. */
export function tinyAnswers() {
  answers ??= {
    chatA: cpu(modelPath, { chat: CHAT_A }, { maxTokens: 64 }),
    chatB: cpu(modelPath, { chat: CHAT_B }, { maxTokens: 64 }),
    rawA: cpu(modelPath, RAW_A, { maxTokens: 10, ignoreEos: true }),
    rawB: cpu(modelPath, RAW_B, { maxTokens: 10, ignoreEos: true }),
  };
  return answers;
}

/**
 * What the package keeps in a page's origin, read in the page (`target`: a Playwright page, or
 * anything with the same evaluate(fn)): Cache Storage's keys, and the names in its OPFS folder
 * (sorted; null when it has none).
 */
export const cacheKeys = (target) => target.evaluate(async () => (await (await caches.open("webgpu-llm-models-v1")).keys()).map((r) => r.url));
export const opfsFiles = (target) => target.evaluate(async () => {
  const dir = await (await navigator.storage.getDirectory()).getDirectoryHandle("webgpu-llm-models").catch(() => null);
  if (!dir) return null;
  const names = [];
  for await (const name of dir.keys()) names.push(name);
  return names.sort();
});

/** `bytes` as the page and the package write sizes (formatBytes in www/app.js): B, KiB, MiB, GiB. */
export function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 ** 2) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

const TYPES = { ".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".wasm": "application/wasm", ".json": "application/json", ".png": "image/png" };

/**
 * Serves `dir` on an ephemeral port to any origin; resolves to {url, requests, cutNext, hangNext,
 * close}. `ranges: false` ignores Range headers (as python's http.server does). `virtual` maps
 * paths ("/big.gguf") to files made as they are sent: {size, chunks(start, end)} (big-model.mjs).
 * Every response is logged in `requests` as {method, path, range, status, sent, complete};
 * `cutNext()` makes the next full GET of a .gguf close the connection after half its body,
 * `hangNext()` stop sending then and keep the connection open.
 */
export function serve(dir, { ranges = true, virtual = {} } = {}) {
  const requests = [];
  let cut = null; // "close" or "hang": what the next full GET of a .gguf does half way
  const server = http.createServer((req, res) => {
    const urlPath = decodeURIComponent(new URL(req.url, "http://x").pathname);
    const entry = { method: req.method, path: urlPath, range: req.headers.range ?? null, status: 200, sent: 0, complete: false };
    requests.push(entry);
    if (req.method === "OPTIONS") {
      entry.status = 204;
      res.writeHead(204, { "access-control-allow-origin": "*", "access-control-allow-headers": "range" }).end();
      return;
    }
    let file = path.join(dir, urlPath);
    if (!file.startsWith(dir)) file = dir;
    if (urlPath.endsWith("/")) file = path.join(file, "index.html");
    const made = virtual[urlPath];
    let size;
    try {
      size = made ? made.size : fs.statSync(file).size;
    } catch {
      entry.status = 404;
      res.writeHead(404, { "content-type": "text/plain" }).end("not found");
      return;
    }
    let start = 0;
    let end = size - 1;
    // Any origin may read it, as on Hugging Face, but Content-Range is not exposed to other origins.
    const headers = { "content-type": TYPES[path.extname(made ? urlPath : file)] ?? "application/octet-stream", "cache-control": "no-store", "access-control-allow-origin": "*" };
    const m = ranges && entry.range && entry.range.match(/^bytes=(\d*)-(\d*)$/);
    if (m) {
      if (m[1] === "") start = Math.max(0, size - Number(m[2]));
      else [start, end] = [Number(m[1]), m[2] === "" ? size - 1 : Math.min(Number(m[2]), size - 1)];
      if (start >= size || start > end) {
        entry.status = 416;
        res.writeHead(416, { "content-range": `bytes */${size}` }).end();
        return;
      }
      entry.status = 206;
      headers["content-range"] = `bytes ${start}-${end}/${size}`;
    }
    if (ranges) headers["accept-ranges"] = "bytes";
    headers["content-length"] = String(end - start + 1);
    res.writeHead(entry.status, headers);
    if (req.method === "HEAD") return res.end();
    const cutting = !m && urlPath.endsWith(".gguf") ? cut : null;
    const limit = cutting ? Math.floor(size / 2) : Infinity;
    if (cutting) cut = null;
    const stream = made ? Readable.from(made.chunks(start, end)) : fs.createReadStream(file, { start, end });
    stream.on("data", (chunk) => {
      if (entry.sent + chunk.length > limit) {
        stream.destroy();
        res.write(chunk.subarray(0, limit - entry.sent), () => cutting === "close" && res.socket.destroy());
        entry.sent = limit;
        return;
      }
      entry.sent += chunk.length;
      if (!res.write(chunk)) stream.pause();
    });
    res.on("drain", () => stream.resume());
    stream.on("end", () => {
      entry.complete = true;
      res.end();
    });
    res.on("close", () => stream.destroy());
  });
  return new Promise((resolve) => {
    server.listen(0, "127.0.0.1", () => {
      resolve({
        url: `http://127.0.0.1:${server.address().port}/`,
        requests,
        cutNext: () => (cut = "close"),
        hangNext: () => (cut = "hang"),
        close: () => {
          server.closeAllConnections();
          server.close();
        },
      });
    });
  });
}

/** Headless Chromium; `webgpu: false` leaves WebGPU off, as on a browser without a usable GPU. */
export async function launch({ webgpu = true } = {}) {
  return chromium.launch(chromiumOptions(webgpu));
}

/**
 * Headless Chromium with a profile on disk, as a user has: its Cache Storage is on disk with a
 * quota of a share of the disk, where a fresh (incognito-like) context keeps it in memory and
 * refuses more than about 1.2 GB. A BrowserContext, with the profile removed on close.
 */
export async function launchWithProfile({ webgpu = true } = {}) {
  const profile = fs.mkdtempSync(path.join(artifacts, "profile-"));
  const context = await chromium.launchPersistentContext(profile, chromiumOptions(webgpu));
  const close = context.close.bind(context);
  context.close = async () => {
    await close();
    fs.rmSync(profile, { recursive: true, force: true });
  };
  return context;
}

function chromiumOptions(webgpu) {
  return {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      ...(webgpu ? ["--enable-unsafe-webgpu"] : []),
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--no-first-run",
      // window.gc(), so memory tests measure what is live, not what awaits collection.
      "--js-flags=--expose-gc",
      "--disable-dev-shm-usage",
    ],
  };
}

/** A folder to serve, with links to the built package and the test model (as model.gguf). */
export function stage(name, files) {
  const dir = path.join(artifacts, name);
  fs.rmSync(dir, { recursive: true, force: true });
  fs.mkdirSync(dir, { recursive: true });
  fs.symlinkSync(path.join(root, "pkg"), path.join(dir, "pkg"));
  fs.symlinkSync(modelPath, path.join(dir, "model.gguf"));
  for (const [file, text] of Object.entries(files)) fs.writeFileSync(path.join(dir, file), text);
  return dir;
}

/** A page that imports the package and runs `body` (a module script); it has a file input #file. */
export function packageHtml(body) {
  return `<!doctype html>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<input id="file" type="file" multiple>
<pre id="out"></pre>
<script type="module">
${body}
</script>`;
}

/**
 * A plain page that imports the package as `window.Engine`, staged as `name` with `files`, served
 * and open in Chromium with its console forwarded: {dir, server, browser, tab, close}. `init`: a
 * script run before the page's own (Playwright's addInitScript). `profile`:
 * a profile on disk (see launchWithProfile), for models over the in-memory cache quota.
 * `virtual`: files the server makes as it sends them (see serve).
 */
export async function openPackagePage(name, { files = {}, profile = false, init = null, virtual = {} } = {}) {
  const dir = stage(name, { "index.html": packageHtml(`import { Engine } from "./pkg/index.js"; window.Engine = Engine; window.ready = true;`), ...files });
  const server = await serve(dir, { virtual });
  const browser = profile ? await launchWithProfile() : await launch();
  try {
    const tab = await browser.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    if (init) await tab.addInitScript(init);
    await tab.goto(`${server.url}index.html`);
    await tab.waitForFunction(() => window.ready);
    return { dir, server, browser, tab, close: async () => { await browser.close(); server.close(); } };
  } catch (e) {
    await browser.close();
    server.close();
    throw e;
  }
}

/**
 * Waits until `done()` is true in the page, failing as soon as `progress()` (any JSON value: the
 * bytes loaded, the tokens streamed) has not changed for `stall` ms, with what the page last
 * reported and whether its main thread still answers: a hang is reported where it happened, in
 * minutes, not after the whole test's time.
 */
export async function waitWithProgress(tab, done, progress, { stall = 240_000, poll = 2000 } = {}) {
  let last;
  let changed = Date.now();
  for (;;) {
    const state = await Promise.race([
      tab.evaluate(([d, p]) => ({ done: (0, eval)(d)(), progress: JSON.stringify((0, eval)(p)()) }), [done.toString(), progress.toString()]),
      new Promise((resolve) => setTimeout(() => resolve(null), 30_000)),
    ]);
    if (state?.done) return;
    if (state && state.progress !== last) {
      last = state.progress;
      changed = Date.now();
    }
    if (Date.now() - changed > stall) {
      const thread = state ? "its main thread still answers" : "its main thread does not answer (a script or wasm call that never returns)";
      throw new Error(`the page made no progress for ${stall / 1000} s; it last reported ${last}; ${thread}`);
    }
    await new Promise((resolve) => setTimeout(resolve, poll));
  }
}
