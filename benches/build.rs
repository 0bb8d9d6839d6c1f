//! Generates the benchmark's echo service.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/bench.proto");
    tessera_rpc_build::compile_protos(&["proto/bench.proto"], &["proto"])?;
    Ok(())
}
