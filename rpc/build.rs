//! Compiles the test-only `.proto` files under `tests/proto/` so that the
//! integration tests exercise the code generator end to end on a service
//! other than the parameter server.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=tests/proto");
    tessera_rpc_build::compile_protos(
        &[
            "tests/proto/echo.proto",
            "tests/proto/collide.proto",
            "tests/proto/legacy.proto",
        ],
        &["tests/proto"],
    )?;
    Ok(())
}
