// webgpu-llm/worker: `WorkerEngine`, the API of `Engine` (index.js) with the engine in a Web
// Worker, so that the page stays responsive while the model loads and generates, or, with
// `{ shared: true }`, in a SharedWorker that the tabs of one origin share: one loaded model and
// one batch serve them all. The worker's side is engine-worker.js (the protocol is described
// there). What differs from Engine: unload() returns a promise, and stats() and info() are what
// the worker sent with the last answer (they are kept current by every generation's end).

/** A URL as the page means it: relative to the page, not to the worker's script. */
const fromPage = (source) => (typeof source === "string" || source instanceof URL ? new URL(String(source), globalThis.location?.href).href : source);

/** An Error as the worker sent it, its code kept. */
const fromWire = (e) => Object.assign(new Error(e.message), e.code && { code: e.code });

/** One call or stream in flight: its result, its progress events, its items and its end. */
class Pending {
  queue = [];
  ended = false;
  failure = null;
  end = null;
  #wake = null;

  constructor(onProgress, onState) {
    this.onProgress = onProgress;
    this.onState = onState;
    this.result = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    // A stream's failure is thrown by its iterator; nobody need await `result` for it.
    this.result.catch(() => {});
  }

  receive(m) {
    if (m.stats !== undefined) this.onState?.(m);
    if ("progress" in m) this.onProgress?.(m.progress);
    else if ("item" in m) this.queue.push(m.item);
    else if ("end" in m) {
      this.ended = true;
      this.end = m.end;
    } else if ("error" in m) {
      this.ended = true;
      this.failure = fromWire(m.error);
      this.reject(this.failure);
    } else if ("result" in m) this.resolve(m.result);
    this.#wake?.();
  }

  /** The stream's items until its end (its return value) or failure (thrown). */
  async *items(cancel) {
    try {
      for (;;) {
        if (this.queue.length) {
          yield this.queue.shift();
          continue;
        }
        if (this.ended) {
          if (this.failure) throw this.failure;
          return this.end;
        }
        await new Promise((resolve) => (this.#wake = resolve));
        this.#wake = null;
      }
    } finally {
      if (!this.ended) cancel();
    }
  }
}

/** A port to one engine worker (dedicated or shared), with its calls in flight. */
class Connection {
  #port;
  #worker = null;
  #next = 1;
  #pending = new Map();
  #failure = null;

  constructor(shared, url = null) {
    const options = { type: "module", name: "webgpu-llm" };
    const failed = (e) => this.#fail(new Error(`the engine's worker (${url ?? "engine-worker.js"}) failed to start${e?.message ? `: ${e.message}` : ""}`));
    if (shared) {
      if (typeof SharedWorker === "undefined") {
        throw Object.assign(new Error("this browser has no SharedWorker (Chrome on Android, for one): load the model with { shared: false }"), { code: "unsupported" });
      }
      // The literal `new URL(..., import.meta.url)` inside the constructor call is the form
      // bundlers (Vite, webpack) recognize and bundle as a worker of its own.
      const worker = url ? new SharedWorker(url, options) : new SharedWorker(new URL("./engine-worker.js", import.meta.url), { type: "module", name: "webgpu-llm" });
      worker.onerror = failed;
      this.#port = worker.port;
      // The worker lets go of this tab's streams and engines when it goes.
      // (A page kept in the back-forward cache may come back: it keeps them.)
      globalThis.addEventListener?.("pagehide", (e) => e.persisted || this.#port.postMessage({ op: "bye" }));
    } else {
      this.#worker = url ? new Worker(url, options) : new Worker(new URL("./engine-worker.js", import.meta.url), { type: "module", name: "webgpu-llm" });
      this.#worker.onerror = failed;
      this.#port = this.#worker;
    }
    this.#port.onmessage = ({ data }) => {
      const pending = this.#pending.get(data.id);
      if (!pending) return;
      pending.receive(data);
      if (pending.ended || (("result" in data || "error" in data) && !pending.streams)) this.#pending.delete(data.id);
    };
  }

  /** Whether the worker failed (to start, or was ended): a later call makes a new one. */
  get failed() {
    return this.#failure !== null;
  }

  #fail(error) {
    this.#failure = error;
    for (const pending of this.#pending.values()) pending.receive({ error });
    this.#pending.clear();
  }

  /** Starts `op`; a stream's Pending (`streams`) keeps receiving after its result. */
  open(op, args, { onProgress, onState, streams = false } = {}) {
    const pending = new Pending(onProgress, onState);
    pending.streams = streams;
    if (this.#failure) {
      pending.receive({ error: this.#failure });
      return pending;
    }
    const id = this.#next++;
    this.#pending.set(id, pending);
    pending.id = id;
    this.#port.postMessage({ id, op, args });
    return pending;
  }

  call(op, args, handlers) {
    return this.open(op, args, handlers).result;
  }

  cancel(id) {
    this.#pending.delete(id);
    this.#port.postMessage({ id, op: "cancel" });
  }

  terminate() {
    this.#worker?.terminate();
    this.#fail(new Error("the engine was unloaded"));
  }
}

// Dedicated workers: one a loaded engine (unload ends it), and one kept idle for the static
// calls, which the next load takes (so a model checked with inspect() loads in the same worker).
const live = new Set();
let idle = null;
let shared = null;
function connection(isShared, url) {
  if (isShared) return shared && !shared.failed ? shared : (shared = new Connection(true, url));
  const engine = live.values().next().value;
  if (engine) return engine;
  return idle && !idle.failed ? idle : (idle = new Connection(false, url));
}

export class WorkerEngine {
  #connection;
  #key;
  #shared;
  #stats;
  #info;
  #state = (m) => {
    this.#stats = m.stats;
    // The worker leaves info out while another tab's generation holds the engine.
    if (m.info) this.#info = m.info;
  };

  constructor(connection, loaded, isShared) {
    this.#connection = connection;
    this.#key = loaded.key;
    this.#shared = isShared;
    this.#state(loaded);
    const chat = (messages, options = {}) => this.#stream("chat", messages, options);
    chat.completions = { create: (request, options) => this.#create(request, options) };
    this.chat = chat;
  }

  /**
   * Loads a model as `Engine.load` does, in a worker. Options: Engine.load's, and `shared`
   * (default false: a dedicated Worker of this page; true: the origin's SharedWorker, where a
   * URL another tab has loaded with the same options is not loaded again) and `workerUrl` (where
   * engine-worker.js is served, for a bundler that does not follow `new URL(..., import.meta.url)`).
   */
  static async load(source, options = {}) {
    const { onProgress, shared: isShared = false, workerUrl, ...rest } = options;
    let conn;
    if (isShared) conn = connection(true, workerUrl);
    else {
      conn = idle && !idle.failed ? idle : new Connection(false, workerUrl);
      idle = null;
      live.add(conn);
    }
    try {
      const loaded = await conn.call("load", [fromPage(source), rest], { onProgress });
      return new WorkerEngine(conn, loaded, isShared);
    } catch (e) {
      if (!isShared) {
        live.delete(conn);
        conn.terminate();
      }
      throw e;
    }
  }

  /** Engine.inspect in a worker; options also take `shared` and `workerUrl`. */
  static inspect(source, { shared: isShared, workerUrl, ...options } = {}) {
    return connection(isShared, workerUrl).call("inspect", [fromPage(source), options]);
  }

  static cachedModels({ shared: isShared, workerUrl } = {}) {
    return connection(isShared, workerUrl).call("cachedModels", []);
  }

  static deleteCached(url, { shared: isShared, workerUrl } = {}) {
    return connection(isShared, workerUrl).call("deleteCached", [fromPage(url)]);
  }

  static clearCache({ shared: isShared, workerUrl } = {}) {
    return connection(isShared, workerUrl).call("clearCache", []);
  }

  static wasmMemoryBytes({ shared: isShared, workerUrl } = {}) {
    return connection(isShared, workerUrl).call("wasmMemoryBytes", []);
  }

  /** Raw-text completion, as Engine.generate. */
  generate(prompt, options = {}) {
    return this.#stream("generate", prompt, options);
  }

  async *#stream(kind, prompt, { signal, ...options } = {}) {
    const pending = this.#connection.open("stream", [this.#key, kind, prompt, options], { onState: this.#state, streams: true });
    const stop = this.#follow(signal, pending);
    try {
      return yield* pending.items(() => this.#connection.cancel(pending.id));
    } finally {
      stop();
    }
  }

  /** OpenAI's chat completion, as Engine's `chat.completions.create`. */
  async #create(request, { signal } = {}) {
    const pending = this.#connection.open("create", [this.#key, request], { onState: this.#state, streams: !!request?.stream });
    const stop = this.#follow(signal, pending);
    let answer;
    try {
      answer = await pending.result;
    } finally {
      if (!request?.stream) stop();
    }
    if (!request?.stream) return answer;
    const items = pending.items(() => this.#connection.cancel(pending.id));
    return (async function* () {
      try {
        return yield* items;
      } finally {
        stop();
      }
    })();
  }

  /** An AbortSignal (which cannot cross to the worker) ends the generation there; returns its unfollow. */
  #follow(signal, pending) {
    if (!signal) return () => {};
    const abort = () => this.#connection.call("abortOne", [pending.id]).catch(() => {});
    if (signal.aborted) abort();
    signal.addEventListener("abort", abort, { once: true });
    return () => signal.removeEventListener("abort", abort);
  }

  async beamSearch(prompt, options = {}) {
    return (await this.#connection.call("beamSearch", [this.#key, prompt, options], { onState: this.#state })).beams;
  }

  /** Stops this page's generations on the engine (in a shared worker, not the other tabs'). */
  abort() {
    this.#connection.call("abort", [this.#key]).catch(() => {});
  }

  stats() {
    return this.#stats;
  }

  info() {
    return { ...this.#info, shared: this.#shared };
  }

  /** Lets go of the engine: a dedicated worker ends; a shared engine is unloaded when no tab holds it. */
  async unload() {
    try {
      await this.#connection.call("unload", [this.#key]);
    } finally {
      if (!this.#shared) {
        live.delete(this.#connection);
        this.#connection.terminate();
      }
    }
  }
}
