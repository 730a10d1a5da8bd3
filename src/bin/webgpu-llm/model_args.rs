//! The model flags every command shares (`--model`, `--backend`, `--context-length`) and
//! loading the model they name: the default model's path, split files, the progress line, the
//! CPU backend when no GPU adapter exists.

use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use webgpu_llm::engine::{BackendKind, Engine, LoadOptions};
use webgpu_llm::gguf::{ByteSource, FileSource, SplitSource};
use webgpu_llm::gpu::GpuOptions;
use webgpu_llm::Error;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// GGUF model file [default: the default model fetched by scripts/fetch-model]
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Where the model runs [default: gpu when an adapter exists, else cpu]
    #[arg(long, value_enum)]
    pub(crate) backend: Option<Backend>,
    /// Tokens the KV cache holds (with `serve`: all streams together) [default: min(model
    /// context, 4096)]
    #[arg(long, value_parser = at_least_one)]
    pub(crate) context_length: Option<usize>,
    /// Tokens the KV pool holds, every sequence together (a server's streams; the prefix
    /// cache keeps what they leave in it) [default: the context length]
    #[arg(long, value_parser = at_least_one)]
    pub(crate) kv_pool_tokens: Option<usize>,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Backend {
    Cpu,
    Gpu,
}

/// A count flag: a whole number of at least 1.
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e} (a whole number of at least 1)")),
    }
}

/// The progress line (`loading weights: 42%`) is open: a message must end it first.
pub(crate) static PROGRESS_OPEN: AtomicBool = AtomicBool::new(false);

pub(crate) fn end_progress_line() {
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

/// Loads the model; without --backend, the GPU when an adapter exists, else the CPU. `rows`:
/// the decode rows a step should take at most (`GpuOptions::max_batch`; None: the default).
pub(crate) async fn load(args: &ModelArgs, rows: Option<usize>) -> Result<Engine, Error> {
    let path = model_path(args.model.clone());
    eprintln!("loading {}", path.display());
    // Read in ranges: the header, then each tensor in pieces into GPU memory.
    let file = SplitSource::new(split_parts(&path).iter().map(|p| FileSource::open(p)).collect::<Result<_, _>>()?);
    load_from(&file, args, rows).await
}

pub(crate) async fn load_from(
    file: &(impl ByteSource + ?Sized),
    args: &ModelArgs,
    rows: Option<usize>,
) -> Result<Engine, Error> {
    let start = std::time::Instant::now();
    let mut progress = |done: usize, total: usize| {
        PROGRESS_OPEN.store(true, Ordering::SeqCst);
        eprint!("\rloading weights: {}%", done * 100 / total.max(1));
    };
    let gpu = GpuOptions { max_batch: rows, kv_tokens: args.kv_pool_tokens, ..GpuOptions::from_env() };
    let options = |backend| LoadOptions { backend, context_length: args.context_length, gpu };
    let engine = match args.backend {
        Some(Backend::Cpu) => Engine::load_from(file, options(BackendKind::Cpu), &mut progress).await?,
        Some(Backend::Gpu) => Engine::load_from(file, options(BackendKind::Gpu), &mut progress).await?,
        None => match Engine::load_from(file, options(BackendKind::Gpu), &mut progress).await {
            Err(Error::NoAdapter(why)) => {
                end_progress_line();
                eprintln!("no GPU adapter ({why}); using the CPU backend");
                Engine::load_from(file, options(BackendKind::Cpu), &mut progress).await?
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
