//! Generates the parameter-server messages, Tessera stubs and the gRPC
//! endpoint from `ps.proto` (with the `stubs` feature, the default).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=ps.proto");
    // The gRPC endpoint too: standard gRPC clients (grpcurl, grpcio) can
    // call a ps-server with nothing but `ps.proto`.
    #[cfg(feature = "stubs")]
    tessera_rpc_build::Builder::new()
        .grpc(true)
        .compile(&["ps.proto"], &["."])?;
    Ok(())
}
