//! One crate's kernels as one fatbin per supported NCCL minor release (2.28 to 2.32), each
//! compiled against that version's headers: nvcc and header discovery, the nvcc command lines
//! (run concurrently), the ptxas spill check, and the generated `OUT_DIR/kernels_meta.rs`.
//!
//! Why one fatbin per NCCL minor: kernels take `ncclDevComm` by value and inline NCCL's
//! Device API, whose layout changes between minors; the runtime picks the fatbin whose
//! major.minor matches `ncclGetVersion` of the library it loads (gin-ep's backend/cuda/mod.rs).
//!
//! Outputs in `OUT_DIR`, per [`KernelBuild`] with file prefix `P`:
//! - `P_2_XX.fatbin` for each set built, from the unity file `P_kernels.cu`;
//! - `kernels_meta.rs`, always: `KERNEL_SETS`, one `KernelSet` (gin-ep's
//!   `backend::cuda::kernels::KernelSet`, which the including module names) per supported minor,
//!   with the fatbin or why it is absent, plus `NVCC_VERSION` and `KERNEL_TARGETS`;
//! - `ptxas.txt`, the resource report of every kernel of every set built (and `ptxas_2_XX.txt`
//!   per set).

use std::env;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::fail;
use crate::nccl_headers::{self, include_var, nccl_version_code, venv_site_packages};

/// Architectures with SASS in the fatbin. sm_90 is the floor (the Device API's LSA path
/// needs Hopper's multimem/fence semantics and we tune for H200); sm_100 is added when
/// nvcc knows it so Blackwell does not fall back to JIT from PTX.
const SASS_ARCHS: &[&str] = &["90", "100"];
/// PTX kept in the fatbin so a newer GPU can JIT; compute_90 is the oldest we support.
const PTX_ARCH: &str = "90";
/// The NCCL minor releases the kernels are built for, oldest first: one header set each
/// (scripts/setup-cuda's venv has 2.28.9, its `.cuda/nccl-2.29.7` ... `.cuda/nccl-2.32.3` the
/// others). gin-ep-sys mirrors the same versions (`DevAbi`); gin-ep's kernels.rs tests they
/// agree.
pub const SUPPORTED_NCCL: &[&str] = &["2.28", "2.29", "2.30", "2.31", "2.32"];

/// What one crate compiles.
#[derive(Clone, Debug)]
pub struct KernelBuild<'a> {
    /// The crate, for messages and warnings ("gin-ep").
    pub crate_name: &'a str,
    pub workspace: &'a Path,
    pub out_dir: &'a Path,
    /// Output file names start with it: `gin_ep` gives `gin_ep_2_28.fatbin`.
    pub prefix: &'a str,
    /// `-I` directories, searched in this order; each is also a rerun trigger.
    pub include_dirs: Vec<PathBuf>,
    /// The `.cu` files of the unity build, included in this order.
    pub units: Vec<PathBuf>,
    /// Lines at the head of the unity file (`#define`s the units read).
    pub prelude: String,
    /// ABI headers included after the units (paths under an include dir), followed by the
    /// generated `abi_checks.h` ([`crate::generate_abi`]), so nvcc checks every layout the
    /// Rust side was generated with.
    pub abi_headers: Vec<String>,
    /// The cfg set when no set was built (`gin_ep_no_kernels`): `kernels_meta.rs` embeds
    /// no fatbin under it.
    pub no_kernels_cfg: &'a str,
}

/// Every `.cu` under `dir`, recursively, sorted.
pub fn collect_units(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    collect_into(dir, &mut out);
    out.sort();
    out
}

fn collect_into(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_into(&path, out);
        } else if path.extension().is_some_and(|e| e == "cu") {
            out.push(path);
        }
    }
}

/// Builds every set it can and writes `kernels_meta.rs`, printing the cargo directives
/// (rerun triggers, the no-kernels cfg, a warning per set not built). Ends the build when a
/// compile fails or spills, and when `GIN_EP_REQUIRE_KERNELS=1` and some set was not built.
pub fn build_kernel_sets(b: &KernelBuild<'_>) {
    println!("cargo:rustc-check-cfg=cfg({})", b.no_kernels_cfg);
    for dir in &b.include_dirs {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    // setup-cuda rewrites its stamp when it (re)installs the toolchain or a header set.
    println!(
        "cargo:rerun-if-changed={}",
        b.workspace.join(".cuda/.pins").display()
    );
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "NCCL_INCLUDE",
        "GIN_EP_REQUIRE_KERNELS",
        "GIN_EP_NVCC_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for label in SUPPORTED_NCCL {
        println!("cargo:rerun-if-env-changed={}", include_var(label));
    }
    let require = env::var("GIN_EP_REQUIRE_KERNELS").is_ok_and(|v| v == "1");

    let mut meta = Meta {
        sets: SUPPORTED_NCCL
            .iter()
            .map(|label| SetMeta {
                label,
                ..SetMeta::default()
            })
            .collect(),
        ..Meta::default()
    };
    if let Err(why) = build(b, &mut meta) {
        for set in &mut meta.sets {
            set.absent_reason = Some(why.clone());
        }
    }
    let absent: Vec<String> = meta
        .sets
        .iter()
        .filter_map(|s| Some(format!("NCCL {}: {}", s.label, s.absent_reason.as_ref()?)))
        .collect();
    if !absent.is_empty() {
        if require {
            // A CI box that sets GIN_EP_REQUIRE_KERNELS must never ship a library that
            // silently lacks kernels for a supported NCCL.
            fail(&format!(
                "{}: GIN_EP_REQUIRE_KERNELS=1 and kernels were not built for every supported NCCL:\n  {}",
                b.crate_name,
                absent.join("\n  ")
            ));
        }
        for line in &absent {
            println!(
                "cargo:warning={}: CUDA kernels not built for {line}; that NCCL will be refused at run time",
                b.crate_name
            );
        }
    }
    if meta.sets.iter().all(|s| s.absent_reason.is_some()) {
        println!("cargo:rustc-cfg={}", b.no_kernels_cfg);
    }
    fs::write(b.out_dir.join("kernels_meta.rs"), meta.render(b)).expect("OUT_DIR is writable");
}

#[derive(Default)]
struct Meta {
    nvcc_version: Option<String>,
    archs: Vec<String>,
    sets: Vec<SetMeta>,
}

/// One supported NCCL minor's kernels.
#[derive(Default)]
struct SetMeta {
    label: &'static str,
    nccl_header_version: Option<u32>,
    nvcc_command: Option<String>,
    /// File name in OUT_DIR, when built.
    fatbin: Option<String>,
    absent_reason: Option<String>,
}

impl Meta {
    fn render(&self, b: &KernelBuild<'_>) -> String {
        let opt_str = |s: &Option<String>| match s {
            Some(s) => format!("Some({s:?})"),
            None => "None".to_string(),
        };
        let cfg = b.no_kernels_cfg;
        let mut out = format!(
            "// @generated by crates/gin-ep-build for {}; do not edit.\n",
            b.crate_name
        );
        let _ = writeln!(
            out,
            "/// 64-byte alignment for the embedded images: `include_bytes!` gives alignment 1,\n\
             /// and the CUDA driver reads the fatbin header with aligned loads.\n\
             #[cfg(not({cfg}))]\n\
             #[repr(C, align(64))]\n\
             struct Aligned<T: ?Sized>(T);"
        );
        let _ = writeln!(
            out,
            "/// `nvcc --version` release line of the compiler that built the fatbins.\n\
             pub const NVCC_VERSION: Option<&str> = {};",
            opt_str(&self.nvcc_version)
        );
        let _ = writeln!(
            out,
            "/// Targets in every fatbin: `sm_XX` are SASS, `compute_XX` is PTX.\n\
             pub const KERNEL_TARGETS: &[&str] = &{:?};",
            self.archs
        );
        let mut entries = String::new();
        for set in &self.sets {
            let fatbin = match &set.fatbin {
                Some(file) => {
                    let name = format!("FATBIN_{}", set.label.replace('.', "_"));
                    let _ = writeln!(
                        out,
                        "#[cfg(not({cfg}))]\n\
                         static {name}: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}\")));"
                    );
                    format!("Some(&{name}.0)")
                }
                None => "None".to_string(),
            };
            let _ = writeln!(
                entries,
                "    KernelSet {{\n        nccl: {:?},\n        nccl_header_version: {},\n        \
                 fatbin: {fatbin},\n        nvcc_command: {},\n        absent_reason: {},\n    }},",
                set.label,
                match set.nccl_header_version {
                    Some(v) => format!("Some({v})"),
                    None => "None".into(),
                },
                opt_str(&set.nvcc_command),
                opt_str(&set.absent_reason),
            );
        }
        let _ = writeln!(
            out,
            "/// One entry per supported NCCL minor, oldest first.\n\
             pub const KERNEL_SETS: &[KernelSet] = &[\n{entries}];"
        );
        out
    }
}

/// Builds every set it can. `Err` only for what stops all of them (no nvcc, no kernel
/// sources); a missing header set is recorded in that set's `absent_reason`.
fn build(b: &KernelBuild<'_>, meta: &mut Meta) -> Result<(), String> {
    let nvcc = find_nvcc(b.workspace).ok_or_else(|| {
        "no nvcc: set NVCC or CUDA_HOME, put nvcc on PATH, or run scripts/setup-cuda".to_string()
    })?;
    let version = run_capture(Command::new(&nvcc).arg("--version"))
        .map_err(|e| format!("{} --version failed: {e}", nvcc.display()))?;
    meta.nvcc_version = version
        .lines()
        .find(|l| l.contains("release"))
        .map(|l| l.trim().to_string());
    let known_archs = run_capture(Command::new(&nvcc).arg("--list-gpu-arch")).unwrap_or_default();

    if b.units.is_empty() {
        return Err(format!("{}: no kernel units (.cu) to build", b.crate_name));
    }
    // One translation unit that includes every kernel file: cuModuleLoadData takes one
    // image per architecture from a fatbin, so all of a crate's kernels live in one module,
    // and a unity build gets there without relocatable device code (which would cost inlining
    // across the fabric headers and registers).
    let mut unity = format!(
        "// @generated by crates/gin-ep-build for {}: every kernel unit in one module.\n",
        b.crate_name
    );
    unity.push_str(&b.prelude);
    for unit in &b.units {
        let _ = writeln!(unity, "#include \"{}\"", unit.display());
    }
    // Last: the layouts the Rust ABI was generated with, checked against the kernels' structs.
    for h in &b.abi_headers {
        let _ = writeln!(unity, "#include \"{h}\"");
    }
    let _ = writeln!(unity, "#include \"{}\"", b.out_dir.join("abi_checks.h").display());
    let unity_path = b.out_dir.join(format!("{}_kernels.cu", b.prefix));
    fs::write(&unity_path, unity).map_err(|e| format!("writing {}: {e}", unity_path.display()))?;

    let mut gencode = Vec::new();
    for arch in SASS_ARCHS {
        if known_archs
            .split_whitespace()
            .any(|a| a == format!("compute_{arch}"))
        {
            gencode.push(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
            meta.archs.push(format!("sm_{arch}"));
        }
    }
    if !meta.archs.iter().any(|a| a == "sm_90") {
        return Err(format!(
            "{} cannot target sm_90 (needs CUDA >= 12)",
            nvcc.display()
        ));
    }
    gencode.push(format!(
        "-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"
    ));
    meta.archs.push(format!("compute_{PTX_ARCH}"));

    // One nvcc per header set, `NUM_JOBS` (cargo's -j, the core count by default) at a time:
    // each nvcc runs its cicc/ptxas steps one after another, so concurrent sets are what uses
    // a second core.
    let jobs: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut queue: Vec<(usize, Command)> = Vec::new();
    for (i, set) in meta.sets.iter_mut().enumerate() {
        // The NCCL wheel beside a PyPI nvcc: site-packages/nvidia/{cu13/bin/nvcc,nccl/include}.
        let beside_nvcc = nvcc
            .parent()
            .and_then(Path::parent)
            .and_then(Path::parent)
            .map(|nvidia| nvidia.join("nccl/include"));
        let cuda_home = env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include"));
        let found = nccl_headers::find_nccl_include(b.workspace, set.label, beside_nvcc, cuda_home);
        let Some(nccl_include) = found else {
            set.absent_reason = Some(format!(
                "no NCCL {} headers (nccl.h + nccl_device.h of that minor): run scripts/setup-cuda or set {}",
                set.label,
                include_var(set.label)
            ));
            continue;
        };
        // Run time compares it with ncclGetVersion of the library it loads (the ncclDevComm
        // layout is version-specific).
        set.nccl_header_version = nccl_version_code(&nccl_include.join("nccl.h"));
        let suffix = set.label.replace('.', "_");
        let fatbin = format!("{}_{suffix}.fatbin", b.prefix);
        let mut cmd = Command::new(&nvcc);
        cmd.args(["--fatbin", "-O3", "-std=c++17", "-Xptxas", "-v"]);
        cmd.args(&gencode);
        for dir in &b.include_dirs {
            cmd.arg(format!("-I{}", dir.display()));
        }
        cmd.arg(format!("-I{}", nccl_include.display()));
        if let Ok(extra) = env::var("GIN_EP_NVCC_FLAGS") {
            cmd.args(extra.split_whitespace());
        }
        cmd.arg(&unity_path).arg("-o").arg(b.out_dir.join(&fatbin));
        set.nvcc_command = Some(render_command(&cmd));
        set.fatbin = Some(fatbin);
        queue.push((i, cmd));
    }

    let mut reports = String::new();
    let mut running: Vec<(usize, Child)> = Vec::new();
    let mut pending = queue.into_iter();
    let mut failure: Option<String> = None;
    loop {
        while failure.is_none() && running.len() < jobs {
            let Some((i, mut cmd)) = pending.next() else {
                break;
            };
            // ptxas -v reports on stderr, straight into the set's report file (a pipe would
            // stall a compile whose report outgrows it while another one is awaited).
            let suffix = meta.sets[i].label.replace('.', "_");
            let report_path = b.out_dir.join(format!("ptxas_{suffix}.txt"));
            let report_file = match fs::File::create(&report_path) {
                Ok(f) => f,
                Err(e) => {
                    failure = Some(format!("creating {}: {e}", report_path.display()));
                    continue;
                }
            };
            cmd.stdout(Stdio::null()).stderr(report_file);
            match cmd.spawn() {
                Ok(child) => running.push((i, child)),
                Err(e) => failure = Some(format!("running {}: {e}", nvcc.display())),
            }
        }
        if running.is_empty() {
            break;
        }
        if failure.is_some() {
            // Stop the other compiles rather than leave them running after the build ends.
            for (_, child) in &mut running {
                let _ = child.kill();
            }
        }
        // Wait for the oldest; the others keep running meanwhile.
        let (i, mut child) = running.remove(0);
        let Ok(status) = child.wait() else {
            failure.get_or_insert_with(|| format!("waiting for {}", nvcc.display()));
            continue;
        };
        if failure.is_some() {
            continue;
        }
        let set = &meta.sets[i];
        let suffix = set.label.replace('.', "_");
        let report_path = b.out_dir.join(format!("ptxas_{suffix}.txt"));
        let report = match fs::read(&report_path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => {
                failure = Some(format!("reading {}: {e}", report_path.display()));
                continue;
            }
        };
        if !status.success() {
            // A compile error is a bug in our kernels (or a version guard they lack), not a
            // missing toolchain: fail loudly even without GIN_EP_REQUIRE_KERNELS, or kernel
            // breakage would hide behind a warning.
            eprintln!("{report}");
            failure = Some(format!(
                "{}: nvcc failed with the NCCL {} headers ({}); command: {}",
                b.crate_name,
                set.label,
                status,
                set.nvcc_command.as_deref().unwrap_or_default()
            ));
            continue;
        }
        let spills = find_spills(&report);
        if !spills.is_empty() {
            // Spills on these kernels mean local-memory traffic in the copy loop, which costs
            // bandwidth we measure against; treat them as a build error so they are fixed at
            // once (reduce unrolling or vector width), not found later in a benchmark.
            failure = Some(format!(
                "{}: kernels spill registers with the NCCL {} headers (see {}):\n{}",
                b.crate_name,
                set.label,
                report_path.display(),
                spills.join("\n")
            ));
            continue;
        }
        let _ = writeln!(reports, "# kernels built against the NCCL {} headers", set.label);
        reports.push_str(&report);
    }
    if let Some(message) = failure {
        fail(&message);
    }
    fs::write(b.out_dir.join("ptxas.txt"), &reports).map_err(|e| format!("writing ptxas.txt: {e}"))?;
    Ok(())
}

/// nvcc in order: $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, then the project-local
/// toolchain that scripts/setup-cuda installs under `<workspace>/.cuda`.
fn find_nvcc(workspace: &Path) -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let p = PathBuf::from(home).join("bin/nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    // Only when the search reaches PATH does PATH decide the result, so only then is a
    // change of PATH a reason to rebuild.
    println!("cargo:rerun-if-env-changed=PATH");
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    venv_site_packages(workspace)
        .map(|sp| sp.join("nvidia/cu13/bin/nvcc"))
        .find(|p| p.is_file())
}

fn run_capture(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "exit {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn render_command(cmd: &Command) -> String {
    let mut parts: Vec<OsString> = vec![cmd.get_program().to_os_string()];
    parts.extend(cmd.get_args().map(|a| a.to_os_string()));
    parts
        .iter()
        .map(|p| p.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every function whose ptxas report has a non-zero spill store or load, named with its
/// architecture. ptxas prints, per function:
///   ptxas info    : Compiling entry function '_Z...' for 'sm_90'
///   ptxas info    : Function properties for _Z...
///       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
fn find_spills(report: &str) -> Vec<String> {
    let mut arch = String::new();
    let mut function = String::new();
    let mut spills = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut it = rest.split('\'');
            function = it.next().unwrap_or_default().to_string();
            arch = it.nth(1).unwrap_or_default().to_string();
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            function = rest.trim().to_string();
        } else if line.contains("bytes spill stores") {
            let stores = number_before(line, "bytes spill stores");
            let loads = number_before(line, "bytes spill loads");
            if stores != Some(0) || loads != Some(0) {
                spills.push(format!("  {function} ({arch}): {}", line.trim()));
            }
        }
    }
    spills
}

fn number_before(line: &str, label: &str) -> Option<u64> {
    let head = &line[..line.find(label)?];
    head.rsplit(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_are_found_per_function_and_architecture() {
        let report = "\
ptxas info    : Compiling entry function 'k_clean' for 'sm_90'
ptxas info    : Function properties for k_clean
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k_spills' for 'sm_100'
ptxas info    : Function properties for k_spills
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
";
        let spills = find_spills(report);
        assert_eq!(spills.len(), 1, "{spills:?}");
        assert!(spills[0].contains("k_spills (sm_100)"), "{}", spills[0]);
        assert!(find_spills("").is_empty());
    }

    #[test]
    fn units_are_every_cu_below_the_tree_sorted() {
        let dir = std::env::temp_dir().join(format!("gin-ep-build-units-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("b")).unwrap();
        for f in ["z.cu", "b/a.cu", "b/h.cuh", "note.md"] {
            fs::write(dir.join(f), "").unwrap();
        }
        let units = collect_units(&dir);
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(units, [dir.join("b/a.cu"), dir.join("z.cu")]);
    }

    #[test]
    fn the_meta_names_every_set_and_embeds_only_built_ones() {
        let b = KernelBuild {
            crate_name: "t",
            workspace: Path::new("/w"),
            out_dir: Path::new("/o"),
            prefix: "t",
            include_dirs: vec![],
            units: vec![],
            prelude: String::new(),
            abi_headers: vec![],
            no_kernels_cfg: "t_no_kernels",
        };
        let meta = Meta {
            nvcc_version: None,
            archs: vec!["sm_90".into()],
            sets: vec![
                SetMeta {
                    label: "2.28",
                    fatbin: Some("t_2_28.fatbin".into()),
                    ..SetMeta::default()
                },
                SetMeta {
                    label: "2.29",
                    absent_reason: Some("no headers".into()),
                    ..SetMeta::default()
                },
            ],
        };
        let text = meta.render(&b);
        assert!(
            text.contains("#[cfg(not(t_no_kernels))]\nstatic FATBIN_2_28"),
            "{text}"
        );
        assert!(text.contains("fatbin: Some(&FATBIN_2_28.0)"), "{text}");
        assert!(!text.contains("FATBIN_2_29"), "{text}");
        assert!(text.contains("absent_reason: Some(\"no headers\")"), "{text}");
    }
}
