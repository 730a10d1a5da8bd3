//! The commands: `generate` streams a completion to stdout, `bench` measures speed, `serve`
//! runs the OpenAI-compatible server (serve.rs), `synthetic` writes bench's random-weight model.

use crate::model_args::{at_least_one, end_progress_line, load, load_from, Backend, ModelArgs};
use clap::{Args, CommandFactory, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use webgpu_llm::chat::Message;
use webgpu_llm::engine::{Engine, GenerateOptions, Prompt, Stats};
use webgpu_llm::gguf::ByteSource;
use webgpu_llm::options::{JsonSchemaFormat, RequestOptions, Resolved, ResponseFormat, Stop};
use webgpu_llm::sampling::SamplingParams;
use webgpu_llm::speculate::{Drafter, Speculation, SpeculationStats};
use webgpu_llm::Error;

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
    /// Measure prefill and decode speed (greedy unless sampling flags are given, EOS ignored) and
    /// what a decode step costs.
    Bench(BenchArgs),
    /// Serve the model over HTTP: OpenAI-compatible chat and text completions, streamed as
    /// server-sent events, many requests batched on one GPU.
    Serve(crate::serve::ServeArgs),
    /// Write bench's random-weight model (--synthetic) to a GGUF file, to run it in another engine.
    Synthetic(SyntheticArgs),
}

#[derive(Args)]
struct SyntheticArgs {
    /// 1b (Llama 3.2 1B's shape) or 8b (Llama 3 8B's).
    shape: String,
    /// The GGUF file to write.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A random-weight Q4_0 model with Llama 3.2 1B's (1b) or Llama 3 8B's (8b) shape, made in
    /// memory, instead of --model: figures for large models without a download.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// Prompt tokens prefilled before decode is timed.
    #[arg(long, default_value_t = 512, value_parser = at_least_one, conflicts_with = "context")]
    prompt_tokens: usize,
    /// Contexts to time decode at (prefill that many tokens, then decode there), comma-separated:
    /// one run each on one load, e.g. 512,4096,16384,32768.
    #[arg(long, value_delimiter = ',', value_parser = at_least_one)]
    context: Vec<usize>,
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    gen_tokens: usize,
    /// One JSON object per run (a line each) instead of text.
    #[arg(long)]
    json: bool,
    /// Also time each kernel family (one dispatch per submission) for a prefill and a decode step.
    #[arg(long)]
    profile: bool,
    /// Also time speculative decoding: lookup, layers:L, draft:PATH or mtp, each bench prompt (prose,
    /// a chat question, code) without and with it, side by side.
    #[arg(long)]
    speculate: Option<String>,
    /// Tokens drafted per verifying pass with --speculate.
    #[arg(long, default_value_t = 4, requires = "speculate")]
    draft_tokens: usize,
    /// Also time batched decode of this many sequences at once (comma-separated, e.g.
    /// 1,2,4,8,16,32): aggregate and per-sequence decode tok/s, each prompt --prompt-tokens long,
    /// and what a step submits and reads back.
    #[arg(long, value_delimiter = ',', value_parser = at_least_one)]
    batch: Vec<usize>,
    /// With --batch: pipeline greedy rounds (submit round n + 1 before reading round n's ids)
    /// [default: true]
    #[arg(long, requires = "batch")]
    pipeline: Option<bool>,
    /// With --batch: a request with a prompt of this many tokens joins each batch halfway
    /// through its decode (its prefill then shares the steps of the running rows).
    #[arg(long, requires = "batch", value_parser = at_least_one)]
    join: Option<usize>,
    /// The sampler of the timed runs (speculation's stays greedy): greedy unless given.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Also time structured output with this JSON schema (a file): a chat answer constrained to
    /// it beside the same answer free, and the CPU time of each step's mask.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
}

/// The sampling flags of `generate` and `bench`. A flag left out keeps the command's base:
/// `generate` samples as `SamplingParams::default()` has it (temperature 0.7, top-k 40, top-p
/// 0.9, min-p 0.05, no penalties), `bench` is greedy (temperature 0, no cuts).
#[derive(Args)]
struct SamplingArgs {
    /// 0 = greedy [default: generate 0.7, bench 0]
    #[arg(long)]
    temperature: Option<f32>,
    /// 1 = no top-p cut [default: generate 0.9, bench 1]
    #[arg(long)]
    top_p: Option<f32>,
    /// 0 = no top-k cut [default: generate 40, bench 0]
    #[arg(long)]
    top_k: Option<usize>,
    /// 0 = no min-p cut [default: generate 0.05, bench 0]
    #[arg(long)]
    min_p: Option<f32>,
    /// 1 = none [default: 1]
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// [default: 0]
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// [default: 0]
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// RNG seed [default: generate from the clock, printed in the stats; bench 0]
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The flags as a request's sampling fields (`RequestOptions` holds the defaults).
    fn request(&self) -> RequestOptions {
        RequestOptions {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            ..RequestOptions::default()
        }
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text. Given more than once, the prompts run as one batch (every decode step
    /// takes all of them); --json lines then carry "seq" (the prompt's index, from 0).
    #[arg(long, required_unless_present = "prompt_file")]
    prompt: Vec<String>,
    /// A file whose whole text is a prompt ("-": standard input), for prompts past what a
    /// command line holds; with --prompt, after them.
    #[arg(long, value_name = "FILE")]
    prompt_file: Vec<PathBuf>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System prompt for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// [default: 256, as every entry point's]
    #[arg(long, value_parser = at_least_one)]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// One JSON object per token on stdout ({"id", "text"}), then {"stats": {...}}; with
    /// --beams one line {"beams": [{"ids", "text", "score"}, ...]}, best first.
    #[arg(long)]
    json: bool,
    /// Speculative decoding: lookup (an n-gram of the context proposes what followed it),
    /// layers:L (the model's first L layers draft), draft:PATH (a smaller model with the same
    /// tokenizer drafts) or mtp (the model's multi-token-prediction head drafts: Qwen3.5).
    #[arg(long)]
    speculate: Option<String>,
    /// Tokens drafted per verifying pass with --speculate [default: 4]
    #[arg(long, requires = "speculate")]
    draft_tokens: Option<usize>,
    /// Beam search with N beams (transformers' semantics; deterministic: the sampling flags do
    /// not apply) instead of sampling; prints the N best hypotheses when the search ends.
    #[arg(long, value_parser = at_least_one)]
    beams: Option<usize>,
    /// Beam search: a hypothesis scores its summed log-probability / length^P [default: 1]
    #[arg(long, requires = "beams")]
    length_penalty: Option<f64>,
    /// Beam search: when to stop (false: no running beam can beat the worst finished one;
    /// true: N hypotheses finished; never: as false, scoring running beams at --max-tokens)
    /// [default: false]
    #[arg(long, value_parser = ["false", "true", "never"], requires = "beams")]
    early_stopping: Option<String>,
    /// Structured output: the text follows this JSON schema (a file; "-": standard input).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "grammar"])]
    json_schema: Option<PathBuf>,
    /// Structured output: the text is one the whole regex matches.
    #[arg(long, conflicts_with = "grammar")]
    regex: Option<String>,
    /// Structured output: the text follows this Lark grammar (llguidance's dialect; a file).
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
}

impl GenerateArgs {
    /// The flags as a request's options (`RequestOptions`: the defaults and bounds every entry
    /// point shares), the constraint's files read.
    fn request(&self) -> Result<RequestOptions, Error> {
        // One flag may read standard input.
        let stdin = std::path::Path::new("-");
        let readers = [("--json-schema", self.json_schema.as_deref()), ("--grammar", self.grammar.as_deref())];
        let mut takers = readers.into_iter().filter(|(_, p)| *p == Some(stdin)).map(|(flag, _)| flag);
        let prompts = self.prompt_file.iter().filter(|p| p.as_path() == stdin).count();
        if let Some(flag) = takers.nth(1 - prompts.min(1)) {
            return Err(Error::InvalidOption {
                name: flag,
                value: "-".into(),
                expected: "a file: standard input is already another flag's (only one may read it)".into(),
            });
        }
        let response_format = match &self.json_schema {
            None => None,
            Some(path) => {
                let schema = read_schema(path)?;
                Some(ResponseFormat::JsonSchema {
                    json_schema: JsonSchemaFormat {
                        name: "cli".into(),
                        description: None,
                        schema: Some(schema),
                        strict: None,
                    },
                })
            }
        };
        let grammar = self.grammar.as_deref().map(|p| read_text_file(p, "--grammar")).transpose()?;
        Ok(RequestOptions {
            response_format,
            regex: self.regex.clone(),
            grammar,
            max_tokens: self.max_tokens,
            stop: (!self.stop.is_empty()).then(|| Stop::Many(self.stop.clone())),
            ignore_eos: self.ignore_eos,
            // A draft model's path is loaded here; the request says "draft".
            speculate: self
                .speculate
                .as_ref()
                .map(|s| if s.starts_with("draft:") { "draft".into() } else { s.clone() }),
            draft_tokens: self.draft_tokens,
            beams: self.beams,
            length_penalty: self.length_penalty,
            early_stopping: self.early_stopping.as_deref().map(|e| match e {
                "true" => serde_json::Value::Bool(true),
                "false" => serde_json::Value::Bool(false),
                other => serde_json::Value::String(other.into()),
            }),
            ..self.sampling.request()
        })
    }
}

/// Exit codes: 1 for a bad model file or a failure, 2 for bad usage (as clap's own errors).
const EXIT_USAGE: u8 = 2;

/// Whether an error is about the flags given rather than the model or the machine.
fn is_usage(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidSamplingParameter { .. }
            | Error::InvalidOption { .. }
            | Error::InvalidConstraint { .. }
            | Error::ContextOverflow { .. }
    )
}

/// Set by Ctrl-C: the generation stops at the next token and prints its stats.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// A generation is streaming: Ctrl-C ends it gracefully (otherwise it quits at once).
static GENERATING: AtomicBool = AtomicBool::new(false);

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
        Err(e) => {
            // The usage of the command it was for, then the error as the last line (what a
            // script reading the last line of stderr gets).
            let text = e.render().to_string();
            let error: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.trim().is_empty())
                .collect();
            let mut command = Cli::command();
            command.build();
            let name = std::env::args().nth(1).unwrap_or_default();
            let usage = match command.find_subcommand_mut(&name) {
                Some(sub) => sub.render_usage(),
                None => command.render_usage(),
            };
            eprintln!("{usage}\n\n{}", error.join("\n"));
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    if let Command::Serve(args) = cli.command {
        // The server handles Ctrl-C and SIGTERM itself: streams end, then it exits.
        return match crate::serve::main(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                end_progress_line();
                eprintln!("error: {e}");
                ExitCode::from(if is_usage(&e) { EXIT_USAGE } else { 1 })
            }
        };
    }
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
        Command::Synthetic(args) => write_synthetic(&args),
        Command::Serve(_) => unreachable!("served above"),
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

fn write_synthetic(args: &SyntheticArgs) -> Result<(), Error> {
    let source = webgpu_llm::synthetic::SyntheticSource::new(webgpu_llm::synthetic::Shape::named(&args.shape)?);
    let io = |source| Error::Io { path: args.out.display().to_string(), source };
    let mut file = std::io::BufWriter::new(std::fs::File::create(&args.out).map_err(io)?);
    source.write_to(&mut file).map_err(io)?;
    file.flush().map_err(io)?;
    eprintln!("wrote {} ({} bytes)", args.out.display(), source.len());
    Ok(())
}

/// The JSON schema file given to `--json-schema`.
fn read_schema(path: &std::path::Path) -> Result<serde_json::Value, Error> {
    serde_json::from_str(&read_text_file(path, "--json-schema")?).map_err(|e| Error::InvalidOption {
        name: "--json-schema",
        value: path.display().to_string(),
        expected: format!("a JSON schema: {e}"),
    })
}

/// Generates from `prompt`: the tokens, and the stats.
async fn generate_ids(
    engine: &mut Engine,
    prompt: &Prompt,
    options: &GenerateOptions,
) -> Result<(Vec<u32>, Stats), Error> {
    let mut ids = Vec::new();
    let stats = engine
        .generate(prompt, options, &mut |ev| {
            ids.push(ev.id);
            true
        })
        .await?;
    Ok((ids, stats))
}

/// A text file given to `flag` ("-": standard input), refused when it is not UTF-8.
fn read_text_file(path: &std::path::Path, flag: &'static str) -> Result<String, Error> {
    let io = |source| Error::Io { path: path.display().to_string(), source };
    let bytes = if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).map_err(io)?;
        bytes
    } else {
        std::fs::read(path).map_err(io)?
    };
    String::from_utf8(bytes).map_err(|e| Error::InvalidOption {
        name: flag,
        value: path.display().to_string(),
        expected: format!("a UTF-8 text file (byte {} is not UTF-8)", e.utf8_error().valid_up_to()),
    })
}

async fn generate(mut args: GenerateArgs) -> Result<(), Error> {
    let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    // Flags first: a typo should not cost a model load.
    let Resolved { generate: options, beams: beam_options, .. } = args.request()?.resolve(clock)?;
    let seed = options.sampling.seed;
    if let Some(context) = args.model.context_length {
        if options.max_tokens >= context {
            return Err(Error::ContextOverflow {
                prompt_tokens: 1,
                max_tokens: options.max_tokens,
                context_length: context,
            });
        }
    }
    // Prompt files before the model loads: a missing file costs no load.
    let mut texts = std::mem::take(&mut args.prompt);
    for path in &args.prompt_file {
        texts.push(read_text_file(path, "--prompt-file")?);
    }
    if texts.len() > 1 && beam_options.is_some() {
        return Err(Error::InvalidOption {
            name: "--beams",
            value: format!("with {} prompts", texts.len()),
            expected: "one prompt: beam search runs one prompt's beams as its batch".into(),
        });
    }
    let mut engine = load(&args.model, None).await?;
    if let Some(spec) = &args.speculate {
        attach_draft(&mut engine, spec, &args.model).await?;
    }
    let prompts: Vec<Prompt> = texts
        .into_iter()
        .map(|text| {
            if args.chat {
                let mut messages: Vec<Message> =
                    args.system.iter().map(|s| Message::new("system", s.clone())).collect();
                messages.push(Message::new("user", text));
                Prompt::Chat(messages)
            } else {
                Prompt::Text(text)
            }
        })
        .collect();
    if prompts.len() > 1 {
        return generate_batch(&mut engine, prompts, options, args.json, seed).await;
    }
    let prompt = prompts.into_iter().next().expect("at least one --prompt");

    if let Some(mut options) = beam_options {
        if !args.ignore_eos {
            options.stop_ids = engine.tokenizer.stop_ids.clone();
        }
        let found = engine.beam_search(&prompt, &options).await?;
        let mut stdout = std::io::stdout().lock();
        if args.json {
            let beams: Vec<_> = found
                .iter()
                .map(|(h, text)| serde_json::json!({ "ids": h.ids, "text": text, "score": h.score }))
                .collect();
            let _ = writeln!(stdout, "{}", serde_json::json!({ "beams": beams }));
        } else {
            for (i, (h, text)) in found.iter().enumerate() {
                let _ = writeln!(stdout, "# beam {} (score {:.4}, {} tokens)\n{text}", i + 1, h.score, h.ids.len());
            }
        }
        return Ok(());
    }

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
    if let Some(sp) = &stats.speculation {
        eprintln!("speculation: {}", speculation_summary(sp, stats.generated_tokens));
    }
    Ok(())
}

/// Several prompts as one batch: --json streams each token as it comes with its "seq"; text
/// prints each sequence's whole output once all are done.
async fn generate_batch(
    engine: &mut Engine,
    prompts: Vec<Prompt>,
    options: GenerateOptions,
    json: bool,
    seed: u64,
) -> Result<(), Error> {
    let requests: Vec<(Prompt, GenerateOptions)> = prompts.into_iter().map(|p| (p, options.clone())).collect();
    let mut texts = vec![String::new(); requests.len()];
    let mut stdout = std::io::stdout().lock();
    GENERATING.store(true, Ordering::SeqCst);
    let stats = engine
        .generate_batch(&requests, &mut |seq, ev| {
            let written = if json {
                writeln!(stdout, "{}", serde_json::json!({ "seq": seq, "id": ev.id, "text": ev.text }))
            } else {
                texts[seq].push_str(&ev.text);
                Ok(())
            };
            written.is_ok() && !INTERRUPTED.load(Ordering::SeqCst)
        })
        .await?;
    for (seq, (s, text)) in stats.iter().zip(&texts).enumerate() {
        if json {
            let _ = writeln!(stdout, "{}", serde_json::json!({ "seq": seq, "stats": stats_json(s, seed) }));
        } else {
            let _ = writeln!(stdout, "# sequence {seq}\n{text}");
        }
        eprintln!(
            "sequence {seq}: prompt tokens: {}, generated tokens: {}, decode: {:.1} tok/s, stop: {:?}",
            s.prompt_tokens, s.generated_tokens, s.decode_tok_s, s.stop_reason
        );
    }
    Ok(())
}

/// Accepted of drafted, and tokens emitted per pass of the whole model.
fn speculation_summary(sp: &SpeculationStats, generated: usize) -> String {
    format!(
        "accepted {} of {} drafted ({:.0}%), {:.2} tokens per forward pass ({} passes, {} draft passes)",
        sp.accepted,
        sp.drafted,
        100.0 * sp.accepted as f64 / sp.drafted.max(1) as f64,
        generated.saturating_sub(1) as f64 / sp.passes.max(1) as f64,
        sp.passes,
        sp.draft_passes
    )
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
        "speculation": s.speculation,
    })
}

fn bench_overflow(args: &BenchArgs, prompt_tokens: usize, context: Option<usize>) -> Error {
    Error::InvalidOption {
        name: if args.context.is_empty() { "--prompt-tokens + --gen-tokens" } else { "--context + --gen-tokens" },
        value: format!("{prompt_tokens} + {}", args.gen_tokens),
        expected: match context {
            Some(context) => format!("must fit the context of {context} tokens (--context-length)"),
            None => "must fit the model's context".into(),
        },
    }
}

/// Text the benchmark prompt is cut from: plain prose, so the tokens are typical.
const BENCH_TEXT: &str = "It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife. However little known the feelings or views of such a man may be on his first entering \
a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered as \
the rightful property of some one or other of their daughters. ";

async fn bench(mut args: BenchArgs) -> Result<(), Error> {
    let contexts = if args.context.is_empty() { vec![args.prompt_tokens] } else { args.context.clone() };
    let longest = contexts.iter().max().copied().unwrap_or(1);
    let needed = longest
        .checked_add(args.gen_tokens)
        .ok_or_else(|| bench_overflow(&args, longest, args.model.context_length))?;
    // --batch B needs B prompts and their tokens in the KV pool at once.
    // (Each sequence holds whole blocks of the pool.)
    let per_seq = (args.prompt_tokens + args.gen_tokens).next_multiple_of(webgpu_llm::gpu::kernels::KV_BLOCK);
    let joining = args.join.map_or(0, |n| (n + 1).next_multiple_of(webgpu_llm::gpu::kernels::KV_BLOCK));
    let batch_needed = args.batch.iter().max().map_or(0, |&b| b.saturating_mul(per_seq).saturating_add(joining));
    match args.model.context_length {
        Some(context) if needed > context => return Err(bench_overflow(&args, longest, Some(context))),
        Some(_) => {}
        // --context or --batch asks for that much: load with room for it.
        None if !args.context.is_empty() || batch_needed > 0 => {
            args.model.context_length = Some(needed.max(batch_needed))
        }
        None => {}
    }
    // --batch B (and a joining request) needs B rows a decode step.
    let rows = args.batch.iter().max().map(|&b| b + args.join.map_or(0, |_| 1));
    let mut engine = match &args.synthetic {
        Some(name) => {
            let shape = webgpu_llm::synthetic::Shape::named(name)?;
            eprintln!("making a random-weight Q4_0 model with Llama's {} shape", name.to_uppercase());
            load_from(&webgpu_llm::synthetic::SyntheticSource::new(shape), &args.model, rows).await?
        }
        None => load(&args.model, rows).await?,
    };
    let context = engine.context_length();
    if needed > context {
        return Err(bench_overflow(&args, longest, Some(context)));
    }
    let options = GenerateOptions {
        max_tokens: args.gen_tokens,
        sampling: args.sampling.request().resolve_over(SamplingParams::greedy())?.generate.sampling,
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    options.validate()?;
    let text = BENCH_TEXT.repeat(longest / 40 + 1);
    let all_tokens = engine.tokenizer.encode(&text)?;
    // A first short run compiles the driver's shader variants and warms caches.
    engine
        .generate(
            &Prompt::Tokens(all_tokens[..8.min(all_tokens.len())].to_vec()),
            &GenerateOptions { max_tokens: 2, ..options.clone() },
            &mut |_| true,
        )
        .await?;
    for &prompt_tokens in &contexts {
        let mut tokens = all_tokens[..prompt_tokens.min(all_tokens.len())].to_vec();
        // A different first token: nothing of the warm-up run is reused from the KV cache.
        tokens[0] = tokens[0].wrapping_add(1) % engine.config.vocab_size as u32;
        let s = engine.generate(&Prompt::Tokens(tokens), &options, &mut |_| true).await?;
        let report = BenchReport::new(&engine, &s, prompt_tokens, args.gen_tokens);
        if args.json {
            println!("{}", report.json());
        } else {
            report.print(&engine, &s);
        }
        if args.profile {
            if let Some(m) = engine.gpu_model_mut() {
                for (what, n, start) in [("prefill", prompt_tokens.min(m.pass_rows()), 0), ("decode", 1, prompt_tokens)]
                {
                    let p = m.profile(n, start).await?;
                    let total: f64 = p.families.iter().map(|t| t.1).sum();
                    let parts: Vec<String> = p.families.iter().map(|(l, ms)| format!("{l} {ms:.3} ms")).collect();
                    let clock = if p.gpu_clock { "GPU timestamps" } else { "host clock, a submission each" };
                    println!("profile {what} ({n} tokens, {clock}): {total:.3} ms = {}", parts.join(", "));
                }
            }
        }
    }
    if !args.batch.is_empty() {
        bench_batch(&mut engine, &args, &options, &all_tokens).await?;
    }
    if let Some(path) = &args.json_schema {
        bench_constrained(&mut engine, &args, path).await?;
    }
    if let Some(spec) = &args.speculate {
        let drafter = drafter(spec)?;
        attach_draft(&mut engine, spec, &args.model).await?;
        let spec = Speculation { drafter, draft_tokens: args.draft_tokens };
        spec.validate()?;
        bench_speculation(&mut engine, &args, spec).await?;
    }
    Ok(())
}

/// `bench --json-schema`: a chat answer (greedy, at most --gen-tokens) constrained to the schema
/// and the same answer free, their decode rates side by side, and how many of the constrained
/// answer's masks the GPU waited for (its forward pass done before the host had written the
/// mask; on the GPU backend); then each step's mask computed again along the constrained
/// answer's tokens, timed alone (the CPU work a constrained row adds to a step, which runs while
/// the GPU runs the step's forward pass).
async fn bench_constrained(engine: &mut Engine, args: &BenchArgs, path: &std::path::Path) -> Result<(), Error> {
    let spec = webgpu_llm::constraint::ConstraintSpec::JsonSchema(read_schema(path)?);
    let prompt = Prompt::Chat(vec![Message::new("user", "Describe a fictional person as JSON.")]);
    let start = std::time::Instant::now();
    let mut constraint = engine.compile_constraint(&spec)?;
    let compile_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut runs = Vec::new();
    let counters = |e: &Engine| e.gpu_model().map(|m| m.gpu.counters());
    let mut masked = None;
    for constrained in [false, true] {
        let options = GenerateOptions {
            max_tokens: args.gen_tokens,
            sampling: SamplingParams::greedy(),
            constraint: constrained.then(|| spec.clone()),
            ..GenerateOptions::default()
        };
        let before = counters(engine);
        runs.push(generate_ids(engine, &prompt, &options).await?);
        masked = counters(engine).zip(before).map(|(a, b)| a - b);
    }
    // (rounds with masks, those the GPU waited for)
    let waits = masked.map(|d| (d.mask_rounds, d.mask_waits));
    let (ids, with) = &runs[1];
    let (mut mask, mut times, mut allowed) = (Vec::new(), Vec::new(), 0usize);
    for &id in ids {
        let t = std::time::Instant::now();
        constraint.fill_mask(&mut mask)?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        allowed += constraint.allowed();
        constraint.accept(id)?;
    }
    let n = times.len().max(1) as f64;
    let mean = times.iter().sum::<f64>() / n;
    let max = times.iter().copied().fold(0.0, f64::max);
    let free = &runs[0].1;
    if args.json {
        let line = serde_json::json!({
            "json_schema": path.display().to_string(),
            "compile_ms": compile_ms,
            "masks": times.len(),
            "mask_us_mean": mean,
            "mask_us_max": max,
            "allowed_mean": allowed as f64 / n,
            "constrained_decode_tok_s": with.decode_tok_s,
            "free_decode_tok_s": free.decode_tok_s,
            "mask_rounds": waits.map(|w| w.0),
            "gpu_waited_for_masks": waits.map(|w| w.1),
        });
        println!("{line}");
    } else {
        let waited = match waits {
            Some((rounds, waits)) => format!("the GPU waited for {waits} of {rounds} masks"),
            None => "masked on the CPU backend".into(),
        };
        println!(
            "json schema {}: compiled in {compile_ms:.1} ms (the model's first: with its vocabulary's trie); {} masks, {mean:.0} us mean, {max:.0} us max, {:.0} tokens allowed on average; decode {:.2} tok/s constrained, {:.2} free; {waited}",
            path.display(),
            times.len(),
            allowed as f64 / n,
            with.decode_tok_s,
            free.decode_tok_s
        );
    }
    Ok(())
}

/// `--speculate`'s drafter: lookup, layers:L, or draft:PATH (a separate draft model).
fn drafter(spec: &str) -> Result<Drafter, Error> {
    match spec.strip_prefix("draft:") {
        Some(_) => Ok(Drafter::Model),
        None => spec.parse(),
    }
}

/// With `--speculate draft:PATH`: loads that model (on the engine's backend, at the same
/// `--context-length`) as the engine's draft model, refused unless it has the same tokenizer.
async fn attach_draft(engine: &mut Engine, spec: &str, model: &ModelArgs) -> Result<(), Error> {
    let Some(path) = spec.strip_prefix("draft:") else { return Ok(()) };
    let args = ModelArgs {
        model: Some(PathBuf::from(path)),
        backend: Some(if engine.gpu_model().is_some() { Backend::Gpu } else { Backend::Cpu }),
        context_length: model.context_length,
        kv_pool_tokens: model.kv_pool_tokens,
    };
    let draft = load(&args, None).await?;
    engine.set_draft_model(draft)
}

/// A repetitive prompt (code), where prompt lookup should pay.
const BENCH_CODE: &str = "Rewrite this function with a loop:\n\ndef total(prices):\n    result = 0\n    result = result + prices[0]\n    result = result + prices[1]\n    result = result + prices[2]\n    result = result + prices[3]\n    return result\n\ndef total(prices):\n";

/// `bench --speculate`: each prompt without and with speculation, greedy, the same tokens
/// (checked: speculation never changes greedy output).
async fn bench_speculation(engine: &mut Engine, args: &BenchArgs, spec: Speculation) -> Result<(), Error> {
    let prompts = [
        ("prose", Prompt::Text(BENCH_TEXT[..120].to_string())),
        ("chat", Prompt::Chat(vec![Message::new("user", "What is the capital of France?")])),
        ("code", Prompt::Text(BENCH_CODE.to_string())),
    ];
    if !args.json {
        println!("speculative decoding ({spec:?}, {} tokens each, greedy):", args.gen_tokens);
        println!(
            "{:>6} {:>14} {:>14} {:>10} {:>12} {:>10}",
            "prompt", "plain tok/s", "spec tok/s", "speedup", "tokens/pass", "accepted"
        );
    }
    for (name, prompt) in prompts {
        let mut runs = Vec::new();
        for speculate in [None, Some(spec)] {
            let options = GenerateOptions {
                max_tokens: args.gen_tokens,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                speculate,
                ..GenerateOptions::default()
            };
            // Each run from an empty cache.
            engine
                .generate(
                    &Prompt::Tokens(vec![0]),
                    &GenerateOptions { max_tokens: 1, ..GenerateOptions::default() },
                    &mut |_| true,
                )
                .await?;
            runs.push(generate_ids(engine, &prompt, &options).await?);
        }
        let [(plain_ids, plain), (spec_ids, with)] = &runs[..] else { unreachable!("two runs") };
        if plain_ids != spec_ids {
            return Err(Error::InvalidOption {
                name: "speculate",
                value: format!("{spec:?}"),
                expected: format!("the same greedy tokens: they differ on the {name} prompt (a bug: please report it)"),
            });
        }
        let sp = with.speculation.unwrap_or_default();
        let per_pass = with.generated_tokens.saturating_sub(1) as f64 / sp.passes.max(1) as f64;
        let rate = sp.accepted as f64 / sp.drafted.max(1) as f64;
        if args.json {
            let line = serde_json::json!({
                "speculate": format!("{spec:?}"),
                "prompt": name,
                "plain_decode_tok_s": plain.decode_tok_s,
                "speculative_decode_tok_s": with.decode_tok_s,
                "tokens_per_pass": per_pass,
                "acceptance_rate": rate,
                "speculation": sp,
            });
            println!("{line}");
        } else {
            println!(
                "{name:>6} {:>14.2} {:>14.2} {:>9.2}x {per_pass:>12.2} {:>9.0}%",
                plain.decode_tok_s,
                with.decode_tok_s,
                with.decode_tok_s / plain.decode_tok_s.max(1e-9),
                100.0 * rate
            );
        }
    }
    Ok(())
}

/// `bench --batch`: B prompts (each its own first token, so nothing is shared) decoded together
/// by the batcher the server runs; decode is timed from the step after every sequence has its
/// first token, so their prefill is left out (a `--join` request's is in). Per step: the GPU
/// submissions and the bytes read back (over every step timed, and over the rows' steps).
async fn bench_batch(
    engine: &mut Engine,
    args: &BenchArgs,
    options: &GenerateOptions,
    all_tokens: &[u32],
) -> Result<(), Error> {
    use webgpu_llm::batcher::{BatchEvent, Batcher};
    let prompt_tokens = args.prompt_tokens.min(all_tokens.len());
    let vocab = engine.config.vocab_size as u32;
    let mut single = None;
    let p = &options.sampling;
    let sampler = if p.is_greedy() {
        "greedy".to_string()
    } else {
        format!(
            "temperature {}, top-k {}, top-p {}, min-p {}, penalties {}/{}/{}",
            p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        )
    };
    if !args.json {
        println!("batched decode ({prompt_tokens}-token prompts, {} tokens each, {sampler}):", args.gen_tokens);
        println!(
            "{:>6} {:>18} {:>20} {:>8} {:>12} {:>14} {:>14}",
            "batch",
            "aggregate tok/s",
            "per-sequence tok/s",
            "vs one",
            "submissions",
            "read back/step",
            "read back/row"
        );
    }
    let counters = |e: &Engine| e.gpu_model().map(|m| m.gpu.counters()).unwrap_or_default();
    for &b in &args.batch {
        let mut batcher = Batcher::new(engine, usize::MAX);
        batcher.limit_rows(b + args.join.is_some() as usize);
        if let Some(on) = args.pipeline {
            batcher.set_pipelining(on);
        }
        let prompt_of = |i: usize| {
            let mut tokens = all_tokens[..prompt_tokens].to_vec();
            tokens[0] = (tokens[0] + 2 + i as u32) % vocab;
            Prompt::Tokens(tokens)
        };
        let mut ids = Vec::with_capacity(b);
        for i in 0..b {
            ids.push(batcher.enqueue(Batcher::prepare(engine, &prompt_of(i), options)?));
        }
        let join = match args.join {
            Some(n) => {
                let tokens: Vec<u32> = all_tokens.iter().cycle().take(n).map(|&t| (t + 1) % vocab).collect();
                let options = GenerateOptions { max_tokens: 1, ..options.clone() };
                Some(Batcher::prepare(engine, &Prompt::Tokens(tokens), &options)?)
            }
            None => None,
        };
        let mut join = join.map(|p| (args.gen_tokens / 2, p));
        let (mut first, mut decoded, mut failed) = (vec![false; b], 0usize, None);
        let (mut started, mut steps, mut rows, mut since) = (None, 0usize, 0usize, counters(engine));
        let mut most_submissions = 0;
        while !batcher.is_empty() {
            if join.as_ref().is_some_and(|j| started.is_some() && steps == j.0) {
                batcher.enqueue(join.take().expect("checked").1);
            }
            let timed = started.is_some();
            let before = counters(engine).submissions;
            let ran = batcher
                .step(engine, &mut |_| true, &mut |id, event| {
                    match (event, ids.iter().position(|&r| r == id)) {
                        (BatchEvent::Token(_), Some(i)) => {
                            if first[i] {
                                decoded += 1;
                            } else {
                                first[i] = true;
                            }
                        }
                        (BatchEvent::Failed(e), _) => failed = Some(e),
                        _ => {}
                    }
                    true
                })
                .await?;
            if let Some(e) = failed.take() {
                batcher.clear(engine);
                return Err(e);
            }
            if timed {
                steps += 1;
                rows += ran;
                most_submissions = most_submissions.max(counters(engine).submissions - before);
            } else if first.iter().all(|&f| f) {
                started = Some(std::time::Instant::now());
                since = counters(engine);
            }
        }
        batcher.clear(engine);
        let secs = started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let spent = counters(engine) - since;
        let per_step = |v: u64| v as f64 / steps.max(1) as f64;
        let (submissions, read_back) = (per_step(spent.submissions), per_step(spent.bytes_read_back));
        let per_row = spent.bytes_read_back as f64 / rows.max(1) as f64;
        let aggregate = decoded as f64 / secs.max(1e-9);
        let base = *single.get_or_insert(aggregate / b as f64);
        if args.json {
            let line = serde_json::json!({
                "batch": b,
                "join": args.join,
                "sampler": sampler,
                "aggregate_decode_tok_s": aggregate,
                "per_sequence_decode_tok_s": aggregate / b as f64,
                "prompt_tokens": prompt_tokens,
                "gen_tokens": args.gen_tokens,
                "steps": steps,
                "submissions_per_step": submissions,
                "max_submissions_per_step": most_submissions,
                "readback_bytes_per_step": read_back,
                "readback_bytes_per_row": per_row,
                // Tokens the GPU's draw left to the host (top-p past its selection) and the
                // steps run again for them.
                "redraws": spent.redraws,
                "reruns": spent.reruns,
            });
            println!("{line}");
        } else {
            println!(
                "{b:>6} {aggregate:>18.2} {:>20.2} {:>7.2}x {submissions:>12.2} {read_back:>14.0} {per_row:>14.0}",
                aggregate / b as f64,
                aggregate / base
            );
        }
    }
    Ok(())
}

/// The decode gemv's SPIR-V instructions per weight byte for each block type the GPU reads
/// (`gpu::spirv`: a GPU's kernel, whatever adapter this run has), by type name; with `int8`,
/// the int8-activation kernel's, for the types it takes.
fn gemv_instruction_counts(int8: bool) -> serde_json::Value {
    let counts = webgpu_llm::quant::FORMATS.iter().filter_map(|f| {
        let n = webgpu_llm::gpu::spirv::gemv_instructions_per_weight_byte(f, int8).ok()?;
        Some((f.ty.name().to_string(), serde_json::json!((n * 100.0).round() / 100.0)))
    });
    serde_json::Value::Object(counts.collect())
}

/// One benchmark run's figures; the traffic ledger is taken at the middle of the decode steps
/// (it grows with the keys attended).
struct BenchReport {
    adapter: String,
    context: usize,
    prefill_tok_s: f64,
    ttft_ms: f64,
    decode_tok_s: f64,
    decode_steps: usize,
    gpu: Option<GpuFigures>,
}

struct GpuFigures {
    dispatches: usize,
    submissions: f64,
    host_ms: f64,
    buffers: f64,
    bind_groups: f64,
    pipelines: f64,
    bytes_read_back: f64,
    ledger: webgpu_llm::gpu::kernels::Ledger,
    min: webgpu_llm::gpu::kernels::Ledger,
    /// The pool's KV cache and a hybrid's recurrent state, bytes.
    cache_bytes: (u64, u64),
}

impl BenchReport {
    fn new(engine: &Engine, s: &Stats, context: usize, gen_tokens: usize) -> Self {
        let gpu = s.decode_counters.zip(engine.gpu_model()).map(|(c, m)| {
            let steps = s.decode_steps.max(1) as f64;
            let seq = s.prompt_tokens + gen_tokens / 2;
            GpuFigures {
                dispatches: m.decode_dispatches(seq),
                submissions: c.submissions as f64 / steps,
                host_ms: c.host_ns as f64 / steps / 1e6,
                buffers: c.buffers as f64 / steps,
                bind_groups: c.bind_groups as f64 / steps,
                pipelines: c.pipelines as f64 / steps,
                bytes_read_back: c.bytes_read_back as f64 / steps,
                ledger: m.decode_traffic(seq),
                min: m.min_decode_traffic(seq),
                cache_bytes: m.cache_bytes(),
            }
        });
        Self {
            adapter: engine.backend_description(),
            context,
            prefill_tok_s: s.prefill_tok_s,
            ttft_ms: s.ttft_ms,
            decode_tok_s: s.decode_tok_s,
            decode_steps: s.decode_steps,
            gpu,
        }
    }

    fn json(&self) -> serde_json::Value {
        let ledger = |l: &webgpu_llm::gpu::kernels::Ledger| {
            serde_json::json!({
                "weights": l.weights, "activations": l.activations, "kv_read": l.kv_read, "kv_written": l.kv_written,
            })
        };
        let g = self.gpu.as_ref();
        serde_json::json!({
            "adapter": self.adapter,
            "context": self.context,
            "prefill_tok_s": self.prefill_tok_s,
            "ttft_ms": self.ttft_ms,
            "decode_tok_s": self.decode_tok_s,
            "decode_steps": self.decode_steps,
            "dispatches_per_token": g.map(|g| g.dispatches),
            "submissions_per_token": g.map(|g| g.submissions),
            "submissions_per_step": g.map(|g| g.submissions),
            "readback_bytes_per_step": g.map(|g| g.bytes_read_back),
            "host_ms_per_token": g.map(|g| g.host_ms),
            "ledger_bytes_per_token": g.map(|g| g.ledger.total()),
            "min_bytes_per_token": g.map(|g| g.min.total()),
            "ledger": g.map(|g| ledger(&g.ledger)),
            "min": g.map(|g| ledger(&g.min)),
            "decode_gb_s": g.map(|g| g.ledger.total() as f64 * self.decode_tok_s / 1e9),
            "kv_cache_bytes": g.map(|g| g.cache_bytes.0),
            "state_bytes": g.map(|g| g.cache_bytes.1),
            "gemv_instructions_per_weight_byte": gemv_instruction_counts(false),
            "gemv_int8_instructions_per_weight_byte": gemv_instruction_counts(true),
        })
    }

    fn print(&self, engine: &Engine, s: &Stats) {
        println!("backend:        {}", self.adapter);
        println!("model:          {} ({} layers)", engine.config.name, engine.config.n_layers);
        if let Some(m) = engine.gpu_model() {
            let pool = m.pool();
            println!(
                "KV pool:        {} blocks of {} tokens ({} free), up to {} sequences, {} per decode step",
                pool.blocks(),
                pool.block_tokens(),
                pool.free_blocks(),
                pool.max_seqs(),
                m.max_batch()
            );
            let (kv, state) = m.cache_bytes();
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!("cache memory:   KV {:.2} MiB, recurrent state {:.2} MiB", mib(kv), mib(state));
        }
        println!("prompt tokens:  {} (prefilled {})", s.prompt_tokens, s.prefilled_tokens);
        println!("prefill:        {:.1} tok/s, TTFT {:.1} ms", self.prefill_tok_s, self.ttft_ms);
        println!(
            "decode:         {:.2} tok/s over {} steps, TPOT {:.2} ms",
            self.decode_tok_s,
            self.decode_steps,
            1e3 / self.decode_tok_s.max(1e-9)
        );
        if let Some(g) = &self.gpu {
            println!(
                "per decode step: {} dispatches, {:.2} submissions, host {:.3} ms to encode and submit, {:.2} buffers created, {:.2} bind groups created, {:.2} pipelines created, {:.0} bytes read back",
                g.dispatches, g.submissions, g.host_ms, g.buffers, g.bind_groups, g.pipelines, g.bytes_read_back
            );
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            let (l, m) = (&g.ledger, &g.min);
            println!(
                "traffic ledger: {:.2} MiB per token (weights {:.2}, KV read {:.2}, KV written {:.3}, activations {:.3}); the least possible {:.2} MiB (weights {:.2}, KV read {:.2}); {:.3}x; {:.2} GB/s at this decode speed",
                mib(l.total()),
                mib(l.weights),
                mib(l.kv_read),
                mib(l.kv_written),
                mib(l.activations),
                mib(m.total()),
                mib(m.weights),
                mib(m.kv_read),
                l.total() as f64 / m.total().max(1) as f64,
                l.total() as f64 * self.decode_tok_s / 1e9
            );
            for (int8, what) in [(false, ""), (true, ", int8 activations")] {
                let counts = gemv_instruction_counts(int8);
                let counts: Vec<String> =
                    counts.as_object().into_iter().flatten().map(|(ty, n)| format!("{ty} {n}")).collect();
                println!("gemv SPIR-V instructions per weight byte (a GPU's kernel{what}): {}", counts.join(", "));
            }
        }
    }
}
