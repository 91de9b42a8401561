//! `gin-ep check --gpus G [--vnodes K] [--node-size M] --mode gin`: the GIN conformance
//! check on G x K ranks. The parent starts the ranks (this binary with GIN_EP_CHILD), each
//! runs `gin_ep::gpu::gincheck::check_rank`, rank 0 prints one line per rank and
//! the summary; the parent turns failed ranks into the error.
//!
//! Owns: the option mapping, the launch, the per-rank lines and the summary, and the verdict
//! of `--kill` (every other rank must fail in time naming the killed one). Never decides
//! whether data is right (the kernel and its driver do), and never waits on a group whose
//! check failed (a peer may be dead: the failing rank exits at once).

use crate::check_cmd::CheckArgs;
use crate::error::{CliError, CliResult};
use crate::gpus;
use gin_ep::gpu::gincheck::{check_rank, GinCheckOptions, KILL_EXIT};
use gin_ep::group::vnodes::TIME_SLICED;
use gin_ep::group::{Group, RankExit, ENV_CHILD};
use std::time::{Duration, Instant};

/// Iterations when `--iters` is absent.
pub const DEFAULT_ITERS: u64 = 100;
/// The launcher's deadline is at least this: long checks (10^4 iterations on time-sliced
/// processes) run far longer than one wait's `--timeout`.
const MIN_RUN_DEADLINE: Duration = Duration::from_secs(600);

/// Parses `--kill RANK:ITER`; the error names the value.
pub fn parse_kill(spec: &str) -> CliResult<(usize, u64)> {
    let bad = |why: &str| CliError::Usage(format!("invalid value: kill = `{spec}`: {why}"));
    let (r, it) = spec
        .split_once(':')
        .ok_or_else(|| bad("expected RANK:ITER, e.g. 2:50"))?;
    let r = r
        .trim()
        .parse::<usize>()
        .map_err(|_| bad("RANK must be a whole number"))?;
    let it = it
        .trim()
        .parse::<u64>()
        .map_err(|_| bad("ITER must be a whole number"))?;
    Ok((r, it))
}

/// The check's options from the flags (applicability was checked by `check_cmd::resolve`).
fn options(a: &CheckArgs) -> CliResult<GinCheckOptions> {
    Ok(GinCheckOptions {
        iters: a.iters.map_or(DEFAULT_ITERS, |n| n as u64),
        seed: a.seed.unwrap_or(0),
        kill: a.kill.as_deref().map(parse_kill).transpose()?,
        timeout: a.timeout,
        ..GinCheckOptions::default()
    })
}

/// A refused option of the check as a usage error naming its flag.
fn refused(e: gin_ep::Error) -> CliError {
    let flag = match &e {
        gin_ep::Error::InvalidInput { what, .. } => match what.as_str() {
            "iters" => Some("--iters"),
            "kill" => Some("--kill"),
            "max-bytes" => Some("the check's largest put"),
            _ => None,
        },
        _ => None,
    };
    match flag {
        Some(f) if e.is_usage() => CliError::Usage(format!("{e} (set by {f})")),
        _ => CliError::from(e),
    }
}

/// Runs the check on `gpus` GPUs (parent or rank, by GIN_EP_CHILD).
pub fn run(a: &CheckArgs, gpus: usize) -> CliResult {
    let world = gpus::set_topology(gpus, &a.shape)?;
    let opts = options(a)?;
    opts.validate(world).map_err(refused)?;
    if std::env::var_os(ENV_CHILD).is_some() {
        return run_child(a, &opts);
    }
    let k = a.shape.vnodes.unwrap_or(1);
    let node = match a.shape.node_size {
        Some(m) => format!("gin-ep nodes of {m} rank(s) (same-node peers by stores)"),
        None => "gin-ep node = NCCL's LSA team".to_string(),
    };
    out!(
        "check: GIN conformance, {gpus} GPU(s) x {k} process(es) = {world} rank(s), {node}, {} \
         iteration(s), seed {}, deadline {:?} per wait{}",
        opts.iters,
        opts.seed,
        opts.timeout,
        opts.kill
            .map(|(r, it)| format!(", rank {r} killed before iteration {it}"))
            .unwrap_or_default()
    );
    if k > 1 {
        out!("processes share GPUs: {TIME_SLICED}");
    }
    let t0 = Instant::now();
    let exits = gpus::relaunch_all(gpus, a.timeout.max(MIN_RUN_DEADLINE))?;
    let secs = t0.elapsed().as_secs_f64();
    match opts.kill {
        Some((victim, it)) => {
            let v = kill_verdict("GIN conformance check", &exits, victim, it, a.timeout);
            out!("{}", v.as_ref().unwrap_or_else(|e| e));
            v.map(|_| ())
                .map_err(|_| CliError::Failed("the GIN kill check failed (above)".into()))
        }
        None => match failure_report(&exits) {
            None => {
                out!("{world} rank(s) passed, 0 failed ({secs:.1} s)");
                Ok(())
            }
            Some(report) => Err(CliError::Failed(report)),
        },
    }
}

/// One rank: the check, then (on success) its result to rank 0, which prints every rank's
/// line and the summary.
fn run_child(a: &CheckArgs, opts: &GinCheckOptions) -> CliResult {
    let group = Group::from_env(a.timeout)?;
    let me = group.rank();
    let report = match check_rank(&group, opts) {
        Ok(r) => r,
        // No close: its barrier would wait a whole timeout on the peer that failed.
        Err(e) => return Err(CliError::Failed(format!("rank {me}: {e}"))),
    };
    let raw = serde_json::to_vec(&report)
        .map_err(|e| CliError::Failed(format!("rank {me}: cannot encode the report: {e}")))?;
    group
        .store()
        .set(&group.key(&format!("gincheck/report/{me}")), &raw)?;
    if me == 0 {
        let mut all = Vec::with_capacity(group.world());
        for r in 0..group.world() {
            let raw = group
                .store()
                .get(&group.key(&format!("gincheck/report/{r}")), a.timeout)?;
            all.push(decode(&raw).map_err(|e| CliError::Failed(format!("report of rank {r}: {e}")))?);
        }
        print_results(&all);
    }
    group.close()?;
    Ok(())
}

/// What rank 0 prints of another rank's report.
#[derive(Debug, Clone, PartialEq)]
struct RankLine {
    rank: u64,
    iters: u64,
    operations: u64,
    bytes_checked: u64,
    node_peers: u64,
    secs: f64,
    time_sliced: bool,
}

fn decode(raw: &[u8]) -> Result<RankLine, String> {
    let v: serde_json::Value = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
    let num = |k: &str| v[k].as_u64().ok_or_else(|| format!("no `{k}`"));
    Ok(RankLine {
        rank: num("rank")?,
        iters: num("iters")?,
        operations: num("operations")?,
        bytes_checked: num("bytes_checked")?,
        node_peers: num("node_peers")?,
        secs: v["secs"].as_f64().ok_or("no `secs`")?,
        time_sliced: v["time_sliced"].as_bool().ok_or("no `time_sliced`")?,
    })
}

fn print_results(all: &[RankLine]) {
    for r in all {
        out!(
            "rank {}: pass: {} iteration(s), {} operation(s), {} byte(s) checked bit-exact, {} \
             same-node peer(s) reached by stores, {:.2} s",
            r.rank,
            r.iters,
            r.operations,
            r.bytes_checked,
            r.node_peers,
            r.secs
        );
    }
    let ops: u64 = all.iter().map(|r| r.operations).sum();
    let bytes: u64 = all.iter().map(|r| r.bytes_checked).sum();
    let slowest = all.iter().map(|r| r.secs).fold(0.0, f64::max);
    let iters = all.first().map_or(0, |r| r.iters);
    let sliced = if all.iter().any(|r| r.time_sliced) {
        format!("; {TIME_SLICED}")
    } else {
        String::new()
    };
    out!(
        "GIN conformance passed: {} rank(s), {iters} iteration(s), {ops} operation(s), {bytes} \
         byte(s) checked bit-exact, {slowest:.2} s (slowest rank){sliced}",
        all.len()
    );
}

/// The last non-empty line of a rank's stderr, cut to 300 characters.
fn last_line(s: &str) -> String {
    let line = s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    line.chars().take(300).collect()
}

fn how(e: &RankExit) -> String {
    if e.killed {
        "was killed at the launcher's deadline".to_string()
    } else {
        match e.status.code() {
            Some(c) => format!("exited with status {c}"),
            None => format!("ended by {}", e.status),
        }
    }
}

/// Without `--kill`: the first rank to fail in full, then one line per other failed rank.
fn failure_report(exits: &[RankExit]) -> Option<String> {
    let first = gin_ep::group::first_failure(exits)?;
    let mut s = format!(
        "GIN conformance check failed: rank {} {} after {:.1} s (the first rank to fail); its \
         stderr:\n{}",
        first.rank,
        how(first),
        first.elapsed.as_secs_f64(),
        first.stderr.trim_end()
    );
    for e in exits.iter().filter(|e| !e.success() && e.rank != first.rank) {
        s.push_str(&format!(
            "\n  then rank {} {} after {:.1} s: {}",
            e.rank,
            how(e),
            e.elapsed.as_secs_f64(),
            last_line(&e.stderr)
        ));
    }
    Some(s)
}

/// Whether `text` names rank `r` ("rank 2", not "rank 20").
fn names_rank(text: &str, r: usize) -> bool {
    let needle = format!("rank {r}");
    text.match_indices(&needle).any(|(i, _)| {
        !text[i + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}

/// With `--kill VICTIM:ITER`: the check passes (`Ok`, its report) when the victim died as
/// asked and every other rank failed within two deadlines of it, naming it (one deadline to
/// notice, one to report, as the launcher allows); `Err` says which of these did not hold.
/// Either report lists every survivor's last error line.
pub fn kill_verdict(
    what: &str,
    exits: &[RankExit],
    victim: usize,
    it: u64,
    timeout: Duration,
) -> Result<String, String> {
    let Some(v) = exits.iter().find(|e| e.rank == victim) else {
        return Err(format!(
            "{what} failed with --kill {victim}:{it}: rank {victim} was never started"
        ));
    };
    let died = !v.killed && v.status.code() == Some(KILL_EXIT);
    let mut bad = Vec::new();
    let mut lines = Vec::new();
    for e in exits.iter().filter(|e| e.rank != victim) {
        let lag = e.elapsed.saturating_sub(v.elapsed);
        let named = names_rank(&e.stderr, victim);
        let ok = !e.success() && !e.killed && named && lag <= timeout * 2;
        if !ok {
            bad.push(e.rank.to_string());
        }
        lines.push(format!(
            "  rank {} {} {:.1} s after rank {victim}{}: {}",
            e.rank,
            if e.success() { "passed".to_string() } else { how(e) },
            lag.as_secs_f64(),
            if named { "" } else { " WITHOUT naming it" },
            last_line(&e.stderr)
        ));
    }
    let verdict = match (died, bad.is_empty()) {
        (false, _) => format!(
            "rank {victim} did not exit as --kill asked ({}): {}",
            how(v),
            last_line(&v.stderr)
        ),
        (true, true) => format!(
            "every other rank failed within 2 x --timeout ({:?}) naming rank {victim}",
            timeout * 2
        ),
        (true, false) => format!(
            "NOT every other rank failed in time naming rank {victim}: rank(s) {}",
            bad.join(", ")
        ),
    };
    let report = |outcome: &str| {
        format!(
            "{what} {outcome} with --kill {victim}:{it}: rank {victim} {} after {:.1} s \
             (status {KILL_EXIT} is the kill); {verdict}\n{}",
            how(v),
            v.elapsed.as_secs_f64(),
            lines.join("\n")
        )
    };
    if died && bad.is_empty() {
        Ok(report("passed"))
    } else {
        Err(report("failed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gin_ep::gpu::gincheck::GinCheckReport;

    #[test]
    fn kill_specs_parse_or_name_the_bad_part() {
        assert_eq!(parse_kill("2:50").unwrap(), (2, 50));
        for (bad, needle) in [
            ("2", "RANK:ITER"),
            ("x:5", "RANK"),
            ("1:y", "ITER"),
            ("-1:5", "RANK"),
        ] {
            let e = parse_kill(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn a_rank_is_named_only_by_its_own_number() {
        assert!(names_rank("error: rank 1: rank 2 failed in phase `x`", 2));
        assert!(names_rank("peer is rank 2", 2));
        assert!(!names_rank("rank 20 failed", 2));
        assert!(!names_rank("peer 2 failed", 2));
    }

    fn exit(rank: usize, code: i32, secs: u64, stderr: &str) -> RankExit {
        use std::os::unix::process::ExitStatusExt;
        RankExit {
            rank,
            status: std::process::ExitStatus::from_raw(code << 8),
            killed: false,
            elapsed: Duration::from_secs(secs),
            stderr: stderr.into(),
            progress: None,
        }
    }

    #[test]
    fn the_kill_verdict_needs_every_survivor_to_fail_in_time_naming_the_victim() {
        let t = Duration::from_secs(20);
        let victim = exit(2, KILL_EXIT, 5, "rank 2: --kill 2:50: exiting abruptly now");
        let named = |r| {
            exit(
                r,
                1,
                30,
                "error: rank 0: rank 2 failed in phase `GIN conformance check`",
            )
        };
        let good = [named(0), named(1), victim.clone(), named(3)];
        let v = kill_verdict("GIN conformance check", &good, 2, 50, t).unwrap();
        assert!(
            v.contains("passed with --kill 2:50") && v.contains("every other rank failed within"),
            "{v}"
        );
        // A survivor that names someone else, one too late, one that passed: each is caught.
        for bad in [
            exit(3, 1, 30, "error: rank 3: timeout waiting for rank 1"),
            exit(3, 1, 50, "error: rank 3: rank 2 failed"),
            exit(3, 0, 30, ""),
        ] {
            let v = kill_verdict(
                "GIN conformance check",
                &[named(0), named(1), victim.clone(), bad],
                2,
                50,
                t,
            )
            .unwrap_err();
            assert!(
                v.contains("NOT every other rank") && v.contains("rank(s) 3"),
                "{v}"
            );
        }
        let survived = exit(2, 1, 5, "some other error");
        let v = kill_verdict(
            "GIN conformance check",
            &[named(0), named(1), survived, named(3)],
            2,
            50,
            t,
        )
        .unwrap_err();
        assert!(v.contains("did not exit as --kill asked"), "{v}");
    }

    #[test]
    fn reports_round_trip_from_the_library_to_the_printed_line() {
        let rep = GinCheckReport {
            rank: 3,
            world: 4,
            iters: 7,
            operations: 99,
            bytes_checked: 12345,
            node_peers: 1,
            secs: 0.5,
            time_sliced: true,
        };
        let line = decode(&serde_json::to_vec(&rep).unwrap()).unwrap();
        assert_eq!(
            line,
            RankLine {
                rank: 3,
                iters: 7,
                operations: 99,
                bytes_checked: 12345,
                node_peers: 1,
                secs: 0.5,
                time_sliced: true
            }
        );
        assert!(decode(b"{\"rank\": 1}").unwrap_err().contains("iters"));
    }
}
