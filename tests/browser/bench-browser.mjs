// A benchmark, not a test: the package's prefill and decode tok/s in headless Chromium
// (SwiftShader on a machine without a GPU) on the default model, as `bench` measures natively,
// for a package in place. Environment: PKG (a built package folder, default pkg/: compare
// builds of two commits side by side), MODEL (default the default model), PROMPT_TOKENS (64),
// GEN_TOKENS (32), RUNS (1). Prints one JSON line a run.
// `PROMPT_TOKENS=512 GEN_TOKENS=128 node tests/browser/bench-browser.mjs`
import fs from "node:fs";
import path from "node:path";
import { openPackagePage, defaultModel } from "./lib.mjs";

const env = (name, fallback) => process.env[name] ?? fallback;
const promptTokens = Number(env("PROMPT_TOKENS", 64));
const genTokens = Number(env("GEN_TOKENS", 32));
const runs = Number(env("RUNS", 1));
// The golden passage (English prose), cut to about the prompt's length in tokens below.
const passage = fs.readFileSync(new URL("../../../shared/golden/passage.txt", import.meta.url), "utf8");

const page = await openPackagePage("bench-browser");
try {
  fs.rmSync(path.join(page.dir, "model.gguf"));
  fs.symlinkSync(path.resolve(env("MODEL", defaultModel)), path.join(page.dir, "model.gguf"));
  if (process.env.PKG) {
    fs.rmSync(path.join(page.dir, "pkg"), { recursive: true, force: true });
    fs.symlinkSync(path.resolve(process.env.PKG), path.join(page.dir, "pkg"));
    await page.tab.reload();
    await page.tab.waitForFunction(() => window.ready);
  }
  for (let i = 0; i < runs; i++) {
    const row = await page.tab.evaluate(
      async ({ passage, promptTokens, genTokens }) => {
        window.engine ??= await window.Engine.load("./model.gguf", { cache: false, contextLength: 2 * promptTokens + genTokens + 64 });
        // About 4 characters a token; the stats say how many it was.
        const prompt = passage.slice(0, promptTokens * 4);
        for await (const _ of window.engine.generate(prompt, { temperature: 0, maxTokens: genTokens, ignoreEos: true })) {
        }
        const s = window.engine.stats();
        return { promptTokens: s.promptTokens, prefillTokS: s.prefillTokS, generated: s.generatedTokens, decodeTokS: s.decodeTokS, hostMs: s.hostMsPerToken, adapter: window.engine.info().adapter };
      },
      { passage, promptTokens, genTokens },
    );
    console.log(JSON.stringify({ pkg: process.env.PKG ?? "pkg", ...row }));
  }
} finally {
  await page.close();
}
