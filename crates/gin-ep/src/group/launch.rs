//! The CLI's process launcher: starts `world` copies of a program as the ranks of one
//! group on this host, serves their store, and collects how each rank ended.
//!
//! Owns: the child processes it spawns (it kills every straggler at the deadline), the
//! store they bootstrap from and its secret. Before starting ranks it removes the
//! shared-memory names that killed ranks of earlier runs left behind (saying so).
//! Must never: kill the surviving ranks as soon as one fails (detecting a dead peer is
//! the ranks' own job, and tests rely on it), wait past its deadline, or keep more than
//! a bounded tail of a child's stderr.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{progress_key, StoreServer, ENV_CHILD, ENV_STORE_PORT, ENV_STORE_SECRET};
use crate::error::{Error, Result};

/// Bytes of each rank's stderr kept (the end of it, where the error message is).
pub const STDERR_TAIL: usize = 64 << 10;
/// Time past `2 * timeout` before stragglers are killed: ranks detect a dead peer within
/// one timeout, and may need another to report it and tear down.
const DEADLINE_SLACK: Duration = Duration::from_secs(10);
/// How often the launcher checks its children.
const POLL: Duration = Duration::from_millis(10);
/// How long to wait for a child's stderr to close after it exited (a grandchild may
/// hold the pipe open forever; we then report what we have).
const STDERR_LINGER: Duration = Duration::from_secs(1);

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    pub rank: usize,
    pub status: ExitStatus,
    /// The launcher killed the rank because it was still running at the deadline.
    pub killed: bool,
    /// Time from launch until the exit was observed; the earliest failure is usually the
    /// cause, later ones the peers noticing it.
    pub elapsed: Duration,
    /// The last [`STDERR_TAIL`] bytes the rank wrote to stderr (lossy UTF-8).
    pub stderr: String,
    /// The last count of finished work the rank reported
    /// ([`Group::report_progress`](super::Group::report_progress)), if it reported any.
    pub progress: Option<u64>,
}

impl RankExit {
    /// The rank exited by itself with status 0.
    pub fn success(&self) -> bool {
        self.status.success() && !self.killed
    }
}

/// The failure observed first (see [`RankExit::elapsed`]), if any rank failed.
pub fn first_failure(exits: &[RankExit]) -> Option<&RankExit> {
    exits
        .iter()
        .filter(|e| !e.success())
        .min_by_key(|e| (e.elapsed, e.rank))
}

/// Runs `world` processes of `exe args` as the ranks of one group on this host and
/// returns how each ended, ordered by rank. Each child gets `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, `GIN_EP_STORE_PORT` and `GIN_EP_STORE_SECRET`
/// (the store this function serves, with a fresh secret) and `GIN_EP_CHILD=1`; stdout is inherited, stderr captured. Children still
/// running `2 * timeout` plus a slack after launch are killed.
pub fn launch_ranks(world: usize, exe: &Path, args: &[String], timeout: Duration) -> Result<Vec<RankExit>> {
    launch_ranks_env(world, exe, args, timeout, &|_| Vec::new())
}

/// [`launch_ranks`], with `env(rank)` added to each rank's environment last (it overrides
/// the launcher's own variables, e.g. `LOCAL_RANK` of a virtual-node launch).
pub fn launch_ranks_env(
    world: usize,
    exe: &Path,
    args: &[String],
    timeout: Duration,
    env: &RankEnv<'_>,
) -> Result<Vec<RankExit>> {
    launch_with_deadline(
        world,
        exe,
        args,
        timeout.saturating_mul(2).saturating_add(DEADLINE_SLACK),
        env,
    )
}

/// Extra variables of one rank.
pub type RankEnv<'a> = dyn Fn(usize) -> Vec<(String, String)> + 'a;

struct Running {
    rank: usize,
    child: Child,
    stderr: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
    exit: Option<(ExitStatus, bool, Duration)>,
}

fn launch_with_deadline(
    world: usize,
    exe: &Path,
    args: &[String],
    limit: Duration,
    env: &RankEnv<'_>,
) -> Result<Vec<RankExit>> {
    if world == 0 {
        return Err(Error::input("ranks", "must be at least 1"));
    }
    crate::backend::host::heap::sweep_stale_segments_once();
    let server = StoreServer::bind("127.0.0.1:0")?;
    let port = server.addr().port().to_string();
    let secret = server.secret().to_hex();
    let start = Instant::now();
    let deadline = start + limit;
    let mut ranks: Vec<Running> = Vec::with_capacity(world);
    for rank in 0..world {
        let spawned = Command::new(exe)
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env(ENV_STORE_PORT, &port)
            .env(ENV_STORE_SECRET, &secret)
            .env(ENV_CHILD, "1")
            .envs(env(rank))
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(mut child) => {
                let stderr = Arc::new(Mutex::new(Vec::new()));
                let reader = child.stderr.take().and_then(|pipe| {
                    let sink = Arc::clone(&stderr);
                    std::thread::Builder::new()
                        .name(format!("gin-ep-rank{rank}-stderr"))
                        .spawn(move || keep_tail(pipe, &sink))
                        .ok()
                });
                ranks.push(Running {
                    rank,
                    child,
                    stderr,
                    reader,
                    exit: None,
                });
            }
            Err(e) => {
                // Without this rank the others can only time out: stop them now.
                for r in &mut ranks {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                }
                return Err(Error::io(
                    format!("launch rank {rank} of {world}: {}", exe.display()),
                    e,
                ));
            }
        }
    }

    loop {
        let mut running = 0;
        for r in ranks.iter_mut().filter(|r| r.exit.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => r.exit = Some((status, false, start.elapsed())),
                Ok(None) => running += 1,
                Err(_) => {
                    // Cannot observe the child: make sure it is gone, then reap it.
                    let _ = r.child.kill();
                    if let Ok(status) = r.child.wait() {
                        r.exit = Some((status, true, start.elapsed()));
                    }
                }
            }
        }
        if running == 0 {
            break;
        }
        if Instant::now() >= deadline {
            for r in ranks.iter_mut().filter(|r| r.exit.is_none()) {
                let _ = r.child.kill();
                if let Ok(status) = r.child.wait() {
                    r.exit = Some((status, true, start.elapsed()));
                }
            }
            break;
        }
        std::thread::sleep(POLL);
    }
    let progress: Vec<Option<u64>> = (0..world)
        .map(|rank| {
            server
                .peek(&progress_key(rank))
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map(u64::from_le_bytes)
        })
        .collect();
    drop(server);

    let mut exits = Vec::with_capacity(world);
    for mut r in ranks {
        if let Some(reader) = r.reader.take() {
            let linger = Instant::now() + STDERR_LINGER;
            while !reader.is_finished() && Instant::now() < linger {
                std::thread::sleep(POLL);
            }
            if reader.is_finished() {
                let _ = reader.join();
            } // else: detached; it ends when the pipe closes
        }
        let stderr =
            String::from_utf8_lossy(&r.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
        let Some((status, killed, elapsed)) = r.exit else {
            // kill() and wait() both failed: the child is not ours to reap any more.
            return Err(Error::Bootstrap(format!(
                "rank {} could not be reaped (pid {})",
                r.rank,
                r.child.id()
            )));
        };
        exits.push(RankExit {
            rank: r.rank,
            status,
            killed,
            elapsed,
            stderr,
            progress: progress[r.rank],
        });
    }
    Ok(exits)
}

/// Copies `pipe` into `sink`, keeping only the last [`STDERR_TAIL`] bytes.
fn keep_tail(mut pipe: impl Read, sink: &Mutex<Vec<u8>>) {
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                let mut buf = sink.lock().unwrap_or_else(|e| e.into_inner());
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > STDERR_TAIL {
                    let excess = buf.len() - STDERR_TAIL;
                    buf.drain(..excess);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> (std::path::PathBuf, Vec<String>) {
        ("/bin/sh".into(), vec!["-c".into(), script.into()])
    }

    #[test]
    fn children_get_their_rank_environment_and_stderr_is_captured() {
        let (exe, args) = sh(
            "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK a=$MASTER_ADDR c=$GIN_EP_CHILD \
             s=${#GIN_EP_STORE_SECRET} p=$GIN_EP_STORE_PORT\" >&2; exit $RANK",
        );
        let exits = launch_ranks(3, &exe, &args, Duration::from_secs(5)).unwrap();
        assert_eq!(exits.len(), 3);
        for (r, e) in exits.iter().enumerate() {
            assert_eq!(e.rank, r);
            assert_eq!(e.status.code(), Some(r as i32));
            assert!(!e.killed);
            let want = format!("r={r} w=3 l={r} a=127.0.0.1 c=1 s=64 p=");
            assert!(e.stderr.starts_with(&want), "rank {r}: {:?}", e.stderr);
            let port: u16 = e.stderr.trim().rsplit('=').next().unwrap().parse().unwrap();
            assert_ne!(port, 0);
        }
        assert!(exits[0].success() && !exits[1].success());
        let first = first_failure(&exits).expect("ranks 1 and 2 failed");
        assert_ne!(first.rank, 0);
    }

    #[test]
    fn per_rank_variables_override_the_launchers_own() {
        let (exe, args) = sh("echo \"l=$LOCAL_RANK h=$NCCL_HOSTID\" >&2");
        let env = |r: usize| {
            vec![
                ("LOCAL_RANK".to_string(), (r / 2).to_string()),
                ("NCCL_HOSTID".to_string(), format!("v{r}")),
            ]
        };
        let exits = launch_ranks_env(4, &exe, &args, Duration::from_secs(5), &env).unwrap();
        for (r, e) in exits.iter().enumerate() {
            assert_eq!(e.stderr.trim(), format!("l={} h=v{r}", r / 2));
        }
    }

    #[test]
    fn a_failing_rank_does_not_stop_the_others() {
        let (exe, args) = sh("if [ \"$RANK\" = 1 ]; then echo boom >&2; exit 3; fi; sleep 0.3; exit 0");
        let exits = launch_ranks(2, &exe, &args, Duration::from_secs(5)).unwrap();
        assert!(exits[0].success(), "rank 0 was stopped: {:?}", exits[0]);
        assert_eq!(exits[1].status.code(), Some(3));
        let first = first_failure(&exits).unwrap();
        assert_eq!((first.rank, first.stderr.trim()), (1, "boom"));
    }

    #[test]
    fn stragglers_are_killed_at_the_deadline() {
        let (exe, args) = sh("if [ \"$RANK\" = 0 ]; then exit 0; fi; exec sleep 30");
        let t0 = Instant::now();
        let exits =
            launch_with_deadline(2, &exe, &args, Duration::from_millis(300), &|_| Vec::new()).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
        assert!(exits[0].success());
        assert!(exits[1].killed && !exits[1].success());
    }

    #[test]
    fn a_missing_program_is_an_error_not_a_panic() {
        let err = launch_ranks(
            2,
            Path::new("/nonexistent/gin-ep-test"),
            &[],
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(err.to_string().contains("rank 0"), "{err}");
        assert!(launch_ranks(0, Path::new("/bin/true"), &[], Duration::from_secs(1)).is_err());
    }

    #[test]
    fn stderr_keeps_only_a_bounded_tail() {
        let sink = Mutex::new(Vec::new());
        let data: Vec<u8> = (0..STDERR_TAIL * 3).map(|i| (i % 251) as u8).collect();
        keep_tail(data.as_slice(), &sink);
        let kept = sink.into_inner().unwrap();
        assert_eq!(kept.len(), STDERR_TAIL);
        assert_eq!(kept, data[data.len() - STDERR_TAIL..]);
    }
}
