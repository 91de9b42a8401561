//! Virtual nodes: `K` processes per GPU, each its own NCCL node, and gin-ep's own grouping of
//! consecutive ranks into nodes.
//!
//! Owns: the rank → GPU mapping of a virtual-node launch, the environment each rank gets
//! (`NCCL_HOSTID`, `NCCL_NET_PLUGIN`, `NCCL_NVLS_ENABLE=0`, `LOCAL_RANK` = its GPU), where the
//! project's NCCL net plugin is found, and reading all of that back inside a rank.
//! Must never: load the plugin where the user did not ask for virtual nodes or the plugin
//! (it replaces NCCL's network for the whole process), or start anything itself (the
//! launcher does).
//!
//! Why each variable: NCCL counts one node per distinct host hash, and `NCCL_HOSTID`
//! replaces the string it hashes (read once per process), so a unique value per rank makes
//! every process its own node — which also lets several processes share one GPU (NCCL's
//! duplicate-GPU check fires only within one host hash). With more than one node NCCL 2.28.9
//! activates GIN for every device communicator, so the plugin that provides GIN (and the net
//! it needs) must be loaded. NVLS needs one process per GPU.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Processes per GPU in a virtual-node launch (set by the launcher for every rank).
pub const ENV_VNODES: &str = "GIN_EP_VNODES";
/// Ranks per gin-ep node (consecutive ranks), when the user chose it.
pub const ENV_NODE_SIZE: &str = "GIN_EP_NODE_SIZE";
/// Path of the project's NCCL net + GIN plugin, overriding the one next to the executable.
pub const ENV_PLUGIN: &str = "GIN_EP_NET_PLUGIN";
/// File name of the plugin as `cargo build --release -p gin-ep-net` makes it.
pub const PLUGIN_FILE: &str = "libnccl_net_ginep.so";
/// Most processes one GPU is asked to carry: MPS serves at most 48 client processes per
/// GPU (Volta and later), and shared GPUs run under MPS.
pub const MAX_VNODES: usize = 48;
/// Most ranks of one launch (as `--gpus`).
pub const MAX_WORLD: usize = 1024;

/// The shape of a launch: GPUs, processes per GPU, ranks per gin-ep node, ranks per NCCL
/// node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    pub gpus: usize,
    pub vnodes: usize,
    /// `None`: gin-ep's node is NCCL's LSA team.
    pub node_size: Option<usize>,
    /// Consecutive ranks that form one NCCL node (one `NCCL_HOSTID`), on distinct GPUs.
    /// `None`: one NCCL node per process when processes share GPUs, else the host's one node.
    pub nccl_node_size: Option<usize>,
}

impl Topology {
    /// Checks the shape: 1..=[`MAX_VNODES`] processes per GPU, at most [`MAX_WORLD`] ranks,
    /// and a node size that divides the world.
    pub fn new(gpus: usize, vnodes: usize, node_size: Option<usize>) -> Result<Topology> {
        if gpus == 0 {
            return Err(Error::input("gpus", "0: must be at least 1"));
        }
        if vnodes == 0 || vnodes > MAX_VNODES {
            return Err(Error::input(
                "vnodes",
                format!("{vnodes}: must be 1..={MAX_VNODES} processes per GPU"),
            ));
        }
        let world = gpus
            .checked_mul(vnodes)
            .filter(|w| *w <= MAX_WORLD)
            .ok_or_else(|| {
                Error::input(
                    "vnodes",
                    format!("{gpus} GPUs x {vnodes} processes is more than {MAX_WORLD} ranks"),
                )
            })?;
        if let Some(m) = node_size {
            if m == 0 || world % m != 0 {
                return Err(Error::input(
                    "node-size",
                    format!("{m}: must divide the {world} ranks into whole nodes of consecutive ranks"),
                ));
            }
        }
        Ok(Topology {
            gpus,
            vnodes,
            node_size,
            nccl_node_size: None,
        })
    }

    /// The same shape with `n` consecutive ranks per NCCL node (`--nccl-node-size`): NCCL
    /// refuses two ranks of one node on one GPU, so an NCCL node holds at most one rank per
    /// GPU; with several processes per GPU the ranks then go round the GPUs (rank r on GPU
    /// r mod G) instead of in runs.
    pub fn with_nccl_nodes(mut self, n: Option<usize>) -> Result<Topology> {
        if let Some(n) = n {
            let world = self.world();
            if n == 0 || !world.is_multiple_of(n) {
                return Err(Error::input(
                    "nccl-node-size",
                    format!("{n}: must divide the {world} ranks into whole NCCL nodes of consecutive ranks"),
                ));
            }
            if n > self.gpus {
                return Err(Error::input(
                    "nccl-node-size",
                    format!(
                        "{n}: an NCCL node holds at most one rank per GPU, and this launch has {} GPU(s)",
                        self.gpus
                    ),
                ));
            }
        }
        self.nccl_node_size = n;
        Ok(self)
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.gpus * self.vnodes
    }

    /// The GPU of `rank`: ranks sharing a GPU are consecutive (NCCL's LSA team needs runs of
    /// consecutive ranks per node), unless NCCL nodes of several ranks span the GPUs
    /// ([`Topology::with_nccl_nodes`]): then rank r is on GPU r mod G.
    pub fn gpu_of(&self, rank: usize) -> usize {
        match self.nccl_node_size {
            Some(n) if n > 1 && self.vnodes > 1 => rank % self.gpus,
            _ => rank / self.vnodes,
        }
    }

    /// The NCCL node of `rank` when this launch sets `NCCL_HOSTID` (several NCCL nodes on
    /// this host), else None (the host's one node).
    pub fn nccl_node_of(&self, rank: usize) -> Option<usize> {
        match self.nccl_node_size {
            Some(n) if n < self.world() => Some(rank / n),
            Some(_) => None,
            None if self.vnodes > 1 => Some(rank),
            None => None,
        }
    }

    /// Whether processes share GPUs (then every figure is time-sliced).
    pub fn shares_gpus(&self) -> bool {
        self.vnodes > 1
    }

    /// Whether ranks need the project's plugin: several NCCL nodes on this host.
    pub fn needs_plugin(&self) -> bool {
        self.nccl_node_of(0).is_some()
    }

    /// The variables rank `rank` gets on top of the launcher's own (`plugin` is required
    /// when [`Topology::needs_plugin`]).
    pub fn rank_env(&self, rank: usize, plugin: Option<&Path>) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(m) = self.node_size {
            env.push((ENV_NODE_SIZE.to_string(), m.to_string()));
        }
        let Some(node) = self.nccl_node_of(rank) else {
            return env;
        };
        env.push(("LOCAL_RANK".into(), self.gpu_of(rank).to_string()));
        env.push((ENV_VNODES.into(), self.vnodes.to_string()));
        env.push(("NCCL_HOSTID".into(), format!("gin-ep-vnode{node}")));
        env.push(("NCCL_NVLS_ENABLE".into(), "0".into()));
        if let Some(p) = plugin {
            env.push(("NCCL_NET_PLUGIN".into(), p.display().to_string()));
            // NCCL 2.28 clears an external net plugin's name when its last communicator is
            // destroyed, so a later communicator of the process gets no GIN; one reference
            // of the process's own keeps it loaded (NCCL 2.30 keeps the name).
            env.push(("NCCL_NET_PLUGIN_REF_COUNT".into(), "1".into()));
        }
        env
    }
}

/// The plugin a virtual-node launch loads: `$GIN_EP_NET_PLUGIN` when set (it must exist),
/// else [`PLUGIN_FILE`] next to `exe`; else an error saying how to build it.
pub fn find_plugin(exe: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf> {
    if let Some(p) = env(ENV_PLUGIN).filter(|p| !p.trim().is_empty()) {
        let path = PathBuf::from(p.trim());
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::input(
                ENV_PLUGIN,
                format!("{}: no such file", path.display()),
            ))
        };
    }
    let beside = exe.parent().map(|d| d.join(PLUGIN_FILE));
    match beside {
        Some(p) if p.is_file() => Ok(p),
        _ => Err(Error::Unavailable {
            backend: "vnodes",
            reason: format!(
                "virtual nodes need the project's NCCL net plugin {PLUGIN_FILE}, not found next to \
                 {} (nor set in {ENV_PLUGIN}): build it with `cargo build --release -p gin-ep-net` \
                 and copy target/release/{PLUGIN_FILE} beside the gin-ep binary, or set {ENV_PLUGIN}",
                exe.display()
            ),
        }),
    }
}

/// The node topology of a rank's launch: how many processes share its GPU and how gin-ep
/// groups consecutive ranks into nodes. An option of every GPU engine (`EpOptions::topology`),
/// alike on every rank; the CLI and Python fill it from [`ENV_VNODES`] and [`ENV_NODE_SIZE`]
/// ([`RankTopology::from_env`]), the engine never reads the environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankTopology {
    /// Processes per GPU (1 outside a virtual-node launch).
    pub vnodes: usize,
    /// Ranks per gin-ep node, when chosen (`None`: NCCL's LSA team is the node).
    pub node_size: Option<usize>,
}

impl Default for RankTopology {
    /// One process per GPU, NCCL's LSA team as the node.
    fn default() -> Self {
        RankTopology {
            vnodes: 1,
            node_size: None,
        }
    }
}

impl RankTopology {
    /// Checks the topology against a world of `world` ranks: 1..=[`MAX_VNODES`] processes
    /// per GPU dividing the world, and a node size that divides the world into whole nodes.
    pub fn validate(&self, world: usize) -> Result<()> {
        let v = self.vnodes;
        if v == 0 || v > MAX_VNODES || !world.is_multiple_of(v) {
            return Err(Error::input(
                "vnodes",
                format!("{v}: must be 1..={MAX_VNODES} processes per GPU and divide the {world} ranks"),
            ));
        }
        if let Some(m) = self.node_size {
            if m == 0 || !world.is_multiple_of(m) {
                return Err(Error::input(
                    "node_size",
                    format!("{m}: must divide the {world} ranks into whole nodes of consecutive ranks"),
                ));
            }
        }
        Ok(())
    }

    /// `cfg` as HT runs it on this launch: grouped into the launch's gin-ep nodes when they
    /// are smaller than the group (HT across nodes: rail forward, node-first combine), else
    /// as given (one node).
    pub fn ht_config(&self, cfg: &crate::config::EpConfig) -> crate::config::EpConfig {
        cfg.clone()
            .with_node_size(self.node_size.filter(|&m| m < cfg.ranks))
    }

    /// Reads [`ENV_VNODES`] and [`ENV_NODE_SIZE`] (for the CLI, the harness and the Python
    /// layer, which pass the result as an option); a malformed value is an error naming it.
    pub fn from_env() -> Result<RankTopology> {
        Self::parse(&|k| std::env::var(k).ok())
    }

    fn parse(env: &dyn Fn(&str) -> Option<String>) -> Result<RankTopology> {
        let num = |name: &str| -> Result<Option<usize>> {
            match env(name) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => match v.trim().parse::<usize>() {
                    Ok(n) if n > 0 => Ok(Some(n)),
                    _ => Err(Error::input(name, format!("{v:?} is not a positive integer"))),
                },
            }
        };
        Ok(RankTopology {
            vnodes: num(ENV_VNODES)?.unwrap_or(1),
            node_size: num(ENV_NODE_SIZE)?,
        })
    }

    /// The SMs one process's kernels may hold at once on a GPU of `sms` SMs: all of them
    /// outside a virtual-node launch; with K processes per GPU (run under MPS, sharing the
    /// SMs) `sms / (2K + 1)` (at least 1). Every rank's CTAs wait for the
    /// other ranks' and must be resident together, and programmatic dependent launch lets a
    /// process hold two grids (the running one and its waiting successor); with a full share
    /// one process's two grids could take every SM while its kernel waits for a peer whose
    /// kernel then never starts. One more share stays free for whatever else the GPU runs
    /// (the share with which the LL check across 2 and 4 virtual nodes passed under MPS; the
    /// plugin's copies run on the copy engines, in a context of its own). (Time-sliced
    /// without MPS, any grid would do.)
    pub fn sm_share(&self, sms: u32) -> u32 {
        match self.vnodes {
            0 | 1 => sms,
            k => (sms / (2 * k as u32 + 1)).max(1),
        }
    }

    /// The gin-ep node of `rank` as (first rank, size), for a world of `world` ranks whose
    /// NCCL LSA team has `lsa_size` ranks (the default node).
    pub fn node_of(&self, rank: usize, world: usize, lsa_size: usize) -> (usize, usize) {
        let m = self.node_size.unwrap_or(lsa_size).clamp(1, world.max(1));
        ((rank / m) * m, m)
    }
}

/// Whether this process was told to load the project's plugin (`NCCL_NET_PLUGIN` names it):
/// the opt-in that makes GIN available without an RDMA device.
pub fn plugin_configured() -> Option<String> {
    plugin_configured_in(&|k| std::env::var(k).ok())
}

fn plugin_configured_in(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let p = env("NCCL_NET_PLUGIN")?;
    let name = Path::new(p.trim()).file_name()?.to_string_lossy().into_owned();
    name.starts_with("libnccl_net_ginep")
        .then(|| p.trim().to_string())
}

/// The note every figure of a run with processes sharing a GPU carries.
pub const TIME_SLICED: &str = "time-sliced: correctness only";

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn a_topology_that_does_not_fit_the_world_is_refused_naming_the_value() {
        let t = |vnodes, node_size| RankTopology { vnodes, node_size };
        assert!(RankTopology::default().validate(3).is_ok());
        assert!(t(2, Some(4)).validate(8).is_ok());
        for (bad, world, name, value) in [
            (t(1, Some(3)), 8, "node_size", "3:"),
            (t(1, Some(0)), 8, "node_size", "0:"),
            (t(0, None), 8, "vnodes", "0:"),
            (t(3, None), 8, "vnodes", "3:"),
            (t(MAX_VNODES + 1, None), 49 * 16, "vnodes", "49:"),
        ] {
            let e = bad.validate(world).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(value), "{bad:?}: {e}");
        }
    }

    #[test]
    fn each_process_keeps_to_half_its_share_of_the_sms() {
        let share = |vnodes| {
            RankTopology {
                vnodes,
                node_size: None,
            }
            .sm_share(132)
        };
        assert_eq!([share(1), share(2), share(4), share(200)], [132, 26, 14, 1]);
    }

    #[test]
    fn ranks_sharing_a_gpu_are_consecutive_and_each_is_its_own_nccl_node() {
        let t = Topology::new(2, 2, None).unwrap();
        assert_eq!(t.world(), 4);
        assert_eq!((0..4).map(|r| t.gpu_of(r)).collect::<Vec<_>>(), [0, 0, 1, 1]);
        let plugin = Path::new("/x/libnccl_net_ginep.so");
        let envs: Vec<HashMap<String, String>> = (0..4)
            .map(|r| t.rank_env(r, Some(plugin)).into_iter().collect())
            .collect();
        for (r, e) in envs.iter().enumerate() {
            assert_eq!(e["LOCAL_RANK"], (r / 2).to_string());
            assert_eq!(e["NCCL_NET_PLUGIN"], "/x/libnccl_net_ginep.so");
            assert_eq!(e["NCCL_NET_PLUGIN_REF_COUNT"], "1");
            assert_eq!(e["NCCL_NVLS_ENABLE"], "0");
            assert_eq!(e[ENV_VNODES], "2");
            assert!(!e.contains_key(ENV_NODE_SIZE));
        }
        let ids: std::collections::HashSet<&String> = envs.iter().map(|e| &e["NCCL_HOSTID"]).collect();
        assert_eq!(ids.len(), 4, "every rank needs its own NCCL_HOSTID");
    }

    #[test]
    fn one_process_per_gpu_changes_nothing_but_the_node_size() {
        let t = Topology::new(4, 1, None).unwrap();
        assert!(t.rank_env(3, None).is_empty());
        assert!(!t.needs_plugin() && !t.shares_gpus());
        let t = Topology::new(4, 1, Some(2)).unwrap();
        assert_eq!(
            t.rank_env(3, None),
            vec![(ENV_NODE_SIZE.to_string(), "2".to_string())]
        );
    }

    #[test]
    fn nccl_nodes_of_one_rank_per_gpu_and_of_two_gpus_each() {
        let plugin = Path::new("/x/libnccl_net_ginep.so");
        let env_of = |t: &Topology, r: usize| -> HashMap<String, String> {
            t.rank_env(r, Some(plugin)).into_iter().collect()
        };
        // Two GPUs, one process each, each its own NCCL node: no sharing.
        let t = Topology::new(2, 1, Some(1))
            .unwrap()
            .with_nccl_nodes(Some(1))
            .unwrap();
        assert!(t.needs_plugin() && !t.shares_gpus());
        for r in 0..2 {
            let e = env_of(&t, r);
            assert_eq!(e["LOCAL_RANK"], r.to_string());
            assert_eq!(e["NCCL_HOSTID"], format!("gin-ep-vnode{r}"));
            assert_eq!(e[ENV_VNODES], "1");
            assert_eq!(e["NCCL_NET_PLUGIN"], "/x/libnccl_net_ginep.so");
        }
        // Four processes on two GPUs as two NCCL nodes of two GPUs: rank r on GPU r % 2.
        let t = Topology::new(2, 2, None)
            .unwrap()
            .with_nccl_nodes(Some(2))
            .unwrap();
        assert_eq!((0..4).map(|r| t.gpu_of(r)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        let ids: Vec<String> = (0..4).map(|r| env_of(&t, r)["NCCL_HOSTID"].clone()).collect();
        assert_eq!(
            ids,
            ["gin-ep-vnode0", "gin-ep-vnode0", "gin-ep-vnode1", "gin-ep-vnode1"]
        );
        assert_eq!(env_of(&t, 3)["LOCAL_RANK"], "1");
        // One NCCL node of every rank: the host's own, nothing set.
        let t = Topology::new(2, 1, None)
            .unwrap()
            .with_nccl_nodes(Some(2))
            .unwrap();
        assert!(!t.needs_plugin() && t.rank_env(1, None).is_empty());
        // Without the option nothing changes.
        assert_eq!(
            Topology::new(2, 2, None).unwrap().with_nccl_nodes(None).unwrap(),
            Topology::new(2, 2, None).unwrap()
        );
        // Refused: a node that does not divide the ranks, or two of its ranks on one GPU.
        let e = Topology::new(2, 2, None)
            .unwrap()
            .with_nccl_nodes(Some(3))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nccl-node-size") && e.contains('3'), "{e}");
        let e = Topology::new(1, 4, None)
            .unwrap()
            .with_nccl_nodes(Some(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("one rank per GPU") && e.contains("1 GPU"), "{e}");
    }

    #[test]
    fn bad_shapes_are_refused_naming_the_value() {
        for (g, k, m, needle) in [
            (1, 0, None, "vnodes"),
            (1, 49, None, "49"),
            (1024, 2, None, "1024"),
            (0, 2, None, "gpus"),
            (1, 4, Some(3), "3"),
            (1, 4, Some(0), "node-size"),
        ] {
            let e = Topology::new(g, k, m).unwrap_err().to_string();
            assert!(e.contains(needle), "({g},{k},{m:?}): {e}");
        }
        assert!(Topology::new(1, 4, Some(2)).is_ok());
        assert!(Topology::new(1, 4, Some(4)).is_ok());
    }

    #[test]
    fn the_plugin_is_found_from_the_env_or_beside_the_binary_or_explained() {
        let dir = std::env::temp_dir().join(format!("gin-ep-vnodes-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("gin-ep");
        let none = env_of(&[]);
        let e = find_plugin(&exe, &none).unwrap_err().to_string();
        assert!(e.contains("cargo build --release -p gin-ep-net"), "{e}");
        assert!(e.contains(PLUGIN_FILE), "{e}");
        std::fs::write(dir.join(PLUGIN_FILE), b"").unwrap();
        assert_eq!(find_plugin(&exe, &none).unwrap(), dir.join(PLUGIN_FILE));
        let missing = dir.join("nope.so").display().to_string();
        let e = find_plugin(&exe, &env_of(&[(ENV_PLUGIN, &missing)])).unwrap_err();
        assert!(e.to_string().contains("nope.so"), "{e}");
        let other = dir.join("libnccl_net_ginep_fault.so");
        std::fs::write(&other, b"").unwrap();
        let chosen = find_plugin(&exe, &env_of(&[(ENV_PLUGIN, &other.display().to_string())])).unwrap();
        assert_eq!(chosen, other);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_rank_reads_its_topology_and_groups_nodes_of_consecutive_ranks() {
        let t = RankTopology::parse(&env_of(&[(ENV_VNODES, "4"), (ENV_NODE_SIZE, "2")])).unwrap();
        assert_eq!((t.vnodes, t.node_size), (4, Some(2)));
        assert_eq!(t.node_of(3, 4, 1), (2, 2));
        assert_eq!(t.node_of(1, 4, 1), (0, 2));
        let d = RankTopology::parse(&env_of(&[])).unwrap();
        assert_eq!((d.vnodes, d.node_size), (1, None));
        assert_eq!(d.node_of(5, 8, 4), (4, 4));
        let e = RankTopology::parse(&env_of(&[(ENV_VNODES, "two")])).unwrap_err();
        assert!(e.to_string().contains("two"), "{e}");
        assert!(RankTopology::parse(&env_of(&[(ENV_NODE_SIZE, "0")])).is_err());
    }

    #[test]
    fn only_the_projects_plugin_counts_as_configured() {
        assert_eq!(plugin_configured_in(&env_of(&[])), None);
        assert_eq!(
            plugin_configured_in(&env_of(&[("NCCL_NET_PLUGIN", "/d/libnccl_net_ginep.so")])).as_deref(),
            Some("/d/libnccl_net_ginep.so")
        );
        assert!(
            plugin_configured_in(&env_of(&[("NCCL_NET_PLUGIN", "/d/libnccl_net_ginep_fault.so")])).is_some()
        );
        assert_eq!(
            plugin_configured_in(&env_of(&[("NCCL_NET_PLUGIN", "libnccl-net-ib.so")])),
            None
        );
    }
}
