//! Generates the lock.v1 and admin.v1 code into OUT_DIR (needs `protoc`,
//! which `scripts/setup` installs from Debian's protobuf-compiler).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "latchkey/lock/v1/lock.proto",
        "latchkey/admin/v1/admin.proto",
        "latchkey/election/v1/election.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // The descriptors of both packages, for the arbiter's server reflection
    // (grpcurl and friends list and call its services without the protos).
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("latchkey.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(descriptors)
        .build_server(true)
        .build_client(true)
        .compile_protos(&protos, &["."])?;
    Ok(())
}
