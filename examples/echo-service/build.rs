//! Generates the Echo service's client, server trait and dispatcher from
//! `proto/echo.proto` into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tessera_rpc_build::compile_protos(&["proto/echo.proto"], &["proto"])?;
    Ok(())
}
