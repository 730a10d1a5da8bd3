// The npm package as an app's dependency, built by a bundler: pkg/ packed with `npm pack`, the
// tarball installed into a copy of a tiny app (tests/browser/bundlers: `import { Engine } from
// "webgpu-llm"`), the app built with Vite and with esbuild, and each build served and run in
// headless Chromium, where it must stream what the crate's CPU reference generates from the same
// model (lib.mjs: cpu). This checks what only a bundler sees: the tarball's files, the
// package.json `exports`, and that the wasm next to the glue is still found once the JS is
// bundled (index.js and wasm-bindgen's glue locate it with `new URL(..., import.meta.url)`).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { build as viteBuild } from "vite";
import * as esbuild from "esbuild";
import { root, artifacts, modelPath, serve, launch, waitWithProgress, CHAT_A, tinyAnswers } from "./lib.mjs";

// The tiny model's chat answer that ends at its end-of-sequence token (lib.mjs: CHAT_A).
const want = tinyAnswers().chatA;

const work = path.join(artifacts, "bundlers");
const app = path.join(work, "app");
let browser;

before(() => {
  fs.rmSync(work, { recursive: true, force: true });
  fs.mkdirSync(work, { recursive: true });
  // What a registry would serve: `npm pack` keeps only the package.json's `files`.
  const [packed] = JSON.parse(execFileSync("npm", ["pack", "--json", "--pack-destination", work], { cwd: path.join(root, "pkg"), encoding: "utf8" }));
  fs.cpSync(path.join(root, "tests/browser/bundlers"), app, { recursive: true });
  // A local tarball has nothing to fetch: this works offline.
  execFileSync("npm", ["install", "--offline", "--no-audit", "--no-fund", path.join(work, packed.filename)], { cwd: app, stdio: "inherit" });
});

after(async () => {
  await browser?.close();
});

/** Serves `dist` with the model beside the app, runs it in Chromium; the page's window.result. */
async function run(dist, worker = false) {
  if (!fs.existsSync(path.join(dist, "model.gguf"))) fs.symlinkSync(modelPath, path.join(dist, "model.gguf"));
  const server = await serve(dist);
  browser ??= await launch();
  const tab = await browser.newPage();
  tab.on("console", (m) => console.log("page:", m.text()));
  try {
    await tab.goto(`${server.url}index.html?${new URLSearchParams({ chat: CHAT_A, maxTokens: 64, ...(worker && { worker: 1 }) })}`);
    await waitWithProgress(tab, () => window.result, () => document.getElementById("out").textContent, { stall: 60_000, poll: 200 });
    const result = await tab.evaluate(() => window.result);
    // The engine's wasm came from the build's output, not from anywhere else.
    const wasm = server.requests.filter((r) => r.path.endsWith(".wasm"));
    console.log(dist, JSON.stringify({ ...result, wasm: wasm.map((r) => `${r.path} ${r.status}`) }));
    return { ...result, wasm };
  } finally {
    await tab.close();
    server.close();
  }
}

function check(result) {
  assert.equal(result.error, undefined);
  assert.equal(want.stats.stop_reason, "Eos"); // so the page's stream ended where the reference's did
  assert.deepEqual(result.ids, want.ids);
  assert.equal(result.text, want.text);
  assert.ok(result.wasm.length > 0 && result.wasm.every((r) => r.status === 200), "the wasm was fetched from the build");
}

test("a Vite build of the app streams the CPU reference's greedy chat answer, with the engine in the page and in webgpu-llm/worker", { timeout: 300_000 }, async () => {
  const dist = path.join(work, "vite-dist");
  // Vite rewrites `new URL("./x.wasm", import.meta.url)` in dependencies too: the wasm is emitted
  // as a hashed asset and the URL points at it. No configuration needed.
  // It bundles `new Worker(new URL("./engine-worker.js", import.meta.url))` as a worker of its own.
  await viteBuild({ root: app, configFile: false, logLevel: "warn", build: { outDir: dist, emptyOutDir: true } });
  check(await run(dist));
  check(await run(dist, true));
});

test("an esbuild bundle of the app streams the CPU reference's greedy chat answer, with the engine in the page and in webgpu-llm/worker", { timeout: 300_000 }, async () => {
  const dist = path.join(work, "esbuild-dist");
  fs.rmSync(dist, { recursive: true, force: true });
  // The engine's worker (webgpu-llm/worker) is a second entry point beside the app: WorkerEngine
  // starts it from `new URL("./engine-worker.js", import.meta.url)`, the bundle's folder.
  const entryPoints = { main: "main.js", "engine-worker": "webgpu-llm/engine-worker.js" };
  await esbuild.build({ absWorkingDir: app, entryPoints, bundle: true, format: "esm", outdir: dist, logLevel: "warning" });
  // esbuild leaves `new URL("./webgpu_llm_bg.wasm", import.meta.url)` as it is (it bundles only
  // what is imported; the file loader, --loader:.wasm=file, applies to imports, not to new URL),
  // and with format esm import.meta.url is then the bundle's own URL. So an esbuild user copies
  // the package's wasm beside the bundle, as here, with the page that loads it.
  fs.copyFileSync(path.join(app, "node_modules/webgpu-llm/webgpu_llm_bg.wasm"), path.join(dist, "webgpu_llm_bg.wasm"));
  fs.copyFileSync(path.join(app, "index.html"), path.join(dist, "index.html"));
  check(await run(dist));
  check(await run(dist, true));
});
