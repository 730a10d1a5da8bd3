// A random-weight model with Llama 3 8B's shapes in Q4_0 (4.2 GB, made by big-model.mjs as the
// test's server sends it):
// larger than wasm32's 4 GiB address space, it must download into Cache Storage, upload in
// pieces and make a token through the npm package with the JS heap and wasm memory under
// 512 MB. Its own file, so that scripts/test runs it beside the other package tests: most of
// its minutes are spent downloading and uploading 4.2 GB, not computing.
import { test } from "node:test";
import assert from "node:assert/strict";
import { defaultModel, openPackagePage, waitWithProgress } from "./lib.mjs";
import { bigModel } from "./big-model.mjs";

test("a random-weight 8B-shaped Q4_0 model (4.2 GB) loads through the package and makes a token with JS heap and wasm memory under 512 MB", { timeout: 1_800_000 }, async () => {
  const MB = 1 << 20;
  const model = bigModel(defaultModel);
  const size = model.size;
  assert.ok(size > 4e9, `${size} bytes`);
  const { tab, close } = await openPackagePage("big", { profile: true, virtual: { "/big.gguf": model } });
  try {
    // Started here, awaited below by its progress: a stall fails in minutes, naming its phase.
    await tab.evaluate(() => {
      window.bigResult = (async () => {
      // Sampled every 100 ms while the model downloads into the cache, uploads and generates.
      const peak = { heap: 0, wasm: 0 };
      let phase = "start";
      const phases = {};
      const sample = async () => {
        const heap = performance.memory.usedJSHeapSize;
        peak.heap = Math.max(peak.heap, heap);
        phases[phase] = Math.max(phases[phase] ?? 0, Math.round(heap / 2 ** 20));
        peak.wasm = Math.max(peak.wasm, await window.Engine.wasmMemoryBytes());
      };
      const timer = setInterval(sample, 100);
      const t0 = performance.now();
      const ms = {};
      try {
        const engine = await window.Engine.load("./big.gguf", {
          contextLength: 64,
          onProgress: (p) => {
            phase = p.phase;
            ms[p.phase] = performance.now() - t0;
            window.bigProgress = [p.phase, p.loaded];
          },
        });
        phase = "generate";
        window.bigProgress = [phase];
        const ids = [];
        for await (const ev of engine.generate("Hello", { temperature: 0, maxTokens: 1, ignoreEos: true })) {
          ids.push(ev.id);
          window.bigProgress = [phase, ids.length];
        }
        ms.generate = performance.now() - t0;
        phase = "done";
        await sample();
        const info = engine.info();
        const cached = await window.Engine.cachedModels();
        engine.unload();
        await window.Engine.clearCache();
        return { ids, info, peak, phases, ms, cached };
      } catch (e) {
        return { failure: String(e?.message ?? e), peak, phases, ms };
      } finally {
        clearInterval(timer);
      }
      })().then((r) => (window.bigDone = true, r));
    });
    await waitWithProgress(tab, () => window.bigDone, () => window.bigProgress, { stall: 300_000 });
    const result = await tab.evaluate(() => window.bigResult);
    console.log(JSON.stringify(result));
    assert.equal(result.failure, undefined);
    assert.equal(result.info.nLayers, 32);
    assert.equal(result.cached[0].bytes, size);
    assert.equal(result.ids.length, 1);
    assert.ok(result.ids.every((id) => id >= 0 && id < result.info.vocabSize), "ids inside the vocabulary");
    assert.ok(result.peak.wasm < 512 * MB, `wasm memory peaked at ${(result.peak.wasm / MB).toFixed(0)} MB`);
    assert.ok(result.peak.heap < 512 * MB, `the JS heap peaked at ${(result.peak.heap / MB).toFixed(0)} MB`);
  } finally {
    await close();
  }
});
