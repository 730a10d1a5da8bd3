// webgpu-llm: the npm package's entry point. Wraps the wasm engine into `Engine`, with model
// download + Cache Storage, progress events and async iterators of tokens. The wasm module
// initializes itself on first use: no separate init call.
import init, { WasmEngine } from "./webgpu_llm.js";

const CACHE_NAME = "webgpu-llm-models-v1";
let ready = null;

function initOnce() {
  ready ??= init({ module_or_path: new URL("./webgpu_llm_bg.wasm", import.meta.url) });
  return ready;
}

function toError(e) {
  if (e instanceof Error) return e;
  return new Error(typeof e === "string" ? e : (e && e.message) || String(e));
}

async function readBody(response, onProgress) {
  const total = Number(response.headers.get("content-length")) || 0;
  if (!response.body) {
    const bytes = new Uint8Array(await response.arrayBuffer());
    onProgress?.({ phase: "download", loaded: bytes.length, total: bytes.length });
    return bytes;
  }
  const reader = response.body.getReader();
  let buffer = new Uint8Array(total || 1 << 20);
  let loaded = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (loaded + value.length > buffer.length) {
      const grown = new Uint8Array(Math.max(buffer.length * 2, loaded + value.length));
      grown.set(buffer.subarray(0, loaded));
      buffer = grown;
    }
    buffer.set(value, loaded);
    loaded += value.length;
    onProgress?.({ phase: "download", loaded, total: total || loaded });
  }
  return buffer.subarray(0, loaded);
}

/** Fetches a model URL, from Cache Storage when it is there (and stores it there when not). */
async function fetchModel(url, { cache = true, onProgress } = {}) {
  const store = cache && typeof caches !== "undefined" ? await caches.open(CACHE_NAME) : null;
  const cached = store ? await store.match(url) : undefined;
  let response = cached;
  if (!response) {
    response = await fetch(url);
    if (!response.ok) throw new Error(`could not fetch the model from ${url}: HTTP ${response.status} ${response.statusText}`);
  }
  const bytes = await readBody(response, onProgress);
  if (store && !cached) {
    try {
      await store.put(url, new Response(bytes, { headers: { "content-length": String(bytes.length), "x-webgpu-llm-cached": "1" } }));
    } catch (e) {
      console.warn("webgpu-llm: the model could not be cached (storage quota?):", e);
    }
  }
  return { bytes, fromCache: !!cached };
}

async function toBytes(source, options) {
  if (typeof source === "string" || source instanceof URL) {
    return fetchModel(new URL(String(source), globalThis.location?.href).href, options);
  }
  if (typeof Blob !== "undefined" && source instanceof Blob) {
    const bytes = new Uint8Array(await source.arrayBuffer());
    options.onProgress?.({ phase: "download", loaded: bytes.length, total: bytes.length });
    return { bytes, fromCache: false };
  }
  if (source instanceof ArrayBuffer) return { bytes: new Uint8Array(source), fromCache: false };
  if (ArrayBuffer.isView(source)) return { bytes: new Uint8Array(source.buffer, source.byteOffset, source.byteLength), fromCache: false };
  throw new TypeError("Engine.load: the source must be a URL, a File/Blob, an ArrayBuffer or a Uint8Array");
}

export class Engine {
  #inner;
  #fromCache;

  constructor(inner, fromCache) {
    this.#inner = inner;
    this.#fromCache = fromCache;
  }

  /**
   * Loads a GGUF model. `source`: a URL (streamed, with progress, kept in Cache Storage), a
   * File/Blob, or bytes. Options: onProgress({phase, loaded, total}), cache (default true),
   * contextLength, cpu (run on the CPU reference instead of WebGPU).
   */
  static async load(source, options = {}) {
    if (!options.cpu) {
      if (typeof navigator === "undefined" || !navigator.gpu) {
        throw new Error("WebGPU is not available in this browser: use a recent Chrome, Edge or Safari, or enable WebGPU");
      }
      // Checked before downloading the model: no adapter means no GPU to run it on.
      if (!(await navigator.gpu.requestAdapter({ powerPreference: "high-performance" }))) {
        throw new Error("WebGPU is enabled but found no usable GPU adapter (the GPU may be blocklisted or its driver too old)");
      }
    }
    await initOnce();
    const { bytes, fromCache } = await toBytes(source, options);
    try {
      const inner = await WasmEngine.load(bytes, { contextLength: options.contextLength, cpu: !!options.cpu }, (done, total) =>
        options.onProgress?.({ phase: "upload", loaded: done, total }),
      );
      return new Engine(inner, fromCache);
    } catch (e) {
      throw toError(e);
    }
  }

  /** Removes every model this package stored in Cache Storage. */
  static async clearCache() {
    if (typeof caches !== "undefined") await caches.delete(CACHE_NAME);
  }

  /** Raw-text completion: an async iterator of {id, text}. */
  generate(prompt, options = {}) {
    return this.#stream(prompt, false, options);
  }

  /** Chat completion with the model's chat template; reuses the KV cache across turns. */
  chat(messages, options = {}) {
    return this.#stream(messages, true, options);
  }

  async *#stream(prompt, chat, options) {
    const queue = [];
    let wake = null;
    let finished = false;
    let failure = null;
    const done = this.#inner.generate(prompt, chat, options, (ev) => {
      queue.push(ev);
      wake?.();
    });
    done.then(
      () => { finished = true; wake?.(); },
      (e) => { failure = toError(e); finished = true; wake?.(); },
    );
    try {
      for (;;) {
        if (queue.length) {
          yield queue.shift();
          continue;
        }
        if (finished) {
          if (failure) throw failure;
          return;
        }
        await new Promise((resolve) => (wake = resolve));
        wake = null;
      }
    } finally {
      if (!finished) {
        this.#inner.abort();
        await done.catch(() => {});
      }
    }
  }

  /** Stops the running generation; the engine stays usable. */
  abort() {
    this.#inner.abort();
  }

  /** {promptTokens, prefilledTokens, generatedTokens, ttftMs, prefillTokS, decodeTokS, stopReason} of the last generation. */
  stats() {
    return this.#inner.stats();
  }

  /** {modelName, architecture, contextLength, adapter, f16, subgroups, ...}; fromCache: loaded from Cache Storage. */
  info() {
    return { ...this.#inner.info(), fromCache: this.#fromCache };
  }

  /** Frees the model's GPU memory. */
  unload() {
    this.#inner.unload();
    this.#inner.free();
  }
}
