//! Child process of `tessera-bench alloc` whose global allocator is
//! mimalloc: runs one workload through `Vec<u8>` and prints its row as JSON.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    tessera_benches::alloc::global_allocator_child("mimalloc")
}
