// webgpu-llm: the npm package's entry point. Wraps the wasm engine into `Engine`, with model
// download + Cache Storage, a look at a model before downloading it (inspect), progress events
// and async iterators of tokens. The wasm module initializes itself on first use: no init call.
import init, { WasmEngine, inspect as inspectHeader } from "./webgpu_llm.js";

const CACHE_NAME = "webgpu-llm-models-v1";
// The first read of a header; it grows while the header needs more (a large vocabulary takes MBs).
const FIRST_HEADER_READ = 1 << 20;
const GIB = 1024 ** 3;
let ready = null;

function initOnce() {
  ready ??= init({ module_or_path: new URL("./webgpu_llm_bg.wasm", import.meta.url) });
  return ready;
}

function toError(e) {
  if (e instanceof Error) return e;
  return new Error(typeof e === "string" ? e : (e && e.message) || String(e));
}

const openCache = () => (typeof caches === "undefined" ? null : caches.open(CACHE_NAME));
const absolute = (url) => new URL(String(url), globalThis.location?.href).href;

/** fetch, with an error in words when the server cannot be reached or answers with an error. */
async function fetchOk(url, init) {
  let response;
  try {
    response = await fetch(url, init);
  } catch (e) {
    throw new Error(`could not reach ${url} (${toError(e).message}): check the address and the connection; a server on another site must allow cross-origin requests`);
  }
  if (!response.ok) throw new Error(`could not fetch ${url}: HTTP ${response.status} ${response.statusText}`.trimEnd());
  return response;
}

/** The body's length when the response says it (and sends it uncompressed). */
function bodyLength(response) {
  if (response.headers.get("content-encoding")) return 0;
  return Number(response.headers.get("content-length")) || 0;
}

/** The body of `response`, counted for progress as it streams through. */
function counted(response, onProgress) {
  const total = bodyLength(response);
  if (!response.body) return response;
  let loaded = 0;
  const body = response.body.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        loaded += chunk.length;
        onProgress?.({ phase: "download", loaded, total: total || loaded });
        controller.enqueue(chunk);
      },
    }),
  );
  return new Response(body, { headers: { "x-webgpu-llm-cached": "1" } });
}

/**
 * A model URL as a Blob, from Cache Storage when it is there. A download streams into the cache
 * (on disk) and the model is then read from there in slices, so the page never holds the file in
 * memory. A download cut off midway rejects the cache write and leaves nothing behind.
 */
async function fetchModel(url, { cache = true, onProgress } = {}) {
  const store = cache ? await openCache() : null;
  const cached = await store?.match(url);
  if (cached) {
    const blob = await cached.blob();
    onProgress?.({ phase: "download", loaded: blob.size, total: blob.size });
    return { blob, fromCache: true };
  }
  const download = async () => counted(await fetchOk(url), onProgress);
  if (store) {
    const body = await download();
    try {
      // The browser errors the body of a connection closed before its Content-Length (or its
      // last chunk), and then put() rejects without storing anything.
      await store.put(url, body);
    } catch (e) {
      if (e?.name !== "QuotaExceededError") throw new Error(`the model download from ${url} failed (${toError(e).message}); nothing was kept in the cache: try again`);
      console.warn("webgpu-llm: the model does not fit the storage quota; loading it without caching");
      return { blob: await (await download()).blob(), fromCache: false };
    }
    const stored = await store.match(url);
    if (stored) return { blob: await stored.blob(), fromCache: false };
  }
  return { blob: await (await download()).blob(), fromCache: false };
}

/** The model as a Blob (URLs, Files) or bytes. */
async function toSource(source, options) {
  if (typeof source === "string" || source instanceof URL) return fetchModel(absolute(source), options);
  if (typeof Blob !== "undefined" && source instanceof Blob) {
    options.onProgress?.({ phase: "download", loaded: source.size, total: source.size });
    return { blob: source, fromCache: false };
  }
  const bytes = asBytes(source);
  if (bytes) return { bytes, fromCache: false };
  throw new TypeError("the model source must be a URL, a File/Blob, an ArrayBuffer or a Uint8Array");
}

function asBytes(source) {
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  if (ArrayBuffer.isView(source)) return new Uint8Array(source.buffer, source.byteOffset, source.byteLength);
  return null;
}

/** The first bytes of a Blob (a File, or a Cache Storage entry), read as a slice. */
function blobPrefix(blob) {
  return {
    fileLen: blob.size,
    bytes: async (n) => new Uint8Array(await blob.slice(0, n).arrayBuffer()),
    close() {},
  };
}

/**
 * The first bytes of a URL, without downloading the file: Range requests, each for the bytes not
 * yet read; from a server that ignores Range, the start of its whole-file answer, whose download
 * is cancelled once enough has arrived.
 */
class UrlPrefix {
  #url;
  #buffer = new Uint8Array(0);
  #have = 0;
  #reader = null;
  fileLen = undefined;

  constructor(url) {
    this.#url = url;
  }

  async bytes(n) {
    while (this.#have < n && this.#have < (this.fileLen ?? Infinity)) {
      if (!this.#reader) {
        await this.#request(n);
        continue;
      }
      const { done, value } = await this.#reader.read();
      if (done) break;
      this.#push(value);
    }
    return this.#buffer.subarray(0, this.#have);
  }

  async #request(n) {
    const response = await fetchOk(this.#url, { headers: { Range: `bytes=${this.#have}-${n - 1}` } });
    if (response.status === 206) {
      this.fileLen ??= rangeTotal(response) ?? (await this.#headLength());
      const got = new Uint8Array(await response.arrayBuffer());
      if (!got.length) throw new Error(`${this.#url} answered a range request with no bytes`);
      this.#push(got);
      return;
    }
    const total = bodyLength(response);
    if (!total || !response.body) {
      await response.body?.cancel();
      throw new Error(`${this.#url}: the server answers neither range requests nor with the file's size, so the model cannot be inspected before it is downloaded`);
    }
    this.fileLen = total;
    this.#have = 0;
    this.#reader = response.body.getReader();
  }

  async #headLength() {
    const length = bodyLength(await fetchOk(this.#url, { method: "HEAD" }));
    if (!length) throw new Error(`${this.#url}: the server does not say the file's size`);
    return length;
  }

  #push(chunk) {
    if (this.#have + chunk.length > this.#buffer.length) {
      const grown = new Uint8Array(Math.max(2 * this.#buffer.length, this.#have + chunk.length));
      grown.set(this.#buffer.subarray(0, this.#have));
      this.#buffer = grown;
    }
    this.#buffer.set(chunk, this.#have);
    this.#have += chunk.length;
  }

  close() {
    this.#reader?.cancel().catch(() => {});
  }
}

/** The total of a `Content-Range: bytes a-b/total` header (unreadable cross-origin unless exposed). */
function rangeTotal(response) {
  const m = response.headers.get("content-range")?.match(/\/(\d+)$/);
  return m ? Number(m[1]) : undefined;
}

/** Where a model's first bytes come from, for `Engine.inspect`. */
async function prefixOf(source, cache) {
  if (typeof source === "string" || source instanceof URL) {
    const url = absolute(source);
    const cached = cache ? await (await openCache())?.match(url) : undefined;
    if (cached) return { prefix: blobPrefix(await cached.blob()), from: "cache" };
    return { prefix: new UrlPrefix(url), from: "network" };
  }
  if (typeof Blob !== "undefined" && source instanceof Blob) return { prefix: blobPrefix(source), from: "file" };
  const bytes = asBytes(source);
  if (bytes) return { prefix: { fileLen: bytes.length, bytes: async () => bytes, close() {} }, from: "bytes" };
  throw new TypeError("the model source must be a URL, a File/Blob, an ArrayBuffer or a Uint8Array");
}

/** The model's facts from its header, read in growing prefixes as the header asks. */
async function readInfo(prefix, contextLength) {
  await initOnce();
  let want = FIRST_HEADER_READ;
  try {
    for (;;) {
      const bytes = await prefix.bytes(want);
      const info = inspectHeader(bytes, prefix.fileLen, contextLength);
      if (info.needBytes === undefined) return info;
      if (bytes.length >= prefix.fileLen) throw new Error("the GGUF header runs past the end of the file: it is truncated or corrupt");
      want = Math.max(info.needBytes, 2 * want);
    }
  } finally {
    prefix.close();
  }
}

/**
 * Whether this browser's WebGPU adapter can hold the model. WebGPU exposes per-buffer limits but
 * not the GPU's memory, so the total is held to a conservative budget: half the device memory
 * the browser reports (navigator.deviceMemory, itself capped), or 2 GiB when it reports none.
 */
async function fit(info) {
  const adapter = globalThis.navigator?.gpu ? await navigator.gpu.requestAdapter({ powerPreference: "high-performance" }) : null;
  if (!adapter) {
    return {
      adapter: null, kvBytesPerValue: 4, kvBytes: info.kvBytesF32, gpuBytes: info.weightBytes + info.kvBytesF32,
      memoryBudget: 0, fits: false, affordableContext: 0,
      note: "This browser offers no WebGPU adapter, so the model cannot run on a GPU here.",
    };
  }
  const f16 = adapter.features.has("shader-f16");
  const { maxBufferSize, maxStorageBufferBindingSize } = adapter.limits;
  const reported = globalThis.navigator?.deviceMemory;
  const memoryBudget = (reported ? reported / 2 : 2) * GIB;
  const kvBytesPerValue = f16 ? 2 : 4;
  const kvBytes = f16 ? info.kvBytesF16 : info.kvBytesF32;
  const kvPerToken = kvBytes / info.context;
  // The engine keeps each layer's K and V in buffers of their own, each one binding.
  const bufferPerToken = kvPerToken / 2 / info.layers;
  const affordableContext = Math.max(0, Math.min(
    info.maxContext,
    Math.floor(Math.min(maxBufferSize, maxStorageBufferBindingSize) / bufferPerToken),
    Math.floor((memoryBudget - info.weightBytes) / kvPerToken),
  ));
  const gpuBytes = info.weightBytes + kvBytes;
  const fits = affordableContext >= info.context;
  const budget = `${(memoryBudget / GIB).toFixed(1)} GiB (${reported ? `half the ${reported} GiB of memory this browser reports` : "this browser reports no memory size"})`;
  const gib = (bytes) => `${(bytes / GIB).toFixed(2)} GiB`;
  let note = `WebGPU does not tell a page how much memory the GPU has, so this checks each buffer against the adapter's limits and the total against ${budget}.`;
  if (info.weightBytes > memoryBudget) note += ` The weights alone need ${gib(info.weightBytes)}; the model may still load on a GPU with more memory.`;
  else if (!fits) note += ` At ${info.context} tokens the model needs ${gib(gpuBytes)}; ${affordableContext} tokens fit, and a GPU with more memory may hold more.`;
  const name = adapter.info ? adapter.info.description || [adapter.info.vendor, adapter.info.architecture].filter(Boolean).join(" ") : "";
  return {
    adapter: { name: name || "WebGPU adapter", f16, maxBufferSize, maxStorageBufferBindingSize },
    kvBytesPerValue, kvBytes, gpuBytes, memoryBudget, fits, affordableContext, note,
  };
}

export class Engine {
  #inner;
  #fromCache;

  constructor(inner, fromCache) {
    this.#inner = inner;
    this.#fromCache = fromCache;
  }

  /**
   * Loads a GGUF model. `source`: a URL (streamed into Cache Storage with progress), a File/Blob,
   * or bytes. URLs and Blobs are read in slices, tensor by tensor, into GPU memory. Options: onProgress({phase, loaded, total}), cache (default true),
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
    const { blob, bytes, fromCache } = await toSource(source, options);
    try {
      const opts = { contextLength: options.contextLength, cpu: !!options.cpu };
      const progress = (done, total) => options.onProgress?.({ phase: "upload", loaded: done, total });
      const inner = blob ? await WasmEngine.loadBlob(blob, opts, progress) : await WasmEngine.load(bytes, opts, progress);
      return new Engine(inner, fromCache);
    } catch (e) {
      throw toError(e);
    }
  }

  /**
   * What a model is and whether this browser's GPU can hold it, from its header alone: a URL is
   * read with Range requests (from Cache Storage when it is there), a File/Blob as a slice.
   * Options: contextLength (the context the memory figures assume), cache (default true: look in
   * Cache Storage first). Throws an Error in words for a file the engine cannot run.
   */
  static async inspect(source, options = {}) {
    const { prefix, from } = await prefixOf(source, options.cache !== false);
    try {
      const info = await readInfo(prefix, options.contextLength);
      return { ...info, source: from, ...(await fit(info)) };
    } catch (e) {
      throw toError(e);
    }
  }

  /** The models this package keeps in Cache Storage: [{url, bytes}]. */
  static async cachedModels() {
    const store = await openCache();
    if (!store) return [];
    const models = [];
    for (const request of await store.keys()) {
      const blob = await (await store.match(request))?.blob();
      if (blob) models.push({ url: request.url, bytes: blob.size });
    }
    return models;
  }

  /** Removes one model from Cache Storage; resolves to whether it was there. */
  static async deleteCached(url) {
    const store = await openCache();
    return store ? store.delete(absolute(url)) : false;
  }

  /** Bytes of the engine's wasm linear memory (it never shrinks: its high-water mark). */
  static async wasmMemoryBytes() {
    return (await initOnce()).memory.buffer.byteLength;
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
