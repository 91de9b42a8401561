//! The C ABI from outside: C and C++ programs compiled against `include/nccl_ep.h` with
//! `-Wall -Werror` (C also `-Wextra`) and linked to the built `libnccl_ep.so`, and the library's exported
//! symbols and SONAME. No GPU: the programs make only calls that fail on their arguments.

use std::path::{Path, PathBuf};
use std::process::Command;

/// NCCL EP's 18 functions and gin-ep's one documented extra.
const EXPORTS: [&str; 19] = [
    "ncclEpCombine",
    "ncclEpComplete",
    "ncclEpCreateGroup",
    "ncclEpCreateHandle",
    "ncclEpDispatch",
    "ncclEpErrorClear",
    "ncclEpGetAsyncError",
    "ncclEpGetLastError",
    "ncclEpGetVersion",
    "ncclEpGroupDestroy",
    "ncclEpHandleDestroy",
    "ncclEpHandleMemSize",
    "ncclEpInitHandle",
    "ncclEpMaskClean",
    "ncclEpMaskQuery",
    "ncclEpMaskUpdate",
    "ncclEpTensorAlloc",
    "ncclEpTensorDestroy",
    "ncclEpUpdateHandle",
];

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cdylib cargo built with this test: `<target>/<profile>/libnccl_ep.so` (the test runs
/// from `<target>/<profile>/deps`).
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir");
    for dir in [deps.parent().expect("profile dir"), deps] {
        let lib = dir.join("libnccl_ep.so");
        if lib.exists() {
            return lib;
        }
    }
    panic!("libnccl_ep.so not found next to {}", exe.display());
}

/// A directory holding the library under its SONAME, as an install would (one per test:
/// tests run in parallel).
fn lib_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-lib-{test}"));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libnccl_ep.so", "libnccl_ep.so.0"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(library(), &link).unwrap();
    }
    dir
}

fn tool(name: &str) -> bool {
    Command::new(name).arg("--version").output().is_ok()
}

fn compile_and_run(compiler: &str, flags: &[&str], source: &str, exe: &str) {
    if !tool(compiler) {
        eprintln!("SKIPPED: {compiler} is not installed; the {source} ABI test did not run");
        return;
    }
    let dir = lib_dir(exe);
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(exe);
    let c = crate_dir();
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg("-I")
        .arg(c.join("include"))
        .arg("-I")
        .arg(c.join("tests/c/stub"))
        .arg(c.join("tests/c").join(source))
        .arg("-L")
        .arg(&dir)
        .arg("-lnccl_ep")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .status()
        .expect("run the compiler");
    assert!(status.success(), "{compiler} failed on {source}");
    let run = Command::new(&out).output().expect("run the ABI test");
    let text = String::from_utf8_lossy(&run.stdout);
    println!("{text}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{source} failed:\n{text}");
}

#[test]
fn c_program_checks_sizes_and_failing_calls() {
    compile_and_run(
        "cc",
        &["-std=c11", "-Wall", "-Wextra", "-Werror"],
        "abi_test.c",
        "abi_test_c",
    );
}

#[test]
fn cpp_program_checks_sizes_and_failing_calls() {
    // -Wextra's missing-field-initializers fires on every designated _INIT macro in C++ (as
    // it does on NCCL EP's header): C++ callers build with -Wall.
    compile_and_run(
        "c++",
        &["-std=c++17", "-Wall", "-Werror"],
        "abi_test.cpp",
        "abi_test_cpp",
    );
}

/// The GPU programs (scripts/capi-gpu runs them) compile against the header here too, with
/// the stub toolkit headers: they cannot drift from the ABI unnoticed.
#[test]
fn gpu_programs_compile_against_the_header() {
    if !tool("cc") {
        eprintln!("SKIPPED: cc is not installed; the GPU programs were not compiled");
        return;
    }
    let c = crate_dir();
    let root = c.parent().and_then(Path::parent).expect("repository root");
    for src in [
        c.join("tests/gpu/ll_expert_major.c"),
        c.join("tests/gpu/ht_flat.c"),
        root.join("examples/c/ll_roundtrip.c"),
    ] {
        let status = Command::new("cc")
            .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
            .arg(c.join("include"))
            .arg("-I")
            .arg(c.join("tests/c/stub"))
            .arg(&src)
            .status()
            .expect("run the compiler");
        assert!(
            status.success(),
            "{} does not compile against the header",
            src.display()
        );
    }
}

#[test]
fn exports_exactly_the_api_and_the_soname() {
    if !tool("nm") || !tool("readelf") {
        eprintln!("SKIPPED: nm or readelf is not installed; the export and SONAME checks did not run");
        return;
    }
    let lib = library();
    let nm = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .unwrap();
    assert!(nm.status.success());
    let mut names: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    names.sort();
    assert_eq!(names, EXPORTS, "exported symbols of {}", lib.display());

    let re = Command::new("readelf").arg("-d").arg(&lib).output().unwrap();
    let text = String::from_utf8_lossy(&re.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("(SONAME)") && l.contains("[libnccl_ep.so.0]")),
        "SONAME of {}:\n{text}",
        lib.display()
    );
}

/// The one-GPU shim (scripts/capi-ep-test preloads it into NCCL EP's ep_test): a program
/// linked to a shared "libcudart" that asks for device 3 gets device 0, and without the
/// shim gets 3 (so the test can fail).
#[test]
fn one_gpu_shim_maps_every_device_to_zero() {
    if !tool("cc") {
        eprintln!("SKIPPED: cc is not installed; the shim was not built");
        return;
    }
    let c = crate_dir();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("one-gpu-shim");
    std::fs::create_dir_all(&dir).unwrap();
    // Inputs first: the linker resolves a library only for the objects before it.
    let cc = |args: &[&str], inputs: &[PathBuf]| {
        let status = Command::new("cc")
            .args(["-Wall", "-Wextra", "-Werror"])
            .args(inputs)
            .args(args)
            .current_dir(&dir)
            .status()
            .expect("run cc");
        assert!(status.success(), "cc {args:?} failed");
    };
    cc(
        &["-shared", "-fPIC", "-o", "libone_gpu_shim.so", "-ldl"],
        &[c.join("tests/gpu/one_gpu_shim.c")],
    );
    cc(
        &["-shared", "-fPIC", "-o", "libcudart.so"],
        &[c.join("tests/c/shim/fake_cudart.c")],
    );
    cc(
        &["-o", "picks_device", "-L.", "-lcudart", "-Wl,-rpath,$ORIGIN"],
        &[c.join("tests/c/shim/picks_device.c")],
    );
    let run = |preload: bool| {
        let mut cmd = Command::new(dir.join("picks_device"));
        if preload {
            cmd.env("LD_PRELOAD", dir.join("libone_gpu_shim.so"));
        }
        let out = cmd.output().expect("run picks_device");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    assert_eq!(run(true), (true, "device 0".to_string()));
    assert_eq!(run(false), (false, "device 3".to_string()));
}
