// Types of the webgpu-llm package.

export interface Progress {
  /** "download" while the file is fetched (or read from the cache), "upload" while weights go to the GPU. */
  phase: "download" | "upload";
  loaded: number;
  total: number;
}

export interface LoadOptions {
  onProgress?: (p: Progress) => void;
  /** Keep a downloaded model in Cache Storage and load it from there next time (default true). */
  cache?: boolean;
  /** Tokens the KV cache holds (default: min(model context, 4096)). */
  contextLength?: number;
  /** Run on the CPU reference forward pass instead of WebGPU (slow). */
  cpu?: boolean;
}

export interface GenerateOptions {
  /** 0 = greedy. Default 0.7. */
  temperature?: number;
  topP?: number;
  /** 0 = off. */
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  presencePenalty?: number;
  frequencyPenalty?: number;
  maxTokens?: number;
  seed?: number;
  /** Generation ends when the text contains one of these (not emitted). */
  stop?: string[];
  ignoreEos?: boolean;
  /** Attach the N most likely candidates to every token (reads logits back each step). */
  candidates?: number;
}

export interface Candidate {
  id: number;
  text: string;
  /** Probability after temperature, before the top-k/top-p/min-p cut. */
  prob: number;
  /** Kept by top-k, top-p and min-p. */
  kept: boolean;
}

export interface TokenEvent {
  id: number;
  /** Text completed by this token (may be empty while a character is incomplete). */
  text: string;
  /** Tokens in the KV cache after this one. */
  position: number;
  candidates?: Candidate[];
}

export interface Stats {
  promptTokens: number;
  prefilledTokens: number;
  generatedTokens: number;
  ttftMs: number;
  prefillTokS: number;
  decodeTokS: number;
  stopReason: "eos" | "stopstring" | "maxtokens" | "aborted";
}

export interface Info {
  modelName: string;
  architecture: string;
  contextLength: number;
  nLayers: number;
  nKvHeads: number;
  headDim: number;
  vocabSize: number;
  kvBytesPerValue: number;
  backend: string;
  adapter: string;
  f16: boolean;
  subgroups: boolean;
  fromCache: boolean;
}

export interface Message {
  role: string;
  content: string;
}

export declare class Engine {
  static load(source: string | URL | Blob | ArrayBuffer | Uint8Array, options?: LoadOptions): Promise<Engine>;
  static clearCache(): Promise<void>;
  generate(prompt: string, options?: GenerateOptions): AsyncIterableIterator<TokenEvent>;
  chat(messages: Message[], options?: GenerateOptions): AsyncIterableIterator<TokenEvent>;
  abort(): void;
  stats(): Stats | null;
  info(): Info;
  unload(): void;
}
