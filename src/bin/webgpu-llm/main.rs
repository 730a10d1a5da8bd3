//! The native command-line tool `webgpu-llm`. It needs a native GPU API (or the CPU backend);
//! built for wasm32 (as `cargo test --target wasm32-unknown-unknown` does) it is an empty shell,
//! since browsers use the library through the npm package.

#[cfg(not(target_arch = "wasm32"))]
mod cli;
#[cfg(not(target_arch = "wasm32"))]
mod model_args;
#[cfg(not(target_arch = "wasm32"))]
mod serve;

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(target_arch = "wasm32")]
fn main() {}
