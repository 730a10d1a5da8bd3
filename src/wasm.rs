//! The wasm-bindgen API: the npm package's surface. `pkg/index.js` wraps it into the
//! `Engine` class with async iterators; this layer turns JS values into engine options and
//! engine errors into JS `Error`s. Nothing here panics on bad input.

use crate::chat::Message;
use crate::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, Stats};
use crate::gguf::{ByteSource, Gguf, GgufError, SplitSource};
use crate::gpu::GpuOptions;
use crate::options::RequestOptions;
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use wasm_bindgen::prelude::*;

#[wasm_bindgen(start)]
fn start() {
    console_error_panic_hook::set_once();
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct JsLoadOptions {
    context_length: Option<usize>,
    /// Run on the CPU reference instead of WebGPU (slow; for tests and machines without WebGPU).
    cpu: bool,
    /// Milliseconds the GPU adapter and device request may take before it is tried once more,
    /// then fails with code "stalled" (the package's `stallMs`).
    stall_ms: Option<u32>,
}

/// The page's extra to a request's options: attach the top-N candidates to each token (its
/// "inside the engine" panel, and `logprobs` in `chat.completions.create`).
#[derive(Default)]
struct JsExtras {
    candidates: usize,
}

/// The package's options (camelCase, every field optional) as a request's (`RequestOptions`:
/// the defaults and bounds the server and the CLI share), with the page's `candidates`.
/// A field it does not name is refused, naming it.
fn js_request(options: JsValue) -> Result<(RequestOptions, JsExtras), JsValue> {
    if options.is_undefined() || options.is_null() {
        return Ok(Default::default());
    }
    let mut fields: serde_json::Map<String, serde_json::Value> = serde_wasm_bindgen::from_value(options)
        .map_err(|e| invalid_option(format!("options must be an object: {e}")))?;
    // undefined and null are "not given".
    fields.retain(|_, v| !v.is_null());
    let candidates = match fields.remove("candidates") {
        None => 0,
        Some(v) => serde_json::from_value(v)
            .map_err(|e| invalid_option(format!("candidates: a count of alternatives per token: {e}")))?,
    };
    let request = serde_json::from_value(serde_json::Value::Object(fields))
        .map_err(|e| invalid_option(format!("options: {e}")))?;
    Ok((request, JsExtras { candidates }))
}

/// A JS `Error` with code "invalid-option".
fn invalid_option(message: String) -> JsValue {
    let js: JsValue = JsError::new(&message).into();
    let _ = js_sys::Reflect::set(&js, &"code".into(), &"invalid-option".into());
    js
}

/// A seed for a request that gives none.
fn random_seed() -> u64 {
    (js_sys::Math::random() * 9007199254740991.0) as u64
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsStats {
    prompt_tokens: usize,
    prefilled_tokens: usize,
    generated_tokens: usize,
    ttft_ms: f64,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    stop_reason: String,
    /// OpenAI's name for how it ended (`openai::finish_reason`).
    finish_reason: String,
    /// Host time to encode and submit one decode step (GPU only), in milliseconds.
    host_ms_per_token: Option<f64>,
    /// With a constraint: masks computed, and their mean and longest CPU time in microseconds.
    masks: Option<usize>,
    mask_us_mean: Option<f64>,
    mask_us_max: Option<f64>,
}

impl From<&Stats> for JsStats {
    fn from(s: &Stats) -> Self {
        Self {
            prompt_tokens: s.prompt_tokens,
            prefilled_tokens: s.prefilled_tokens,
            generated_tokens: s.generated_tokens,
            ttft_ms: s.ttft_ms,
            prefill_tok_s: s.prefill_tok_s,
            decode_tok_s: s.decode_tok_s,
            stop_reason: format!("{:?}", s.stop_reason).to_lowercase(),
            finish_reason: crate::openai::finish_reason(s).into(),
            host_ms_per_token: s.decode_counters.map(|c| c.host_ns as f64 / s.decode_steps.max(1) as f64 / 1e6),
            masks: s.masks.map(|m| m.masks),
            mask_us_mean: s.masks.map(|m| m.mean_us()),
            mask_us_max: s.masks.map(|m| m.max_us),
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsInfo {
    model_name: String,
    architecture: String,
    context_length: usize,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    vocab_size: usize,
    /// Bytes per cached key or value element (2 with an f16 KV cache, else 4).
    kv_bytes_per_value: usize,
    backend: String,
    adapter: String,
    f16: bool,
    subgroups: bool,
    /// The KV cache's block pool (GPU backend).
    kv_pool: Option<JsKvPool>,
}

/// The KV pool as the page's panel draws it: per block, the sequences that hold it, and
/// whether the prefix cache has it (`free_blocks` counts the cached blocks no sequence holds:
/// they are handed out when nothing else is free).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct JsKvPool {
    block_tokens: usize,
    blocks: usize,
    free_blocks: usize,
    cached_blocks: usize,
    owners: Vec<Vec<usize>>,
    cached: Vec<bool>,
}

/// A JS `Error` for a misuse of this API (a wrong argument type, a call at the wrong time).
fn js_err(e: impl std::fmt::Display) -> JsValue {
    JsError::new(&e.to_string()).into()
}

/// A JS `Error` for an engine error, with `code` (`Error::code`: "device-lost",
/// "out-of-gpu-memory", "invalid-file", ...) beside the message, for programs to act on.
fn engine_err(e: impl Into<crate::Error>) -> JsValue {
    let e = e.into();
    let js: JsValue = JsError::new(&e.to_string()).into();
    let _ = js_sys::Reflect::set(&js, &"code".into(), &e.code().into());
    js
}

#[wasm_bindgen]
extern "C" {
    /// The package's reader of Blob slices (`Slices` in js/index.js): it reads into one buffer
    /// it reuses, so a model's gigabytes pass through without leaving garbage in the JS heap.
    pub type SliceReader;
    /// `len` bytes of `blob` from `offset`, as a Uint8Array valid until the next read.
    #[wasm_bindgen(method)]
    fn read(this: &SliceReader, blob: &web_sys::Blob, offset: f64, len: f64) -> js_sys::Promise;
}

/// A Blob read in slices: Chromium keeps large Blobs and Cache Storage bodies on disk, so only
/// the slice asked for enters memory.
struct BlobSource {
    blob: web_sys::Blob,
    reader: SliceReader,
}

impl ByteSource for BlobSource {
    fn len(&self) -> u64 {
        self.blob.size() as u64
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        let promise = self.reader.read(&self.blob, offset as f64, len as f64);
        let bytes = wasm_bindgen_futures::JsFuture::from(promise).await.map_err(|e| {
            let message = e.dyn_ref::<js_sys::Error>().map_or_else(|| format!("{e:?}"), |e| e.message().into());
            let code = js_sys::Reflect::get(&e, &"code".into()).ok().and_then(|c| c.as_string());
            if code.as_deref() == Some("stalled") {
                GgufError::Stalled(message)
            } else {
                GgufError::Read(message)
            }
        })?;
        Ok(js_sys::Uint8Array::from(bytes).to_vec())
    }
}

/// The engine as JS sees it. Cheap to clone internally so that async calls own what they use.
#[wasm_bindgen]
pub struct WasmEngine {
    engine: Rc<RefCell<Option<Engine>>>,
    aborted: Rc<Cell<bool>>,
    busy: Rc<Cell<bool>>,
    last_stats: Rc<RefCell<Option<Stats>>>,
    /// Requests for the batch (`submit`) the pump has not taken yet.
    submitted: Rc<RefCell<Vec<Submitted>>>,
    /// A pump is running the batch.
    pumping: Rc<Cell<bool>>,
    /// The batch, kept between pumps for its prefix cache (a chat's next turn forks the blocks
    /// of the last); dropped, its blocks freed, when the conversation or beam search runs.
    batch: Rc<RefCell<Option<crate::batcher::Batcher>>>,
}

/// Frees the batch's blocks (its prefix cache) before work outside it takes the pool.
fn release_batch(batch: &Rc<RefCell<Option<crate::batcher::Batcher>>>, e: &mut Engine) {
    if let Some(mut b) = batch.borrow_mut().take() {
        b.clear(e);
    }
}

/// A request `submit` queued: its prompt and options, its token callback and its promise's ends.
struct Submitted {
    prompt: Prompt,
    options: GenerateOptions,
    on_token: js_sys::Function,
    resolve: js_sys::Function,
    reject: js_sys::Function,
}

#[wasm_bindgen]
impl WasmEngine {
    /// Loads a GGUF model from its bytes. `on_progress(done, total)` follows the upload.
    pub async fn load(
        bytes: js_sys::Uint8Array,
        options: JsValue,
        on_progress: Option<js_sys::Function>,
    ) -> Result<WasmEngine, JsValue> {
        Self::load_source(&bytes.to_vec()[..], options, on_progress).await
    }

    /// Loads a GGUF model from Blobs (Files, or Cache Storage entries' bodies): one Blob per part
    /// of a split model (`name-00001-of-00003.gguf`, in order), else one. Headers first, then one
    /// tensor at a time, read as slices of at most 8 MiB straight into GPU buffers, so wasm memory
    /// holds one slice however large the model is.
    #[wasm_bindgen(js_name = loadBlobs)]
    pub async fn load_blobs(
        parts: Vec<web_sys::Blob>,
        reader: SliceReader,
        options: JsValue,
        on_progress: Option<js_sys::Function>,
    ) -> Result<WasmEngine, JsValue> {
        let reader = || reader.clone().unchecked_into::<SliceReader>();
        let source = SplitSource::new(parts.into_iter().map(|blob| BlobSource { blob, reader: reader() }).collect());
        Self::load_source(&source, options, on_progress).await
    }

    async fn load_source(
        source: &(impl ByteSource + ?Sized),
        options: JsValue,
        on_progress: Option<js_sys::Function>,
    ) -> Result<WasmEngine, JsValue> {
        let opts: JsLoadOptions = if options.is_undefined() || options.is_null() {
            Default::default()
        } else {
            serde_wasm_bindgen::from_value(options)?
        };
        let load = LoadOptions {
            backend: if opts.cpu { BackendKind::Cpu } else { BackendKind::Gpu },
            context_length: opts.context_length,
            gpu: GpuOptions { request_deadline_ms: opts.stall_ms, ..Default::default() },
        };
        let mut progress = |done: usize, total: usize| {
            if let Some(f) = &on_progress {
                let _ = f.call2(&JsValue::NULL, &JsValue::from(done as f64), &JsValue::from(total as f64));
            }
        };
        let engine = Engine::load_from(source, load, &mut progress).await.map_err(engine_err)?;
        Ok(WasmEngine {
            engine: Rc::new(RefCell::new(Some(engine))),
            aborted: Rc::new(Cell::new(false)),
            busy: Rc::new(Cell::new(false)),
            last_stats: Rc::new(RefCell::new(None)),
            submitted: Rc::new(RefCell::new(Vec::new())),
            pumping: Rc::new(Cell::new(false)),
            batch: Rc::new(RefCell::new(None)),
        })
    }

    /// Model and device facts: name, architecture, context length, adapter, f16/subgroup use.
    pub fn info(&self) -> Result<JsValue, JsValue> {
        let guard = self.engine.try_borrow().map_err(|_| js_err("the engine is busy"))?;
        // A running generation holds the engine: that is not an unloaded model.
        let running = self.busy.get() || self.pumping.get();
        let e = guard.as_ref().ok_or_else(|| {
            js_err(if running {
                "the engine is busy generating: ask for its info when the generation ends"
            } else {
                "the model was unloaded"
            })
        })?;
        let c = &e.config;
        let gpu = e.gpu_model().map(|m| &m.gpu);
        let info = JsInfo {
            model_name: c.name.clone(),
            architecture: c.architecture.clone(),
            context_length: e.context_length(),
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            vocab_size: c.vocab_size,
            kv_bytes_per_value: gpu.map_or(4, |g| g.kv_bytes() as usize),
            backend: e.backend_description(),
            adapter: gpu.map(|g| g.adapter_name()).unwrap_or_else(|| "cpu".into()),
            f16: gpu.is_some_and(|g| g.f16),
            subgroups: gpu.is_some_and(|g| g.subgroups),
            kv_pool: e.gpu_model().map(|m| {
                let pool = m.pool();
                JsKvPool {
                    block_tokens: pool.block_tokens(),
                    blocks: pool.blocks(),
                    free_blocks: pool.free_blocks(),
                    cached_blocks: pool.cached_blocks(),
                    owners: pool.owners(),
                    cached: (0..pool.blocks()).map(|b| pool.is_cached(b)).collect(),
                }
            }),
        };
        Ok(serde_wasm_bindgen::to_value(&info)?)
    }

    /// Generates from a raw prompt (string) or chat messages ([{role, content}]), calling
    /// `on_token({id, text, position, candidates?})` per token; resolves to the stats.
    pub fn generate(
        &self,
        prompt: JsValue,
        chat: bool,
        options: JsValue,
        on_token: js_sys::Function,
    ) -> js_sys::Promise {
        let (engine, aborted, busy, last, batch) =
            (self.engine.clone(), self.aborted.clone(), self.busy.clone(), self.last_stats.clone(), self.batch.clone());
        wasm_bindgen_futures::future_to_promise(async move {
            if busy.replace(true) {
                return Err(JsError::new("a generation is already running: await it or call abort() first").into());
            }
            let result = generate(&engine, &batch, &aborted, prompt, chat, options, &on_token).await;
            busy.set(false);
            let stats = result?;
            let js = serde_wasm_bindgen::to_value(&JsStats::from(&stats))?;
            *last.borrow_mut() = Some(stats);
            Ok(js)
        })
    }

    /// Queues a generation for the batch: requests submitted while others run join them between
    /// decode steps (each weight read once per step for all). `on_token({id, text, position})`
    /// per token, returning false ends the request; resolves to its stats. The conversation's
    /// KV cache is not used: a request whose prompt starts as an ended one's did (the next turn
    /// of a chat) forks that request's blocks and prefills only the rest.
    pub fn submit(&self, prompt: JsValue, chat: bool, options: JsValue, on_token: js_sys::Function) -> js_sys::Promise {
        let mut parsed = Some(js_prompt(prompt, chat).and_then(|p| Ok((p, js_generate_options(options)?))));
        let (engine, busy, submitted, pumping, batch) =
            (self.engine.clone(), self.busy.clone(), self.submitted.clone(), self.pumping.clone(), self.batch.clone());
        js_sys::Promise::new(&mut |resolve, reject| match parsed.take() {
            Some(Ok((prompt, options))) => {
                submitted.borrow_mut().push(Submitted { prompt, options, on_token: on_token.clone(), resolve, reject });
                if !pumping.replace(true) {
                    wasm_bindgen_futures::spawn_local(pump(
                        engine.clone(),
                        batch.clone(),
                        busy.clone(),
                        submitted.clone(),
                        pumping.clone(),
                    ));
                }
            }
            Some(Err(e)) => {
                let _ = reject.call1(&JsValue::NULL, &e);
            }
            None => {}
        })
    }

    /// Beam search from a raw prompt (string) or chat messages: resolves to the N best
    /// hypotheses, best first, as [{ids, text, score}] (`BeamOptions`: beams, maxTokens,
    /// lengthPenalty, earlyStopping false | true | "never", ignoreEos).
    #[wasm_bindgen(js_name = beamSearch)]
    pub fn beam_search(&self, prompt: JsValue, chat: bool, options: JsValue) -> js_sys::Promise {
        let (engine, busy, batch) = (self.engine.clone(), self.busy.clone(), self.batch.clone());
        wasm_bindgen_futures::future_to_promise(async move {
            if busy.replace(true) {
                return Err(JsError::new("a generation is already running: await it or call abort() first").into());
            }
            let result = beam_search(&engine, &batch, prompt, chat, options).await;
            busy.set(false);
            result
        })
    }

    /// Stops the running generation after the current token; the engine stays usable.
    pub fn abort(&self) {
        if self.busy.get() {
            self.aborted.set(true);
        }
    }

    /// Stats of the last finished generation, or null.
    pub fn stats(&self) -> Result<JsValue, JsValue> {
        match self.last_stats.borrow().as_ref() {
            Some(s) => Ok(serde_wasm_bindgen::to_value(&JsStats::from(s))?),
            None => Ok(JsValue::NULL),
        }
    }

    /// Frees the model's GPU memory; the engine cannot be used afterwards.
    pub fn unload(&self) -> Result<(), JsValue> {
        let mut guard =
            self.engine.try_borrow_mut().map_err(|_| js_err("abort the running generation before unloading"))?;
        guard.take();
        self.batch.borrow_mut().take();
        Ok(())
    }
}

async fn generate(
    engine: &Rc<RefCell<Option<Engine>>>,
    batch: &Rc<RefCell<Option<crate::batcher::Batcher>>>,
    aborted: &Rc<Cell<bool>>,
    prompt: JsValue,
    chat: bool,
    options: JsValue,
    on_token: &js_sys::Function,
) -> Result<Stats, JsValue> {
    let prompt = js_prompt(prompt, chat)?;
    let options = js_generate_options(options)?;
    // The engine is taken out for the duration, so a concurrent info()/unload() gets an error
    // instead of a borrow panic.
    let mut e = engine.borrow_mut().take().ok_or_else(|| js_err("the model was unloaded"))?;
    release_batch(batch, &mut e);
    aborted.set(false);
    let mut callback_error = None;
    let result = {
        let mut on = |ev: &crate::engine::TokenEvent| match serde_wasm_bindgen::to_value(ev)
            .map_err(JsValue::from)
            .and_then(|v| on_token.call1(&JsValue::NULL, &v))
        {
            Ok(_) => !aborted.get(),
            Err(err) => {
                callback_error = Some(err);
                false
            }
        };
        e.generate(&prompt, &options, &mut on).await
    };
    *engine.borrow_mut() = Some(e);
    if let Some(err) = callback_error {
        return Err(js_err(format!(
            "the token callback threw: {}",
            err.as_string().unwrap_or_else(|| format!("{err:?}"))
        )));
    }
    result.map_err(engine_err)
}

/// The package's generation options as the engine's; beam search and several choices have
/// calls of their own (`beamSearch`, one `generate` a choice), so they are refused here.
fn js_generate_options(options: JsValue) -> Result<GenerateOptions, JsValue> {
    let (request, extras) = js_request(options)?;
    let resolved = request.resolve(random_seed()).map_err(engine_err)?;
    if resolved.beams.is_some() || resolved.n > 1 {
        let (name, value) =
            if resolved.beams.is_some() { ("beams", request.beams.unwrap_or(0)) } else { ("n", resolved.n) };
        return Err(engine_err(crate::Error::InvalidOption {
            name,
            value: value.to_string(),
            expected: "beamSearch for beams, one call a choice for n".into(),
        }));
    }
    let mut options = resolved.generate;
    options.top_candidates = extras.candidates;
    options.validate().map_err(engine_err)?;
    Ok(options)
}

/// Runs the submitted requests as one batch until none is left: queues them in the batcher
/// (which admits what the KV pool and a decode step's rows allow, the rest waiting in order), steps, hands each token to its request's
/// callback (which returns false to end it) and settles each request's promise with its stats.
async fn pump(
    engine: Rc<RefCell<Option<Engine>>>,
    batch: Rc<RefCell<Option<crate::batcher::Batcher>>>,
    busy: Rc<Cell<bool>>,
    submitted: Rc<RefCell<Vec<Submitted>>>,
    pumping: Rc<Cell<bool>>,
) {
    struct Live {
        on_token: js_sys::Function,
        resolve: js_sys::Function,
        reject: js_sys::Function,
        /// What the token callback threw (the request then ends, and its promise rejects).
        thrown: Option<JsValue>,
    }
    let reject_all = |why: &str| {
        for s in submitted.borrow_mut().drain(..) {
            let _ = s.reject.call1(&JsValue::NULL, &js_err(why));
        }
    };
    if busy.replace(true) {
        reject_all("a generation is already running: await it or call abort() first");
        pumping.set(false);
        return;
    }
    let Some(mut e) = engine.borrow_mut().take() else {
        reject_all("the model was unloaded");
        busy.set(false);
        pumping.set(false);
        return;
    };
    let kept = batch.borrow_mut().take();
    let mut batcher = kept.unwrap_or_else(|| crate::batcher::Batcher::new(&e, e.pass_rows()));
    let mut live = std::collections::HashMap::new();
    loop {
        let taken: Vec<Submitted> = submitted.borrow_mut().drain(..).collect();
        for s in taken {
            match crate::batcher::Batcher::prepare(&e, &s.prompt, &s.options) {
                Ok(p) => {
                    let l = Live { on_token: s.on_token, resolve: s.resolve, reject: s.reject, thrown: None };
                    live.insert(batcher.enqueue(p), l);
                }
                Err(err) => {
                    let _ = s.reject.call1(&JsValue::NULL, &engine_err(err));
                }
            }
        }
        if batcher.is_empty() {
            break;
        }
        let result = batcher
            .step(&mut e, &mut |_| true, &mut |id, event| {
                let Some(l) = live.get_mut(&id) else { return false };
                match event {
                    crate::batcher::BatchEvent::Token(ev) => match serde_wasm_bindgen::to_value(ev)
                        .map_err(JsValue::from)
                        .and_then(|v| l.on_token.call1(&JsValue::NULL, &v))
                    {
                        Ok(keep) => keep.as_bool() != Some(false),
                        Err(err) => {
                            l.thrown = Some(err);
                            false
                        }
                    },
                    crate::batcher::BatchEvent::Done(stats) => {
                        let l = live.remove(&id).expect("a live request");
                        if let Some(err) = l.thrown {
                            let why = err.as_string().unwrap_or_else(|| format!("{err:?}"));
                            let _ = l.reject.call1(&JsValue::NULL, &js_err(format!("the token callback threw: {why}")));
                            return true;
                        }
                        match serde_wasm_bindgen::to_value(&JsStats::from(&stats)) {
                            Ok(v) => l.resolve.call1(&JsValue::NULL, &v),
                            Err(err) => l.reject.call1(&JsValue::NULL, &err.into()),
                        }
                        .is_ok()
                    }
                    crate::batcher::BatchEvent::Failed(err) => {
                        let l = live.remove(&id).expect("a live request");
                        let _ = l.reject.call1(&JsValue::NULL, &engine_err(err));
                        true
                    }
                    // `submit` queues no beam search (`beamSearch` runs its own batch).
                    crate::batcher::BatchEvent::Beams(_) => true,
                }
            })
            .await;
        if let Err(err) = result {
            let code = err.code();
            for id in batcher.clear(&mut e) {
                if let Some(l) = live.remove(&id) {
                    let js = js_err(&err);
                    let _ = js_sys::Reflect::set(&js, &"code".into(), &code.into());
                    let _ = l.reject.call1(&JsValue::NULL, &js);
                }
            }
        }
    }
    *engine.borrow_mut() = Some(e);
    *batch.borrow_mut() = Some(batcher);
    busy.set(false);
    pumping.set(false);
}

async fn beam_search(
    engine: &Rc<RefCell<Option<Engine>>>,
    batch: &Rc<RefCell<Option<crate::batcher::Batcher>>>,
    prompt: JsValue,
    chat: bool,
    options: JsValue,
) -> Result<JsValue, JsValue> {
    let (mut request, _) = js_request(options)?;
    // `beamSearch`'s own default: 4 beams.
    request.beams.get_or_insert(4);
    let ignore_eos = request.ignore_eos;
    let mut options = request.resolve(0).map_err(engine_err)?.beams.expect("beams set above");
    let prompt = js_prompt(prompt, chat)?;
    let mut e = engine.borrow_mut().take().ok_or_else(|| js_err("the model was unloaded"))?;
    release_batch(batch, &mut e);
    if !ignore_eos {
        options.stop_ids = e.tokenizer.stop_ids.clone();
    }
    let result = e.beam_search(&prompt, &options).await;
    *engine.borrow_mut() = Some(e);
    #[derive(Serialize)]
    struct JsBeam {
        ids: Vec<u32>,
        text: String,
        score: f64,
    }
    let beams: Vec<JsBeam> =
        result.map_err(engine_err)?.into_iter().map(|(h, text)| JsBeam { ids: h.ids, text, score: h.score }).collect();
    Ok(serde_wasm_bindgen::to_value(&beams)?)
}

/// An OpenAI chat completion request on this engine (`engine.chat.completions.create`): the
/// request parsed and checked by `openai::parse` (the server's), and its answer built by
/// `openai::Answer` from the token events the package's generation yields.
#[wasm_bindgen]
pub struct OpenAiCall {
    request: crate::openai::Request,
    answer: crate::openai::Answer,
}

#[wasm_bindgen]
impl OpenAiCall {
    /// Parses `request` (OpenAI's fields and the engine's options; any other is refused by
    /// name, with code "invalid-option") for a model named `model`.
    #[wasm_bindgen(constructor)]
    pub fn new(request: JsValue, model: String) -> Result<OpenAiCall, JsValue> {
        use crate::openai::{parse, Answer, Endpoint, RequestError};
        let value: serde_json::Value = serde_wasm_bindgen::from_value(request)
            .map_err(|e| invalid_option(format!("chat.completions.create: the request must be an object: {e}")))?;
        let request = parse(Endpoint::Chat, value, random_seed()).map_err(|e| {
            let message = match e {
                RequestError::Shape(m) => m,
                RequestError::Invalid { param, message } => format!("{param}: {message}"),
            };
            invalid_option(format!("chat.completions.create: {message}"))
        })?;
        if request.n > 1 || request.beams.is_some() {
            return Err(invalid_option(
                "chat.completions.create: n must be 1 and beams are beamSearch's (make n calls: they run as one batch)"
                    .into(),
            ));
        }
        let created = (js_sys::Date::now() / 1000.0) as u64;
        let answer = Answer::new(&request, &model, (js_sys::Math::random() * 2f64.powi(52)) as u64, created, 0);
        Ok(OpenAiCall { request, answer })
    }

    #[wasm_bindgen(getter)]
    pub fn stream(&self) -> bool {
        self.request.stream
    }

    /// The messages, for the package's chat generation.
    pub fn messages(&self) -> Result<JsValue, JsValue> {
        let Prompt::Chat(messages) = &self.request.prompt else { unreachable!("a chat request") };
        // Plain objects (an assistant's tool calls are JSON values), as js_prompt reads them back.
        let serializer = serde_wasm_bindgen::Serializer::json_compatible();
        Ok(serde::Serialize::serialize(messages, &serializer)?)
    }

    /// The options, for the package's generation calls (its `candidates` for `logprobs`).
    pub fn options(&self) -> Result<JsValue, JsValue> {
        let mut fields = self.request.option_fields.clone();
        if self.request.generate.top_candidates > 0 {
            fields.insert("candidates".into(), self.request.generate.top_candidates.into());
        }
        let serializer = serde_wasm_bindgen::Serializer::json_compatible();
        Ok(serde::Serialize::serialize(&fields, &serializer)?)
    }

    /// The stream chunk of a token event, or null when it makes none.
    pub fn chunk(&mut self, event: JsValue) -> Result<JsValue, JsValue> {
        let ev: crate::engine::TokenEvent = serde_wasm_bindgen::from_value(event)?;
        if !crate::openai::worth_a_chunk(&ev) {
            return Ok(JsValue::NULL);
        }
        let lp = crate::openai::Logprobs::of(&ev);
        // None: text held back (it may be a tool call).
        match self.answer.token_chunk(0, &ev.text, lp.as_ref(), ev.position, ev.speculation.as_ref(), ev.allowed) {
            Some(chunk) => js_json(&chunk),
            None => Ok(JsValue::NULL),
        }
    }

    /// The last stream chunks, from the generation's stats: `finish_reason`, then the usage
    /// when asked for.
    pub fn finish(&mut self, stats: JsValue) -> Result<JsValue, JsValue> {
        let (reason, generated) = self.ended(stats)?;
        let chunks = self.answer.finish_chunks(0, &reason, generated);
        js_json(&serde_json::Value::Array(chunks))
    }

    /// Adds a token event to a whole answer.
    pub fn push(&mut self, event: JsValue) -> Result<(), JsValue> {
        let ev: crate::engine::TokenEvent = serde_wasm_bindgen::from_value(event)?;
        self.answer.push(0, &ev.text, crate::openai::Logprobs::of(&ev));
        Ok(())
    }

    /// The whole answer (`chat.completion`), from the generation's stats.
    pub fn completion(&mut self, stats: JsValue) -> Result<JsValue, JsValue> {
        let (reason, generated) = self.ended(stats)?;
        self.answer.finish(0, &reason, generated);
        js_json(&self.answer.completion())
    }

    /// How the generation ended (the package's stats: `finishReason`, `generatedTokens`,
    /// `promptTokens`).
    fn ended(&mut self, stats: JsValue) -> Result<(String, usize), JsValue> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Ended {
            finish_reason: String,
            generated_tokens: usize,
            prompt_tokens: usize,
        }
        let s: Ended = serde_wasm_bindgen::from_value(stats)?;
        self.answer.prompt_tokens = s.prompt_tokens;
        Ok((s.finish_reason, s.generated_tokens))
    }
}

/// A JSON value as a plain JS value (objects, not Maps).
fn js_json(v: &serde_json::Value) -> Result<JsValue, JsValue> {
    Ok(serde::Serialize::serialize(v, &serde_wasm_bindgen::Serializer::json_compatible())?)
}

/// A raw prompt (a string) or chat messages ([{role, content}]).
fn js_prompt(prompt: JsValue, chat: bool) -> Result<Prompt, JsValue> {
    Ok(if chat {
        let messages: Vec<Message> = serde_wasm_bindgen::from_value(prompt)
            .map_err(|e| js_err(format!("messages must be an array of {{role, content}} strings: {e}")))?;
        Prompt::Chat(messages)
    } else {
        Prompt::Text(prompt.as_string().ok_or_else(|| js_err("the prompt must be a string"))?)
    })
}

/// What a model needs, from the first bytes of its file (`file_lens[i]` bytes in all for part i of
/// a split model; one prefix and one length for a whole file): the page reads them with ranged
/// requests before downloading. Returns `{needBytes, part}` when part `part`'s header goes on past
/// its prefix (fetch that many bytes of it and call again), else the model's facts (`ModelInfo`).
#[wasm_bindgen]
pub fn inspect(
    prefixes: Vec<js_sys::Uint8Array>,
    file_lens: Vec<f64>,
    context_length: Option<u32>,
) -> Result<JsValue, JsValue> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct NeedMore {
        need_bytes: u64,
        part: usize,
    }
    let serializer = serde_wasm_bindgen::Serializer::json_compatible();
    if prefixes.len() != file_lens.len() {
        return Err(js_err("inspect: one file length per header prefix"));
    }
    let (mut headers, mut starts, mut total) = (Vec::with_capacity(prefixes.len()), Vec::new(), 0u64);
    for (part, (prefix, &len)) in prefixes.iter().zip(&file_lens).enumerate() {
        let len = len as u64;
        match Gguf::parse_prefix(&prefix.to_vec(), len) {
            Err(GgufError::HeaderPastPrefix { needed, .. }) => {
                return Ok(NeedMore { need_bytes: needed, part }.serialize(&serializer)?)
            }
            Err(e) => return Err(engine_err(e)),
            Ok(gguf) => headers.push(gguf),
        }
        starts.push(total);
        total += len;
    }
    let gguf = Gguf::merge_split(headers, &starts).map_err(engine_err)?;
    let info = crate::model::ModelInfo::new(&gguf, total, context_length.map(|c| c as usize)).map_err(engine_err)?;
    Ok(info.serialize(&serializer)?)
}
