//! `webgpu-llm serve`: an OpenAI-compatible HTTP server over one engine, with continuous
//! batching.
//!
//! One thread owns the engine and runs the `Batcher`'s rounds; HTTP handlers (axum on tokio)
//! send it requests and read each request's events from a bounded channel. Between rounds the
//! engine thread admits waiting requests (FIFO, while a decode row and the KV pool's room are
//! free), ends requests whose client went away (their blocks are free for the next round), and
//! leaves out of the next decode step any request whose reader is `--stream-buffer` events
//! behind: a slow reader makes its own stream wait, never the others, and never grows memory.
//! A full batch and a full queue answer 429 with Retry-After. SIGTERM or Ctrl-C: no new
//! connections; running and waiting requests end with an error event ("server shutting down").

use crate::model_args::{at_least_one, load, ModelArgs};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use webgpu_llm::batcher::{BatchEvent, Batcher, RequestId};
use webgpu_llm::beam::BeamOptions;
use webgpu_llm::engine::{Engine, GenerateOptions, Prompt, Stats, TokenSpeculation};
use webgpu_llm::openai::{self, Answer, Endpoint, Logprobs, Request, RequestError};
use webgpu_llm::Error;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests decoded together at most (the rows of a decode step, up to 256; capped by what
    /// the GPU's largest binding holds). Past 32 rows a decode step's projections are tiled
    /// matrix products.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    max_batch: usize,
    /// Requests waiting for a place in the batch at most; past that, 429 with Retry-After, at
    /// the door (before the request is read further or tokenized).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Seconds a request may wait for a place in the batch; past that it is answered 503
    /// (code queue_timeout) and leaves the queue.
    #[arg(long, default_value_t = 60, value_parser = at_least_one)]
    queue_timeout: usize,
    /// Prompt tokens prefilled per round (between two decode steps of the running requests):
    /// bounds what a newcomer's prompt adds to the others' inter-token latency.
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    prefill_chunk: usize,
    /// Events held per stream for a reader that is behind; when they are all unread, that
    /// stream's decoding waits until the reader catches up.
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    stream_buffer: usize,
    /// Seconds a stream may stay paused (its reader not taking events) before its request is
    /// ended and its KV blocks freed: a reader that stops for good does not hold a row forever.
    #[arg(long, default_value_t = 60, value_parser = at_least_one)]
    pause_timeout: usize,
    /// Each connection's kernel send buffer, in bytes: with the stream buffer, what a reader that
    /// is behind can leave unread before its stream waits.
    #[arg(long, default_value_t = 64 << 10, value_parser = at_least_one)]
    send_buffer: usize,
    /// The largest request body, in bytes (413 past it).
    #[arg(long, default_value_t = 1 << 20, value_parser = at_least_one)]
    max_body: usize,
    /// Connections open at most; past it a new one is answered 503 and closed [default: 4096,
    /// or the open-file limit less 64]
    #[arg(long, value_parser = at_least_one)]
    max_connections: Option<usize>,
    /// Seconds a client may take to send a request's head, and a keep-alive connection may wait
    /// idle for its next request, before the connection is closed.
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    header_timeout: usize,
    /// Seconds a client may take to send a request's body (408 past it).
    #[arg(long, default_value_t = 30, value_parser = at_least_one)]
    body_timeout: usize,
    /// Seconds a graceful shutdown (SIGTERM, Ctrl-C) may take: streams end with an error event
    /// and connections close; past it, or at a second signal, the server exits at once.
    #[arg(long, default_value_t = 30, value_parser = at_least_one)]
    shutdown_timeout: usize,
}

pub fn main(args: ServeArgs) -> Result<(), Error> {
    let model_id = args
        .model
        .model
        .as_deref()
        .and_then(|p| p.file_stem())
        .and_then(|s| s.to_str())
        .unwrap_or("SmolLM2-135M-Instruct.Q4_1")
        .to_string();
    // The address first: a port taken or a host that is not this machine's is the flags'
    // error (exit code 2), said before the model loads.
    let addr = format!("{}:{}", args.host, args.port);
    let std_listener =
        std::net::TcpListener::bind(&addr).and_then(|l| l.set_nonblocking(true).map(|()| l)).map_err(|e| {
            Error::InvalidOption {
                name: "--host/--port",
                value: addr.clone(),
                expected: format!("an address this machine can listen on ({e})"),
            }
        })?;
    let engine = pollster::block_on(load(&args.model, Some(args.max_batch)))?;
    let encoder = engine.prompt_encoder();
    let max_batch = args.max_batch;
    let metrics = Arc::new(Metrics::default());
    // Every request the door lets in holds a place until it ends: the channel to the engine
    // thread never holds more than the batch and the queue.
    let capacity = max_batch + args.max_queue;
    let (commands, rx) = mpsc::channel(capacity + 1);
    let inflight = Arc::new(AtomicUsize::new(0));
    let config = EngineConfig {
        max_batch,
        pause_timeout: Duration::from_secs(args.pause_timeout as u64),
        queue_timeout: Duration::from_secs(args.queue_timeout as u64),
        max_queue: args.max_queue,
        prefill_chunk: args.prefill_chunk,
        inflight: inflight.clone(),
    };
    let thread_metrics = metrics.clone();
    let engine_thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || engine_loop(engine, rx, config, &thread_metrics))
        .map_err(|e| Error::Io { path: "engine thread".into(), source: e })?;
    let state = Arc::new(AppState {
        model_id,
        commands: commands.clone(),
        inflight,
        capacity,
        metrics,
        next_id: AtomicU64::new(1),
        stream_buffer: args.stream_buffer,
        max_body: args.max_body,
        body_timeout: Duration::from_secs(args.body_timeout as u64),
        encoder,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Io { path: "tokio runtime".into(), source: e })?;
    let result = runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::from_std(std_listener).map_err(|e| Error::Io { path: addr.clone(), source: e })?;
        let local = listener.local_addr().map_or(addr.clone(), |a| a.to_string());
        let send_buffer = args.send_buffer;
        let shutdown_timeout = Duration::from_secs(args.shutdown_timeout as u64);
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(state.clone());
        eprintln!("serving on http://{local} (OpenAI-compatible: POST /v1/chat/completions, /v1/completions)");
        let limits = Limits {
            max_connections: args.max_connections.unwrap_or_else(default_max_connections).min(1 << 20),
            header_timeout: Duration::from_secs(args.header_timeout as u64),
            send_buffer,
        };
        let shutdown = async move {
            shutdown_signal().await;
            eprintln!("shutting down: ending streams (a second signal exits at once)");
            let _ = commands.send(Command::Shutdown).await;
            // A client holding a connection open (a half-sent request) must not keep the
            // server up: the shutdown is bounded, and a second signal ends it now.
            tokio::spawn(async move {
                tokio::select! {
                    _ = shutdown_signal() => {
                        eprintln!("second signal: exiting now");
                        std::process::exit(130);
                    }
                    _ = tokio::time::sleep(shutdown_timeout) => {
                        eprintln!("shutdown took longer than --shutdown-timeout: exiting now");
                        std::process::exit(1);
                    }
                }
            });
        };
        accept_loop(listener, app, limits, &state.metrics, shutdown).await;
        Ok(())
    });
    let _ = engine_thread.join();
    result
}

/// Caps a connection's kernel send buffer (Linux doubles the value for its bookkeeping).
#[cfg(unix)]
fn set_send_buffer(tcp: &tokio::net::TcpStream, bytes: usize) {
    use std::os::fd::AsRawFd;
    let value = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: the descriptor is `tcp`'s open socket, and the option value is a c_int whose size
    // is passed with it.
    unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

#[cfg(not(unix))]
fn set_send_buffer(_tcp: &tokio::net::TcpStream, _bytes: usize) {}

/// The accept loop's bounds (`--max-connections`, `--header-timeout`).
struct Limits {
    max_connections: usize,
    header_timeout: Duration,
    send_buffer: usize,
}

/// Connections at most when `--max-connections` is not given: 4096, or what the process's
/// open-file limit leaves (less 64 for the model's files and the GPU driver's).
fn default_max_connections() -> usize {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the limits into the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            return (lim.rlim_cur as usize).saturating_sub(64).clamp(16, 4096);
        }
    }
    4096
}

/// Serves `app` on `listener` until `shutdown` completes, then lets the open connections end
/// (their streams get the shutdown's error event). Each connection is HTTP/1.1 with a header
/// read timeout, which bounds a request's head (slowloris) and a keep-alive connection's wait
/// for its next request; past `max_connections` a new connection is answered 503 and closed.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    metrics: &Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors and the like: wait a moment rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Tokens go out as they come, not held for a fuller packet.
        let _ = tcp.set_nodelay(true);
        set_send_buffer(&tcp, limits.send_buffer);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.count("connection", 503);
            tokio::spawn(refuse_connection(tcp));
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(tcp), service);
            let mut conn = std::pin::pin!(conn);
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    changed = closing.changed() => {
                        if changed.is_err() || *closing.borrow() {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.as_mut().await;
                            break;
                        }
                    }
                }
            }
            drop(permit);
        });
    }
    // No new connections; the open ones end their responses (the engine sends each stream its
    // last event) and close. --shutdown-timeout bounds the wait.
    let _ = closing_tx.send(true);
    let _ = permits.acquire_many(limits.max_connections as u32).await;
}

/// A connection past `--max-connections`: a 503 with an OpenAI error, then closed.
async fn refuse_connection(mut tcp: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt as _;
    let body = r#"{"error":{"message":"the server has as many connections open as --max-connections allows; retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await
    })
    .await;
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

// ---------------------------------------------------------------------------------------------
// The engine thread

struct EngineConfig {
    max_batch: usize,
    pause_timeout: Duration,
    queue_timeout: Duration,
    max_queue: usize,
    prefill_chunk: usize,
    /// Streams the door has let in and that have not ended (`AppState::inflight`): the engine
    /// thread gives a place back when a stream ends or a request is refused.
    inflight: Arc<AtomicUsize>,
}

enum Command {
    Submit(Box<Job>, oneshot::Sender<Result<Accepted, ApiError>>),
    Shutdown,
}

/// A request as the engine thread takes it: `n` choices of one prompt, or a beam search.
struct Job {
    /// Tokenized by the HTTP handler.
    prompt: Prompt,
    /// The request's field that held the prompt ("messages" or "prompt"), for errors.
    param: &'static str,
    options: GenerateOptions,
    /// `options.constraint` compiled by the HTTP handler (the engine thread only runs the batch).
    constraint: Option<webgpu_llm::constraint::Constraint>,
    n: usize,
    beams: Option<BeamOptions>,
    events: mpsc::Sender<Out>,
    received: Instant,
}

struct Accepted {
    prompt_tokens: usize,
}

/// Places taken at the door (`AppState::inflight`), given back when dropped unless `keep`
/// hands them to the engine thread.
struct Places<'a> {
    inflight: &'a AtomicUsize,
    n: usize,
}

impl<'a> Places<'a> {
    fn take(inflight: &'a AtomicUsize, n: usize) -> Self {
        inflight.fetch_add(n, Ordering::Relaxed);
        Self { inflight, n }
    }

    fn keep(mut self) {
        self.n = 0;
    }
}

impl Drop for Places<'_> {
    fn drop(&mut self) {
        self.inflight.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// What a request's channel carries.
enum Out {
    Token {
        index: usize,
        text: String,
        logprobs: Option<Logprobs>,
        position: usize,
        speculation: Option<TokenSpeculation>,
        allowed: Option<u32>,
    },
    Done {
        index: usize,
        stats: Stats,
    },
    /// A beam search's hypotheses: ids, text, score, ended on a stop token.
    Beams(Vec<(Vec<u32>, String, f64, bool)>),
    Error(ApiError),
}

/// A choice being generated (or finished, with events its reader has not taken yet).
struct Stream {
    events: mpsc::Sender<Out>,
    index: usize,
    /// Events the channel had no room for; while any is held the choice is not decoded.
    held: VecDeque<Out>,
    done: bool,
    received: Instant,
    last_token: Option<Instant>,
    /// Since when events have been held (the reader behind).
    behind_since: Option<Instant>,
    /// A beam search's: its answer is `Out::Beams`, with no `Done` after it.
    beams: bool,
}

impl Stream {
    /// Sends or holds `out`; false when the reader is gone.
    fn push(&mut self, out: Out) -> bool {
        if !self.held.is_empty() {
            self.held.push_back(out);
            return true;
        }
        match self.events.try_send(out) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(out)) => {
                self.held.push_back(out);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Sends held events while the channel has room.
    fn flush(&mut self) {
        while let Some(out) = self.held.pop_front() {
            match self.events.try_send(out) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(out)) => {
                    self.held.push_front(out);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.held.clear();
                    return;
                }
            }
        }
    }
}

fn engine_loop(mut engine: Engine, mut commands: mpsc::Receiver<Command>, config: EngineConfig, metrics: &Metrics) {
    let mut batcher = Batcher::new(&engine, config.prefill_chunk);
    batcher.limit_rows(config.max_batch);
    let mut streams: HashMap<RequestId, Stream> = HashMap::new();
    let mut shutting_down = false;
    // Requests whose readers are behind: left out of the next decode step.
    let mut paused: Vec<RequestId> = Vec::new();
    // A beam hypothesis that ends on one of these finished ("stop"), else it ran out ("length").
    let stop_ids = engine.tokenizer.stop_ids.clone();
    loop {
        let idle = batcher.is_empty() && streams.is_empty();
        if idle {
            if shutting_down {
                return;
            }
            match commands.blocking_recv() {
                Some(c) => handle(c, &mut engine, &mut batcher, &mut streams, &config, &mut shutting_down),
                None => return,
            }
        }
        while let Ok(c) = commands.try_recv() {
            handle(c, &mut engine, &mut batcher, &mut streams, &config, &mut shutting_down);
        }
        // Streams that end below give their places back at the door.
        let held = streams.len();
        if shutting_down {
            for id in batcher.clear(&mut engine) {
                if let Some(s) = streams.get_mut(&id) {
                    s.push(Out::Error(ApiError::shutting_down()));
                    s.done = true;
                }
            }
            // Readers that are behind get what fits; the rest is dropped with the thread.
            streams.values_mut().for_each(Stream::flush);
            return;
        }
        // Requests that waited past --queue-timeout for a place in the batch leave the queue
        // with 503 (oldest first: the queue is in order).
        let expired: Vec<RequestId> = batcher
            .waiting_ids()
            .take_while(|id| streams.get(id).is_some_and(|s| s.received.elapsed() >= config.queue_timeout))
            .collect();
        for id in expired {
            batcher.cancel(&mut engine, id);
            if let Some(s) = streams.get_mut(&id) {
                s.push(Out::Error(ApiError::queue_timeout(config.queue_timeout)));
                s.done = true;
            }
        }
        // Readers gone: their requests end now (blocks free for this round's admissions).
        streams.retain(|&id, s| {
            if !s.events.is_closed() {
                return true;
            }
            batcher.cancel(&mut engine, id);
            false
        });
        streams.values_mut().for_each(Stream::flush);
        streams.retain(|_, s| !(s.done && s.held.is_empty()));
        // A reader behind for longer than the pause timeout: its request ends (the stream closes
        // after what it has been sent), its blocks go back to the pool.
        let now = Instant::now();
        streams.retain(|&id, s| {
            if s.held.is_empty() {
                s.behind_since = None;
                return true;
            }
            let since = *s.behind_since.get_or_insert(now);
            if now - since < config.pause_timeout {
                return true;
            }
            if !s.done {
                batcher.cancel(&mut engine, id);
            }
            false
        });
        config.inflight.fetch_sub(held - streams.len(), Ordering::Relaxed);
        paused.clear();
        paused.extend(streams.iter().filter(|(_, s)| !s.held.is_empty() && !s.done).map(|(&id, _)| id));
        metrics.paused.store(paused.len(), Ordering::Relaxed);
        metrics.queue_depth.store(batcher.waiting(), Ordering::Relaxed);
        metrics.running.store(batcher.len(), Ordering::Relaxed);
        let cached = engine.gpu_model().map_or(0, |m| m.pool().cached_blocks() * m.pool().block_tokens());
        metrics.prefix_cache_tokens.store(cached, Ordering::Relaxed);
        if batcher.is_empty() {
            if !streams.is_empty() {
                // Only finished streams whose readers are behind: wait for them.
                std::thread::sleep(Duration::from_millis(2));
            }
            continue;
        }
        let round = Instant::now();
        let prefilling = batcher.prefilling();
        let result =
            pollster::block_on(batcher.step(&mut engine, &mut |id| !paused.contains(&id), &mut |id, event| {
                let Some(s) = streams.get_mut(&id) else { return false };
                match event {
                    BatchEvent::Token(ev) => {
                        let now = Instant::now();
                        match s.last_token {
                            None => metrics.ttft.lock().unwrap().observe((now - s.received).as_secs_f64()),
                            Some(t) => metrics.itl.lock().unwrap().observe((now - t).as_secs_f64()),
                        }
                        s.last_token = Some(now);
                        metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
                        if !openai::worth_a_chunk(ev) {
                            return !s.events.is_closed();
                        }
                        let logprobs = Logprobs::of(ev);
                        let (index, text, position, speculation, allowed) =
                            (s.index, ev.text.clone(), ev.position, ev.speculation.clone(), ev.allowed);
                        s.push(Out::Token { index, text, logprobs, position, speculation, allowed })
                    }
                    BatchEvent::Done(stats) => {
                        metrics.prompt_tokens.fetch_add(stats.prompt_tokens as u64, Ordering::Relaxed);
                        let cached = stats.prompt_tokens - stats.prefilled_tokens;
                        metrics.cached_prompt_tokens.fetch_add(cached as u64, Ordering::Relaxed);
                        s.done = true;
                        s.beams || s.push(Out::Done { index: s.index, stats })
                    }
                    BatchEvent::Beams(found) => {
                        let beams = found
                            .into_iter()
                            .map(|(h, text)| {
                                let stopped = h.ids.last().is_some_and(|id| stop_ids.contains(id));
                                (h.ids, text, h.score, stopped)
                            })
                            .collect();
                        s.push(Out::Beams(beams))
                    }
                    BatchEvent::Failed(e) => {
                        s.done = true;
                        s.push(Out::Error(ApiError::from_engine(&e, "prompt")))
                    }
                }
            }));
        match result {
            Ok(rows) => {
                metrics.batch_rows.store(rows, Ordering::Relaxed);
                let secs = round.elapsed().as_secs_f64();
                if rows > 0 && prefilling == 0 {
                    *metrics.decode_tok_s.lock().unwrap() = rows as f64 / secs.max(1e-9);
                }
                if rows == 0 && prefilling == 0 {
                    // Every running request waits for its reader.
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            Err(e) => {
                eprintln!("error in a batch step: {e}");
                let err = ApiError::from_engine(&e, "prompt");
                for id in batcher.clear(&mut engine) {
                    if let Some(s) = streams.get_mut(&id) {
                        s.push(Out::Error(err.clone()));
                        s.done = true;
                    }
                }
            }
        }
    }
}

fn handle(
    command: Command,
    engine: &mut Engine,
    batcher: &mut Batcher,
    streams: &mut HashMap<RequestId, Stream>,
    config: &EngineConfig,
    shutting_down: &mut bool,
) {
    let (mut job, reply) = match command {
        Command::Shutdown => {
            *shutting_down = true;
            return;
        }
        Command::Submit(job, reply) => (job, reply),
    };
    // A refused request gives its places at the door back.
    let places = if job.beams.is_some() { 1 } else { job.n };
    let refuse = |reply: oneshot::Sender<Result<Accepted, ApiError>>, e: ApiError| {
        config.inflight.fetch_sub(places, Ordering::Relaxed);
        let _ = reply.send(Err(e));
    };
    if *shutting_down {
        refuse(reply, ApiError::shutting_down());
        return;
    }
    let stream = |index| Stream {
        events: job.events.clone(),
        index,
        held: VecDeque::new(),
        done: false,
        received: job.received,
        last_token: None,
        behind_since: None,
        beams: job.beams.is_some(),
    };
    let param = job.param;
    // Capacity first (no work for a request that is refused): the batch's rows and the queue.
    let (running, waiting) = (batcher.len(), batcher.waiting());
    if running + waiting + job.n > batcher.max_rows() + config.max_queue {
        refuse(reply, ApiError::busy(waiting, running));
        return;
    }
    // Beam search runs in the batch: its beams are rows of the decode steps beside the others.
    if let Some(beams) = &job.beams {
        let mut beams = beams.clone();
        if !job.options.ignore_eos {
            beams.stop_ids = engine.tokenizer.stop_ids.clone();
        }
        match Batcher::prepare_beams(engine, &job.prompt, &beams) {
            Ok(p) => {
                let prompt_tokens = p.prompt_tokens();
                streams.insert(batcher.enqueue(p), stream(0));
                let _ = reply.send(Ok(Accepted { prompt_tokens }));
            }
            Err(e) => {
                refuse(reply, ApiError::from_engine(&e, param));
            }
        }
        return;
    }
    // Tokenized once; choice i samples with seed + i.
    let first = match Batcher::prepare_with(engine, &job.prompt, &job.options, job.constraint.take()) {
        Ok(p) => p,
        Err(e) => {
            refuse(reply, ApiError::from_engine(&e, param));
            return;
        }
    };
    let mut prepared = Vec::with_capacity(job.n);
    for i in 1..job.n {
        match first.with_seed(job.options.sampling.seed.wrapping_add(i as u64)) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                refuse(reply, ApiError::from_engine(&e, param));
                return;
            }
        }
    }
    prepared.insert(0, first);
    let prompt_tokens = prepared[0].prompt_tokens();
    for (i, p) in prepared.into_iter().enumerate() {
        streams.insert(batcher.enqueue(p), stream(i));
    }
    let _ = reply.send(Ok(Accepted { prompt_tokens }));
}

// ---------------------------------------------------------------------------------------------
// HTTP

struct AppState {
    model_id: String,
    commands: mpsc::Sender<Command>,
    /// Streams let in and not ended (a request's choices each; the engine thread gives places
    /// back), and the most there may be: the batch's rows and the queue.
    inflight: Arc<AtomicUsize>,
    capacity: usize,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    /// Events a stream's channel holds (`--stream-buffer`).
    stream_buffer: usize,
    /// `--max-body` and `--body-timeout`.
    max_body: usize,
    body_timeout: Duration,
    /// The model's tokenizer and chat template: requests are tokenized in the handlers.
    encoder: webgpu_llm::engine::PromptEncoder,
}

type Shared = Arc<AppState>;

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with its status.
#[derive(Debug, Clone)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<String>,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.into());
        self
    }

    fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            code: Some("invalid_value".into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    fn shutting_down() -> Self {
        Self {
            code: Some("shutting_down".into()),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the server is shutting down")
        }
    }

    fn busy(waiting: usize, running: usize) -> Self {
        Self {
            code: Some("rate_limit_exceeded".into()),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("the server is at capacity ({running} requests running, {waiting} waiting); retry later"),
            )
        }
    }

    /// A request that waited longer than `--queue-timeout` for a place in the batch.
    fn queue_timeout(waited: Duration) -> Self {
        Self {
            code: Some("queue_timeout".into()),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!(
                    "the request waited {} s (--queue-timeout) for a place in the batch; retry later",
                    waited.as_secs()
                ),
            )
        }
    }

    /// An engine error about a request (`param`: the field holding the prompt).
    fn from_engine(e: &Error, param: &str) -> Self {
        let message = e.to_string();
        match e {
            Error::InvalidSamplingParameter { name, .. }
            | Error::InvalidOption { name, .. }
            | Error::InvalidConstraint { field: name, .. } => Self::invalid(name, message),
            Error::ContextOverflow { .. } => Self {
                param: Some(param.into()),
                code: Some("context_length_exceeded".into()),
                ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            },
            Error::EmptyPrompt
            | Error::TokenOutOfRange { .. }
            | Error::ChatTemplate(_)
            | Error::NoChatTemplate
            | Error::Tokenizer(_) => Self::invalid(param, message),
            // More than the whole pool: never, not later.
            Error::KvPoolFull { needed_tokens, capacity_tokens, .. } if needed_tokens > capacity_tokens => Self {
                param: Some(param.into()),
                code: Some("context_length_exceeded".into()),
                ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            },
            Error::KvPoolFull { .. } | Error::TooManySequences { .. } => Self {
                code: Some("rate_limit_exceeded".into()),
                retry_after: Some(1),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            _ => Self {
                code: Some(e.code().into()),
                ..Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            },
        }
    }

    fn body(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// Reads and parses a body for `endpoint` (`openai::parse`): 400 for what is not JSON and for
/// a field's value or a field the engine does not take (naming it), 422 for JSON of the wrong
/// shape, 413 past `--max-body`, 408 past `--body-timeout`, 404 for another model.
async fn parse(state: &AppState, endpoint: Endpoint, body: axum::body::Body) -> Result<Request, ApiError> {
    let body = match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, state.max_body)).await {
        Err(_) => {
            let message = format!("the request body took longer than {} s to arrive", state.body_timeout.as_secs());
            return Err(
                ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", message).with_code("body_timeout")
            );
        }
        Ok(Err(_)) => {
            let message = format!("the request body is over the {} bytes --max-body allows", state.max_body);
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
                .with_code("request_too_large"));
        }
        Ok(Ok(bytes)) => bytes,
    };
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", format!("the body is not valid JSON: {e}"))
            .with_code("invalid_json")
    })?;
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let request = openai::parse(endpoint, value, seed).map_err(|e| match e {
        RequestError::Shape(m) => {
            let message = format!("the request does not have the expected fields: {m}");
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request_error", message)
                .with_code("invalid_request")
        }
        RequestError::Invalid { param, message } => ApiError::invalid(&param, message),
    })?;
    if let Some(m) = request.model.as_deref().filter(|m| !m.is_empty() && *m != state.model_id) {
        return Err(ApiError {
            param: Some("model".into()),
            code: Some("model_not_found".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{m}' does not exist; this server runs '{}'", state.model_id),
            )
        });
    }
    Ok(request)
}

async fn chat_completions(State(state): State<Shared>, body: axum::body::Body) -> Response {
    let result = async { run(&state, parse(&state, Endpoint::Chat, body).await?).await }.await;
    finish(&state, "/v1/chat/completions", result)
}

async fn completions(State(state): State<Shared>, body: axum::body::Body) -> Response {
    let result = async { run(&state, parse(&state, Endpoint::Completions, body).await?).await }.await;
    finish(&state, "/v1/completions", result)
}

fn finish(state: &AppState, endpoint: &'static str, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(IntoResponse::into_response);
    state.metrics.count(endpoint, response.status().as_u16());
    response
}

async fn run(state: &Shared, request: Request) -> Result<Response, ApiError> {
    let param = if matches!(request.prompt, Prompt::Chat(_)) { "messages" } else { "prompt" };
    // A prompt too long for the context by its length alone is refused before anything else.
    let (min_tokens, context) = (state.encoder.min_tokens(&request.prompt), state.encoder.context_length());
    let max_tokens = request.beams.as_ref().map_or(request.generate.max_tokens, |b| b.max_tokens);
    if min_tokens.saturating_add(max_tokens) > context {
        let message = format!(
            "the prompt is at least {min_tokens} tokens by its length, and with max_tokens {max_tokens} that is past this server's {context}-token context"
        );
        return Err(ApiError::invalid(param, message).with_code("context_length_exceeded"));
    }
    // Admission at the door: a place for each stream, or 429 now (nothing queued, nothing held).
    // The places go back when this handler ends before the engine thread took the request
    // (an error, or the client gone while its prompt was tokenized: the future is dropped).
    let places = Places::take(&state.inflight, if request.beams.is_some() { 1 } else { request.n });
    if state.inflight.load(Ordering::Relaxed) > state.capacity {
        drop(places);
        let running = state.metrics.running.load(Ordering::Relaxed);
        return Err(ApiError::busy(state.metrics.queue_depth.load(Ordering::Relaxed), running));
    }
    // Tokenized, and its constraint compiled, here on a blocking thread, not on the engine's
    // (which only runs the batch). A beam search refuses a constraint on the engine thread.
    let encoder = state.encoder.clone();
    let (prompt, tools) = (request.prompt.clone(), request.generate.tools.clone());
    let spec = request.generate.constraint.clone().filter(|_| request.beams.is_none());
    let prepared = tokio::task::spawn_blocking(move || {
        let tokens = encoder.tokens(&prompt, tools.as_deref())?;
        let constraint = spec.map(|s| encoder.constraint(&s)).transpose()?;
        Ok::<_, webgpu_llm::error::Error>((tokens, constraint))
    });
    let (tokens, constraint) = match prepared.await {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => return Err(ApiError::from_engine(&e, param)),
        Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "tokenizing failed")),
    };
    // The channel's bound is what a slow reader can leave unread before its stream waits.
    let (tx, rx) = mpsc::channel(state.stream_buffer);
    let (reply, accepted) = oneshot::channel();
    let job = Job {
        prompt: Prompt::Tokens(tokens),
        param,
        options: request.generate.clone(),
        constraint,
        n: request.n,
        beams: request.beams.clone(),
        events: tx,
        received: Instant::now(),
    };
    if let Err(e) = state.commands.try_send(Command::Submit(Box::new(job), reply)) {
        return Err(match e {
            mpsc::error::TrySendError::Full(_) => ApiError::busy(state.capacity, 0),
            mpsc::error::TrySendError::Closed(_) => ApiError::shutting_down(),
        });
    }
    // The engine thread has the request: it gives the places back when its streams end.
    places.keep();
    let accepted = accepted.await.map_err(|_| ApiError::shutting_down())??;
    let number = state.next_id.fetch_add(1, Ordering::Relaxed);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let answer = Answer::new(&request, &state.model_id, number, created, accepted.prompt_tokens);
    if request.stream {
        Ok(stream_response(answer, rx))
    } else {
        whole_response(answer, rx).await
    }
}

fn stream_response(answer: Answer, rx: mpsc::Receiver<Out>) -> Response {
    struct St {
        answer: Answer,
        rx: mpsc::Receiver<Out>,
        queue: VecDeque<Event>,
        ended: bool,
    }
    let st = St { answer, rx, queue: VecDeque::new(), ended: false };
    let events = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(e), st));
            }
            if st.ended {
                return None;
            }
            let data = |v: Value| Event::default().data(v.to_string());
            match st.rx.recv().await {
                Some(Out::Token { index, text, logprobs, position, speculation, allowed }) => {
                    // None: text held back (it may be a tool call).
                    let chunk =
                        st.answer.token_chunk(index, &text, logprobs.as_ref(), position, speculation.as_ref(), allowed);
                    st.queue.extend(chunk.map(data));
                }
                Some(Out::Done { index, stats }) => {
                    let reason = openai::finish_reason(&stats);
                    let chunks = st.answer.finish_chunks(index, reason, stats.generated_tokens);
                    st.queue.extend(chunks.into_iter().map(data));
                    if st.answer.done() {
                        st.queue.push_back(Event::default().data("[DONE]"));
                        st.ended = true;
                    }
                }
                Some(Out::Beams(beams)) => {
                    st.queue.extend(st.answer.beams(&beams, true).into_iter().map(data));
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ended = true;
                }
                Some(Out::Error(e)) => {
                    st.queue.push_back(data(e.body()));
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ended = true;
                }
                None => {
                    let message = "the stream was ended by the server (its reader was paused past --pause-timeout, or the engine stopped)";
                    let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
                        .with_code("stream_ended");
                    st.queue.push_back(data(e.body()));
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ended = true;
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn whole_response(mut answer: Answer, mut rx: mpsc::Receiver<Out>) -> Result<Response, ApiError> {
    while !answer.done() {
        match rx.recv().await {
            Some(Out::Token { index, text, logprobs, .. }) => answer.push(index, &text, logprobs),
            Some(Out::Done { index, stats }) => {
                answer.finish(index, openai::finish_reason(&stats), stats.generated_tokens)
            }
            Some(Out::Beams(beams)) => {
                let body = answer.beams(&beams, false).remove(0);
                return Ok(axum::Json(body).into_response());
            }
            Some(Out::Error(e)) => return Err(e),
            None => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the engine stopped")),
        }
    }
    Ok(axum::Json(answer.completion()).into_response())
}

async fn models(State(state): State<Shared>) -> Response {
    let body = json!({
        "object": "list",
        "data": [{ "id": state.model_id, "object": "model", "created": 0, "owned_by": "webgpu-llm" }],
    });
    finish(&state, "/v1/models", Ok(axum::Json(body).into_response()))
}

async fn health(State(state): State<Shared>) -> Response {
    if state.commands.is_closed() {
        let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine thread has stopped")
            .with_code("engine_stopped");
        return finish(&state, "/health", Err(e));
    }
    let body = json!({
        "status": "ok",
        "running": state.metrics.running.load(Ordering::Relaxed),
        "waiting": state.metrics.queue_depth.load(Ordering::Relaxed),
    });
    finish(&state, "/health", Ok(axum::Json(body).into_response()))
}

async fn not_found(State(state): State<Shared>, uri: axum::http::Uri) -> Response {
    let e = ApiError {
        code: Some("not_found".into()),
        ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route {}", uri.path()))
    };
    finish(&state, "other", Err(e))
}

async fn method_not_allowed(State(state): State<Shared>, method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let e = ApiError {
        code: Some("method_not_allowed".into()),
        ..ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{method} is not allowed on {}", uri.path()),
        )
    };
    finish(&state, "other", Err(e))
}

async fn metrics_text(State(state): State<Shared>) -> Response {
    let text = state.metrics.render();
    let mut response = text.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    response
}

// ---------------------------------------------------------------------------------------------
// Metrics (Prometheus text format)

/// Latency buckets, seconds.
const BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if let Some(i) = BUCKETS.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in BUCKETS.iter().zip(self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

#[derive(Default)]
struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    queue_depth: AtomicUsize,
    running: AtomicUsize,
    paused: AtomicUsize,
    batch_rows: AtomicUsize,
    generated_tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    prefix_cache_tokens: AtomicUsize,
    decode_tok_s: Mutex<f64>,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Metrics {
    fn count(&self, endpoint: &'static str, status: u16) {
        *self.requests.lock().unwrap().entry((endpoint, status)).or_default() += 1;
    }

    fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(out, "# HELP webgpu_llm_requests_total HTTP requests answered, by endpoint and status.");
        let _ = writeln!(out, "# TYPE webgpu_llm_requests_total counter");
        for ((endpoint, status), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(out, "webgpu_llm_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
        }
        let gauges = [
            (
                "webgpu_llm_queue_depth",
                "Requests waiting for a place in the batch.",
                self.queue_depth.load(Ordering::Relaxed) as f64,
            ),
            (
                "webgpu_llm_running_requests",
                "Requests in the running batch.",
                self.running.load(Ordering::Relaxed) as f64,
            ),
            (
                "webgpu_llm_paused_streams",
                "Running requests whose readers are behind (not decoded until they read).",
                self.paused.load(Ordering::Relaxed) as f64,
            ),
            ("webgpu_llm_batch_size", "Rows of the last decode step.", self.batch_rows.load(Ordering::Relaxed) as f64),
            (
                "webgpu_llm_prefix_cache_tokens",
                "Tokens in the KV pool's prefix cache (full blocks registered for later prompts, in use or idle).",
                self.prefix_cache_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                "webgpu_llm_decode_tokens_per_second",
                "Tokens per second of the last decode round without prefill (all rows).",
                *self.decode_tok_s.lock().unwrap(),
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let counters = [
            ("webgpu_llm_generated_tokens_total", "Tokens generated.", self.generated_tokens.load(Ordering::Relaxed)),
            (
                "webgpu_llm_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "webgpu_llm_prompt_tokens_cached_total",
                "Prompt tokens of finished requests taken from the prefix cache (not prefilled).",
                self.cached_prompt_tokens.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        self.ttft.lock().unwrap().render(
            "webgpu_llm_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            &mut out,
        );
        self.itl.lock().unwrap().render(
            "webgpu_llm_inter_token_latency_seconds",
            "Between two tokens of a request.",
            &mut out,
        );
        out
    }
}
