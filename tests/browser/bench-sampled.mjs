// A benchmark, not a test: the package's decode tok/s in headless Chromium on the tests' tiny
// llama3 (a token in milliseconds, so the host's turn between steps shows), greedy and top-k
// sampled, three runs each in turn, for the pkg/ in place (scripts/build-pkg; the test deps from
// scripts/install-deps). `node tests/browser/bench-sampled.mjs` prints one JSON line.
import { openPackagePage } from "./lib.mjs";
const page = await openPackagePage("bench-sampled");
try {
  const out = await page.tab.evaluate(async () => {
    const engine = await window.Engine.load("./model.gguf");
    const run = async (opts) => {
      for await (const _ of engine.generate("Once upon a time", { maxTokens: 200, ignoreEos: true, seed: 3, ...opts })) {}
      return engine.stats();
    };
    await run({ temperature: 0 });
    const res = {};
    for (let i = 0; i < 3; i++) {
      for (const [name, opts] of [["greedy", { temperature: 0 }], ["topk40", { temperature: 0.8, topK: 40, topP: 0.9, minP: 0.05 }]]) {
        const s = await run(opts);
        (res[name] ??= []).push(Math.round(s.decodeTokS * 10) / 10);
      }
    }
    return res;
  });
  console.log(JSON.stringify(out));
} finally {
  await page.close();
}
