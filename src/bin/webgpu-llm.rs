//! The native command-line tool: `webgpu-llm generate ...` streams a completion to stdout.

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use webgpu_llm::chat::Message;
use webgpu_llm::engine::{BackendKind, Engine, GenerateOptions, LoadOptions, Prompt, Stats};
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
    Generate(GenerateArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    Cpu,
    Gpu,
}

#[derive(Args)]
struct GenerateArgs {
    /// GGUF model file [default: the default model fetched by scripts/fetch-model]
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
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
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Tokens the KV cache holds [default: min(model context, 4096)]
    #[arg(long)]
    context_length: Option<usize>,
    /// One JSON object per token on stdout ({"id", "text"}), then {"stats": {...}}.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
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
    let result = match cli.command {
        Command::Generate(args) => pollster::block_on(generate(args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
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

async fn generate(args: GenerateArgs) -> Result<(), Error> {
    let path = model_path(args.model);
    let io_err = |source| Error::Io { path: path.display().to_string(), source };
    eprintln!("loading {}", path.display());
    let bytes = std::fs::read(&path).map_err(io_err)?;
    let backend = match args.backend {
        Backend::Cpu => BackendKind::Cpu,
        Backend::Gpu => BackendKind::Gpu,
    };
    let load_start = std::time::Instant::now();
    let mut engine = Engine::load(&bytes, LoadOptions { backend, context_length: args.context_length }, &mut |done, total| {
        eprint!("\rloading weights: {}%", done * 100 / total.max(1));
    })
    .await?;
    let c = &engine.config;
    eprintln!(
        "\rloaded {:?} ({}, {} layers, d_model {}, vocab {}) in {:.2} s on the {} backend",
        c.name,
        c.architecture,
        c.n_layers,
        c.d_model,
        c.vocab_size,
        load_start.elapsed().as_secs_f64(),
        if backend == BackendKind::Cpu { "cpu" } else { "gpu" },
    );

    let prompt = if args.chat {
        let mut messages: Vec<Message> = args.system.into_iter().map(|s| Message::new("system", s)).collect();
        messages.push(Message::new("user", args.prompt));
        Prompt::Chat(messages)
    } else {
        Prompt::Text(args.prompt)
    };
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
    };

    let json = args.json;
    let mut stdout = std::io::stdout().lock();
    let stats = engine
        .generate(&prompt, &options, &mut |ev| {
            let written = if json {
                writeln!(stdout, "{}", serde_json::json!({ "id": ev.id, "text": ev.text }))
            } else {
                write!(stdout, "{}", ev.text).and_then(|_| stdout.flush())
            };
            written.is_ok()
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
