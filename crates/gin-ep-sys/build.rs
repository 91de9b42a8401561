//! Build script of gin-ep-sys: checks the Rust mirrors of NCCL's structs against nccl.h, once
//! per supported NCCL minor (2.28 to 2.32: the mirrors in src/dev_abi.rs).
//!
//! For each header set found, a small C++ probe is compiled against it and run; it prints
//! `const` assertions (size, alignment, every field offset) on that version's mirrors into
//! `OUT_DIR/layout_checks.rs`, which dev_abi.rs includes, so a struct that differs from its
//! version's headers is a compile error, not memory corruption inside a kernel launch.
//! Without headers or a C++ compiler a version gets no generated checks (dev_abi.rs's fixed
//! ones still apply). Never: links NCCL (it is loaded at run time) or fails for a missing
//! toolchain.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// The NCCL header search, shared with the kernel builds of gin-ep and gin-ep-lab.
use gin_ep_build::nccl_headers::{self, venv_site_packages};

/// (C struct, Rust path, fields), checked against every header set.
const COMMON: &[(&str, &str, &[&str])] = &[
    ("ncclUniqueId", "crate::ncclUniqueId", &["internal"]),
    ("ncclTeam", "crate::ncclTeam", &["nRanks", "rank", "stride"]),
    ("ncclMultimemHandle", "crate::ncclMultimemHandle", &["mcBasePtr"]),
    (
        "ncclLsaBarrierHandle",
        "crate::ncclLsaBarrierHandle",
        &["bufHandle", "nBarriers"],
    ),
    // The second word is `bufHandle` in 2.28 and `unused` later: only its size is common.
    (
        "ncclGinBarrierHandle",
        "crate::ncclGinBarrierHandle",
        &["signal0"],
    ),
    (
        "ncclDevResourceRequirements",
        "crate::ncclDevResourceRequirements",
        &[
            "next",
            "bufferSize",
            "bufferAlign",
            "outBufferHandle",
            "ginSignalCount",
            "ginCounterCount",
            "outGinSignalStart",
            "outGinCounterStart",
        ],
    ),
    (
        "ncclTeamRequirements",
        "crate::ncclTeamRequirements",
        &["next", "team", "multimem", "outMultimemHandle"],
    ),
];

const WINDOW_2_28: &[&str] = &[
    "winHost",
    "lsaFlatBase",
    "lsaRank",
    "worldRank",
    "stride4G",
    "mcOffset4K",
    "ginOffset4K",
    "ginWins",
];

const REQS_2_28: &[&str] = &[
    "resourceRequirementsList",
    "teamRequirementsList",
    "lsaMultimem",
    "barrierCount",
    "lsaBarrierCount",
    "railGinBarrierCount",
    "lsaLLA2ABlockCount",
    "lsaLLA2ASlotCount",
    "ginForceEnable",
    "ginContextCount",
    "ginSignalCount",
    "ginCounterCount",
];

const WINDOW_2_31: &[&str] = &[
    "winHost",
    "lsaFlatBase",
    "lsaRank",
    "worldRank",
    "stride4G",
    "mcOffset4K",
    "ginOffset4K",
    "ginWinsDefaultBackend",
    "ginMultiSegmentWins",
    "numSegments",
    "cftFlatRank",
];

const WINDOW_2_32: &[&str] = &[
    "winHost",
    "lsaFlatBase",
    "lsaRank",
    "worldRank",
    "stride4G",
    "mcOffset4K",
    "ginOffset4K",
    "winFlags",
    "ginWinsDefaultBackend",
    "ginMultiSegmentWins",
    "numSegments",
    "cftFlatRank",
    "ucLeIdBase",
];

const RESOURCE_WINDOW_2_31: &[&str] = &["lsaFlatBase", "stride4G", "mcOffset4K"];

/// 2.31's `ncclDevComm`, also 2.32's.
const DEV_COMM_2_31: &[&str] = &[
    "magic",
    "version",
    "rank",
    "nRanks",
    "nRanks_rcp32",
    "lsaRank",
    "lsaSize",
    "lsaSize_rcp32",
    "windowTable",
    "resourceWindow",
    "resourceWindow_inlined",
    "hybridDenseGinBarrier",
    "lsaMultimem",
    "lsaBarrier",
    "railGinBarrier",
    "ginConnectionCount",
    "backendIndex",
    "ginNetDeviceTypes",
    "ginHandles",
    "ginSignalCount",
    "ginCounterCount",
    "ginSignalShadows",
    "ginContextCount",
    "ginConnectionStride",
    "ginContextStride",
    "ginStrongLegacySignals",
    "abortFlag",
    "hybridLsaBarrier",
    "hybridRailGinBarrier",
    "worldGinBarrier",
    "ginConnectionStride_rcp32",
    "cftRank",
    "cftSize",
    "cftMultimemRank",
    "cftMultimemSize",
    "cftMultimemSize_rcp32",
    "ucLeId",
    "mcLeId",
    "cftBarrier",
    "cftMultimemBarrier",
];

/// 2.31's requirements, also 2.32's.
const REQS_2_31: &[&str] = &[
    "size",
    "magic",
    "version",
    "resourceRequirementsList",
    "teamRequirementsList",
    "lsaMultimem",
    "barrierCount",
    "lsaBarrierCount",
    "railGinBarrierCount",
    "lsaLLA2ABlockCount",
    "lsaLLA2ASlotCount",
    "ginForceEnable",
    "ginContextCount",
    "ginSignalCount",
    "ginCounterCount",
    "ginConnectionType",
    "ginExclusiveContexts",
    "ginQueueDepth",
    "ginTrafficClass",
    "worldGinBarrierCount",
    "ginStrongSignalsRequired",
    "ginVaSignalsRequired",
    "ginCustomStride",
    "ginType",
    "useRuntimeVersion",
    "cftCaps",
    "cftBarrierCount",
];

/// Per minor: (label, Rust module, the version's own structs).
type Versioned = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static [&'static str])],
);
const VERSIONS: &[Versioned] = &[
    (
        "2.28",
        "v2_28",
        &[
            ("ncclWindow_vidmem", WINDOW_2_28),
            (
                "ncclDevComm",
                &[
                    "rank",
                    "nRanks",
                    "nRanks_rcp32",
                    "lsaRank",
                    "lsaSize",
                    "lsaSize_rcp32",
                    "windowTable",
                    "resourceWindow",
                    "resourceWindow_inlined",
                    "lsaMultimem",
                    "lsaBarrier",
                    "railGinBarrier",
                    "ginContextCount",
                    "ginTypes",
                    "ginHandles",
                    "ginSignalBase",
                    "ginSignalCount",
                    "ginCounterBase",
                    "ginCounterCount",
                    "ginSignalShadows",
                ],
            ),
            ("ncclDevCommRequirements", REQS_2_28),
        ],
    ),
    (
        "2.29",
        "v2_29",
        &[
            ("ncclWindow_vidmem", WINDOW_2_28),
            (
                "ncclDevComm",
                &[
                    "rank",
                    "nRanks",
                    "nRanks_rcp32",
                    "lsaRank",
                    "lsaSize",
                    "lsaSize_rcp32",
                    "windowTable",
                    "resourceWindow",
                    "resourceWindow_inlined",
                    "lsaMultimem",
                    "lsaBarrier",
                    "railGinBarrier",
                    "ginConnectionCount",
                    "ginNetDeviceTypes",
                    "ginHandles",
                    "ginSignalBase",
                    "ginSignalCount",
                    "ginCounterBase",
                    "ginCounterCount",
                    "ginSignalShadows",
                    "ginContextCount",
                    "ginContextBase",
                    "ginIsRailed",
                    "abortFlag",
                ],
            ),
            (
                "ncclDevCommRequirements",
                &[
                    "size",
                    "magic",
                    "version",
                    "resourceRequirementsList",
                    "teamRequirementsList",
                    "lsaMultimem",
                    "barrierCount",
                    "lsaBarrierCount",
                    "railGinBarrierCount",
                    "lsaLLA2ABlockCount",
                    "lsaLLA2ASlotCount",
                    "ginForceEnable",
                    "ginContextCount",
                    "ginSignalCount",
                    "ginCounterCount",
                    "ginConnectionType",
                    "ginExclusiveContexts",
                    "ginQueueDepth",
                ],
            ),
        ],
    ),
    (
        "2.30",
        "v2_30",
        &[
            (
                "ncclWindow_vidmem",
                &[
                    "winHost",
                    "lsaFlatBase",
                    "lsaRank",
                    "worldRank",
                    "stride4G",
                    "mcOffset4K",
                    "ginOffset4K",
                    "ginWins",
                    "ginMultiSegmentWins",
                    "numSegments",
                ],
            ),
            (
                "ncclResourceWindow_vidmem",
                &[
                    "reserved1",
                    "lsaFlatBase",
                    "reserved2",
                    "stride4G",
                    "mcOffset4K",
                    "reserved3",
                ],
            ),
            (
                "ncclDevComm",
                &[
                    "magic",
                    "version",
                    "rank",
                    "nRanks",
                    "nRanks_rcp32",
                    "lsaRank",
                    "lsaSize",
                    "lsaSize_rcp32",
                    "windowTable",
                    "resourceWindow",
                    "resourceWindow_inlined",
                    "hybridWorldGinBarrier",
                    "lsaMultimem",
                    "lsaBarrier",
                    "railGinBarrier",
                    "ginConnectionCount",
                    "ginNetDeviceTypes",
                    "ginHandles",
                    "ginSignalCount",
                    "ginCounterCount",
                    "ginSignalShadows",
                    "ginContextCount",
                    "ginConnectionsRailed",
                    "ginStrongLegacySignals",
                    "ginContextsRailed",
                    "abortFlag",
                    "hybridLsaBarrier",
                    "hybridRailGinBarrier",
                    "worldGinBarrier",
                ],
            ),
            (
                "ncclDevCommRequirements",
                &[
                    "size",
                    "magic",
                    "version",
                    "resourceRequirementsList",
                    "teamRequirementsList",
                    "lsaMultimem",
                    "barrierCount",
                    "lsaBarrierCount",
                    "railGinBarrierCount",
                    "lsaLLA2ABlockCount",
                    "lsaLLA2ASlotCount",
                    "ginForceEnable",
                    "ginContextCount",
                    "ginSignalCount",
                    "ginCounterCount",
                    "ginConnectionType",
                    "ginExclusiveContexts",
                    "ginQueueDepth",
                    "ginTrafficClass",
                    "worldGinBarrierCount",
                    "ginStrongSignalsRequired",
                    "ginVaSignalsRequired",
                ],
            ),
        ],
    ),
    (
        "2.31",
        "v2_31",
        &[
            ("ncclWindow_vidmem", WINDOW_2_31),
            ("ncclResourceWindow_vidmem", RESOURCE_WINDOW_2_31),
            ("ncclCftBarrierHandle", &["bufHandle", "nBarriers"]),
            ("ncclDevComm", DEV_COMM_2_31),
            ("ncclDevCommRequirements", REQS_2_31),
        ],
    ),
    (
        "2.32",
        "v2_32",
        &[
            ("ncclWindow_vidmem", WINDOW_2_32),
            ("ncclResourceWindow_vidmem", RESOURCE_WINDOW_2_31),
            ("ncclDevComm", DEV_COMM_2_31),
            ("ncclDevCommRequirements", REQS_2_31),
        ],
    ),
];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let workspace = manifest
        .parent()
        .and_then(Path::parent)
        .expect("crates/gin-ep-sys")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets this"));
    for var in [
        "NCCL_INCLUDE",
        "NCCL_INCLUDE_2_28",
        "NCCL_INCLUDE_2_29",
        "NCCL_INCLUDE_2_30",
        "NCCL_INCLUDE_2_31",
        "NCCL_INCLUDE_2_32",
        "CUDA_HOME",
        "CXX",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join(".cuda/.pins").display()
    );

    let mut checks = String::new();
    let mut checked = Vec::new();
    for (label, module, structs) in VERSIONS {
        let Some(nccl_include) = nccl_headers::find_nccl_include(&workspace, label, None, None) else {
            continue;
        };
        match probe(&workspace, &out_dir, &nccl_include, module, structs) {
            Ok((version, text)) => {
                checked.push(version);
                checks.push_str(&text);
            }
            Err(why) => {
                // Headers exist but the probe did not run: say so, since the checks that
                // should guard the layouts are then missing.
                println!(
                    "cargo:warning=gin-ep-sys: NCCL {label} layout probe failed, layouts unchecked against {}: {why}",
                    nccl_include.display()
                );
            }
        }
    }
    let text = format!(
        "// @generated by crates/gin-ep-sys/build.rs from the NCCL headers; do not edit.\n\
         /// NCCL_VERSION_CODE of each header set these checks came from.\n\
         pub const CHECKED_AGAINST: &[i32] = &{checked:?};\n{checks}"
    );
    fs::write(out_dir.join("layout_checks.rs"), text).expect("OUT_DIR is writable");
}

/// Runs the probe for one version; returns its NCCL_VERSION_CODE and the assertions.
fn probe(
    workspace: &Path,
    out_dir: &Path,
    nccl_include: &Path,
    module: &str,
    structs: &[(&str, &[&str])],
) -> Result<(i32, String), String> {
    let cuda_include = find_cuda_include(workspace).ok_or_else(|| {
        format!(
            "{} has NCCL headers but no cuda.h was found (set CUDA_HOME)",
            nccl_include.display()
        )
    })?;
    println!("cargo:rerun-if-changed={}", nccl_include.join("nccl.h").display());

    let mut src = String::from(
        "#include <nccl.h>\n#include <nccl_device.h>\n#include <cstddef>\n#include <cstdio>\n\
         #define SIZE(T, R) std::printf(\"const _: () = assert!(core::mem::size_of::<%s>() == %zu && core::mem::align_of::<%s>() == %zu, \\\"%s: size/align differ from nccl.h %d\\\");\\n\", R, sizeof(T), R, alignof(T), R, NCCL_VERSION_CODE);\n\
         #define FIELD(T, R, f) std::printf(\"const _: () = assert!(core::mem::offset_of!(%s, %s) == %zu, \\\"%s.%s: offset differs from nccl.h %d\\\");\\n\", R, #f, offsetof(T, f), R, #f, NCCL_VERSION_CODE);\n\
         int main() {\n  std::printf(\"%d\\n\", NCCL_VERSION_CODE);\n",
    );
    let own: Vec<(String, String, &[&str])> = structs
        .iter()
        .map(|(c, fields)| (c.to_string(), format!("crate::{module}::{c}"), *fields))
        .collect();
    let common = COMMON
        .iter()
        .map(|(c, r, fields)| (c.to_string(), r.to_string(), *fields));
    for (c, rust, fields) in common.chain(own) {
        src.push_str(&format!("  SIZE({c}, \"{rust}\")\n"));
        for f in fields {
            src.push_str(&format!("  FIELD({c}, \"{rust}\", {f})\n"));
        }
    }
    src.push_str("  return 0;\n}\n");
    let cpp = out_dir.join(format!("nccl_layout_probe_{module}.cpp"));
    let exe = out_dir.join(format!("nccl_layout_probe_{module}"));
    fs::write(&cpp, src).map_err(|e| e.to_string())?;

    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let mut cmd = Command::new(&cxx);
    cmd.arg("-std=c++17").arg(format!("-I{}", nccl_include.display()));
    // nccl_device includes <cuda.h> (GIN types) and <cuda/atomic> (CCCL); a toolkit has
    // CCCL in include/ (CUDA 12) or include/cccl (CUDA 13 and the PyPI wheels).
    cmd.arg(format!("-I{}", cuda_include.display()));
    cmd.arg(format!("-I{}", cuda_include.join("cccl").display()));
    cmd.arg(&cpp).arg("-o").arg(&exe);
    let out = cmd.output().map_err(|e| format!("{cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cxx}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let run = Command::new(&exe).output().map_err(|e| e.to_string())?;
    if !run.status.success() {
        return Err(format!("probe exited with {}", run.status));
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    let (version, checks) = stdout.split_once('\n').ok_or("probe printed nothing")?;
    let version: i32 = version
        .trim()
        .parse()
        .map_err(|_| format!("probe printed {version:?}"))?;
    Ok((version, format!("// NCCL {version} ({module})\n{checks}")))
}

fn find_cuda_include(workspace: &Path) -> Option<PathBuf> {
    let mut cuda: Vec<PathBuf> = env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("include"))
        .into_iter()
        .collect();
    cuda.extend(venv_site_packages(workspace).map(|sp| sp.join("nvidia/cu13/include")));
    cuda.push(PathBuf::from("/usr/local/cuda/include"));
    cuda.into_iter().find(|d| d.join("cuda.h").is_file())
}
