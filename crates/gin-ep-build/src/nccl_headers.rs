//! Where NCCL's header sets are found, for gin-ep-sys's layout probe and the kernel sets of
//! gin-ep and gin-ep-lab ([`crate::kernels`]), so that every build picks the same headers for a
//! minor. Never: prints cargo directives or fails the build (the callers decide).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// `NCCL_INCLUDE_2_29` for "2.29": the variable naming that minor's header set.
pub fn include_var(label: &str) -> String {
    format!("NCCL_INCLUDE_{}", label.replace('.', "_"))
}

/// "2.29" for 22907.
pub fn minor_label(code: u32) -> String {
    format!("{}.{}", code / 10000, code / 100 % 100)
}

/// `#define NCCL_VERSION_CODE 22809` from nccl.h.
pub fn nccl_version_code(header: &Path) -> Option<u32> {
    let text = fs::read_to_string(header).ok()?;
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("#define"), Some("NCCL_VERSION_CODE"), Some(v)) => v.parse().ok(),
            _ => None,
        }
    })
}

/// `<workspace>/.cuda/lib/python3.*/site-packages`, whatever the Python minor version.
pub fn venv_site_packages(workspace: &Path) -> impl Iterator<Item = PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(workspace.join(".cuda/lib"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs.into_iter()
}

/// The header set of NCCL `label` ("2.29"), in order: `$NCCL_INCLUDE_2_29`, `$NCCL_INCLUDE`,
/// the `.cuda/nccl-2.29.*/include` that scripts/setup-cuda extracts (newest patch first),
/// `beside_nvcc`, the `.cuda` venv's nvidia/nccl/include, `cuda_home`, /usr/include; the
/// first with nccl_device.h and a nccl.h of that minor. gin-ep passes the NCCL wheel beside
/// a PyPI nvcc and $CUDA_HOME/include; gin-ep-sys's probe has no nvcc and passes neither.
pub fn find_nccl_include(
    workspace: &Path,
    label: &str,
    beside_nvcc: Option<PathBuf>,
    cuda_home: Option<PathBuf>,
) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os(include_var(label)) {
        candidates.push(PathBuf::from(p));
    }
    if let Some(p) = env::var_os("NCCL_INCLUDE") {
        candidates.push(PathBuf::from(p));
    }
    let mut extracted: Vec<PathBuf> = fs::read_dir(workspace.join(".cuda"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("nccl-{label}."))
        })
        .map(|e| e.path().join("include"))
        .collect();
    extracted.sort();
    candidates.extend(extracted.into_iter().rev());
    candidates.extend(beside_nvcc);
    candidates.extend(venv_site_packages(workspace).map(|sp| sp.join("nvidia/nccl/include")));
    candidates.extend(cuda_home);
    candidates.push(PathBuf::from("/usr/include"));
    candidates.into_iter().find(|d| {
        d.join("nccl_device.h").is_file()
            && nccl_version_code(&d.join("nccl.h")).is_some_and(|v| minor_label(v) == label)
    })
}
