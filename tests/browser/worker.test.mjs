// WorkerEngine (the package's webgpu-llm/worker): Engine's API with the engine in a dedicated
// Worker, and with { shared: true } in a SharedWorker that the tabs of one origin share. What it
// must say comes from the crate's CPU reference on the same tiny model (lib.mjs: cpu); its errors
// and inspections must be the main-thread Engine's own.
import { test } from "node:test";
import assert from "node:assert/strict";
import { serve, launch, stage, modelPath, cpu, packageHtml as html, waitWithProgress, CHAT_A, CHAT_B, RAW_A, tinyAnswers } from "./lib.mjs";

const { chatA, chatB, rawA } = tinyAnswers();

const page = html(`import { WorkerEngine } from "./pkg/worker.js";
import { Engine } from "./pkg/index.js";
window.WorkerEngine = WorkerEngine;
window.Engine = Engine;
// A greedy chat.completions.create stream's text and finish reason.
window.complete = async (engine, content) => {
  let text = "", finish = null;
  for await (const chunk of await engine.chat.completions.create({ messages: [{ role: "user", content }], temperature: 0, max_tokens: 64, stream: true })) {
    text += chunk.choices[0]?.delta?.content ?? "";
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  return { text, finish };
};
window.ready = true;`);

test("WorkerEngine in a dedicated worker: the CPU reference's tokens through chat, generate, OpenAI's API and beams; Engine's errors and inspection; abort; unload", { timeout: 600_000 }, async () => {
  const server = await serve(stage("worker", { "index.html": page }));
  const browser = await launch();
  try {
    const tab = await browser.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    await tab.goto(`${server.url}index.html`);
    await tab.waitForFunction(() => window.ready);
    // Inspection in the worker is Engine.inspect's in the page.
    const [inWorker, inPage] = await tab.evaluate(() => Promise.all([WorkerEngine.inspect("./model.gguf"), Engine.inspect("./model.gguf")]));
    assert.deepEqual(inWorker, inPage);

    await tab.evaluate(() => {
      window.phases = new Set();
      WorkerEngine.load("./model.gguf", { onProgress: (p) => window.phases.add(p.phase) }).then(
        (engine) => (window.engine = engine),
        (e) => (window.failure = String(e.message)),
      );
    });
    await waitWithProgress(tab, () => window.engine || window.failure, () => [...window.phases]);
    const loaded = await tab.evaluate(() => ({ failure: window.failure, phases: [...window.phases], info: window.engine?.info() }));
    assert.equal(loaded.failure, undefined);
    assert.deepEqual(loaded.phases.sort(), ["download", "prepare", "upload"]);
    assert.equal(loaded.info.architecture, "llama");
    assert.equal(loaded.info.shared, false);

    // The conversation, the batch and OpenAI's API, each the CPU reference's greedy tokens.
    const chat = await tab.evaluate(async (content) => {
      const ids = [];
      for await (const ev of window.engine.chat([{ role: "user", content }], { temperature: 0, maxTokens: 64 })) ids.push(ev.id);
      return { ids, stats: window.engine.stats() };
    }, CHAT_B);
    assert.deepEqual(chat.ids, chatB.ids);
    assert.equal(chat.stats.generatedTokens, chatB.ids.length);
    const raw = await tab.evaluate(async (prompt) => {
      const ids = [];
      for await (const ev of window.engine.generate(prompt, { temperature: 0, maxTokens: 10, ignoreEos: true })) ids.push(ev.id);
      return ids;
    }, RAW_A);
    assert.deepEqual(raw, rawA.ids);
    const openai = await tab.evaluate((content) => window.complete(window.engine, content), CHAT_A);
    assert.deepEqual(openai, { text: chatA.text, finish: "stop" });
    const whole = await tab.evaluate((content) => window.engine.chat.completions.create({ messages: [{ role: "user", content }], temperature: 0, max_tokens: 64 }), CHAT_A);
    assert.equal(whole.choices[0].message.content, chatA.text);
    assert.equal(whole.usage.completion_tokens, chatA.ids.length);
    const beamPrompt = "Once upon a time";
    const cpuBeams = cpu(modelPath, beamPrompt, { beams: 2, maxTokens: 8, ignoreEos: true });
    const beams = await tab.evaluate((prompt) => window.engine.beamSearch(prompt, { beams: 2, maxTokens: 8, ignoreEos: true }), beamPrompt);
    beams.forEach((b, i) => assert.deepEqual(b.ids, cpuBeams[i].ids, `beam ${i}`));

    // Errors arrive as the main thread's: the same message and code.
    const errors = await tab.evaluate(async () => {
      const local = await Engine.load("./model.gguf");
      const caught = (p) => p.then(() => null, (e) => [e.message, e.code]);
      const out = [];
      for (const engine of [window.engine, local]) {
        out.push([
          await caught(engine.beamSearch("Hi", { beams: 0 })),
          await caught(engine.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], frobnicate: 1 })),
          await caught((async () => { for await (const _ of engine.generate("Hi", { topP: 7 })); })()),
        ]);
      }
      local.unload();
      return out;
    });
    assert.deepEqual(errors[0], errors[1]);
    assert.equal(errors[0][0][1], "invalid-option", errors[0][0][0]);
    assert.ok(errors[0].every((e) => e && e[0].length > 0), JSON.stringify(errors[0]));

    // abort() ends a running generation within a few tokens, and the engine goes on.
    const aborted = await tab.evaluate(async (prompt) => {
      const ids = [];
      const tokens = window.engine.generate(prompt, { temperature: 0, maxTokens: 400, ignoreEos: true });
      let step;
      while (!(step = await tokens.next()).done) {
        ids.push(step.value.id);
        if (ids.length === 3) window.engine.abort();
      }
      return { n: ids.length, stats: step.value };
    }, RAW_A);
    assert.ok(aborted.n >= 3 && aborted.n < 40, `${aborted.n} tokens after the abort at 3`);
    assert.equal(aborted.stats.stopReason, "aborted");
    const after = await tab.evaluate((content) => window.complete(window.engine, content), CHAT_A);
    assert.equal(after.text, chatA.text);

    // An AbortSignal (which cannot cross to the worker) ends its own generation only: the one
    // beside it in the batch runs to the CPU reference's end.
    const [cut, whole2] = await tab.evaluate(async ([prompt, content]) => {
      const controller = new AbortController();
      const one = (async () => {
        const ids = [];
        const tokens = window.engine.generate(prompt, { temperature: 0, maxTokens: 400, ignoreEos: true, signal: controller.signal });
        let step;
        while (!(step = await tokens.next()).done) {
          ids.push(step.value.id);
          if (ids.length === 3) controller.abort();
        }
        return { n: ids.length, stats: step.value };
      })();
      return Promise.all([one, window.complete(window.engine, content)]);
    }, [RAW_A, CHAT_B]);
    assert.ok(cut.n >= 3 && cut.n < 40, `${cut.n} tokens after the abort at 3`);
    assert.equal(cut.stats.stopReason, "aborted");
    assert.equal(whole2.text, chatB.text);

    // unload ends the worker: the engine is gone and says so.
    const gone = await tab.evaluate(async () => {
      await window.engine.unload();
      return window.engine.beamSearch("Hi", { beams: 2, maxTokens: 2 }).then(() => null, (e) => e.message);
    });
    assert.match(gone, /unloaded/);
  } finally {
    await browser.close();
    server.close();
  }
});

test("WorkerEngine { shared: true }: tabs share one loaded model and batch, each gets its own tokens, and a tab closed mid-stream lets go of it", { timeout: 600_000 }, async () => {
  const server = await serve(stage("shared-worker", { "index.html": page }));
  const browser = await launch();
  // No cache: every load that is not shared downloads the model, so the server's log counts them.
  const downloads = () => server.requests.filter((r) => r.path === "/model.gguf" && r.method === "GET" && !r.range).length;
  const open = async () => {
    const tab = await context.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    await tab.goto(`${server.url}index.html`);
    await tab.waitForFunction(() => window.ready);
    const failure = await tab.evaluate(() => WorkerEngine.load("./model.gguf", { shared: true, cache: false }).then((e) => { window.engine = e; }, (e) => String(e.message)));
    assert.equal(failure, undefined);
    return tab;
  };
  const context = await browser.newContext();
  try {
    const one = await open();
    assert.equal(downloads(), 1);
    const two = await open();
    assert.equal(downloads(), 1, "the second tab's load shares the first's engine");
    assert.equal(await two.evaluate(() => window.engine.info().shared), true);

    // Both tabs at once, on one batch: each its own CPU reference answer.
    const [a, b] = await Promise.all([
      one.evaluate((content) => window.complete(window.engine, content), CHAT_A),
      two.evaluate((content) => window.complete(window.engine, content), CHAT_B),
    ]);
    assert.equal(a.text, chatA.text);
    assert.equal(b.text, chatB.text);

    // A tab closed while it streams: its generation ends and its hold on the engine goes, so that
    // once the other tab unloads, a new tab's load downloads the model again.
    await one.evaluate((prompt) => {
      window.seen = 0;
      (async () => { for await (const _ of window.engine.generate(prompt, { temperature: 0, maxTokens: 400, ignoreEos: true })) window.seen++; })();
    }, RAW_A);
    await one.waitForFunction(() => window.seen >= 3);
    await one.close({ runBeforeUnload: true });
    const again = await two.evaluate((content) => window.complete(window.engine, content), CHAT_A);
    assert.equal(again.text, chatA.text);
    await two.evaluate(() => window.engine.unload());
    const three = await open();
    assert.equal(downloads(), 2, "the engine was unloaded once no tab held it");
    const last = await three.evaluate((content) => window.complete(window.engine, content), CHAT_B);
    assert.equal(last.text, chatB.text);
  } finally {
    await browser.close();
    server.close();
  }
});
