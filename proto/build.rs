//! Generates the parameter-server messages and stubs from `ps.proto`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=ps.proto");
    tessera_rpc_build::compile_protos(&["ps.proto"], &["."])?;
    Ok(())
}
