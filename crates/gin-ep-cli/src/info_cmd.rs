//! `gin-ep info`: what this machine and this build offer, honestly and without
//! loading any GPU library.

use crate::error::CliResult;
use crate::host;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `/dev/nvidiaN` device nodes.
fn nvidia_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.strip_prefix("nvidia")
                        .is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|n| n[6..].parse::<u32>().unwrap_or(u32::MAX));
    v
}

/// `nvidia-smi -L`, if it is on PATH and answers within a few seconds.
fn nvidia_smi() -> Option<Vec<String>> {
    let mut child = Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let out = child.wait_with_output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.trim().to_string())
            .collect(),
    )
}

pub fn run() -> CliResult {
    out!("gin-ep {}", env!("CARGO_PKG_VERSION"));
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get().to_string())
        .unwrap_or_else(|_| "unknown".into());
    out!("cpus:     {cpus} usable");
    match (host::mem_total(), host::mem_available()) {
        (Some(t), Some(a)) => out!(
            "memory:   {:.1} GiB total, {:.1} GiB available",
            host::gib(t),
            host::gib(a)
        ),
        _ => out!("memory:   unknown (no /proc/meminfo)"),
    }
    let devs = nvidia_devices();
    match nvidia_smi() {
        Some(gpus) if !gpus.is_empty() => {
            out!("gpus:     {} (nvidia-smi -L)", gpus.len());
            for g in gpus {
                out!("          {g}");
            }
        }
        _ if !devs.is_empty() => out!(
            "gpus:     {} NVIDIA device node(s) ({}); nvidia-smi not available",
            devs.len(),
            devs.iter()
                .map(|d| format!("/dev/{d}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => out!("gpus:     none found (no /dev/nvidia* device, no nvidia-smi)"),
    }
    use gin_ep::ep::probe::{driver, gin_network, nccl_probe, KERNEL_SETS};
    match driver::probe() {
        Ok(d) => out!(
            "driver:   CUDA {}.{} ({} device(s))",
            d.version / 1000,
            d.version % 1000 / 10,
            d.device_count
        ),
        Err(e) => out!("driver:   unusable: {e}"),
    }
    // The NCCL gin-ep would load, whether its kernels are here, and the supported set.
    use gin_ep::ep::probe::{kernels_for, supported_text, version_text};
    match nccl_probe() {
        Ok((src, v)) => match kernels_for(v, &src) {
            Ok((_, abi)) => out!(
                "nccl:     {} loaded ({src}): supported, runs the NCCL {abi} kernel set",
                version_text(v)
            ),
            Err(e) => out!("nccl:     {} loaded ({src}): NOT usable: {e}", version_text(v)),
        },
        Err(e) => out!("nccl:     not loadable: {e}"),
    }
    out!("          supported: {}", supported_text());
    for set in KERNEL_SETS {
        match (set.fatbin, set.nccl_header_version) {
            (Some(f), Some(h)) => out!(
                "kernels:  NCCL {}: {} KiB fatbin (headers {})",
                set.nccl,
                f.len() / 1024,
                version_text(h as i32)
            ),
            _ => out!(
                "kernels:  NCCL {}: absent: {}",
                set.nccl,
                set.absent_reason.unwrap_or("not built")
            ),
        }
    }
    match gin_network() {
        Ok(n) => out!("gin:      {n}"),
        Err(why) => out!("gin:      no GIN-capable network ({why})"),
    }
    out!(
        "backends: host threads (1-{} ranks in one process), host processes (1-{} ranks on \
         POSIX shared memory); cuda: {}",
        host::HOST_MAX_RANKS,
        host::HOST_MAX_RANKS,
        if KERNEL_SETS.iter().any(|s| s.fatbin.is_some()) && driver::probe().is_ok() {
            "usable (all-to-all)"
        } else {
            "not usable here"
        }
    );
    Ok(())
}
