// The npm package imported into a plain ES-module page: the README's snippet, Engine.inspect
// against facts read from the file by an independent parser (tests/browser/gguf.mjs), and the
// Cache Storage API (a cut download leaves nothing behind; list and delete), stalls, split
// models, a lost device, GPU out of memory, a full quota, abort cycles and every architecture's
// plan (the 8B-shaped model: big-model.test.mjs, which scripts/test runs beside this file). The
// model that generates is the tiny random Llama 3 of tests/data/arch (lib.mjs: modelPath); what
// it must say comes from the crate's CPU reference on the same file (lib.mjs: cpu). The page's default model (SmolLM2, 98 MB) is used only where
// its size is the point, and never decodes.
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { serve, launch, stage, modelPath, defaultModel, root, cpu, artifacts, packageHtml as html, openPackagePage, waitWithProgress, CHAT_A, CHAT_B, RAW_A, RAW_B, tinyAnswers } from "./lib.mjs";
import { readGguf, splitGguf } from "./gguf.mjs";
import { writeTinyGemma } from "./tiny-gemma.mjs";

// The tiny model's prompts and the CPU reference's answers (lib.mjs).
const { chatA, chatB, rawA, rawB } = tinyAnswers();

test("the README snippet streams a seeded chat completion, the same text for the same seed", { timeout: 600_000 }, async () => {
  const snippet = `import { Engine } from "./pkg/index.js";
const out = document.getElementById("out");
const url = "./model.gguf";
try {
  window.adapterSubgroups = (await navigator.gpu.requestAdapter()).features.has("subgroups");
  const engine = await Engine.load(url, { onProgress: ({ loaded, total }) => { window.loaded = [loaded, total]; } });
  for await (const ev of engine.chat([{ role: "user", content: "Hi" }], { temperature: 0.7, topP: 0.9, maxTokens: 128, seed: 42 })) {
    out.textContent += ev.text;                      // ev = { id, text }
    window.tokens = (window.tokens ?? 0) + 1;
  }
  window.stats = engine.stats();
  window.info = engine.info();
  window.engine = engine;
} catch (e) {
  window.failure = String(e && e.message || e);
}
window.finished = true;`;
  const server = await serve(stage("package", { "index.html": html(snippet) }));
  const browser = await launch();
  try {
    const tab = await browser.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    await tab.goto(`${server.url}index.html`);
    await waitWithProgress(tab, () => window.finished, () => [window.loaded, window.tokens]);
    const result = await tab.evaluate(() => ({ failure: window.failure, text: document.getElementById("out").textContent, tokens: window.tokens, stats: window.stats, info: window.info, adapterSubgroups: window.adapterSubgroups }));
    console.log(JSON.stringify(result));
    assert.equal(result.failure, undefined);
    assert.ok(result.tokens > 0 && result.text.trim().length > 0, "streamed some text");
    assert.equal(result.stats.generatedTokens, result.tokens);
    assert.equal(result.info.architecture, "llama");
    // The engine runs its subgroup kernels where the adapter offers subgroups (SwiftShader does,
    // 4 wide, since Chromium 134): wgpu's WebGPU backend requests the feature (vendor/wgpu).
    assert.equal(result.info.subgroups, result.adapterSubgroups, "subgroups where the adapter has them");
    // The CPU cost of a decode step in the browser (encode and submit), measured by the engine.
    assert.ok(result.stats.hostMsPerToken > 0 && result.stats.hostMsPerToken < 1000, `host ${result.stats.hostMsPerToken} ms`);

    // The same seed samples the same tokens; greedy decoding gives the CPU reference's answer.
    const again = await tab.evaluate(async () => {
      let text = "";
      for await (const ev of window.engine.chat([{ role: "user", content: "Hi" }], { temperature: 0.7, topP: 0.9, maxTokens: 128, seed: 42 })) text += ev.text;
      return text;
    });
    assert.equal(again, result.text);
    const colors = [{ role: "user", content: CHAT_B }];
    const greedy = await tab.evaluate(async (messages) => {
      let text = "";
      for await (const ev of window.engine.chat(messages, { temperature: 0, maxTokens: 64 })) text += ev.text;
      return text;
    }, colors);
    assert.equal(chatB.stats.stop_reason, "Eos");
    assert.equal(greedy, chatB.text);

    // Beam search through the package: the CPU reference's beams (2 beams, 8 tokens, no EOS:
    // `webgpu-llm generate --beams 2`, transformers' semantics) and their scores. The prompt's
    // beams are 0.11 and more apart in score, far beyond the GPU's rounding.
    const beamPrompt = "Once upon a time";
    const cpuBeams = cpu(modelPath, beamPrompt, { beams: 2, maxTokens: 8, ignoreEos: true });
    const beams = await tab.evaluate(([prompt]) => window.engine.beamSearch(prompt, { beams: 2, maxTokens: 8, ignoreEos: true }), [beamPrompt]);
    assert.equal(beams.length, 2);
    beams.forEach((b, i) => assert.deepEqual(b.ids, cpuBeams[i].ids, `beam ${i}`));
    beams.forEach((b, i) => assert.ok(Math.abs(b.score - cpuBeams[i].score) < 1e-3, `beam ${i}: ${b.score} vs ${cpuBeams[i].score}`));
    const badBeams = await tab.evaluate(() => window.engine.beamSearch("Hi", { beams: 0 }).then(() => null, (e) => [e.message, e.code]));
    assert.equal(badBeams[1], "invalid-option", badBeams[0]);

    // OpenAI's API on the batch: two chat.completions.create streams consumed at once both
    // stream (each one's chunks arrive before the other ends) and each gives the CPU
    // reference's text; a whole completion gives that text and usage.
    const capital = [{ role: "user", content: CHAT_A }];
    assert.equal(chatA.stats.stop_reason, "Eos");
    const both = await tab.evaluate(async ([a, b]) => {
      const order = [];
      const run = async (messages, tag) => {
        const stream = await window.engine.chat.completions.create({ messages, stream: true, temperature: 0, max_tokens: 64, stream_options: { include_usage: true } });
        let text = "", finish = null, usage = null;
        for await (const chunk of stream) {
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices) {
            if (c.delta.content) { text += c.delta.content; order.push(tag); }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
        order.push(tag + "-end");
        return { text, finish, usage, object: stream[Symbol.asyncIterator] ? "iterable" : "?" };
      };
      const [ra, rb] = await Promise.all([run(a, "a"), run(b, "b")]);
      return { ra, rb, order };
    }, [capital, colors]);
    assert.equal(both.ra.text, chatA.text);
    assert.equal(both.rb.text, chatB.text);
    assert.equal(both.ra.finish, "stop");
    assert.equal(both.rb.usage.completion_tokens, chatB.stats.generated_tokens);
    assert.equal(both.rb.usage.prompt_tokens, chatB.stats.prompt_tokens);
    // Interleaved: b's first token comes before a ends, and a's first before b ends.
    assert.ok(both.order.indexOf("b") < both.order.indexOf("a-end") && both.order.indexOf("a") < both.order.indexOf("b-end"), both.order.join(" "));
    // Two engine.generate iterators consumed at once: both stream, one batch, the CPU reference's ids.
    const pair = await tab.evaluate(async ([a, b]) => {
      const order = [];
      const run = async (prompt, tag) => {
        const ids = [];
        for await (const ev of window.engine.generate(prompt, { temperature: 0, maxTokens: 6, ignoreEos: true })) {
          ids.push(ev.id);
          order.push(tag);
        }
        order.push(tag + "-end");
        return ids;
      };
      return { ids: await Promise.all([run(a, "a"), run(b, "b")]), order };
    }, [RAW_A, RAW_B]);
    assert.deepEqual(pair.ids[0], rawA.ids.slice(0, 6));
    assert.deepEqual(pair.ids[1], rawB.ids.slice(0, 6));
    assert.ok(pair.order.indexOf("b") < pair.order.indexOf("a-end") && pair.order.indexOf("a") < pair.order.indexOf("b-end"), pair.order.join(" "));
    // Speculative decoding in the browser (prompt lookup): the CPU reference's greedy tokens,
    // and every token says where it came from.
    const spec = await tab.evaluate(async (prompt) => {
      const ids = [], origins = [];
      for await (const ev of window.engine.generate(prompt, { temperature: 0, maxTokens: 10, ignoreEos: true, speculate: "lookup", draftTokens: 4 })) {
        ids.push(ev.id);
        origins.push(ev.speculation);
      }
      return { ids, origins };
    }, RAW_A);
    assert.deepEqual(spec.ids, rawA.ids);
    assert.ok(spec.origins.every((o) => o && typeof o.accepted === "boolean"), JSON.stringify(spec.origins));
    const whole = await tab.evaluate((messages) => window.engine.chat.completions.create({ messages, temperature: 0, max_tokens: 64 }), capital);
    assert.equal(whole.object, "chat.completion");
    assert.equal(whole.choices[0].message.content, chatA.text);
    assert.equal(whole.choices[0].finish_reason, "stop");
    assert.equal(whole.usage.completion_tokens, chatA.stats.generated_tokens);
    // The same messages again, as a chat client resends them: the prompt's whole blocks come
    // from the ended request (prefix cache), only the rest is prefilled, and the text is the same.
    const again2 = await tab.evaluate((messages) => window.engine.chat.completions.create({ messages, temperature: 0, max_tokens: 64 }), capital);
    assert.equal(again2.choices[0].message.content, chatA.text);
    const repeated = await tab.evaluate(() => window.engine.stats());
    assert.ok(repeated.prefilledTokens < repeated.promptTokens && repeated.prefilledTokens >= 1, JSON.stringify(repeated));
    // logprobs: one entry per token, its text the content; greedy picks the most likely
    // alternative, whose logprob is the token's.
    const probed = await tab.evaluate((messages) => window.engine.chat.completions.create({ messages, temperature: 0, max_tokens: 6, logprobs: true, top_logprobs: 3 }), colors);
    const entries = probed.choices[0].logprobs.content;
    assert.equal(entries.length, probed.usage.completion_tokens);
    assert.equal(entries.map((e) => e.token).join(""), probed.choices[0].message.content);
    for (const e of entries) {
      assert.equal(e.top_logprobs.length, 3);
      assert.equal(e.top_logprobs[0].token, e.token);
      assert.ok(Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 && e.logprob <= 0, JSON.stringify(e));
      assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob && e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob);
    }
    const badRequest = await tab.evaluate(() => window.engine.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], temperature: -1 }).then(() => null, (e) => [e.message, e.code]));
    assert.equal(badRequest[1], "invalid-option", badRequest[0]);
    // The server's parser (src/openai.rs): a field it does not take is refused by name, never
    // ignored; so is an option the package's generate does not know.
    const refused = await tab.evaluate(async () => {
      const messages = [{ role: "user", content: "Hi" }];
      const create = (extra) => window.engine.chat.completions.create({ messages, ...extra }).then(() => null, (e) => [e.message, e.code]);
      const generate = async () => {
        try {
          for await (const _ of window.engine.generate("Hi", { maxTokenz: 5 }));
          return null;
        } catch (e) {
          return [e.message, e.code];
        }
      };
      return [await create({ tools: [] }), await create({ frobnicate: 1 }), await create({ messages: [{ role: "user", content: "Hi", audio: {} }] }), await generate()];
    });
    for (const [i, field] of ["tools", "frobnicate", "audio", "maxTokenz"].entries()) {
      assert.ok(refused[i], `${field} was accepted`);
      assert.equal(refused[i][1], "invalid-option", refused[i][0]);
      assert.ok(refused[i][0].includes(field), refused[i][0]);
    }
    // Structured output through the package (llguidance in wasm): a regex-constrained greedy
    // generation and a chat completion with the same regex give the CPU reference's tokens (its
    // masks are Python llguidance's: tests/golden/constrained.rs), the text matches the regex,
    // and a broken regex is an error with its code.
    const regex = "(yes|no), [a-z ]{2,12}\\.";
    const wantRegex = cpu(modelPath, RAW_A, { maxTokens: 24, regex });
    // A JSON schema too (an enum, a bounded integer, an array with bounds): the GPU takes the
    // argmax among the allowed tokens, the CPU reference masks its whole row.
    const schema = { type: "object", properties: { kind: { enum: ["cat", "dog"] }, n: { type: "integer", minimum: 0, maximum: 99 },
      ok: { type: "array", items: { type: "boolean" }, minItems: 1, maxItems: 2 } }, required: ["kind", "n", "ok"],
      additionalProperties: false, "x-guidance": { whitespace_flexible: false } };
    const wantSchema = cpu(modelPath, RAW_A, { maxTokens: 40, jsonSchema: schema });
    const constrained = await tab.evaluate(async ([prompt, regex, schema]) => {
      const run = async (options) => {
        const ids = [];
        let text = "";
        for await (const ev of window.engine.generate(prompt, { temperature: 0, ...options })) {
          ids.push(ev.id);
          text += ev.text;
        }
        return { ids, text };
      };
      const { ids, text } = await run({ maxTokens: 24, regex });
      const stats = window.engine.stats();
      const json = await run({ maxTokens: 40, responseFormat: { type: "json_schema", json_schema: { name: "pet", schema } } });
      const bad = await window.engine.chat.completions.create({ messages: [{ role: "user", content: "Hi" }], regex: "(a" }).then(() => null, (e) => [e.message, e.code]);
      return { ids, text, bad, stats, json };
    }, [RAW_A, regex, schema]);
    assert.deepEqual(constrained.ids, wantRegex.ids);
    assert.deepEqual(constrained.json.ids, wantSchema.ids);
    const pet = JSON.parse(constrained.json.text);
    assert.deepEqual(Object.keys(pet).sort(), ["kind", "n", "ok"], constrained.json.text);
    assert.ok(["cat", "dog"].includes(pet.kind) && Number.isInteger(pet.n) && pet.n >= 0 && pet.n <= 99, constrained.json.text);
    assert.ok(pet.ok.length >= 1 && pet.ok.length <= 2 && pet.ok.every((b) => typeof b === "boolean"), constrained.json.text);
    // The masks' CPU time in wasm (the package's stats; `bench --json-schema` prints it natively).
    const m = constrained.stats;
    assert.ok(m.masks >= constrained.ids.length && m.maskUsMax >= m.maskUsMean && m.maskUsMean > 0, JSON.stringify(m));
    console.log(`regex masks in Chromium (wasm): ${m.masks}, ${m.maskUsMean.toFixed(0)} µs on average, ${m.maskUsMax.toFixed(0)} µs at most`);
    assert.match(constrained.text, new RegExp(`^${regex}$`));
    assert.equal(constrained.bad?.[1], "invalid-constraint", String(constrained.bad));

    // Tool calls through the package (the server's OpenAI module, in wasm): tool_choice
    // "required" returns a call whose arguments the schema holds; the call and a role "tool"
    // result go back, and the streamed answer is the CPU reference's on the prompt written by
    // hand as the engine renders tools for a template without them (tests/server's twin).
    const tools = [{ type: "function", function: { name: "get_time", parameters: { type: "object",
      properties: { zone: { enum: ["UTC", "CET"] } }, required: ["zone"], additionalProperties: false,
      "x-guidance": { whitespace_flexible: false } } } }];
    const toolRun = await tab.evaluate(async (tools) => {
      const question = [{ role: "user", content: "What time is it?" }];
      const r = await window.engine.chat.completions.create({ messages: question, tools, tool_choice: "required", temperature: 0, max_tokens: 120 });
      const call = r.choices[0].message.tool_calls[0];
      const history = [...question, r.choices[0].message, { role: "tool", tool_call_id: call.id, content: "12:00" }];
      let text = "";
      for await (const chunk of await window.engine.chat.completions.create({ messages: history, tools, temperature: 0, max_tokens: 16, stream: true })) {
        text += chunk.choices[0]?.delta?.content ?? "";
      }
      return { finish: r.choices[0].finish_reason, content: r.choices[0].message.content, call, text };
    }, tools);
    assert.equal(toolRun.finish, "tool_calls");
    assert.equal(toolRun.content, null);
    assert.equal(toolRun.call.function.name, "get_time");
    assert.ok(["UTC", "CET"].includes(JSON.parse(toolRun.call.function.arguments).zone), toolRun.call.function.arguments);
    const system = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" +
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" +
      tools.map((t) => "\n" + JSON.stringify(t)).join("") +
      "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " +
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    const callText = JSON.stringify({ name: "get_time", arguments: JSON.parse(toolRun.call.function.arguments) });
    const toolPrompt = `<|im_start|>system\n${system}<|im_end|>\n<|im_start|>user\nWhat time is it?<|im_end|>\n` +
      `<|im_start|>assistant\n<tool_call>\n${callText}\n</tool_call><|im_end|>\n` +
      `<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n`;
    assert.equal(toolRun.text, cpu(modelPath, toolPrompt, { maxTokens: 16 }).text);
  } finally {
    await browser.close();
    server.close();
  }
});

/** What Engine.inspect must report for `file`, from tests/browser/gguf.mjs. */
function expectedInfo(context, file = modelPath) {
  const { metadata: m, tensors } = readGguf(file);
  const arch = m["general.architecture"];
  const typeBytes = {};
  for (const t of tensors) typeBytes[t.type] = (typeBytes[t.type] ?? 0) + t.bytes;
  const headDim = m[`${arch}.attention.key_length`] ?? m[`${arch}.embedding_length`] / m[`${arch}.attention.head_count`];
  const maxContext = m[`${arch}.context_length`];
  const ctx = Math.min(context ?? 4096, maxContext);
  const kvValues = 2 * m[`${arch}.block_count`] * m[`${arch}.attention.head_count_kv`] * headDim * ctx;
  return {
    name: m["general.name"],
    architecture: arch,
    parameters: tensors.reduce((sum, t) => sum + t.elements, 0),
    fileBytes: fs.statSync(file).size,
    typeBytes,
    maxContext,
    context: ctx,
    kvBytesF16: 2 * kvValues,
    kvBytesF32: 4 * kvValues,
    largestTensorBytes: Math.max(...tensors.map((t) => t.bytes)),
    tensorBytes: tensors.reduce((sum, t) => sum + t.bytes, 0),
  };
}

function assertInfo(info, expected) {
  for (const key of ["name", "architecture", "parameters", "fileBytes", "maxContext", "context", "kvBytesF16", "kvBytesF32", "largestTensorBytes"]) {
    assert.equal(info[key], expected[key], key);
  }
  assert.deepEqual(info.typeBytes, expected.typeBytes);
  // Weights go to the GPU as they are in the file, blocks padded to whole words (Q8_0: 34 -> 36 bytes).
  assert.ok(info.weightBytes >= expected.tensorBytes && info.weightBytes <= expected.tensorBytes * 36 / 34, `weightBytes ${info.weightBytes}`);
}

const ggufRequests = (server) => server.requests.filter((r) => r.path.endsWith(".gguf"));
const cacheKeys = (tab) => tab.evaluate(async () => (await (await caches.open("webgpu-llm-models-v1")).keys()).map((r) => r.url));
// The package stores a download in chunks of 32 MiB (Chromium refuses one entry over 2 GiB).
const CHUNK_BYTES = 32 << 20;
const chunkKeys = (url, size) => Array.from({ length: Math.ceil(size / CHUNK_BYTES) }, (_, i) => `${url}?webgpu-llm-chunk=${i}`);

// On the page's default model (98 MB): that only its header travels is the point, and a 1 MB
// model is smaller than the package's first header read. Nothing is decoded.
test("Engine.inspect reads a model from its header: by URL with ranges, from a server without, from a picked file", { timeout: 600_000 }, async () => {
  const expectedInfoOf = (context) => expectedInfo(context, defaultModel);
  const expected = expectedInfoOf();
  const dir = stage("package-inspect", { "index.html": html(`import { Engine } from "./pkg/index.js"; window.Engine = Engine; window.ready = true;`), "not-a-model.gguf": "<html>hello</html>" });
  fs.rmSync(path.join(dir, "model.gguf"));
  fs.symlinkSync(defaultModel, path.join(dir, "model.gguf"));
  const ranged = await serve(dir);
  const crossOrigin = await serve(dir);
  const plain = await serve(dir, { ranges: false });
  const browser = await launch();
  try {
    const tab = await browser.newPage();
    tab.on("console", (m) => console.log("page:", m.text()));
    await tab.goto(`${ranged.url}index.html`);
    await tab.waitForFunction(() => window.ready);
    const inspect = (url, options) => tab.evaluate(([u, o]) => window.Engine.inspect(u, o), [url, options]);

    // A server that answers Range: only the header's bytes travel.
    const t0 = Date.now();
    const info = await inspect("./model.gguf");
    console.log(`inspect by URL: ${Date.now() - t0} ms`, JSON.stringify(info));
    assertInfo(info, expected);
    assert.equal(info.source, "network");
    const requests = ggufRequests(ranged);
    assert.ok(requests.length >= 1 && requests.every((r) => r.status === 206), JSON.stringify(requests));
    const sent = requests.reduce((sum, r) => sum + r.sent, 0);
    assert.ok(sent < 4 << 20, `inspect read ${sent} bytes of a ${expected.fileBytes}-byte file`);

    // The KV cache is f16, 2 bytes a value: natively with shader-f16, packed in words without it
    // (SwiftShader has none).
    const adapter = await tab.evaluate(async () => {
      const a = await navigator.gpu.requestAdapter();
      return { f16: a.features.has("shader-f16"), maxBinding: Math.min(a.limits.maxBufferSize, a.limits.maxStorageBufferBindingSize), memory: navigator.deviceMemory };
    });
    assert.equal(info.kvBytesPerValue, 2);
    assert.equal(info.kvBytes, expected.kvBytesF16);
    assert.equal(info.gpuBytes, info.weightBytes + info.kvBytes);
    assert.equal(info.adapter.f16, adapter.f16);
    assert.equal(info.fits, true);
    // 135M parameters and 45 KiB of KV cache a token: the whole trained context fits in the budget.
    assert.equal(info.affordableContext, expected.maxContext);
    assert.match(info.note, /does not tell .* memory/);

    // The context the figures assume follows the option, within the trained context.
    const short = await inspect("./model.gguf", { contextLength: 1000 });
    assertInfo(short, expectedInfoOf(1000));
    assert.equal(short.kvBytes, short.kvBytesPerValue * expectedInfoOf(1000).kvBytesF16 / 2);

    // Another origin that does not expose Content-Range: the size comes from a HEAD request.
    const other = await inspect(`${crossOrigin.url}model.gguf`);
    assertInfo(other, expected);
    assert.deepEqual(ggufRequests(crossOrigin).map((r) => [r.method, r.status]).sort(), [["GET", 206], ["GET", 206], ["HEAD", 200]]);

    // A server that ignores Range: the whole-file answer is cancelled once the header is in.
    const before = Date.now();
    const fromPlain = await inspect(`${plain.url}model.gguf`);
    assertInfo(fromPlain, expected);
    await new Promise((resolve) => setTimeout(resolve, 500));
    const whole = ggufRequests(plain);
    console.log(`inspect without ranges: ${Date.now() - before} ms, ${JSON.stringify(whole)}`);
    assert.equal(whole.length, 1);
    assert.equal(whole[0].status, 200);
    assert.equal(whole[0].complete, false, "the download was not cancelled");
    assert.ok(whole[0].sent < expected.fileBytes / 4, `sent ${whole[0].sent} bytes`);

    // A GPU with little memory (as far as the browser says): the KV cache of 4096 tokens does not
    // fit beside the weights, and the context that does is what the budget leaves.
    const small = await browser.newPage();
    await small.addInitScript(() => Object.defineProperty(Navigator.prototype, "deviceMemory", { get: () => 0.25 }));
    await small.goto(`${ranged.url}index.html`);
    await small.waitForFunction(() => window.ready);
    const tight = await small.evaluate(() => window.Engine.inspect("./model.gguf"));
    assert.equal(tight.memoryBudget, 0.125 * 1024 ** 3);
    assert.equal(tight.fits, false);
    assert.equal(tight.affordableContext, Math.floor((tight.memoryBudget - tight.weightBytes) / (tight.kvBytes / tight.context)));
    assert.ok(tight.affordableContext > 0 && tight.affordableContext < 4096, `${tight.affordableContext}`);
    assert.match(tight.note, new RegExp(`${tight.affordableContext} tokens fit`));
    await small.close();

    // A picked file: read as a slice, nothing fetched.
    await tab.setInputFiles("#file", defaultModel);
    const fromFile = await tab.evaluate(() => window.Engine.inspect(document.getElementById("file").files[0]));
    assertInfo(fromFile, expected);
    assert.equal(fromFile.source, "file");

    // Errors are Errors with words: not a GGUF file, a missing file.
    const failure = (url) => tab.evaluate((u) => window.Engine.inspect(u).then(() => "no error", (e) => `${e instanceof Error} ${e.message}`), url);
    assert.match(await failure("./not-a-model.gguf"), /^true .*GGUF/);
    assert.match(await failure("./missing.gguf"), /^true .*404/);
  } finally {
    await browser.close();
    ranged.close();
    crossOrigin.close();
    plain.close();
  }
});

// On the page's default model (98 MB, three 32 MiB chunks and a part): a cut after the first
// chunk was stored must remove it. Loaded, never decoded.
test("a cut download leaves nothing in Cache Storage; cachedModels lists a model and deleteCached removes it", { timeout: 600_000 }, async () => {
  const { dir, tab, server, close } = await openPackagePage("package-cache");
  fs.rmSync(path.join(dir, "model.gguf"));
  fs.symlinkSync(defaultModel, path.join(dir, "model.gguf"));
  const size = fs.statSync(defaultModel).size;
  try {
    const load = () => tab.evaluate(async () => {
      try {
        const engine = await window.Engine.load("./model.gguf", { cache: "cache-storage" });
        const info = engine.info();
        engine.unload();
        return { ok: info.fromCache };
      } catch (e) {
        return { error: `${e instanceof Error} ${e.message}` };
      }
    });
    // The cut comes after the first 32 MiB chunk was stored: that chunk must go too.
    server.cutNext();
    const cut = await load();
    console.log("cut download:", JSON.stringify(cut), JSON.stringify(ggufRequests(server)));
    assert.match(cut.error ?? "", /^true .*download .* failed/);
    assert.equal(ggufRequests(server).at(-1).sent, Math.floor(size / 2));
    assert.ok(size / 2 > CHUNK_BYTES);
    assert.deepEqual(await cacheKeys(tab), []);
    assert.deepEqual(await tab.evaluate(() => window.Engine.cachedModels()), []);

    const t0 = Date.now();
    assert.deepEqual(await load(), { ok: false });
    console.log(`download and load: ${Date.now() - t0} ms`);
    const url = `${server.url}model.gguf`;
    assert.deepEqual(await tab.evaluate(() => window.Engine.cachedModels()), [{ url, bytes: size, store: "cache-storage" }]);
    // Stored as 32 MiB chunks and the entry that lists them: no entry near Chromium's 2 GiB limit.
    assert.deepEqual((await cacheKeys(tab)).sort(), [url, ...chunkKeys(url, size)].sort());
    const count = ggufRequests(server).length;
    const cached = await tab.evaluate(() => window.Engine.inspect("./model.gguf"));
    assert.equal(cached.source, "cache");
    assert.equal(cached.fileBytes, size);
    assert.equal(ggufRequests(server).length, count, "inspect of a cached model went to the network");
    assert.deepEqual(await load(), { ok: true });
    assert.equal(ggufRequests(server).length, count, "a load of a cached model went to the network");

    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./model.gguf")), true);
    assert.deepEqual(await cacheKeys(tab), []);
    assert.deepEqual(await tab.evaluate(() => window.Engine.cachedModels()), []);
    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./model.gguf")), false);
  } finally {
    await close();
  }
});

test("a load never waits forever: a stalled cache read, file read or GPU request is tried once more, then fails with code stalled, and a hung download fails", { timeout: 600_000 }, async () => {
  // `window.stall[what]`: how many of the next such calls never settle, as a browser that loses
  // an answer does.
  const init = () => {
    window.stall = { match: 0, stream: 0, device: 0 };
    const never = () => new Promise(() => {});
    const match = Cache.prototype.match;
    Cache.prototype.match = function (...args) {
      return window.stall.match-- > 0 ? never() : match.apply(this, args);
    };
    const stream = Blob.prototype.stream;
    Blob.prototype.stream = function () {
      return window.stall.stream-- > 0 ? new ReadableStream({ type: "bytes", pull: never }) : stream.call(this);
    };
    const requestDevice = GPUAdapter.prototype.requestDevice;
    GPUAdapter.prototype.requestDevice = function (...args) {
      return window.stall.device-- > 0 ? never() : requestDevice.apply(this, args);
    };
  };
  const { tab, server, close } = await openPackagePage("package-stall", { init });
  const warnings = [];
  tab.on("console", (m) => m.type() === "warning" && warnings.push(m.text()));
  const c = { prompt: RAW_A, ids: rawA.ids }; // the CPU reference greedy
  const stallMs = 3000;
  const load = (stall, n = 0) => tab.evaluate(async ({ stall, stallMs, prompt, n }) => {
    Object.assign(window.stall, stall);
    const t0 = performance.now();
    try {
      const phases = [];
      const onProgress = (p) => phases.at(-1) !== p.phase && phases.push(p.phase);
      const engine = await window.Engine.load("./model.gguf", { stallMs, contextLength: 64, onProgress });
      const ids = [];
      for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: n, ignoreEos: true })) ids.push(ev.id);
      engine.unload();
      return { ids, phases, ms: performance.now() - t0 };
    } catch (e) {
      return { error: e.message, code: e.code, ms: performance.now() - t0 };
    } finally {
      Object.assign(window.stall, { match: 0, stream: 0, device: 0 });
    }
  }, { stall, stallMs, prompt: c.prompt, n });
  try {
    // Stalled once each (the cache lookup before the download, a slice read, the device
    // request): every one is tried again and the model runs exactly.
    const once = await load({ match: 1, stream: 1, device: 1 }, 2);
    console.log("stalled once each:", JSON.stringify(once), warnings);
    assert.deepEqual(once.ids, c.ids.slice(0, 2));
    assert.deepEqual(once.phases, ["download", "prepare", "upload"]);
    for (const what of ["Cache Storage", "bytes from disk", "GPU adapter and device request"]) {
      assert.ok(warnings.some((w) => w.includes(what) && w.includes("3 s")), `a warning that ${what} was tried again`);
    }
    // Stalled twice: an Error with code "stalled" naming what, after two deadlines, not a hang.
    for (const [stall, what] of [[{ device: 2 }, /GPU adapter and device request/], [{ stream: 2 }, /bytes from disk/], [{ match: 2 }, /Cache Storage/]]) {
      const failed = await load(stall);
      console.log(JSON.stringify(stall), JSON.stringify(failed));
      assert.equal(failed.code, "stalled");
      assert.match(failed.error, what);
      assert.match(failed.error, /within 3 s, twice/);
      assert.ok(failed.ms < 30_000, `${failed.ms} ms`);
    }
    // A server that stops sending half way without closing: the download fails, nothing cached.
    await tab.evaluate(() => window.Engine.clearCache());
    server.hangNext();
    const hung = await load({});
    console.log("hung download:", JSON.stringify(hung));
    assert.equal(hung.code, "stalled");
    assert.match(hung.error, /download .* failed \(no bytes of the model came for 3 s: the server or the disk stopped sending\)/);
    assert.deepEqual(await cacheKeys(tab), []);
    // And the engine loads and runs after all of it, without a reload.
    assert.deepEqual((await load({}, 1)).ids, c.ids.slice(0, 1));
  } finally {
    await close();
  }
});

test("a split model (3 parts) loads from any part's URL, each part cached, and from its parts picked together", { timeout: 900_000 }, async () => {
  const { dir, tab, server, close } = await openPackagePage("package-split");
  const parts = splitGguf(modelPath, path.join(dir, "tiny.gguf"), 3);
  const sizes = parts.map((p) => fs.statSync(p).size);
  const total = sizes.reduce((a, b) => a + b, 0);
  const c = { prompt: RAW_A, ids: rawA.ids }; // the CPU reference greedy
  const n = 8;
  try {
    // The header facts add up over the parts: the same model as the file it was split from.
    const info = await tab.evaluate(() => window.Engine.inspect("./tiny-00002-of-00003.gguf"));
    assertInfo(info, { ...expectedInfo(), fileBytes: total });
    assert.equal(info.parts, 3);
    assert.equal(info.source, "network");

    const run = (source, prompt, n) => tab.evaluate(async ({ source, prompt, n }) => {
      try {
        let last = null;
        const engine = await window.Engine.load(source === "picked" ? document.getElementById("file").files : source, { cache: "cache-storage", contextLength: 64, onProgress: (p) => (last = p) });
        const ids = [];
        for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: n, ignoreEos: true })) ids.push(ev.id);
        const fromCache = engine.info().fromCache;
        engine.unload();
        return { ids, fromCache, last };
      } catch (e) {
        return { error: `${e instanceof Error} ${e.message}` };
      }
    }, { source, prompt, n });

    const byUrl = await run("./tiny-00003-of-00003.gguf", c.prompt, n);
    console.log(JSON.stringify(byUrl));
    assert.equal(byUrl.error, undefined);
    assert.deepEqual(byUrl.ids, c.ids.slice(0, n));
    assert.equal(byUrl.fromCache, false);
    assert.deepEqual(byUrl.last, { phase: "upload", loaded: byUrl.last.total, total: byUrl.last.total });
    const urls = parts.map((p) => `${server.url}${path.basename(p)}`);
    assert.deepEqual(await tab.evaluate(() => window.Engine.cachedModels()), [{ url: urls[0], bytes: total, store: "cache-storage", parts: 3, of: 3 }]);
    assert.deepEqual((await cacheKeys(tab)).sort(), urls.flatMap((u, i) => [u, ...chunkKeys(u, sizes[i])]).sort());

    const count = ggufRequests(server).length;
    const again = await run("./tiny-00001-of-00003.gguf", c.prompt, n);
    assert.deepEqual(again.ids, byUrl.ids);
    assert.equal(again.fromCache, true);
    assert.equal(ggufRequests(server).length, count, "a cached split model went to the network");
    assert.equal(await tab.evaluate(() => window.Engine.deleteCached("./tiny-00002-of-00003.gguf")), true);
    assert.deepEqual(await cacheKeys(tab), []);

    // Picked or dropped together, in any order.
    await tab.setInputFiles("#file", [parts[2], parts[0], parts[1]]);
    const picked = await run("picked", c.prompt, n);
    assert.deepEqual(picked.ids, byUrl.ids);
    const pickedInfo = await tab.evaluate(() => window.Engine.inspect(document.getElementById("file").files));
    assertInfo(pickedInfo, { ...expectedInfo(), fileBytes: total });
    assert.equal(pickedInfo.source, "file");
    // One part missing: an error that says which parts to pick.
    await tab.setInputFiles("#file", [parts[0], parts[2]]);
    assert.match((await run("picked", c.prompt, 1)).error, /^true tiny-00001-of-00003\.gguf is one part of a model split in 3 parts: pick or drop all 3 parts/);
  } finally {
    await close();
  }
});

test("a lost GPU device is an Error in words, and the model loads and runs again without a reload", { timeout: 600_000 }, async () => {
  // Every device the page creates is kept, so the test can destroy the engine's.
  const init = () => {
    window.devices = [];
    const request = GPUAdapter.prototype.requestDevice;
    GPUAdapter.prototype.requestDevice = async function (...args) {
      const device = await request.apply(this, args);
      window.devices.push(device);
      return device;
    };
  };
  const { tab, close } = await openPackagePage("package-device-lost", { init });
  const c = { prompt: RAW_A, ids: rawA.ids }; // the CPU reference greedy
  try {
    const result = await tab.evaluate(async ({ prompt, want }) => {
      const ids = async (engine) => {
        const out = [];
        for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: want.length, ignoreEos: true })) out.push(ev.id);
        return out;
      };
      const load = () => window.Engine.load("./model.gguf", { cache: false, contextLength: 64 });
      const engine = await load();
      const before = await ids(engine);
      window.devices.at(-1).destroy();
      let lost = null;
      try {
        await ids(engine);
      } catch (e) {
        lost = `${e instanceof Error} ${e.code} ${e.message}`;
      }
      // Loading again makes a new device; the lost engine can still be unloaded.
      engine.unload();
      const again = await load();
      return { before, lost, after: await ids(again), devices: window.devices.length };
    }, { prompt: c.prompt, want: c.ids.slice(0, 4) });
    console.log(JSON.stringify(result));
    assert.deepEqual(result.before, c.ids.slice(0, 4));
    assert.match(result.lost ?? "", /^true device-lost the GPU device was lost .*reload the model/);
    assert.deepEqual(result.after, result.before);
    assert.equal(result.devices, 2);
  } finally {
    await close();
  }
});

test("a GPU that runs out of memory: an Error in words at load, nothing held after it or after unload, and a smaller context loads", { timeout: 600_000 }, async () => {
  // A GPU with `gpuMemory.cap` bytes, as browsers report running out: createBuffer returns an
  // invalid buffer and a GPUOutOfMemoryError goes to the innermost out-of-memory error scope, or
  // else to the device's uncapturederror event. Memory comes back when a buffer or its device is
  // destroyed (as GPU memory does; a buffer merely dropped waits for garbage collection).
  const init = () => {
    const memory = (window.gpuMemory = { cap: Infinity, held: 0, refused: 0 });
    const sizes = new Map();
    const owned = new Map();
    const scopes = new Map();
    const P = GPUDevice.prototype;
    const { createBuffer, pushErrorScope, popErrorScope, destroy } = P;
    const release = (buffer) => {
      if (!sizes.has(buffer)) return;
      memory.held -= sizes.get(buffer);
      sizes.delete(buffer);
    };
    const stack = (device) => scopes.get(device) ?? scopes.set(device, []).get(device);
    P.pushErrorScope = function (filter) {
      stack(this).push({ filter, error: null });
      return pushErrorScope.call(this, filter);
    };
    P.popErrorScope = async function () {
      const scope = stack(this).pop();
      const error = await popErrorScope.call(this);
      return scope?.error ?? error;
    };
    P.createBuffer = function (descriptor) {
      if (memory.held + descriptor.size > memory.cap) {
        memory.refused += 1;
        pushErrorScope.call(this, "validation");
        const invalid = createBuffer.call(this, { size: 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.STORAGE });
        popErrorScope.call(this);
        const error = new GPUOutOfMemoryError(`a buffer of ${descriptor.size} bytes does not fit`);
        const scope = stack(this).findLast((s) => s.filter === "out-of-memory");
        if (scope) scope.error ??= error;
        else setTimeout(() => this.dispatchEvent(new GPUUncapturedErrorEvent("uncapturederror", { error })));
        return invalid;
      }
      const buffer = createBuffer.call(this, descriptor);
      sizes.set(buffer, descriptor.size);
      memory.held += descriptor.size;
      (owned.get(this) ?? owned.set(this, new Set()).get(this)).add(buffer);
      return buffer;
    };
    const destroyBuffer = GPUBuffer.prototype.destroy;
    GPUBuffer.prototype.destroy = function () {
      release(this);
      return destroyBuffer.call(this);
    };
    P.destroy = function () {
      for (const buffer of owned.get(this) ?? []) release(buffer);
      owned.delete(this);
      return destroy.call(this);
    };
  };
  const { tab, close } = await openPackagePage("package-out-of-memory", { init });
  const c = { prompt: RAW_A, ids: rawA.ids }; // the CPU reference greedy
  try {
    const result = await tab.evaluate(async ({ prompt, want }) => {
      const load = (contextLength) => window.Engine.load("./model.gguf", { cache: false, contextLength });
      const ids = async (engine) => {
        const out = [];
        for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: want.length, ignoreEos: true })) out.push(ev.id);
        return out;
      };
      const m = window.gpuMemory;
      const small = await load(64);
      const needs = m.held;
      small.unload();
      const afterUnload = m.held;
      // Room for the model at 64 tokens and a little more: not for a 2048-token KV cache.
      m.cap = Math.ceil(needs * 1.05);
      let error = null;
      try {
        await load(2048);
      } catch (e) {
        error = `${e instanceof Error} ${e.code} ${e.message}`;
      }
      const afterFailure = m.held;
      const again = await load(64);
      return { needs, afterUnload, error, refused: m.refused, afterFailure, ids: await ids(again) };
    }, { prompt: c.prompt, want: c.ids.slice(0, 4) });
    console.log(JSON.stringify(result));
    // Every weight of the file is on the GPU (and the KV cache and buffers beside them).
    assert.ok(result.needs > expectedInfo().tensorBytes, `the model at 64 tokens holds ${result.needs} bytes`);
    assert.equal(result.afterUnload, 0, "unload leaves GPU memory held");
    assert.ok(result.refused > 0);
    assert.match(result.error ?? "", /^true out-of-gpu-memory the GPU ran out of memory holding this model's buffers \(\d+ MiB\): try a smaller model or a shorter context length/);
    assert.equal(result.afterFailure, 0, "a failed load leaves GPU memory held");
    assert.deepEqual(result.ids, c.ids.slice(0, 4));
  } finally {
    await close();
  }
});

// Four loops of generate/abort cycles run at once (generations started while others run join
// them in one batch), so that a decode step serves up to four and the 1000 cycles take a minute
// or two in SwiftShader, not six: each cycle still starts, streams and aborts its own generation
// at a random point, now also while others join, run and abort beside it.
test("1000 generate/abort cycles at random points, four at a time, leave the JS heap, wasm memory and GPU buffers flat", { timeout: 900_000 }, async () => {
  // Counts the GPU buffers the page creates.
  const init = () => {
    window.gpuBuffers = 0;
    const create = GPUDevice.prototype.createBuffer;
    GPUDevice.prototype.createBuffer = function (...args) {
      window.gpuBuffers += 1;
      return create.apply(this, args);
    };
  };
  // The tiny random-weight llama model (tests/data/arch), so that a cycle takes milliseconds.
  const { tab, close } = await openPackagePage("package-cycles", { init });
  try {
    const result = await tab.evaluate(async () => {
      const engine = await window.Engine.load("./model.gguf", { cache: false, contextLength: 128 });
      const words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far"];
      let aborted = 0;
      let loops = 0;
      // One loop of `n` cycles, with a random sequence of its own.
      const loop = async (n) => {
        let seed = ++loops;
        const rand = (k) => ((seed = (seed * 1103515245 + 12345) >>> 0) >>> 8) % k;
        for (let i = 0; i < n; i++) {
          const prompt = Array.from({ length: 1 + rand(8) }, () => words[rand(words.length)]).join(" ");
          const options = rand(2) ? { temperature: 0 } : { temperature: 0.8, seed: rand(1000), repetitionPenalty: 1.1 };
          const stopAfter = 1 + rand(12);
          let seen = 0;
          for await (const ev of engine.generate(prompt, { ...options, maxTokens: 16, ignoreEos: true })) {
            if (++seen >= stopAfter) break; // abort: leaving the loop stops the generation
          }
          aborted += engine.stats().stopReason === "aborted" ? 1 : 0;
        }
      };
      const cycles = (n) => Promise.all(Array.from({ length: 4 }, () => loop(n / 4)));
      const measure = async () => {
        window.gc();
        await new Promise((r) => setTimeout(r, 50));
        window.gc();
        return { heap: performance.memory.usedJSHeapSize, wasm: await window.Engine.wasmMemoryBytes(), buffers: window.gpuBuffers };
      };
      await cycles(100);
      const before = await measure();
      const t0 = performance.now();
      aborted = 0;
      await cycles(1000);
      const ms = performance.now() - t0;
      const after = await measure();
      engine.unload();
      return { before, after, aborted, ms };
    });
    console.log(JSON.stringify(result));
    assert.ok(result.aborted > 800, `${result.aborted} of 1000 cycles were aborted`);
    assert.equal(result.after.buffers, result.before.buffers, "GPU buffers created by the cycles");
    assert.equal(result.after.wasm, result.before.wasm, "wasm memory grew");
    assert.ok(result.after.heap - result.before.heap < 2 << 20, `the JS heap grew by ${result.after.heap - result.before.heap} bytes`);
  } finally {
    await close();
  }
});

test("a full storage quota loads the model without caching it and leaves nothing behind", { timeout: 600_000 }, async () => {
  // Cache Storage refuses every write after the first chunk, as a full quota does.
  const init = () => {
    const put = Cache.prototype.put;
    let writes = 0;
    Cache.prototype.put = function (...args) {
      if (++writes > 1) return Promise.reject(new DOMException("Quota exceeded.", "QuotaExceededError"));
      return put.apply(this, args);
    };
  };
  const { tab, close } = await openPackagePage("package-quota", { init });
  const c = { prompt: RAW_A, ids: rawA.ids }; // the CPU reference greedy
  try {
    const result = await tab.evaluate(async ({ prompt, n }) => {
      const engine = await window.Engine.load("./model.gguf", { cache: "cache-storage", contextLength: 64 });
      const ids = [];
      for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: n, ignoreEos: true })) ids.push(ev.id);
      const keys = (await (await caches.open("webgpu-llm-models-v1")).keys()).map((r) => r.url);
      return { ids, fromCache: engine.info().fromCache, keys, cached: await window.Engine.cachedModels() };
    }, { prompt: c.prompt, n: 4 });
    console.log(JSON.stringify(result));
    assert.deepEqual(result.ids, c.ids.slice(0, 4));
    assert.equal(result.fromCache, false);
    assert.deepEqual(result.keys, [], "the chunk stored before the quota ran out was removed");
    assert.deepEqual(result.cached, []);
  } finally {
    await close();
  }
});

// Gemma 3 270M (253 MB, about a token a second in SwiftShader) is replaced by a tiny random
// Gemma 3 with its SentencePiece tokenizer and its K-quant weight types (tiny-gemma.mjs), and
// the other architectures' plans (tests/data/arch) run beside it: each through the package
// against the CPU reference on the same file. (Gemma 3 270M's own numbers against transformers
// are tests/golden's; the K-quant kernels against the CPU's dequantization are the wasm kernel
// twins'.)
test("every architecture's plan through the package gives the CPU reference's greedy ids: a tiny Gemma 3 (sliding window, SentencePiece, Q4_K/Q6_K/Q5_0/Q8_0), qwen2, qwen3, phi3, mistral", { timeout: 600_000 }, async () => {
  const { dir, tab, close } = await openPackagePage("package-architectures");
  const gemma = path.join(artifacts, "tiny-gemma3.gguf");
  writeTinyGemma(gemma, path.join(root, "models/gemma-3-270m-q4_k_m.gguf"));
  const models = [
    // A prompt longer than the sliding window (4 tokens), which the generated tokens then cross again.
    { name: "gemma3", file: gemma, prompt: "Once upon a time, in a land far away, there lived", n: 6 },
    ...["qwen2", "qwen3", "phi3", "mistral"].map((name) => ({ name, file: path.join(root, `tests/data/arch/${name}/model.gguf`), prompt: RAW_A, n: 8 })),
  ];
  try {
    for (const m of models) {
      fs.symlinkSync(m.file, path.join(dir, `${m.name}.gguf`));
      const want = cpu(m.file, m.prompt, { maxTokens: m.n, ignoreEos: true });
      const got = await tab.evaluate(
        async ({ url, prompt, n }) => {
          const engine = await window.Engine.load(url, { cache: false, contextLength: 64 });
          const ids = [];
          for await (const ev of engine.generate(prompt, { temperature: 0, maxTokens: n, ignoreEos: true })) ids.push(ev.id);
          const result = { ids, info: engine.info(), stats: engine.stats() };
          engine.unload();
          return result;
        },
        { url: `./${m.name}.gguf`, prompt: m.prompt, n: m.n },
      );
      console.log(m.name, JSON.stringify(got.ids), JSON.stringify(want.ids));
      assert.equal(got.info.architecture, readGguf(m.file).metadata["general.architecture"], m.name);
      // The prompt tokenized in wasm as natively (SentencePiece for Gemma, with its BOS), then the same tokens.
      assert.equal(got.stats.promptTokens, want.stats.prompt_tokens, m.name);
      assert.deepEqual(got.ids, want.ids, m.name);
    }
    assert.equal(models.length, 5);
  } finally {
    await close();
  }
});
