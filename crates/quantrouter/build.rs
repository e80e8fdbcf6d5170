//! Compiles KEDA's external scaler interface (`proto/externalscaler.proto`) into Rust with
//! protox, a protobuf compiler written in Rust, so a fresh clone builds with cargo alone
//! (no `protoc` on the machine, the same output everywhere).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/externalscaler.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"])?;
    tonic_prost_build::configure()
        // The server for KEDA and a client for the tests; no transport (the router serves
        // gRPC on its own hyper stack).
        .build_server(true)
        .build_client(true)
        .build_transport(false)
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors)?;
    Ok(())
}
