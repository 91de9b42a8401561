//! One process of this binary per GPU: the `--gpus N` runs of `bench`, `check` and
//! `alltoall` start themselves again N times (with GIN_EP_CHILD) and report the first
//! rank that failed. Owns only that plumbing; each command words its own report.

use crate::applies::{Opt, Rule};
use crate::error::{parse_whole, CliError, CliResult};
use gin_ep::group::vnodes::{find_plugin, Topology};
use gin_ep::group::{first_failure, launch_ranks_env, Group, RankExit};
use std::sync::OnceLock;
use std::time::Duration;

/// The launch shape of this command ([`LaunchShape`]), set once before relaunching.
static TOPOLOGY: OnceLock<Topology> = OnceLock::new();

/// How the ranks of a `--gpus N` launch are laid out, shared by `check`, `bench` and
/// `alltoall` (each command's help and docs/cli.md say what it runs on each shape).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct LaunchShape {
    /// With --gpus: K processes per GPU, each its own NCCL node (consecutive ranks share a
    /// GPU), with the project's NCCL net plugin loaded; timings are then time-sliced
    /// (correctness and byte counts only).
    #[arg(long, value_name = "K", value_parser = parse_whole::<usize>)]
    pub vnodes: Option<usize>,
    /// With --gpus: M consecutive ranks form one gin-ep node, whose windows are mapped into
    /// one another and reached by stores [default: NCCL's LSA team]. `check` and `bench
    /// --mode ht` on the host backend: HT across nodes of M consecutive ranks (rail forward, node-first combine).
    #[arg(long, value_name = "M", value_parser = parse_whole::<usize>)]
    pub node_size: Option<usize>,
    /// With --gpus: N consecutive ranks form one NCCL node (one NCCL_HOSTID, the project's
    /// plugin loaded), at most one rank per GPU: `--gpus 2 --nccl-node-size 1` makes each
    /// GPU's process its own NCCL node without sharing a GPU; with --vnodes K the ranks then
    /// go round the GPUs (rank r on GPU r mod G). [default: one NCCL node per process with
    /// --vnodes, else the host's one node]
    #[arg(long, value_name = "N", value_parser = parse_whole::<usize>)]
    pub nccl_node_size: Option<usize>,
}

impl LaunchShape {
    /// The shape's options for `applies::refuse_inapplicable` of a run on GPUs (`gpus`) or on
    /// the host backend: --vnodes and --nccl-node-size need --gpus; --node-size shapes a GPU
    /// launch, and on the host backend groups ranks into HT nodes (--mode ht only).
    pub fn opts(&self, gpus: bool) -> [Opt; 3] {
        const HT: &[crate::bench_cmd::Mode] = &[crate::bench_cmd::Mode::Ht];
        let node_size = if gpus {
            Rule::ANY.gpus()
        } else {
            Rule::ANY.host().modes(HT)
        };
        [
            Opt::new("--vnodes", self.vnodes.is_some(), Rule::ANY.gpus()),
            Opt::new(
                "--nccl-node-size",
                self.nccl_node_size.is_some(),
                Rule::ANY.gpus(),
            ),
            Opt::new("--node-size", self.node_size.is_some(), node_size),
        ]
    }

    /// Whether any of the shape's options was given (they all need --gpus).
    pub fn any(&self) -> bool {
        self.vnodes.is_some() || self.node_size.is_some() || self.nccl_node_size.is_some()
    }
}

/// Records `--gpus G` and its launch shape for [`relaunch`]; a bad shape is a usage error
/// naming the value. Returns the number of ranks.
pub fn set_topology(gpus: usize, shape: &LaunchShape) -> CliResult<usize> {
    let t = Topology::new(gpus, shape.vnodes.unwrap_or(1), shape.node_size)
        .and_then(|t| t.with_nccl_nodes(shape.nccl_node_size))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let _ = TOPOLOGY.set(t);
    Ok(t.world())
}

/// HT and LL (`mode`) on a launch of `gpus` GPUs. HT reaches its peers by load/store only,
/// so all of its ranks must be in one node: NCCL's LSA team (a one-process-per-GPU launch on
/// this host), or, for the checks (`node_launch`), a gin-ep node of every rank
/// (`--vnodes K --node-size G*K`: several processes per GPU, windows mapped with CUDA IPC).
/// LL reaches the ranks of other gin-ep nodes over GIN, so its checks take any node size
/// when this host holds several NCCL nodes (`--vnodes K > 1` or `--nccl-node-size`: they load
/// the project's plugin); otherwise the processes of one host share one NCCL node, where GIN
/// has no network.
/// `ht_across`: HT may run across gin-ep nodes of `--node-size` ranks (stores inside a node,
/// GIN between them).
pub fn refuse_lsa_only(
    mode: &str,
    gpus: usize,
    shape: &LaunchShape,
    node_launch: bool,
    ht_across: bool,
) -> CliResult {
    let (vnodes, node_size) = (shape.vnodes, shape.node_size);
    let why = if mode == "ll" {
        "LL crosses gin-ep nodes over GIN, which needs several NCCL nodes here (--vnodes K > 1, or \
         --nccl-node-size) to load the project's plugin"
    } else {
        "HT reaches peers by load/store only here, so every rank must be in one gin-ep node \
         (HT across gin-ep nodes runs in `gin-ep check --mode ht --node-size G` and `gin-ep \
         bench --mode ht --node-size G` through `Ep`, on several NCCL nodes)"
    };
    let world = gpus * vnodes.unwrap_or(1);
    // Several NCCL nodes on this host (the project's plugin is loaded): set_topology ran first.
    let nccl_nodes = TOPOLOGY.get().is_some_and(|t| t.needs_plugin());
    if node_launch && (vnodes.is_some_and(|k| k > 1) || nccl_nodes) {
        return match node_size {
            _ if mode == "ll" => Ok(()),
            Some(m) if m == world => Ok(()),
            // Nodes of m ranks, stores inside, GIN across (TopologyShape checked m divides).
            Some(_) if mode == "ht" && ht_across => Ok(()),
            Some(m) => Err(CliError::Usage(format!(
                "--node-size {m} does not apply to --mode {mode} across NCCL nodes (--vnodes, \
                 --nccl-node-size): {why}. Use \
                 --node-size {world} (one gin-ep node of all {world} ranks)"
            ))),
            None => Err(CliError::Usage(format!(
                "--mode {mode} across NCCL nodes (--vnodes, --nccl-node-size) needs --node-size {world}: \
                 its ranks reach each other by \
                 stores into CUDA-IPC-mapped windows, so all {world} must be one gin-ep node"
            ))),
        };
    }
    if nccl_nodes && vnodes.is_none_or(|k| k <= 1) {
        return Err(CliError::Usage(format!(
            "--nccl-node-size does not apply to --mode {mode} here: {why}"
        )));
    }
    if let Some(k) = vnodes.filter(|&k| k > 1) {
        let hint = format!(
            " (the check runs on them: `gin-ep check --gpus {gpus} --vnodes {k} --node-size {world} --mode {mode}`)"
        );
        return Err(CliError::Usage(format!(
            "--vnodes {k} does not apply to --mode {mode} here: {why}. Use --vnodes 1, or \
             `gin-ep check --gpus {gpus} --vnodes {k} --mode gin` for the GIN conformance check{hint}"
        )));
    }
    if let Some(m) = node_size.filter(|&m| m != gpus) {
        return Err(CliError::Usage(format!(
            "--node-size {m} does not apply to --mode {mode}: their node is NCCL's LSA team (all \
             {gpus} ranks of this launch); {why}"
        )));
    }
    Ok(())
}

/// `--gpus N` must name 1 to 1024 ranks.
pub fn check_count(gpus: usize) -> CliResult {
    if gpus == 0 || gpus > 1024 {
        return Err(CliError::Usage(format!(
            "invalid value: gpus = {gpus}: must be 1..=1024"
        )));
    }
    Ok(())
}

/// Starts `gpus` ranks of this binary with this process's arguments and waits for them
/// (the launcher kills stragglers at `deadline`). `Ok(None)`: every rank succeeded;
/// `Ok(Some(exit))`: the first rank to fail.
/// With [`set_topology`], `gpus` x vnodes ranks, each with its virtual-node environment.
pub fn relaunch(gpus: usize, deadline: Duration) -> CliResult<Option<RankExit>> {
    let exits = relaunch_all(gpus, deadline)?;
    Ok(first_failure(&exits).cloned())
}

/// [`relaunch`], returning how every rank ended (ordered by rank).
pub fn relaunch_all(gpus: usize, deadline: Duration) -> CliResult<Vec<RankExit>> {
    let exe =
        std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own binary: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let topo = match TOPOLOGY.get() {
        Some(t) => *t,
        None => Topology::new(gpus, 1, None).map_err(|e| CliError::Usage(e.to_string()))?,
    };
    let plugin = if topo.needs_plugin() {
        Some(find_plugin(&exe, &|k| std::env::var(k).ok()).map_err(|e| CliError::Failed(e.to_string()))?)
    } else {
        None
    };
    let env = |r: usize| topo.rank_env(r, plugin.as_deref());
    Ok(launch_ranks_env(topo.world(), &exe, &args, deadline, &env)?)
}

/// A GPU rank's group, following its peers' failures as `gin_ep.Buffer`'s group does: a peer
/// that exits or posts an error ends this rank's waits at once, naming it. Without the watch a
/// survivor of a killed rank waits for its kernel's deadline, and across gin-ep nodes the
/// network plugin has by then stopped every put of the context (it fails the whole context on
/// a lost peer), so the missing rows the deadline names may be any remote peer's.
pub fn rank_group(timeout: Duration) -> CliResult<Group> {
    let mut group = Group::from_env(timeout)?;
    group.watch_peers(None)?;
    Ok(group)
}

/// How a failed rank ended: "killed at the deadline" or its exit status.
pub fn how(f: &RankExit) -> String {
    if f.killed {
        "killed at the deadline".to_string()
    } else {
        f.status.to_string()
    }
}
