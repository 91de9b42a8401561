//! Links the cdylib as NCCL EP's library is linked: SONAME `libnccl_ep.so.0`, and only the
//! C API's symbols exported (the version script lists them; Rust's own stay local).

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let script = format!("{dir}/exports.map");
    println!("cargo:rerun-if-changed=exports.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl_ep.so.0");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={script}");
}
