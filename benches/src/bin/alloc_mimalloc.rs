//! Child process of `tessera-bench alloc` whose global allocator is
//! mimalloc: runs one workload through `Vec<u8>` and prints its row as JSON.

use std::process::ExitCode;

use tessera_benches::alloc::{GlobalAllocator, parse_child_args, run};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse_child_args(&args) {
        Ok((workload, threads, ops)) => {
            let row = run(GlobalAllocator, "mimalloc", workload, threads, ops);
            match serde_json::to_string(&row) {
                Ok(json) => {
                    println!("{json}");
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("{err}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(err) => {
            eprintln!("alloc-mimalloc: {err}");
            ExitCode::FAILURE
        }
    }
}
