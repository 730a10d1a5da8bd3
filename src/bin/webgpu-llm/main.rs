//! The native command-line tool `webgpu-llm`. It needs a native GPU API (or the CPU backend);
//! built for wasm32 (as `cargo test --target wasm32-unknown-unknown` does) it is an empty shell,
//! since browsers use the library through the npm package.

#[cfg(not(target_arch = "wasm32"))]
mod cli;
#[cfg(not(target_arch = "wasm32"))]
mod model_args;
#[cfg(not(target_arch = "wasm32"))]
mod serve;

/// jemalloc for Rust and, through its unprefixed `malloc`, for the GPU driver's C code too (a CPU
/// driver allocates a record per command it is given: a decode step's host time 0.79 -> 0.58 ms
/// on lavapipe; README, "Host time").
#[cfg(all(unix, not(target_arch = "wasm32")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(target_arch = "wasm32")]
fn main() {}
