//! Compiles the gRPC interfaces the router serves into Rust with protox, a protobuf compiler
//! written in Rust, so a fresh clone builds with cargo alone (no `protoc` on the machine, the
//! same output everywhere): KEDA's external scaler (`proto/externalscaler.proto`) and Envoy's
//! external processing service, which the endpoint picker serves (`proto/envoy/`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: [&str; 2] = [
        "proto/externalscaler.proto",
        "proto/envoy/service/ext_proc/v3/external_processor.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        // Servers, and clients for the tests; no transport (the router serves gRPC on its
        // own hyper stack).
        .build_server(true)
        .build_client(true)
        .build_transport(false)
        // Bodies pass through the picker as `Bytes`, sliced and handed on without copies.
        .bytes(".envoy")
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors)?;
    Ok(())
}
