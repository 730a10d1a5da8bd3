// Types of webgpu-llm/worker: Engine's API with the engine in a (shared) worker.
import type { Engine, LoadOptions, InspectOptions, ModelSource, Inspection, CachedModel, Info, Stats } from "./index.js";

export interface WorkerOptions {
  /** false (default): a dedicated Worker of this page; true: the origin's SharedWorker, shared by its tabs. */
  shared?: boolean;
  /** Where engine-worker.js is served, for a bundler that does not follow `new URL("./engine-worker.js", import.meta.url)`. */
  workerUrl?: string | URL;
}

export declare class WorkerEngine {
  /**
   * Engine.load in a worker. With `shared: true` a URL that another tab of this origin has loaded
   * with the same options is not loaded again: the tabs share the engine and its batch.
   */
  static load(source: ModelSource, options?: LoadOptions & WorkerOptions): Promise<WorkerEngine>;
  static inspect(source: ModelSource, options?: InspectOptions & WorkerOptions): Promise<Inspection>;
  static cachedModels(options?: WorkerOptions): Promise<CachedModel[]>;
  static deleteCached(url: string | URL, options?: WorkerOptions): Promise<boolean>;
  static clearCache(options?: WorkerOptions): Promise<void>;
  static wasmMemoryBytes(options?: WorkerOptions): Promise<number>;
  generate: Engine["generate"];
  chat: Engine["chat"];
  beamSearch: Engine["beamSearch"];
  /** Stops this page's generations (in a shared worker, not the other tabs'). */
  abort(): void;
  /** The stats of this page's generation that ended last, as the worker sent them. */
  stats(): Stats | null;
  /** Engine's info, and whether the engine is in the shared worker. */
  info(): Info & { shared: boolean };
  /** Lets go of the engine: a dedicated worker ends; a shared engine is unloaded when no tab holds it. */
  unload(): Promise<void>;
}
