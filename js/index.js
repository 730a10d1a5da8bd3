// webgpu-llm: the npm package's entry point. Wraps the wasm engine into `Engine`, with model
// download into the Origin Private File System or Cache Storage, a look at a model before
// downloading it (inspect), progress events and async iterators of tokens. The wasm module
// initializes itself on first use: no init call.
import init, { WasmEngine, OpenAiCall, inspect as inspectHeader } from "./webgpu_llm.js";

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
/** An absolute URL without its fragment (Cache Storage ignores fragments anyway). */
function absolute(url) {
  const u = new URL(String(url), globalThis.location?.href);
  u.hash = "";
  return u.href;
}

// A split model's parts, as llama.cpp's gguf-split names them: name-00001-of-00003.gguf.
const SPLIT = /-(\d{5})-of-(\d{5})\.gguf$/i;

/** The URLs of every part of a split model named by any of its parts' URLs; else just `url`. */
function partUrls(url) {
  const u = new URL(url);
  const m = u.pathname.match(SPLIT);
  if (!m || Number(m[2]) < 1) return [url];
  return Array.from({ length: Number(m[2]) }, (_, i) => {
    const part = new URL(u);
    part.pathname = u.pathname.replace(SPLIT, `-${String(i + 1).padStart(5, "0")}-of-${m[2]}.gguf`);
    return part.href;
  });
}

/**
 * Picked or dropped files in the order of their parts: a split model's parts sorted by their
 * numbers (all of them must be there), or the one file. Files named otherwise keep their order
 * and the engine checks each part's own split.no.
 */
function orderParts(files) {
  if (files.length === 0) throw new TypeError("no model file was given");
  const named = files.map((f) => ({ file: f, m: String(f.name ?? "").match(SPLIT) }));
  if (!named.every((n) => n.m)) return files;
  const count = Number(named[0].m[2]);
  const base = (n) => n.file.name.slice(0, n.m.index);
  if (files.length !== count || named.some((n) => Number(n.m[2]) !== count || base(n) !== base(named[0]))) {
    throw new Error(`${named[0].file.name} is one part of a model split in ${count} parts: pick or drop all ${count} parts (${base(named[0])}-00001-of-${named[0].m[2]}.gguf ...) together`);
  }
  return named.sort((a, b) => Number(a.m[1]) - Number(b.m[1])).map((n) => n.file);
}

// How long one read of Cache Storage or of a Blob, one GPU adapter request, or a download without
// a byte may take before it counts as stalled. Headless Chromium has been seen, rarely and under
// load, to leave a load waiting forever between the download and the upload. A load never waits
// forever: what stalls is tried once more (a lost answer is then usually given), then it fails in
// words with code "stalled".
const STALL_MS = 60_000;

function stalledError(message) {
  const e = new Error(message);
  e.code = "stalled";
  return e;
}

/**
 * What `start()` settles with, or what `late()` returns (or throws) when that takes over `ms`.
 * The deadline is set before `start` runs, so it fires before any deadline `start` sets for the
 * same `ms` (a file read's own idle deadline, inside a retried read).
 */
function within(ms, late, start) {
  let timer;
  const expiry = new Promise((resolve, reject) => {
    timer = setTimeout(() => {
      try {
        resolve(late());
      } catch (e) {
        reject(e);
      }
    }, ms);
  });
  return Promise.race([new Promise((resolve) => resolve(start())), expiry]).finally(() => clearTimeout(timer));
}

/**
 * `attempt(signal)`, tried once more when it has not settled in `ms` (`signal` is aborted then,
 * so the attempt can let go of what it holds), else an Error with code "stalled".
 */
async function patiently(what, attempt, ms = STALL_MS) {
  for (let tries = 1; ; tries++) {
    const giveUp = new AbortController();
    const result = await within(ms, () => giveUp, () => attempt(giveUp.signal));
    if (result !== giveUp) return result;
    giveUp.abort();
    if (tries === 2) throw stalledError(`the browser did not finish ${what} within ${ms / 1000} s, twice: try again, and if it stays stuck restart the browser`);
    console.warn(`webgpu-llm: ${what} did not finish in ${ms / 1000} s; trying once more`);
  }
}

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

// Cache Storage refuses an entry over 2 GiB (Chromium), so a download is stored in chunks of its
// own under `<url>?webgpu-llm-chunk=<i>`, and last an empty entry under the URL that says how
// many chunks and bytes there are. A model is in the cache only once that entry is there.
const CHUNK_BYTES = 32 << 20;
const CHUNKS = "x-webgpu-llm-chunks";
const BYTES = "x-webgpu-llm-bytes";
const CHUNK_KEY = /[?&]webgpu-llm-chunk=\d+$/;
const chunkKey = (url, i) => `${url}${url.includes("?") ? "&" : "?"}webgpu-llm-chunk=${i}`;

/** A cached URL's bytes as one Blob (its chunks joined; read from disk as sliced), or null. */
async function cachedBlob(store, url, ms = STALL_MS) {
  if (!store) return null;
  const what = "reading the model from Cache Storage";
  const read = (key) => patiently(what, async () => (await store.match(key))?.blob() ?? null, ms);
  const entry = await patiently(what, () => store.match(url), ms);
  if (!entry) return null;
  if (!entry.headers.has(CHUNKS)) return read(url); // one whole-file entry
  const parts = [];
  for (let i = 0; i < Number(entry.headers.get(CHUNKS)); i++) {
    const chunk = await read(chunkKey(url, i));
    if (!chunk) return null;
    parts.push(chunk);
  }
  return new Blob(parts);
}

/** The bytes a cache entry holds for its URL: from its chunk count entry, or its body's size. */
async function cachedBytes(store, request) {
  const entry = await store.match(request);
  if (!entry) return null;
  if (entry.headers.has(CHUNKS)) return Number(entry.headers.get(BYTES));
  return (await entry.blob()).size;
}

/** Removes a URL's entries (the chunks and the entry that lists them); whether any was there. */
async function deleteUrl(store, url) {
  let found = false;
  for (const request of await store.keys()) {
    if (request.url === url || request.url.replace(CHUNK_KEY, "") === url) found = (await store.delete(request)) || found;
  }
  return found;
}

/**
 * Reads a stream into `size`-byte chunks of one buffer it reuses (`buffer`, at least `size`
 * bytes, or a new one): `chunk(bytes)` gets each (the last may be shorter) and must be done with
 * it when its promise settles. Returns {total, buffer}: the bytes read and the buffer, which a
 * BYOB read hands back as a new ArrayBuffer object over the same memory. With a BYOB
 * reader (fetch bodies and Blob streams in Chromium and Firefox) the bytes are read straight into
 * that buffer, so gigabytes pass through without leaving garbage in the JS heap. A read that
 * brings nothing for `ms`, or an abort of `signal`, cancels the stream and rejects.
 */
async function readChunks(stream, size, chunk, counted, { buffer = new ArrayBuffer(size), signal = null, ms = STALL_MS } = {}) {
  let fill = 0;
  let total = 0;
  let byob = null;
  try {
    byob = stream.getReader({ mode: "byob" });
  } catch {
    // Not a byte stream: read its chunks and copy them in.
  }
  const reader = byob ?? stream.getReader();
  const cancel = () => reader.cancel().catch(() => {});
  signal?.addEventListener("abort", cancel);
  // Each read races a timer: a stream that stops without ending (a server that hangs) fails.
  const read = (view) =>
    within(
      ms,
      () => {
        throw stalledError(`no bytes of the model came for ${ms / 1000} s: the server or the disk stopped sending`);
      },
      () => (view ? byob.read(view) : reader.read()),
    );
  let pending = null;
  try {
    for (;;) {
      let got;
      if (byob) {
        const { done, value } = await read(new Uint8Array(buffer, fill, size - fill));
        if (value) buffer = value.buffer;
        if (done) break;
        got = value.byteLength;
      } else {
        if (!pending) {
          const { done, value } = await read(null);
          if (done) break;
          pending = value;
        }
        got = Math.min(pending.length, size - fill);
        new Uint8Array(buffer, fill, got).set(pending.subarray(0, got));
        pending = got < pending.length ? pending.subarray(got) : null;
      }
      fill += got;
      total += got;
      counted?.(total);
      if (fill === size) {
        await chunk(new Uint8Array(buffer, 0, fill));
        fill = 0;
      }
    }
    if (fill) await chunk(new Uint8Array(buffer, 0, fill));
  } catch (e) {
    cancel();
    throw e;
  } finally {
    signal?.removeEventListener("abort", cancel);
  }
  return { total, buffer };
}

/**
 * Streams a response's body into Cache Storage, chunk by chunk. `counted(n)` follows the bytes.
 * A download cut off midway rejects; the chunks stored before are removed, so nothing of it stays.
 */
async function storeChunked(store, url, response, counted, ms) {
  let chunks = 0;
  try {
    // new Response(bytes) copies them, so the buffer can take the next chunk.
    const put = (key, body, init) => patiently("storing the model in Cache Storage", () => store.put(key, new Response(body, init)), ms);
    const { total } = await readChunks(response.body, CHUNK_BYTES, (bytes) => put(chunkKey(url, chunks++), bytes), counted, { ms });
    await put(url, null, { headers: { [CHUNKS]: String(chunks), [BYTES]: String(total) } });
  } catch (e) {
    await deleteUrl(store, url).catch(() => {});
    throw e;
  }
}

// Where downloads are kept. Each store: {name, available(), blob(url, ms) (the URL's bytes, or
// null), put(url, response, counted, ms) (streams the body in; a cut or refused download
// rejects and leaves nothing), remove(url) (whether it was there), list() ([{url, bytes}]), clear()}.
const cacheStorage = {
  name: "cache-storage",
  available: () => typeof caches !== "undefined",
  blob: async (url, ms) => cachedBlob(await openCache(), url, ms),
  put: async (url, response, counted, ms) => storeChunked(await openCache(), url, response, counted, ms),
  remove: async (url) => deleteUrl(await openCache(), url),
  async list() {
    const store = await openCache();
    const models = [];
    for (const request of await store.keys()) {
      if (CHUNK_KEY.test(request.url)) continue;
      const bytes = await cachedBytes(store, request);
      if (bytes !== null) models.push({ url: request.url, bytes });
    }
    return models;
  },
  clear: () => caches.delete(CACHE_NAME),
};

// The Origin Private File System keeps a download as one file, "<sha256 of the URL>.gguf" in
// OPFS_DIR (no size limit per entry, where Cache Storage's is 2 GiB), and beside it
// "<same>.json", {url, bytes}, written last: a model is there only once its .json is.
// createWritable() (in windows and workers) writes to a swap file that takes the file's place
// on close(), so a cut download is aborted and leaves nothing.
const OPFS_DIR = "webgpu-llm-models";

/** The package's OPFS folder, or null when it was never made (and `create` is false). */
async function opfsDir(create) {
  const root = await navigator.storage.getDirectory();
  return root.getDirectoryHandle(OPFS_DIR, { create }).catch((e) => {
    if (e?.name === "NotFoundError") return null;
    throw e;
  });
}

/** A file of the folder (a File), or null when there is none. */
const opfsFile = (dir, name) => dir.getFileHandle(name).then((h) => h.getFile(), () => null);

async function opfsName(url) {
  const hash = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(url));
  return Array.from(new Uint8Array(hash), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** A stored model's {url, bytes, file} from its .json, or null when it is not whole. */
async function opfsEntry(dir, meta) {
  const file = await opfsFile(dir, meta);
  let entry = null;
  try {
    entry = file && JSON.parse(await file.text());
  } catch {
    // Not written by this package: not a model.
  }
  if (!entry) return null;
  const data = await opfsFile(dir, meta.replace(/\.json$/, ".gguf"));
  return data?.size === entry.bytes ? { ...entry, file: data } : null;
}

const opfs = {
  name: "opfs",
  // Safari had getDirectory years before createWritable (2025): without it, Cache Storage.
  available: () => typeof globalThis.navigator?.storage?.getDirectory === "function" && typeof globalThis.FileSystemFileHandle?.prototype.createWritable === "function",
  async blob(url, ms) {
    const name = await opfsName(url);
    return patiently("reading the model from the Origin Private File System", async () => {
      const dir = await opfsDir(false);
      const entry = dir && (await opfsEntry(dir, `${name}.json`));
      return entry?.url === url ? entry.file : null;
    }, ms);
  },
  async put(url, response, counted, ms = STALL_MS) {
    const dir = await opfsDir(true);
    const name = await opfsName(url);
    let writable = null;
    // A write is not tried twice as a Cache Storage put is (it would append the bytes again):
    // one that does not settle in `ms` fails the download, which then leaves nothing.
    const bounded = (step) =>
      within(
        ms,
        () => {
          throw stalledError(`the browser did not finish writing the model to the Origin Private File System within ${ms / 1000} s: try again, and if it stays stuck restart the browser or pass cache: "cache-storage"`);
        },
        step,
      );
    try {
      writable = await bounded(async () => (await dir.getFileHandle(`${name}.gguf`, { create: true })).createWritable());
      // write() copies the bytes before it resolves, so the buffer can take the next chunk.
      const { total } = await readChunks(response.body, CHUNK_BYTES, (bytes) => bounded(() => writable.write(bytes)), counted, { ms });
      await bounded(() => writable.close());
      writable = null;
      await bounded(async () => {
        const meta = await (await dir.getFileHandle(`${name}.json`, { create: true })).createWritable();
        await meta.write(JSON.stringify({ url, bytes: total }));
        await meta.close();
      });
    } catch (e) {
      // A stream whose write never settled may never settle its abort either: not waited for past `ms`.
      if (writable) await bounded(() => writable.abort()).catch(() => {});
      await this.remove(url).catch(() => {});
      throw e;
    }
  },
  async remove(url) {
    const dir = await opfsDir(false);
    if (!dir) return false;
    const name = await opfsName(url);
    const gone = (file) => dir.removeEntry(file).then(() => true, () => false);
    const listed = await gone(`${name}.json`);
    await gone(`${name}.gguf`);
    return listed;
  },
  async list() {
    const dir = await opfsDir(false);
    const models = [];
    for await (const name of dir?.keys() ?? []) {
      const entry = name.endsWith(".json") ? await opfsEntry(dir, name) : null;
      if (entry) models.push({ url: entry.url, bytes: entry.bytes });
    }
    return models;
  },
  clear: () => navigator.storage.getDirectory().then((root) => root.removeEntry(OPFS_DIR, { recursive: true })).catch((e) => {
    if (e?.name !== "NotFoundError") throw e;
  }),
};

// Where `cache: true` stores a download: the first of these this browser has. Measured in
// headless Chromium (98 MB, on-disk profile, 3 runs each, alternating, twice more) the two are
// level: download+store 0.49-0.58 s vs 0.44-0.80 s, reload 0.31-0.33 s vs 0.32-0.38 s. OPFS
// goes first as it holds one file of any size where Cache Storage needs 32 MiB chunks (2 GiB
// per entry). A download is looked up in all of them.
const STORES = [opfs, cacheStorage];

/**
 * The stores a load looks in (every one this browser has, `cache: false` none) and the one it
 * stores a download in: `cache` true (the default: the first of STORES it has), "opfs" or
 * "cache-storage".
 */
function storesFor(cache = true) {
  if (!cache) return { lookIn: [], store: null };
  const lookIn = STORES.filter((s) => s.available());
  if (typeof cache !== "string") return { lookIn, store: lookIn[0] ?? null };
  const store = STORES.find((s) => s.name === cache);
  if (!store) throw new TypeError(`the cache option must be true, false, "opfs" or "cache-storage", not ${JSON.stringify(cache)}`);
  if (!store.available()) throw new Error(`this browser has no ${cache === "opfs" ? "Origin Private File System (navigator.storage.getDirectory)" : "Cache Storage"}: use cache: true to take the store it has`);
  return { lookIn: [store, ...lookIn.filter((s) => s !== store)], store };
}

/** A URL's bytes from the first store (in `lookIn`'s order) that has them, or null; all are asked at once. */
async function findCached(lookIn, url, ms) {
  const found = await Promise.all(lookIn.map((s) => s.blob(url, ms)));
  return found.find(Boolean) ?? null;
}

/**
 * Reads slices of Blobs into one buffer it reuses (the engine copies each slice into wasm memory
 * before asking for the next), so that loading a model leaves no garbage in the JS heap.
 */
class Slices {
  #buffer = new ArrayBuffer(0);
  #ms;

  constructor(ms = STALL_MS) {
    this.#ms = ms;
  }

  async read(blob, offset, len) {
    const slice = blob.slice(offset, offset + len);
    if (slice.size !== len) throw new Error(`the file is ${blob.size} bytes, too short for ${len} bytes at ${offset}: it changed or is truncated`);
    if (len === 0) return new Uint8Array(0);
    const { total, buffer } = await patiently("reading the model's bytes from disk", (signal) => {
      // A read given up on keeps (detaches) the buffer it was handed: the next try takes a new one.
      if (this.#buffer.byteLength < len) this.#buffer = new ArrayBuffer(len);
      return readChunks(slice.stream(), len, () => {}, null, { buffer: this.#buffer, signal, ms: this.#ms });
    }, this.#ms);
    this.#buffer = buffer;
    if (total !== len) throw new Error(`only ${total} of ${len} bytes at ${offset} could be read: the file changed or is truncated`);
    return new Uint8Array(buffer, 0, len);
  }
}

/**
 * One URL as a Blob: `cached` (its stored bytes, or null) when it is there. A download
 * streams into `store` (on disk) and the model is then read from there in slices, so the page
 * never holds the file in memory. A download cut off midway leaves nothing behind. `counted(loaded, total)` follows it.
 */
async function fetchPart(store, url, cached, counted, ms) {
  if (cached) {
    counted(cached.size, cached.size);
    return { blob: cached, fromCache: true };
  }
  const response = await fetchOk(url);
  const length = bodyLength(response);
  if (store && response.body) {
    try {
      await store.put(url, response, (loaded) => counted(loaded, length || loaded), ms);
      const stored = await store.blob(url, ms);
      if (stored) return { blob: stored, fromCache: false };
    } catch (e) {
      if (e?.name !== "QuotaExceededError") {
        throw Object.assign(new Error(`the model download from ${url} failed (${toError(e).message}); nothing was kept in the cache: try again`), e?.code && { code: e.code });
      }
      console.warn("webgpu-llm: the model does not fit the storage quota; loading it without caching");
    }
    try {
      return { blob: await (await fetchOk(url)).blob(), fromCache: false };
    } catch (e) {
      const quota = await globalThis.navigator?.storage?.estimate?.().catch(() => null);
      const room = quota ? ` (${((quota.quota - quota.usage) / GIB).toFixed(1)} GiB free for this site)` : "";
      throw new Error(`${url} does not fit this browser's storage for the site${room} and could not be held in memory either (${toError(e).message}): free some space, leave private browsing (it keeps little), or pick the file from disk instead`);
    }
  }
  const blob = await response.blob();
  counted(blob.size, blob.size);
  return { blob, fromCache: false };
}

/** A model URL (any part's, for a split model) as its parts' Blobs, each cached. */
async function fetchModel(url, { cache = true, onProgress, stallMs } = {}) {
  const { lookIn, store } = storesFor(cache);
  const urls = partUrls(url);
  const cached = await Promise.all(urls.map((u) => findCached(lookIn, u, stallMs)));
  // Each part's size, for one progress bar over all of them: cached, said by the server (only
  // asked for a split model), or 0 until its download starts.
  const sizes = await Promise.all(urls.map(async (u, i) => cached[i]?.size ?? (urls.length > 1 ? bodyLength(await fetchOk(u, { method: "HEAD" }).catch(() => new Response())) : 0)));
  const blobs = [];
  let fromCache = true;
  let before = 0;
  for (const [i, u] of urls.entries()) {
    const part = await fetchPart(store, u, cached[i], (loaded, total) => {
      sizes[i] = total;
      const all = sizes.reduce((a, b) => a + b, 0);
      onProgress?.({ phase: "download", loaded: before + loaded, total: Math.max(all, before + loaded) });
    }, stallMs);
    blobs.push(part.blob);
    fromCache &&= part.fromCache;
    before += part.blob.size;
  }
  return { blobs, fromCache };
}

/** The model as Blobs, one per part (URLs, Files, arrays of a split model's Files), or bytes. */
async function toSource(source, options) {
  if (typeof source === "string" || source instanceof URL) return fetchModel(absolute(source), options);
  const files = asFiles(source);
  if (files) {
    const size = files.reduce((sum, f) => sum + f.size, 0);
    options.onProgress?.({ phase: "download", loaded: size, total: size });
    return { blobs: files, fromCache: false };
  }
  const bytes = asBytes(source);
  if (bytes) return { bytes, fromCache: false };
  throw new TypeError(SOURCE_TYPES);
}

const SOURCE_TYPES = "the model source must be a URL, a File/Blob (or every part of a split model as an array of Files), an ArrayBuffer or a Uint8Array";

/** A File/Blob, or an array (or FileList) of a split model's parts, as Blobs in part order. */
function asFiles(source) {
  if (typeof Blob === "undefined") return null;
  if (source instanceof Blob) return [source];
  const list = Array.isArray(source) || (typeof FileList !== "undefined" && source instanceof FileList) ? Array.from(source) : null;
  if (!list) return null;
  if (!list.every((f) => f instanceof Blob)) throw new TypeError(SOURCE_TYPES);
  return orderParts(list);
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

/** Where a model's first bytes come from, for `Engine.inspect`: one prefix per part. */
async function prefixesOf(source, cache) {
  if (typeof source === "string" || source instanceof URL) {
    const { lookIn } = storesFor(cache);
    let from = "cache";
    const prefixes = [];
    for (const url of partUrls(absolute(source))) {
      const cached = await findCached(lookIn, url);
      if (!cached) from = "network";
      prefixes.push(cached ? blobPrefix(cached) : new UrlPrefix(url));
    }
    return { prefixes, from };
  }
  const files = asFiles(source);
  if (files) return { prefixes: files.map(blobPrefix), from: "file" };
  const bytes = asBytes(source);
  if (bytes) return { prefixes: [{ fileLen: bytes.length, bytes: async () => bytes, close() {} }], from: "bytes" };
  throw new TypeError(SOURCE_TYPES);
}

/** The model's facts from its headers (one per part), each read in growing prefixes as it asks. */
async function readInfo(prefixes, contextLength) {
  await initOnce();
  const want = prefixes.map(() => FIRST_HEADER_READ);
  try {
    for (;;) {
      const bytes = await Promise.all(prefixes.map((p, i) => p.bytes(want[i])));
      const info = inspectHeader(bytes, prefixes.map((p) => p.fileLen), contextLength);
      if (info.needBytes === undefined) return { ...info, parts: prefixes.length };
      const i = info.part;
      if (bytes[i].length >= prefixes[i].fileLen) throw new Error("the GGUF header runs past the end of the file: it is truncated or corrupt");
      want[i] = Math.max(info.needBytes, 2 * want[i]);
    }
  } finally {
    for (const p of prefixes) p.close();
  }
}

const requestAdapter = (ms) => patiently("the GPU adapter request", () => navigator.gpu.requestAdapter({ powerPreference: "high-performance" }), ms);

/**
 * Whether this browser's WebGPU adapter can hold the model. WebGPU exposes per-buffer limits but
 * not the GPU's memory, so the total is held to a conservative budget: half the device memory
 * the browser reports (navigator.deviceMemory, itself capped), or 2 GiB when it reports none.
 */
async function fit(info) {
  const adapter = globalThis.navigator?.gpu ? await requestAdapter() : null;
  if (!adapter) {
    return {
      adapter: null, kvBytesPerValue: 4, kvBytes: info.kvBytesF32, gpuBytes: info.weightBytes + info.kvBytesF32 + info.stateBytes,
      memoryBudget: 0, fits: false, affordableContext: 0,
      note: "This browser offers no WebGPU adapter, so the model cannot run on a GPU here.",
    };
  }
  const f16 = adapter.features.has("shader-f16");
  const { maxBufferSize, maxStorageBufferBindingSize } = adapter.limits;
  const reported = globalThis.navigator?.deviceMemory;
  const memoryBudget = (reported ? reported / 2 : 2) * GIB;
  // The engine keeps the cache in f16: natively with shader-f16, else packed two per u32 word.
  const kvBytesPerValue = 2;
  const kvBytes = info.kvBytesF16;
  // A hybrid's recurrent state grows with the context as the cache does (LFM2).
  const kvPerToken = (kvBytes + info.stateBytes) / info.context;
  // The engine keeps each layer's K and V (or state) in buffers of their own, each one binding.
  const bufferPerToken = Math.max(kvBytes / 2 / info.layers, info.stateBytes / info.layers) / info.context;
  const affordableContext = Math.max(0, Math.min(
    info.maxContext,
    Math.floor(Math.min(maxBufferSize, maxStorageBufferBindingSize) / bufferPerToken),
    Math.floor((memoryBudget - info.weightBytes) / kvPerToken),
  ));
  const gpuBytes = info.weightBytes + kvBytes + info.stateBytes;
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
  #model;
  /** Ends each running batched generation (`abort`). */
  #cancels = new Set();
  /** The stats of the generation that ended last. */
  #lastStats = null;

  constructor(inner, fromCache) {
    this.#inner = inner;
    this.#fromCache = fromCache;
    this.#model = inner.info().modelName;
    // engine.chat(messages, options) is the conversation (its KV cache reused across turns);
    // engine.chat.completions.create(request) is OpenAI's API, on the batch.
    const chat = (messages, options = {}) => this.#stream(messages, true, options);
    chat.completions = { create: (request, options) => this.#create(request, options) };
    this.chat = chat;
  }

  /**
   * Loads a GGUF model. `source`: a URL (streamed into the cache on disk with progress; any part's URL
   * of a split model `name-00001-of-00003.gguf` loads all its parts), a File/Blob, an array or
   * FileList of a split model's parts, or bytes. URLs and Blobs are read in slices, tensor by
   * tensor, into GPU memory, so a model larger than wasm's 4 GiB loads when the GPU has room.
   * Options: onProgress({phase: "download" | "prepare" | "upload", loaded, total}), cache (where a
   * download is kept: "opfs" (the Origin Private File System), "cache-storage", true (the
   * default: OPFS where the browser has it, else Cache Storage) or false (not kept; a URL kept
   * in either store loads from there unless false)), contextLength, cpu (run on the CPU reference instead of WebGPU), stallMs (default 60000:
   * a read of the cache or the file, or a GPU request, that has not finished in that long is
   * tried once more, then the load rejects with code "stalled"; a download without a byte for
   * that long rejects).
   */
  static async load(source, options = {}) {
    if (!options.cpu) {
      if (typeof navigator === "undefined" || !navigator.gpu) {
        throw new Error("WebGPU is not available in this browser: use a recent Chrome, Edge or Safari, or enable WebGPU");
      }
      // Checked before downloading the model: no adapter means no GPU to run it on.
      if (!(await requestAdapter(options.stallMs))) {
        throw new Error("WebGPU is enabled but found no usable GPU adapter (the GPU may be blocklisted or its driver too old)");
      }
    }
    await initOnce();
    const { blobs, bytes, fromCache } = await toSource(source, options);
    try {
      const opts = { contextLength: options.contextLength, cpu: !!options.cpu, stallMs: options.stallMs };
      options.onProgress?.({ phase: "prepare", loaded: 0, total: 0 });
      const progress = (done, total) => options.onProgress?.({ phase: "upload", loaded: done, total });
      const inner = blobs ? await WasmEngine.loadBlobs(blobs, new Slices(options.stallMs), opts, progress) : await WasmEngine.load(bytes, opts, progress);
      return new Engine(inner, fromCache);
    } catch (e) {
      throw toError(e);
    }
  }

  /**
   * What a model is and whether this browser's GPU can hold it, from its header alone: a URL is
   * read with Range requests (from the cache when either store has it), a File/Blob as a slice.
   * Options: contextLength (the context the memory figures assume), cache (default true: look in
   * both stores first; false: go to the network). Throws an Error in words for a file the engine cannot run.
   */
  static async inspect(source, options = {}) {
    try {
      const { prefixes, from } = await prefixesOf(source, options.cache ?? true);
      const info = await readInfo(prefixes, options.contextLength);
      return { ...info, source: from, ...(await fit(info)) };
    } catch (e) {
      throw toError(e);
    }
  }

  /**
   * The models this package keeps, in OPFS and in Cache Storage: [{url, bytes, store}] (store
   * "opfs" or "cache-storage"), a split model once per store under its first part's URL with `parts` (how many of its parts are cached) and `of` (how many it has).
   */
  static async cachedModels() {
    const models = new Map();
    for (const store of storesFor(true).lookIn) {
      for (const { url, bytes } of await store.list()) {
        const parts = partUrls(url);
        const key = `${store.name} ${parts[0]}`;
        const model = models.get(key) ?? { url: parts[0], bytes: 0, store: store.name, ...(parts.length > 1 && { parts: 0, of: parts.length }) };
        model.bytes += bytes;
        if (parts.length > 1) model.parts += 1;
        models.set(key, model);
      }
    }
    return [...models.values()];
  }

  /** Removes a model (every part of a split one) from both stores; resolves to whether it was there. */
  static async deleteCached(url) {
    let found = false;
    for (const store of storesFor(true).lookIn) {
      for (const part of partUrls(absolute(url))) found = (await store.remove(part)) || found;
    }
    return found;
  }

  /** Bytes of the engine's wasm linear memory (it never shrinks: its high-water mark). */
  static async wasmMemoryBytes() {
    return (await initOnce()).memory.buffer.byteLength;
  }

  /** Removes every model this package stored, in both stores. */
  static async clearCache() {
    for (const store of storesFor(true).lookIn) await store.clear();
  }

  /**
   * Raw-text completion: an async iterator of {id, text, position}. Generations started while
   * others run join them in one batch (each decode step serves all); with `candidates` or
   * `speculate` a generation runs alone.
   */
  generate(prompt, options = {}) {
    return this.#stream(prompt, false, options, !(options?.candidates > 0 || options?.speculate));
  }

  /**
   * Streams the token events of one generation: the conversation's (`batched` false: the KV cache
   * reused across turns, one at a time) or the batch's (`batched`: requests running at once share
   * every decode step). The iterator's return value is the generation's stats.
   */
  async *#stream(prompt, chat, { signal, ...options } = {}, batched = false) {
    const queue = [];
    let wake = null;
    let finished = false;
    let failure = null;
    let stats = null;
    let cancelled = false;
    const onToken = (ev) => {
      queue.push(ev);
      wake?.();
      return !cancelled;
    };
    const cancel = () => { cancelled = true; };
    if (batched) this.#cancels.add(cancel);
    // An AbortSignal ends this generation alone, as abort() would (stop reason "aborted").
    const onAbort = () => (batched ? cancel() : this.#inner.abort());
    signal?.addEventListener("abort", onAbort, { once: true });
    if (signal?.aborted) onAbort();
    const done = batched ? this.#inner.submit(prompt, chat, options, onToken) : this.#inner.generate(prompt, chat, options, onToken);
    done.then(
      (s) => { stats = s; this.#lastStats = s; finished = true; wake?.(); },
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
          return stats;
        }
        await new Promise((resolve) => (wake = resolve));
        wake = null;
      }
    } finally {
      if (!finished) {
        cancelled = true;
        if (!batched) this.#inner.abort();
        await done.catch(() => {});
      }
      this.#cancels.delete(cancel);
      signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * OpenAI's chat completion on this engine (`engine.chat.completions.create`): resolves to a
   * `chat.completion`, or with `stream: true` to an async iterable of `chat.completion.chunk`s.
   * The request is parsed and the answer shaped by the engine's OpenAI module (`src/openai.rs`,
   * the server's own), so the fields, their checks and the shapes are the server's: any field
   * it does not take is refused by name. Calls made while others run join them in one batch; a
   * call whose messages start as an earlier one's did (a chat's next turn) starts from the
   * prefix cache and prefills only the rest. `options.signal` (an AbortSignal, as in OpenAI's
   * client) ends this call alone, with finish reason as abort() gives.
   */
  async #create(request, { signal } = {}) {
    const call = await this.#openai(request);
    // Speculation and candidates run as one-request batches of their own (`generate`).
    const options = call.options();
    const tokens = this.#stream(call.messages(), true, { ...options, signal }, !options.speculate);
    if (!call.stream) {
      let step;
      while (!(step = await tokens.next()).done) call.push(step.value);
      const answer = call.completion(step.value);
      call.free();
      return answer;
    }
    // The first token is awaited here, so a request the engine refuses rejects create() itself.
    const first = await tokens.next();
    return (async function* () {
      let step = first;
      try {
        while (!step.done) {
          const chunk = call.chunk(step.value);
          if (chunk) yield chunk;
          step = await tokens.next();
        }
        yield* call.finish(step.value);
      } finally {
        await tokens.return();
        call.free();
      }
    })();
  }

  /** The engine's parse of an OpenAI request (`OpenAiCall`), its errors as the package's. */
  async #openai(request) {
    await initOnce();
    try {
      return new OpenAiCall(request, this.#model);
    } catch (e) {
      throw toError(e);
    }
  }

  /**
   * Beam search from a raw prompt (string) or chat messages (array): the N best continuations,
   * best first, as [{ids, text, score}] (transformers' num_beams semantics).
   */
  async beamSearch(prompt, options = {}) {
    try {
      return await this.#inner.beamSearch(prompt, Array.isArray(prompt), options);
    } catch (e) {
      throw toError(e);
    }
  }

  /** Stops the running generations (the conversation's and the batch's); the engine stays usable. */
  abort() {
    for (const cancel of this.#cancels) cancel();
    this.#inner.abort();
  }

  /** {promptTokens, prefilledTokens, generatedTokens, ttftMs, prefillTokS, decodeTokS, stopReason} of the generation that ended last. */
  stats() {
    return this.#lastStats ?? this.#inner.stats();
  }

  /** {modelName, architecture, contextLength, adapter, f16, subgroups, ...}; fromCache: loaded from the cache (either store). */
  info() {
    return { ...this.#inner.info(), fromCache: this.#fromCache };
  }

  /** Frees the model's GPU memory. */
  unload() {
    this.#inner.unload();
    this.#inner.free();
  }
}
