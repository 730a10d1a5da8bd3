// The package's Origin Private File System cache (`cache: "opfs"`, issue 27) beside Cache
// Storage, in headless Chromium: a load from OPFS gives the CPU reference's tokens, a reload
// downloads nothing, cachedModels/deleteCached/clearCache cover both stores, a cut download or a
// full quota leaves nothing, a write that hangs fails in time. OPFS_BENCH=1 adds the
// measurement that picked the default store.
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { modelPath, defaultModel, cpu, openPackagePage, cacheKeys, opfsFiles } from "./lib.mjs";
import { splitGguf } from "./gguf.mjs";

const PROMPT = "The Fibonacci numbers are 0, 1, 1, 2, 3, 5, 8,";
const N = 8;
const reference = cpu(modelPath, PROMPT, { maxTokens: N, ignoreEos: true });

const ggufGets = (server) => server.requests.filter((r) => r.method === "GET" && r.path.endsWith(".gguf"));
const cachedModels = async (tab) => (await tab.evaluate(() => window.Engine.cachedModels())).sort((a, b) => a.url.localeCompare(b.url));

/** Loads `url` with `cache` in the page and generates N greedy tokens: {ids, fromCache} or {error}. */
const run = (tab, url, cache) => tab.evaluate(async ({ url, cache, prompt, n }) => {
  try {
    const engine = await window.Engine.load(url, { cache, contextLength: 64 });
    const ids = [];
    for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: n, ignoreEos: true })) ids.push(ev.id);
    const fromCache = engine.info().fromCache;
    engine.unload();
    return { ids, fromCache };
  } catch (e) {
    return { error: `${e instanceof Error} ${e.message}` };
  }
}, { url, cache, prompt: PROMPT, n: N });

test("cache opfs: the CPU reference's tokens, a reload without download, listed with its store and size, deleted, a cut download leaves nothing", { timeout: 600_000 }, async () => {
  const { dir, tab, server, close } = await openPackagePage("opfs-load");
  fs.symlinkSync(defaultModel, path.join(dir, "big.gguf"));
  const size = fs.statSync(modelPath).size;
  const url = `${server.url}model.gguf`;
  try {
    const first = await run(tab, "./model.gguf", "opfs");
    assert.deepEqual(first, { ids: reference.ids, fromCache: false });
    assert.deepEqual(await cachedModels(tab), [{ url, bytes: size, store: "opfs" }]);
    // One file and its record beside it; nothing in Cache Storage.
    const files = await opfsFiles(tab);
    assert.equal(files.length, 2, JSON.stringify(files));
    assert.match(files.join(" "), /^([0-9a-f]{64})\.gguf \1\.json$/);
    assert.deepEqual(await cacheKeys(tab), []);

    // From OPFS, with the store named or by default, and inspect: no request for the model.
    const gets = ggufGets(server).length;
    assert.deepEqual(await run(tab, "./model.gguf", "opfs"), { ids: reference.ids, fromCache: true });
    assert.deepEqual(await run(tab, "./model.gguf", true), { ids: reference.ids, fromCache: true });
    assert.deepEqual(await run(tab, "./model.gguf", "cache-storage"), { ids: reference.ids, fromCache: true }, "a model in OPFS is found whichever store is named");
    const inspected = await tab.evaluate(() => window.Engine.inspect("./model.gguf"));
    assert.equal(inspected.source, "cache");
    assert.equal(inspected.fileBytes, size);
    assert.equal(ggufGets(server).length, gets, "a model kept in OPFS went to the network");
    assert.deepEqual(await cacheKeys(tab), []);

    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./model.gguf")), true);
    assert.deepEqual(await opfsFiles(tab), []);
    assert.deepEqual(await cachedModels(tab), []);
    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./model.gguf")), false);

    // A download cut half way: an error in words, and no file, part or record left.
    server.cutNext();
    const cut = await run(tab, "./model.gguf", "opfs");
    assert.match(cut.error ?? "", /^true the model download from .* failed/);
    assert.equal(ggufGets(server).at(-1).complete, false);
    assert.deepEqual(await opfsFiles(tab), []);
    assert.deepEqual(await cachedModels(tab), []);
    // The same on the page's 98 MB model, cut after its first 32 MiB were written to the file.
    server.cutNext();
    const bigCut = await run(tab, "./big.gguf", "opfs");
    assert.match(bigCut.error ?? "", /^true the model download from .* failed/);
    assert.ok(ggufGets(server).at(-1).sent > 32 << 20);
    assert.deepEqual(await opfsFiles(tab), []);
    assert.deepEqual(await cachedModels(tab), []);

    // A wrong choice is refused in words.
    assert.match((await run(tab, "./model.gguf", "disk")).error, /^true the cache option must be true, false, "opfs" or "cache-storage", not "disk"/);
  } finally {
    await close();
  }
});

test("cachedModels lists both stores, a split model in OPFS loads from any part, deleteCached and clearCache cover both", { timeout: 600_000 }, async () => {
  const { dir, tab, server, close } = await openPackagePage("opfs-both");
  fs.symlinkSync(modelPath, path.join(dir, "copy.gguf"));
  const parts = splitGguf(modelPath, path.join(dir, "tiny.gguf"), 3);
  const partsBytes = parts.reduce((sum, p) => sum + fs.statSync(p).size, 0);
  const size = fs.statSync(modelPath).size;
  try {
    assert.deepEqual(await run(tab, "./model.gguf", "cache-storage"), { ids: reference.ids, fromCache: false });
    assert.deepEqual(await run(tab, "./copy.gguf", "opfs"), { ids: reference.ids, fromCache: false });
    assert.deepEqual(await run(tab, "./tiny-00002-of-00003.gguf", "opfs"), { ids: reference.ids, fromCache: false });
    const first = `${server.url}tiny-00001-of-00003.gguf`;
    assert.deepEqual(await cachedModels(tab), [
      { url: `${server.url}copy.gguf`, bytes: size, store: "opfs" },
      { url: `${server.url}model.gguf`, bytes: size, store: "cache-storage" },
      { url: first, bytes: partsBytes, store: "opfs", parts: 3, of: 3 },
    ]);
    assert.equal((await opfsFiles(tab)).length, 8);

    // Each loads from its store, the split model from another part's URL.
    const gets = ggufGets(server).length;
    for (const url of ["./model.gguf", "./copy.gguf", "./tiny-00003-of-00003.gguf"]) {
      assert.deepEqual(await run(tab, url, true), { ids: reference.ids, fromCache: true }, url);
    }
    assert.equal(ggufGets(server).length, gets, "a cached model went to the network");

    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./tiny-00003-of-00003.gguf")), true);
    assert.equal((await opfsFiles(tab)).length, 2);
    // A model in Cache Storage is found when OPFS is named: not downloaded again.
    assert.deepEqual(await run(tab, "./model.gguf", "opfs"), { ids: reference.ids, fromCache: true });
    assert.equal(ggufGets(server).length, gets);
    await tab.evaluate(() => window.Engine.clearCache());
    assert.equal(await opfsFiles(tab), null);
    assert.deepEqual(await cacheKeys(tab), []);
    assert.deepEqual(await cachedModels(tab), []);
  } finally {
    await close();
  }
});

test("a full quota in OPFS loads the model without keeping it and leaves nothing behind", { timeout: 600_000 }, async () => {
  const init = () => {
    FileSystemWritableFileStream.prototype.write = () => Promise.reject(new DOMException("Quota exceeded.", "QuotaExceededError"));
  };
  const { tab, close } = await openPackagePage("opfs-quota", { init });
  try {
    assert.deepEqual(await run(tab, "./model.gguf", "opfs"), { ids: reference.ids, fromCache: false });
    assert.deepEqual(await opfsFiles(tab), []);
    assert.deepEqual(await cachedModels(tab), []);
  } finally {
    await close();
  }
});

test("a write to OPFS that never settles fails the load with code stalled after stallMs, leaves nothing, and the next load stores the model", { timeout: 600_000 }, async () => {
  // `window.stallWrites`: how many of the next writes never settle, as a browser whose disk hangs.
  const init = () => {
    window.stallWrites = 0;
    const write = FileSystemWritableFileStream.prototype.write;
    FileSystemWritableFileStream.prototype.write = function (...args) {
      return window.stallWrites-- > 0 ? new Promise(() => {}) : write.apply(this, args);
    };
  };
  const { tab, close } = await openPackagePage("opfs-stall", { init });
  try {
    const stalled = await tab.evaluate(async () => {
      window.stallWrites = 1;
      const t0 = performance.now();
      try {
        await window.Engine.load("./model.gguf", { cache: "opfs", stallMs: 2000, contextLength: 64 });
        return { loaded: true };
      } catch (e) {
        return { error: e.message, code: e.code, ms: performance.now() - t0 };
      } finally {
        window.stallWrites = 0;
      }
    });
    console.log("stalled write:", JSON.stringify(stalled));
    assert.equal(stalled.code, "stalled");
    assert.match(stalled.error, /did not finish writing the model to the Origin Private File System within 2 s/);
    assert.ok(stalled.ms < 30_000, `the stall took ${stalled.ms} ms to be reported`);
    assert.deepEqual(await opfsFiles(tab), []);
    assert.deepEqual(await cachedModels(tab), []);
    assert.deepEqual(await run(tab, "./model.gguf", "opfs"), { ids: reference.ids, fromCache: false });
    assert.equal((await cachedModels(tab))[0]?.store, "opfs");
  } finally {
    await close();
  }
});

// The measurement behind the default store (OPFS where the browser has it): the page's 98 MB
// model stored and read back through each store, 3 runs each, alternating, in a profile on disk.
test("OPFS against Cache Storage: store and reload times (OPFS_BENCH=1)", { timeout: 900_000, skip: !process.env.OPFS_BENCH }, async () => {
  const { dir, tab, close } = await openPackagePage("opfs-bench", { profile: true });
  fs.rmSync(path.join(dir, "model.gguf"));
  fs.symlinkSync(defaultModel, path.join(dir, "model.gguf"));
  try {
    const rows = [];
    for (let i = 0; i < 3; i++) {
      for (const cache of i % 2 ? ["cache-storage", "opfs"] : ["opfs", "cache-storage"]) {
        const row = await tab.evaluate(async (cache) => {
          await window.Engine.clearCache();
          const time = async () => {
            const t0 = performance.now();
            let stored = 0;
            const engine = await window.Engine.load("./model.gguf", { cache, cpu: true, contextLength: 64, onProgress: (p) => p.phase === "prepare" && !stored && (stored = performance.now() - t0) });
            const fromCache = engine.info().fromCache;
            engine.unload();
            return { download: Math.round(stored), load: Math.round(performance.now() - t0), fromCache };
          };
          const store = await time();
          const reload = await time();
          return { cache, store, reload };
        }, cache);
        console.log(JSON.stringify(row));
        rows.push(row);
      }
    }
    for (const cache of ["opfs", "cache-storage"]) {
      const mine = rows.filter((r) => r.cache === cache);
      const median = (f) => mine.map(f).sort((a, b) => a - b)[1];
      console.log(`${cache}: download+store median ${median((r) => r.store.download)} ms, first load ${median((r) => r.store.load)} ms, reload ${median((r) => r.reload.load)} ms`);
    }
    await tab.evaluate(() => window.Engine.clearCache());
  } finally {
    await close();
  }
});
