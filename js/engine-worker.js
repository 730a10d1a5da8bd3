// The engine's side of WorkerEngine (worker.js): this module runs in a dedicated Worker or a
// SharedWorker and serves `Engine` (index.js) to its clients, one MessagePort each.
//
// A client sends {id, op, args}; the worker answers {id, result} or {id, error}, and for a load
// {id, progress} before its result. A stream ("stream", or "create" with `stream: true`) sends
// {id, item} per token event or chunk and ends with {id, end}; {op: "cancel", id} ends it early
// and silently, {op: "abortOne", args: [id]} as an abort would (stop reason "aborted").
// Every answer that follows a generation carries the engine's `stats` and `info` (the client
// keeps them, so its stats() and info() stay synchronous as Engine's are). {op: "bye"} (a tab
// closing) ends that client's streams and lets go of its engines.
//
// In a SharedWorker the tabs of one origin share the engines: a load of a URL that is loaded
// already (with the same options) gives the same engine, whose batch then serves every tab's
// requests; the engine is unloaded when the last tab holding it unloads or goes.
import { Engine } from "./index.js";

/** key -> {engine: Promise<Engine>, holders: Set<Client>, listeners: Set<(p) => void>} */
const engines = new Map();
let anonymous = 0;

/** The engine's key: a URL with its options is shared; a File or bytes is an engine of its own. */
function keyOf(source, options) {
  const { contextLength, cpu, cache } = options;
  return typeof source === "string" || source instanceof URL
    ? JSON.stringify([String(source), contextLength ?? null, !!cpu, cache !== false])
    : `local:${++anonymous}`;
}

/** An Error as a message can carry it (its code kept: callers act on it). */
const wireError = (e) => ({ message: String((e && e.message) || e), name: e?.name ?? "Error", ...(e?.code && { code: e.code }) });

class Client {
  #port;
  /** Streams running for this client: id -> the iterator to end on cancel. */
  #streams = new Map();
  /** The engines this client holds, by key (a load each, an unload each). */
  #held = new Map();
  /** Each generation's AbortController and engine key, while it runs. */
  #aborts = new Map();
  #keys = new Map();
  /** The streams' pumps, which end once their generation has (after a cancel: at its next token). */
  #running = new Set();

  constructor(port) {
    this.#port = port;
    port.onmessage = ({ data }) => this.#receive(data);
    // Chrome tells a SharedWorker when a client's port is gone (a tab closed or crashed);
    // elsewhere the client's "bye" on pagehide is what says so.
    port.addEventListener?.("close", () => this.bye());
    port.start?.();
  }

  #post(message) {
    try {
      this.#port.postMessage(message);
    } catch {
      // The client is gone: what it asked for is dropped with it.
    }
  }

  async #receive({ id, op, args = [] }) {
    try {
      switch (op) {
        case "cancel":
          return this.#cancel(id);
        case "bye":
          return this.bye();
        case "stream":
          return await this.#stream(id, ...args);
        case "create":
          return await this.#create(id, ...args);
      }
      this.#post({ id, result: await this.#call(id, op, args) });
    } catch (e) {
      this.#post({ id, error: wireError(e) });
    }
  }

  async #call(id, op, args) {
    switch (op) {
      case "inspect":
        return Engine.inspect(...args);
      case "cachedModels":
        return Engine.cachedModels();
      case "deleteCached":
        return Engine.deleteCached(...args);
      case "clearCache":
        return Engine.clearCache();
      case "wasmMemoryBytes":
        return Engine.wasmMemoryBytes();
      case "load":
        return this.#load(id, ...args);
      case "beamSearch": {
        const [key, prompt, options] = args;
        const engine = await this.#engine(key);
        return { beams: await engine.beamSearch(prompt, options), ...this.#state(engine) };
      }
      case "abort":
        return this.#abort(args[0]);
      case "abortOne":
        return this.#aborts.get(args[0])?.abort();
      case "unload":
        return this.#release(args[0]);
    }
    throw new Error(`the engine's worker has no operation "${op}" (the package's worker.js and engine-worker.js must be of one version)`);
  }

  async #load(id, source, options) {
    const key = keyOf(source, options);
    let entry = engines.get(key);
    if (!entry) {
      const listeners = new Set();
      const engine = Engine.load(source, { ...options, onProgress: (p) => listeners.forEach((f) => f(p)) });
      entry = { engine, holders: new Set(), listeners };
      engines.set(key, entry);
      engine.catch(() => engines.get(key) === entry && engines.delete(key));
    }
    const listener = (progress) => this.#post({ id, progress });
    entry.listeners.add(listener);
    try {
      const engine = await entry.engine;
      entry.holders.add(this);
      this.#held.set(key, entry);
      return { key, shared: entry.holders.size > 1, ...this.#state(engine) };
    } finally {
      entry.listeners.delete(listener);
    }
  }

  async #engine(key) {
    const entry = this.#held.get(key);
    if (!entry) throw Object.assign(new Error("this engine has been unloaded: load the model again"), { code: "invalid-option" });
    if (entry.lost) throw entry.lost;
    return entry.engine;
  }

  /** The engine's stats and info, as far as it gives them now (info not while another client's generation runs). */
  #state(engine) {
    try {
      return { stats: engine.stats(), info: engine.info() };
    } catch {
      return { stats: engine.stats() };
    }
  }

  /** A generation's token events: `kind` "chat" (the conversation) or "generate" (the batch). */
  async #stream(id, key, kind, prompt, options) {
    const signal = this.#signal(id, key);
    const engine = await this.#engine(key).catch((e) => this.#forget(id) ?? Promise.reject(e));
    await this.#pump(id, engine, kind === "chat" ? engine.chat(prompt, { ...options, signal }) : engine.generate(prompt, { ...options, signal }));
  }

  /** OpenAI's chat completion: one answer, or (stream: true) its chunks as a stream. */
  async #create(id, key, request) {
    const signal = this.#signal(id, key);
    const engine = await this.#engine(key).catch((e) => this.#forget(id) ?? Promise.reject(e));
    let answer;
    try {
      answer = await engine.chat.completions.create(request, { signal });
    } catch (e) {
      this.#failed(id, e);
      return this.#forget(id);
    }
    if (!request?.stream) this.#forget(id);
    if (!request?.stream) return this.#post({ id, result: answer, ...this.#state(engine) });
    this.#post({ id, result: null });
    await this.#pump(id, engine, answer[Symbol.asyncIterator]());
  }

  /** Sends `items`' values until they end, fail or the client cancels them. */
  #pump(id, engine, items) {
    this.#streams.set(id, items);
    const done = this.#run(id, engine, items);
    this.#running.add(done);
    return done.finally(() => this.#running.delete(done));
  }

  async #run(id, engine, items) {
    try {
      let step;
      while (!(step = await items.next()).done) {
        if (!this.#streams.has(id)) break;
        this.#post({ id, item: step.value });
      }
      // A generation's own stats are its return value (the engine's last may be another tab's).
      if (this.#streams.has(id)) this.#post({ id, end: step.value ?? null, ...this.#state(engine), ...(step.value && { stats: step.value }) });
    } catch (e) {
      this.#failed(id, e);
    } finally {
      this.#forget(id);
    }
  }

  #forget(id) {
    this.#streams.delete(id);
    this.#aborts.delete(id);
    this.#keys.delete(id);
  }

  #failed(id, e) {
    // A lost device takes its engine: every holder's later call fails with the same error, and
    // the next load of the model makes a new engine.
    const key = this.#keys.get(id);
    const entry = this.#held.get(key);
    if (e?.code === "device-lost" && entry && !entry.lost) {
      entry.lost = e;
      if (engines.get(key) === entry) engines.delete(key);
      entry.engine.then((engine) => engine.unload()).catch(() => {});
    }
    this.#post({ id, error: wireError(e) });
  }

  #cancel(id) {
    const items = this.#streams.get(id);
    this.#streams.delete(id);
    // Ends the generation at its next token (its iterator's finally cancels it in the engine).
    items?.return?.().catch(() => {});
  }

  /** What abort() ends: the generation `id` on engine `key` (not another client's). Made before
   * any await, so that an abortOne right behind the request finds it. */
  #signal(id, key) {
    const controller = new AbortController();
    this.#aborts.set(id, controller);
    this.#keys.set(id, key);
    return controller.signal;
  }

  /** Ends this client's generations on engine `key`, each with stop reason "aborted", as Engine.abort. */
  async #abort(key) {
    await this.#engine(key);
    for (const [id, controller] of this.#aborts) if (this.#keys.get(id) === key) controller.abort();
  }

  async #release(key) {
    const entry = this.#held.get(key);
    if (!entry) return;
    this.#held.delete(key);
    entry.holders.delete(this);
    if (entry.holders.size === 0) {
      if (engines.get(key) === entry) engines.delete(key);
      if (!entry.lost) (await entry.engine).unload();
    }
  }

  /** The client is gone: its streams end, then its engines are let go (an engine unloads only once no generation holds it). */
  async bye() {
    for (const id of [...this.#streams.keys()]) this.#cancel(id);
    await Promise.allSettled([...this.#running]);
    for (const key of [...this.#held.keys()]) await this.#release(key).catch(() => {});
  }
}

if (typeof SharedWorkerGlobalScope !== "undefined" && self instanceof SharedWorkerGlobalScope) {
  self.onconnect = ({ ports }) => new Client(ports[0]);
} else {
  new Client(self);
}
