//! The commands: `generate` streams a completion to stdout, `bench` measures speed.

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use webgpu_llm::chat::Message;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, Stats};
use webgpu_llm::gguf::{FileSource, SplitSource};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::Error;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(name = "webgpu-llm", version, about = "Run a GGUF language model on your own GPU (or the CPU reference)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout.
    // Negative numbers are values (`--temperature -1` is then refused as invalid, not misparsed).
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Measure prefill and decode speed (greedy, EOS ignored) and what a decode step costs.
    Bench(BenchArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF model file [default: the default model fetched by scripts/fetch-model]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where the model runs [default: gpu when an adapter exists, else cpu]
    #[arg(long, value_enum)]
    backend: Option<Backend>,
    /// Tokens the KV cache holds [default: min(model context, 4096)]
    #[arg(long, value_parser = at_least_one)]
    context_length: Option<usize>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    gen_tokens: usize,
    /// Also time each kernel family (one dispatch per submission) for a prefill and a decode step.
    #[arg(long)]
    profile: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    Cpu,
    Gpu,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = SamplingParams::default().temperature)]
    temperature: f32,
    #[arg(long, default_value_t = SamplingParams::default().top_p)]
    top_p: f32,
    /// 0 = no top-k cut.
    #[arg(long, default_value_t = SamplingParams::default().top_k)]
    top_k: usize,
    #[arg(long, default_value_t = SamplingParams::default().min_p)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// RNG seed [default: from the clock; printed in the stats]
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// One JSON object per token on stdout ({"id", "text"}), then {"stats": {...}}.
    #[arg(long)]
    json: bool,
}

/// A count flag: a whole number of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e} (a whole number of at least 1)")),
    }
}

/// Exit codes: 1 for a bad model file or a failure, 2 for bad usage (as clap's own errors).
const EXIT_USAGE: u8 = 2;

/// Whether an error is about the flags given rather than the model or the machine.
fn is_usage(e: &Error) -> bool {
    matches!(e, Error::InvalidSamplingParameter { .. } | Error::InvalidOption { .. } | Error::ContextOverflow { .. })
}

/// The progress line (`loading weights: 42%`) is open: a message must end it first.
static PROGRESS_OPEN: AtomicBool = AtomicBool::new(false);
/// Set by Ctrl-C: the generation stops at the next token and prints its stats.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// A generation is streaming: Ctrl-C ends it gracefully (otherwise it quits at once).
static GENERATING: AtomicBool = AtomicBool::new(false);

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            if e.use_stderr() && !e.to_string().contains("Usage:") {
                eprintln!("\n{}", Cli::command().render_usage());
            }
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    // Ctrl-C while generating ends the generation (what was generated and the stats are still
    // printed); a second one, or one while loading, quits at once.
    let _ = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) || !GENERATING.load(Ordering::SeqCst) {
            end_progress_line();
            std::process::exit(130);
        }
    });
    let result = match cli.command {
        Command::Generate(args) => pollster::block_on(generate(args)),
        Command::Bench(args) => pollster::block_on(bench(args)),
    };
    match result {
        Ok(()) if INTERRUPTED.load(Ordering::SeqCst) => ExitCode::from(130),
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            end_progress_line();
            eprintln!("error: {e}");
            ExitCode::from(if is_usage(&e) { EXIT_USAGE } else { 1 })
        }
    }
}

fn end_progress_line() {
    if PROGRESS_OPEN.swap(false, Ordering::SeqCst) {
        eprintln!();
    }
}

fn model_path(arg: Option<PathBuf>) -> PathBuf {
    arg.unwrap_or_else(|| {
        let here = PathBuf::from(DEFAULT_MODEL);
        if here.exists() {
            here
        } else {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_MODEL)
        }
    })
}

/// The parts of a split model (`name-00001-of-00003.gguf`, any part named), or just `path`.
fn split_parts(path: &std::path::Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let parsed = name.strip_suffix(".gguf").and_then(|stem| {
        let (rest, count) = stem.rsplit_once("-of-")?;
        let (base, _) = rest.rsplit_once('-')?;
        let n: usize = count.parse().ok().filter(|_| count.len() == 5)?;
        Some((base.to_string(), n))
    });
    match parsed {
        Some((base, n)) => (1..=n).map(|i| path.with_file_name(format!("{base}-{i:05}-of-{n:05}.gguf"))).collect(),
        None => vec![path.to_path_buf()],
    }
}

/// Loads the model; without --backend, the GPU when an adapter exists, else the CPU.
async fn load(args: &ModelArgs) -> Result<Engine, Error> {
    let path = model_path(args.model.clone());
    eprintln!("loading {}", path.display());
    // Read in ranges: the header, then each tensor in pieces into GPU memory.
    let file = SplitSource::new(split_parts(&path).iter().map(|p| FileSource::open(p)).collect::<Result<_, _>>()?);
    let start = std::time::Instant::now();
    let mut progress = |done: usize, total: usize| {
        PROGRESS_OPEN.store(true, Ordering::SeqCst);
        eprint!("\rloading weights: {}%", done * 100 / total.max(1));
    };
    let options = |backend| LoadOptions { backend, context_length: args.context_length, gpu: GpuOptions::from_env() };
    let engine = match args.backend {
        Some(Backend::Cpu) => Engine::load_from(&file, options(BackendKind::Cpu), &mut progress).await?,
        Some(Backend::Gpu) => Engine::load_from(&file, options(BackendKind::Gpu), &mut progress).await?,
        None => match Engine::load_from(&file, options(BackendKind::Gpu), &mut progress).await {
            Err(Error::NoAdapter(why)) => {
                end_progress_line();
                eprintln!("no GPU adapter ({why}); using the CPU backend");
                Engine::load_from(&file, options(BackendKind::Cpu), &mut progress).await?
            }
            other => other?,
        },
    };
    let c = &engine.config;
    end_progress_line();
    eprintln!(
        "loaded {:?} ({}, {} layers, d_model {}, vocab {}) in {:.2} s on {}",
        c.name,
        c.architecture,
        c.n_layers,
        c.d_model,
        c.vocab_size,
        start.elapsed().as_secs_f64(),
        engine.backend_description(),
    );
    Ok(engine)
}

async fn generate(args: GenerateArgs) -> Result<(), Error> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed,
        },
        stop: args.stop,
        ignore_eos: args.ignore_eos,
        top_candidates: 0,
    };
    // Flags first: a typo should not cost a model load.
    options.validate()?;
    if let Some(context) = args.model.context_length {
        if args.max_tokens >= context {
            return Err(Error::ContextOverflow {
                prompt_tokens: 1,
                max_tokens: args.max_tokens,
                context_length: context,
            });
        }
    }
    let mut engine = load(&args.model).await?;
    let prompt = if args.chat {
        let mut messages: Vec<Message> = args.system.into_iter().map(|s| Message::new("system", s)).collect();
        messages.push(Message::new("user", args.prompt));
        Prompt::Chat(messages)
    } else {
        Prompt::Text(args.prompt)
    };

    let json = args.json;
    let mut stdout = std::io::stdout().lock();
    GENERATING.store(true, Ordering::SeqCst);
    let stats = engine
        .generate(&prompt, &options, &mut |ev| {
            let written = if json {
                writeln!(stdout, "{}", serde_json::json!({ "id": ev.id, "text": ev.text }))
            } else {
                write!(stdout, "{}", ev.text).and_then(|_| stdout.flush())
            };
            written.is_ok() && !INTERRUPTED.load(Ordering::SeqCst)
        })
        .await?;
    if json {
        let _ = writeln!(stdout, "{}", serde_json::json!({ "stats": stats_json(&stats, seed) }));
    } else {
        let _ = writeln!(stdout);
    }
    eprintln!(
        "prompt tokens: {}, generated tokens: {}, TTFT: {:.1} ms, prefill: {:.1} tok/s, decode: {:.1} tok/s, stop: {:?}, seed: {seed}",
        stats.prompt_tokens, stats.generated_tokens, stats.ttft_ms, stats.prefill_tok_s, stats.decode_tok_s, stats.stop_reason
    );
    Ok(())
}

fn stats_json(s: &Stats, seed: u64) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": s.prompt_tokens,
        "prefilled_tokens": s.prefilled_tokens,
        "generated_tokens": s.generated_tokens,
        "ttft_ms": s.ttft_ms,
        "prefill_tok_s": s.prefill_tok_s,
        "decode_tok_s": s.decode_tok_s,
        "stop_reason": format!("{:?}", s.stop_reason),
        "seed": seed,
    })
}

fn bench_overflow(args: &BenchArgs, context: usize) -> Error {
    Error::InvalidOption {
        name: "--prompt-tokens + --gen-tokens",
        value: format!("{} + {}", args.prompt_tokens, args.gen_tokens),
        expected: format!("must fit the context of {context} tokens (--context-length)"),
    }
}

/// Text the benchmark prompt is cut from: plain prose, so the tokens are typical.
const BENCH_TEXT: &str = "It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife. However little known the feelings or views of such a man may be on his first entering \
a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered as \
the rightful property of some one or other of their daughters. ";

async fn bench(args: BenchArgs) -> Result<(), Error> {
    if let Some(context) = args.model.context_length {
        if args.prompt_tokens.checked_add(args.gen_tokens).is_none_or(|n| n > context) {
            return Err(bench_overflow(&args, context));
        }
    }
    let mut engine = load(&args.model).await?;
    let context = engine.context_length();
    if args.prompt_tokens.checked_add(args.gen_tokens).is_none_or(|n| n > context) {
        return Err(bench_overflow(&args, context));
    }
    let text = BENCH_TEXT.repeat(args.prompt_tokens / 40 + 1);
    let mut tokens = engine.tokenizer.encode(&text)?;
    tokens.truncate(args.prompt_tokens);
    let options = GenerateOptions {
        max_tokens: args.gen_tokens,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    // A first short run compiles the driver's shader variants and warms caches.
    engine
        .generate(
            &Prompt::Tokens(tokens[..8.min(tokens.len())].to_vec()),
            &GenerateOptions { max_tokens: 2, ..options.clone() },
            &mut |_| true,
        )
        .await?;
    let mut fresh = tokens.clone();
    fresh[0] = fresh[0].wrapping_add(1) % engine.config.vocab_size as u32;
    let s = engine.generate(&Prompt::Tokens(fresh), &options, &mut |_| true).await?;
    println!("backend:        {}", engine.backend_description());
    println!("model:          {} ({} layers)", engine.config.name, engine.config.n_layers);
    println!("prompt tokens:  {} (prefilled {})", s.prompt_tokens, s.prefilled_tokens);
    println!("prefill:        {:.1} tok/s, TTFT {:.1} ms", s.prefill_tok_s, s.ttft_ms);
    println!(
        "decode:         {:.2} tok/s over {} steps, TPOT {:.2} ms",
        s.decode_tok_s,
        s.decode_steps,
        1e3 / s.decode_tok_s.max(1e-9)
    );
    if let (Some(c), Some(m)) = (s.decode_counters, engine.gpu_model()) {
        let steps = s.decode_steps.max(1) as f64;
        println!(
            "per decode step: {} dispatches, {:.2} submissions, {:.2} buffers created, {:.2} bind groups created, {:.2} pipelines created, {:.0} bytes read back",
            m.decode_dispatches(),
            c.submissions as f64 / steps,
            c.buffers as f64 / steps,
            c.bind_groups as f64 / steps,
            c.pipelines as f64 / steps,
            c.bytes_read_back as f64 / steps
        );
        if args.profile {
            for (what, n, start) in [
                ("prefill", args.prompt_tokens.min(webgpu_llm::gpu::PREFILL_CHUNK), 0),
                ("decode", 1, args.prompt_tokens),
            ] {
                let times = m.profile(n, start)?;
                let total: f64 = times.iter().map(|t| t.1).sum();
                let parts: Vec<String> = times.iter().map(|(l, ms)| format!("{l} {ms:.1} ms")).collect();
                println!("profile {what} ({n} tokens): {total:.1} ms = {}", parts.join(", "));
            }
        }
    }
    Ok(())
}
