// Types of the webgpu-llm package.

export interface Progress {
  /**
   * "download" while the file is fetched (or read from the cache), "prepare" while its header is
   * read and the GPU device is opened, "upload" while weights go to the GPU.
   */
  phase: "download" | "prepare" | "upload";
  loaded: number;
  total: number;
}

/** Where downloads are kept: see LoadOptions.cache. */
export type CacheChoice = boolean | "opfs" | "cache-storage";

export interface LoadOptions {
  onProgress?: (p: Progress) => void;
  /**
   * Where a downloaded model is kept and loaded from next time: "opfs" (the Origin Private File
   * System: one file, no 2 GiB limit), "cache-storage" (32 MiB chunks), true (the default: OPFS
   * where the browser has it, else Cache Storage) or false (neither kept nor looked up). A URL
   * kept in either store loads from there.
   */
  cache?: CacheChoice;
  /** Tokens the KV cache holds (default: min(model context, 4096)). */
  contextLength?: number;
  /** Run on the CPU reference forward pass instead of WebGPU (slow). */
  cpu?: boolean;
  /**
   * Milliseconds a cache or file read, or a GPU adapter/device request, may take before
   * it is tried once more, then the load rejects with code "stalled"; also how long a download
   * may bring no byte and a write to OPFS may take (default 60000).
   */
  stallMs?: number;
}

export interface GenerateOptions {
  /** Ends this generation alone, as abort() would (stop reason "aborted"). */
  signal?: AbortSignal;
  /** 0 = greedy. Default 0.7. */
  temperature?: number;
  topP?: number;
  /** 0 = off. */
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  presencePenalty?: number;
  frequencyPenalty?: number;
  /** Default 256 (as the server's and the CLI's: one options type in the engine holds them). */
  maxTokens?: number;
  seed?: number;
  /** Generation ends when the text contains one of these (not emitted): at most 4, of at most 1024 bytes each. */
  stop?: string | string[];
  ignoreEos?: boolean;
  /** Attach the N most likely candidates to every token (reads logits back each step). */
  candidates?: number;
  /**
   * Speculative decoding: "lookup" (an n-gram of the context proposes what followed it) or
   * "layers:L" (the model's first L layers draft). Greedy output and the sampling distribution
   * are unchanged; not with `candidates`.
   */
  speculate?: string;
  /** Tokens drafted per checking pass with `speculate` (1 to 31). Default 4. */
  draftTokens?: number;
  /** Structured output (one of responseFormat, regex, grammar; not with speculate, beams or ignoreEos). */
  responseFormat?: ResponseFormat;
  /** Structured output: the text is one the whole regex matches. */
  regex?: string;
  /** Structured output: the text follows this Lark grammar (llguidance's dialect). */
  grammar?: string;
  /**
   * Functions the chat template shows the model (chat prompts). The text holds its calls in the
   * model's format; `chat.completions.create` returns them parsed as `tool_calls`.
   */
  tools?: Tool[];
  /** "auto" (default), "none", "required" or one function: the last two hold the text to calls. */
  toolChoice?: "auto" | "none" | "required" | { type: "function"; function: { name: string } };
  parallelToolCalls?: boolean;
}

/** OpenAI's `response_format`: any JSON object, or JSON a schema validates. */
export type ResponseFormat =
  | { type: "text" }
  | { type: "json_object" }
  | { type: "json_schema"; json_schema: { name: string; description?: string; schema?: object; strict?: boolean } };

/** OpenAI's function tool. */
export interface Tool {
  type: "function";
  function: { name: string; description?: string; parameters?: object; strict?: boolean };
}

/** A call the model made (`message.tool_calls`; streamed as `delta.tool_calls` with an `index`). */
export interface ToolCall {
  id: string;
  type: "function";
  /** The arguments as JSON text. */
  function: { name: string; arguments: string };
}

/** OpenAI's chat message: text, an assistant's calls, or a tool's result for a call. */
export interface ChatMessage {
  role: string;
  content: string | { type: "text"; text: string }[] | null;
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

/** OpenAI's chat completion request (the fields this engine takes; any other is refused by name). */
export interface ChatCompletionRequest {
  messages: ChatMessage[];
  model?: string;
  stream?: boolean;
  stream_options?: { include_usage?: boolean };
  max_tokens?: number;
  max_completion_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number;
  stop?: string | string[];
  /** Only 1: make several calls instead (they run as one batch). */
  n?: number;
  presence_penalty?: number;
  frequency_penalty?: number;
  /** Each token's log-probability (in the distribution it was drawn from: after temperature and penalties). */
  logprobs?: boolean;
  /** With logprobs: the most likely alternatives per token (0 to 20). */
  top_logprobs?: number;
  /** The engine's extensions. */
  top_k?: number;
  min_p?: number;
  repetition_penalty?: number;
  ignore_eos?: boolean;
  /** Speculative decoding ("lookup" or "layers:L"); such a call runs alone, not in the batch. */
  speculate?: string;
  draft_tokens?: number;
  /** Structured output: any JSON object, or JSON the schema validates. */
  response_format?: ResponseFormat;
  /** Structured output (the engine's): the text is one the whole regex matches. */
  regex?: string;
  /** Structured output (the engine's): the text follows this Lark grammar (llguidance's dialect). */
  grammar?: string;
  /** Functions the model may call (the chat template shows them; up to 128). */
  tools?: Tool[];
  /** "auto" (default), "none", "required" or one function: the last two hold the answer to calls. */
  tool_choice?: "auto" | "none" | "required" | { type: "function"; function: { name: string } };
  /** Several calls in one answer (default true). */
  parallel_tool_calls?: boolean;
}

export interface ChatCompletionUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export interface TopLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  /** Inside the top-k/top-p/min-p cut (the engine's extension). */
  kept: boolean;
}

export interface TokenLogprobs {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: TopLogprob[];
}

export interface ChatCompletion {
  id: string;
  object: "chat.completion";
  created: number;
  model: string;
  choices: {
    index: number;
    /** With tools: the calls, and the text beside them (null when none). */
    message: { role: "assistant"; content: string | null; tool_calls?: ToolCall[] };
    logprobs: { content: TokenLogprobs[] } | null;
    finish_reason: "stop" | "length" | "tool_calls";
  }[];
  usage: ChatCompletionUsage;
}

export interface ChatCompletionChunk {
  id: string;
  object: "chat.completion.chunk";
  created: number;
  model: string;
  /** The engine's extension, on a token's chunk: tokens in the KV cache once it is fed back. */
  position?: number;
  /** The engine's extension, with `speculate`: where the token came from. */
  speculation?: TokenSpeculation;
  /** The engine's extension, with a constraint: tokens its mask allowed at this token's step. */
  allowed?: number;
  choices: {
    index: number;
    /** With tools, text that may be a call is held back; calls come when the choice ends. */
    delta: { role?: "assistant"; content?: string; tool_calls?: (ToolCall & { index: number })[] };
    logprobs: { content: TokenLogprobs[] } | null;
    finish_reason: "stop" | "length" | "tool_calls" | null;
  }[];
  usage?: ChatCompletionUsage;
}

export interface BeamOptions {
  /** Beams kept and hypotheses returned (1 to 32). Default 4. */
  beams?: number;
  /** New tokens at most per hypothesis. Default 256. */
  maxTokens?: number;
  /** A hypothesis scores its summed log-probability / length^lengthPenalty. Default 1. */
  lengthPenalty?: number;
  /** As transformers': false (default), true, or "never". */
  earlyStopping?: boolean | "never";
  /** No hypothesis ends at the end-of-sequence token: each runs maxTokens. */
  ignoreEos?: boolean;
}

export interface Beam {
  ids: number[];
  text: string;
  score: number;
}

export interface Candidate {
  id: number;
  text: string;
  /** Probability after temperature, before the top-k/top-p/min-p cut. */
  prob: number;
  /** Kept by top-k, top-p and min-p. */
  kept: boolean;
}

export interface TokenSpeculation {
  /** A drafted token the model accepted (false: the model's own token). */
  accepted: boolean;
  /** The drafts this own token replaced (the first one the model rejected, and those after it). */
  rejected?: string[];
}

export interface TokenEvent {
  id: number;
  /** Text completed by this token (may be empty while a character is incomplete). */
  text: string;
  /** Tokens in the KV cache after this one. */
  position: number;
  candidates?: Candidate[];
  /** With `speculate`: whether the token was drafted and accepted, or which drafts it replaced. */
  speculation?: TokenSpeculation;
}

export interface Stats {
  promptTokens: number;
  prefilledTokens: number;
  generatedTokens: number;
  ttftMs: number;
  prefillTokS: number;
  decodeTokS: number;
  stopReason: "eos" | "stopstring" | "maxtokens" | "aborted";
  /** CPU time to encode and submit one decode step, in ms (absent on the CPU backend). */
  hostMsPerToken?: number;
  /** With a constraint: the masks computed and their CPU time (mean and longest), in µs. */
  masks?: number;
  maskUsMean?: number;
  maskUsMax?: number;
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
  /** The KV cache's pool of blocks (GPU backend): per block, the sequences holding it (0: the conversation). */
  /** Per block: the sequences holding it, and whether the prefix cache has it; `freeBlocks` counts the cached blocks no sequence holds (handed out when nothing else is free). */
  kvPool?: { blockTokens: number; blocks: number; freeBlocks: number; cachedBlocks: number; owners: number[][]; cached: boolean[] };
  backend: string;
  adapter: string;
  f16: boolean;
  subgroups: boolean;
  fromCache: boolean;
}

export interface InspectOptions {
  /** The context (tokens) the memory figures assume (default: min(model context, 4096), as load). */
  contextLength?: number;
  /** Read a URL from the cache (either store) when it is there (default true; false: the network). */
  cache?: CacheChoice;
}

/** What a GGUF file holds and needs, from its header alone. */
export interface ModelInfo {
  name: string;
  architecture: string;
  /** Transformer layers (each keeps its K and V in buffers of their own). */
  layers: number;
  /** Sum of the element counts of all tensors. */
  parameters: number;
  /** Parameters one token uses: all but a mixture of experts' unchosen experts. */
  activeParameters: number;
  /** The file's bytes (all parts of a split model). */
  fileBytes: number;
  /** 1, or how many files a split model comes in. */
  parts: number;
  /** Bytes of tensor data per block type (the quantization mix), e.g. {Q4_K: ..., Q6_K: ...}. */
  typeBytes: Record<string, number>;
  /** The context the model was trained for. */
  maxContext: number;
  /** The context the figures below assume. */
  context: number;
  /** GPU memory for the weights as uploaded (blocks padded to whole words). */
  weightBytes: number;
  /** The KV cache at `context` tokens, with f16 and with f32 values. */
  kvBytesF16: number;
  kvBytesF32: number;
  /** The largest single tensor in the file (the engine splits it over bindings when needed). */
  /** GPU memory of a hybrid model's recurrent state at `context` (LFM2's short convolutions); 0 otherwise. */
  stateBytes: number;
  largestTensorBytes: number;
}

export interface AdapterLimits {
  name: string;
  /** The adapter has shader-f16: the KV cache holds f16 values. */
  f16: boolean;
  maxBufferSize: number;
  maxStorageBufferBindingSize: number;
}

/** `Engine.inspect`'s answer: the model's facts and whether this browser's GPU can hold it. */
export interface Inspection extends ModelInfo {
  /** Where the header was read: the cache (either store), the network (Range requests), a File/Blob, bytes. */
  source: "cache" | "network" | "file" | "bytes";
  /** This browser's WebGPU adapter, or null when there is none. */
  adapter: AdapterLimits | null;
  /** 2 (f16) or 4 (f32): what the engine will use on this adapter. */
  kvBytesPerValue: 2 | 4;
  /** The KV cache at `context` tokens on this adapter. */
  kvBytes: number;
  /** weightBytes + kvBytes + stateBytes. */
  gpuBytes: number;
  /**
   * The GPU memory assumed available. WebGPU does not expose it: half of navigator.deviceMemory,
   * or 2 GiB when the browser does not report it; 0 without an adapter.
   */
  memoryBudget: number;
  /** Each buffer within the adapter's limits and gpuBytes within memoryBudget. */
  fits: boolean;
  /** The largest context (tokens) that fits both, at most maxContext; 0 when the weights alone do not. */
  affordableContext: number;
  /** What `fits` rests on, in words, to show beside it. */
  note: string;
}

export interface CachedModel {
  /** The model's URL; a split model's first part's URL. */
  url: string;
  /** Bytes kept (all cached parts of a split model). */
  bytes: number;
  /** Which store keeps it: the Origin Private File System or Cache Storage (a model in both is listed twice). */
  store: "opfs" | "cache-storage";
  /** A split model only: how many of its parts are cached, and how many it has. */
  parts?: number;
  of?: number;
}

/**
 * Where a model comes from: a URL (a split model's by any part's URL,
 * `name-00001-of-00003.gguf`), a File/Blob, every part of a split model as Files (any order), or
 * bytes.
 */
export type ModelSource = string | URL | Blob | Blob[] | FileList | ArrayBuffer | Uint8Array;

export interface Message {
  role: string;
  content: string;
  /** An assistant's calls, arguments as objects (the shape chat templates take). */
  tool_calls?: { id?: string; type: "function"; function: { name: string; arguments: object } }[];
  tool_call_id?: string;
}

/**
 * What the package rejects with: an `Error` whose message says what went wrong and what to do,
 * and, for the engine's errors, a `code` to act on: "device-lost" (load the model again),
 * "out-of-gpu-memory" (a smaller model or context), "invalid-file", "unsupported",
 * "invalid-metadata", "tokenizer", "chat-template", "invalid-option", "context-overflow",
 * "kv-pool-full", "too-many-sequences",
 * "non-finite", "invalid-prompt", "no-gpu", "gpu-limit", "gpu", "io", "stalled" (the browser
 * did not answer a read or a GPU request, twice, or a download stopped: try again).
 */
export interface EngineError extends Error {
  code?: string;
}

export declare class Engine {
  static load(source: ModelSource, options?: LoadOptions): Promise<Engine>;
  /**
   * A model's facts and whether this GPU can hold it, from the header alone: a URL with Range
   * requests (or the start of the download, cancelled, from a server without them), a File/Blob
   * as a slice, a cached URL from the cache. Rejects with an Error in words for a file the
   * engine cannot run or a server it cannot reach.
   */
  static inspect(source: ModelSource, options?: InspectOptions): Promise<Inspection>;
  /** The models kept by `load`, in OPFS and in Cache Storage. */
  static cachedModels(): Promise<CachedModel[]>;
  /** Removes one model (every part of a split one) from both stores; resolves to whether it was there. */
  static deleteCached(url: string | URL): Promise<boolean>;
  /** Removes every model kept by `load`, in both stores. */
  static clearCache(): Promise<void>;
  /** Bytes of the engine's wasm linear memory (its high-water mark: wasm memory never shrinks). */
  static wasmMemoryBytes(): Promise<number>;
  generate(prompt: string, options?: GenerateOptions): AsyncIterableIterator<TokenEvent>;
  /**
   * The conversation: chat completion with the model's chat template, the KV cache reused across
   * turns. `chat.completions.create` is OpenAI's API on the batch (concurrent calls share every
   * decode step).
   */
  chat: ((messages: Message[], options?: GenerateOptions) => AsyncIterableIterator<TokenEvent>) & {
    completions: {
      create(request: ChatCompletionRequest & { stream: true }, options?: { signal?: AbortSignal }): Promise<AsyncIterable<ChatCompletionChunk>>;
      create(request: ChatCompletionRequest & { stream?: false }, options?: { signal?: AbortSignal }): Promise<ChatCompletion>;
    };
  };
  /** Beam search (transformers' num_beams semantics) from a raw prompt or chat messages: the N best, best first. */
  beamSearch(prompt: string | Message[], options?: BeamOptions): Promise<Beam[]>;
  abort(): void;
  stats(): Stats | null;
  info(): Info;
  unload(): void;
}
