//! Whether kernels may ask NCCL for GIN (GPU-Initiated Networking) on this host, decided
//! without asking NCCL for GIN: that request crashes NCCL 2.28.9 later on a host without an
//! RDMA NIC (shared/ANCHORS.md).
//!
//! Owns: reading `/sys/class/infiniband` and the NCCL environment for that verdict. Never:
//! loads NCCL, touches a GPU, or turns GIN on where the user did not ask for it.

use std::path::Path;

/// Whether this host has a network GIN could use: an RDMA device with an active port under
/// `/sys/class/infiniband`, and NCCL not told to avoid it (`NCCL_NET=Socket`,
/// `NCCL_IB_DISABLE=1`). `Err` holds the reason for the "needs a GIN-capable network"
/// message. This is necessary, not sufficient: NCCL may still lack a GIN plugin for it.
pub fn gin_network() -> std::result::Result<String, String> {
    gin_network_at(Path::new("/sys/class/infiniband"), &|k| std::env::var(k).ok())
}

/// Whether kernels may ask NCCL for GIN here: an RDMA network ([`gin_network`]), or the
/// project's plugin configured in `NCCL_NET_PLUGIN` (the opt-in of virtual nodes and of hosts
/// without an RDMA NIC; never chosen by gin-ep where the user did not ask for it). `Err` says
/// why neither holds.
pub fn gin_available() -> std::result::Result<String, String> {
    match gin_network() {
        Ok(n) => Ok(n),
        Err(why) => match crate::group::vnodes::plugin_configured() {
            Some(p) => Ok(format!("the project's NCCL net plugin ({p})")),
            None => Err(format!(
                "{why}; nor is the project's plugin configured (NCCL_NET_PLUGIN=<path to {}>, \
                 or `--vnodes` with `--gpus`)",
                crate::group::vnodes::PLUGIN_FILE
            )),
        },
    }
}

fn gin_network_at(sysfs: &Path, env: &dyn Fn(&str) -> Option<String>) -> std::result::Result<String, String> {
    if env("NCCL_NET").is_some_and(|v| v.eq_ignore_ascii_case("socket")) {
        return Err("NCCL_NET=Socket excludes RDMA".into());
    }
    if env("NCCL_IB_DISABLE").is_some_and(|v| v.trim() == "1") {
        return Err("NCCL_IB_DISABLE=1 excludes RDMA".into());
    }
    let Ok(devices) = std::fs::read_dir(sysfs) else {
        return Err(format!("no RDMA device found ({} absent)", sysfs.display()));
    };
    let mut seen = Vec::new();
    for dev in devices.flatten() {
        let name = dev.file_name().to_string_lossy().into_owned();
        let ports = std::fs::read_dir(dev.path().join("ports")).into_iter().flatten();
        for port in ports.flatten() {
            let state = std::fs::read_to_string(port.path().join("state")).unwrap_or_default();
            // sysfs writes e.g. "4: ACTIVE".
            if state.contains("ACTIVE") {
                return Ok(format!("{name} port {}", port.file_name().to_string_lossy()));
            }
            seen.push(format!("{name}: {}", state.trim()));
        }
    }
    if seen.is_empty() {
        Err("no RDMA device found".into())
    } else {
        Err(format!("no RDMA port is ACTIVE ({})", seen.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn gin_is_unavailable_without_an_active_rdma_port() {
        let dir = std::env::temp_dir().join(format!("gin-ep-ib-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let none = gin_network_at(&dir, &env(&[])).unwrap_err();
        assert!(none.contains("no RDMA device"), "{none}");

        let port = dir.join("mlx5_0/ports/1");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("state"), "1: DOWN\n").unwrap();
        let down = gin_network_at(&dir, &env(&[])).unwrap_err();
        assert!(down.contains("mlx5_0: 1: DOWN"), "{down}");

        std::fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        assert_eq!(gin_network_at(&dir, &env(&[])).unwrap(), "mlx5_0 port 1");
        let socket = gin_network_at(&dir, &env(&[("NCCL_NET", "Socket")])).unwrap_err();
        assert!(socket.contains("NCCL_NET=Socket"), "{socket}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
