//! Generates the lock.v1 and admin.v1 code into OUT_DIR (needs `protoc`,
//! which `scripts/setup` installs from Debian's protobuf-compiler).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "latchkey/lock/v1/lock.proto",
        "latchkey/admin/v1/admin.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&protos, &["."])?;
    Ok(())
}
