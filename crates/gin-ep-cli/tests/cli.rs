//! End-to-end tests of the `gin-ep` binary: exit codes, messages, and small
//! real runs of `check`, `bench` and `info` on the host backend.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_gin-ep");

fn gin_ep(args: &[&str]) -> Output {
    Command::new(EXE)
        .args(args)
        .env_remove("GIN_EP_FAULT")
        .output()
        .expect("run gin-ep")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs `args`, expects exit code 2 and `needle` in stderr, and no panic.
fn usage_error(args: &[&str], needle: &str) {
    let o = gin_ep(args);
    let (out, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "gin-ep {args:?}: want exit 2\nstdout: {out}\nstderr: {err}"
    );
    assert!(
        err.contains(needle),
        "gin-ep {args:?}: stderr does not name `{needle}`: {err}"
    );
    assert!(!err.contains("panicked"), "gin-ep {args:?} panicked: {err}");
}

#[test]
fn bad_config_values_are_named_and_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--experts", "255"], "experts = 255"),
        (&["bench", "--experts", "255"], "ranks = 4"),
        (&["bench", "--dtype", "fp8", "--hidden", "136"], "hidden = 136"),
        (
            &["bench", "--dtype", "fp8-ue8m0", "--hidden", "200"],
            "hidden = 200",
        ),
        (
            &["bench", "--tokens", "5000", "--max-tokens", "4096"],
            "tokens = 5000",
        ),
        (&["bench", "--ranks", "0"], "ranks = 0"),
        (&["bench", "--ht-sizing", "exact"], "--ht-sizing exact"),
        (&["bench", "--ht-sizing", "sometimes"], "sometimes"),
        (&["bench", "--ranks", "65", "--experts", "260"], "ranks = 65"),
        (&["bench", "--hidden", "0"], "hidden = 0"),
        (&["bench", "--hidden", "1e9"], "1e9"),
        (&["bench", "--hidden", "1000000000"], "hidden = 1000000000"),
        (&["bench", "--hidden", "100"], "hidden = 100"),
        (&["bench", "--topk", "0"], "topk = 0"),
        (
            &["bench", "--ranks", "2", "--experts", "16", "--topk", "20"],
            "topk = 20",
        ),
        (&["bench", "--experts", "0"], "experts = 0"),
        (&["bench", "--tokens", "0"], "= 0"),
        (&["bench", "--iters", "0"], "iters = 0"),
        (&["bench", "--tokens", "-3"], "-3"),
        (&["bench", "--dtype", "fp16"], "fp16"),
        (&["bench", "--mode", "xx"], "xx"),
        (&["bench", "--timeout", "0"], "'0'"),
        (&["bench", "--timeout", "soon"], "soon"),
        (&["bench", "--routing", "zipf:x"], "zipf:x"),
        (&["bench", "--routing", "zipf:0"], "zipf:0"),
        (&["bench", "--routing", "hot:2"], "hot:2"),
        (&["bench", "--routing", "normal"], "normal"),
        (&["check", "--ranks", "3-1"], "3-1"),
        (&["check", "--ranks", "x"], "`x`"),
        (&["check", "--ranks", "0"], "'0'"),
        (&["check", "--ranks", "2,,4"], "2,,4"),
        (&["check", "--ranks", "1-100"], "1-100"),
        (&["check", "--launch", "mpi"], "mpi"),
        (&["check", "--cases", "0"], "cases = 0"),
        (&["check", "--iters", "0"], "iters = 0"),
        (&["check", "--cases", "3", "--case", "3"], "case = 3"),
        (&["alltoall", "--modes", "nccl,lsa-fast"], "ce-serial"),
        (&["alltoall", "--modes", "lsa-each"], "lsa-count"),
        (&["alltoall", "--modes", "ce,ce"], "`ce` given twice"),
    ];
    for (args, needle) in cases {
        usage_error(args, needle);
    }
}

#[test]
fn absurd_sizes_are_refused_not_attempted() {
    // Valid for the library, but far more memory than any machine has.
    let t0 = Instant::now();
    usage_error(
        &[
            "bench",
            "--ranks",
            "64",
            "--experts",
            "256",
            "--hidden",
            "65536",
            "--tokens",
            "1048576",
        ],
        "ranks = 64",
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn unknown_flags_and_subcommands_exit_2() {
    usage_error(&["bench", "--bogus"], "--bogus");
    usage_error(&["frobnicate"], "frobnicate");
    usage_error(&[], "Usage");
}

#[test]
fn bad_fault_spec_exits_2() {
    let o = Command::new(EXE)
        .args(["check", "--ranks", "2", "--cases", "1"])
        .env("GIN_EP_FAULT", "one:combine")
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("one"), "{err}");
}

#[test]
fn bad_stall_spec_exits_2_naming_it() {
    usage_error(
        &["check", "--gpus", "2", "--stall", "5:ht-combine"],
        "rank 5 is not below the 2 GPUs",
    );
    usage_error(
        &["check", "--gpus", "2", "--stall", "1:ll-nothing"],
        "`ll-nothing` is not ht-dispatch, ht-combine, ll-dispatch, ll-combine or ll-combine-rank-first",
    );
    usage_error(
        &["check", "--gpus", "2", "--stall", "1:ll-combine", "--mode", "ht"],
        "use --mode ll",
    );
    usage_error(&["check", "--gpus", "2", "--stall", "1"], "expected RANK:OP");
    usage_error(
        &["check", "--gpus", "2", "--stall", "1:ht-combine", "--mode", "ll"],
        "use --mode ht",
    );
}

#[test]
fn gpus_flag_without_a_gpu_is_a_clear_failure() {
    // On a machine with GPUs this would run; the test machines have none.
    if gin_ep::backend::cuda::driver::probe().is_ok() {
        return;
    }
    for args in [
        &[
            "bench", "--gpus", "2", "--tokens", "8", "--hidden", "128", "--iters", "1",
        ][..],
        &["check", "--gpus", "2", "--cases", "1"][..],
    ] {
        let o = gin_ep(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("unavailable"), "{args:?}: {err}");
    }
}

#[test]
fn check_threads_passes() {
    let o = gin_ep(&["check", "--ranks", "1-3", "--cases", "3"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("9 cases passed (ranks 1-3, threads)"), "{out}");
    assert!(out.contains("9 passed, 0 failed"), "{out}");
}

#[test]
fn check_processes_passes() {
    let o = gin_ep(&[
        "check",
        "--launch",
        "processes",
        "--ranks",
        "2,3",
        "--cases",
        "2",
        "--timeout",
        "30",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("4 passed, 0 failed"), "{out}");
}

#[test]
fn a_killed_rank_is_named_with_its_phase_within_the_timeout() {
    let t0 = Instant::now();
    let o = Command::new(EXE)
        .args([
            "check",
            "--launch",
            "processes",
            "--ranks",
            "3",
            "--cases",
            "1",
            "--timeout",
            "2",
        ])
        .env("GIN_EP_FAULT", "1:combine")
        .output()
        .unwrap();
    let took = t0.elapsed();
    let (out, err) = text(&o);
    let all = format!("{out}\n{err}");
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(took < Duration::from_secs(15), "took {took:?}: {all}");
    assert!(all.contains("rank 1"), "{all}");
    assert!(all.contains("`combine`"), "{all}");
    assert!(!all.contains("panicked"), "{all}");
}

#[test]
fn bench_writes_json_with_ops_and_options() {
    let dir = std::env::temp_dir().join(format!("gin-ep-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench.json");
    let o = gin_ep(&[
        "bench",
        "--ranks",
        "2",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--experts",
        "8",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
        path.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("backend: host")).count(),
        1,
        "{out}"
    );
    for needle in ["dispatch", "combine", "median µs", "logical GB/s", "remote"] {
        assert!(out.contains(needle), "no `{needle}` in {out}");
    }
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ops = doc["ops"].as_array().expect("ops array");
    let names: Vec<&str> = ops.iter().filter_map(|op| op["op"].as_str()).collect();
    assert_eq!(names, ["dispatch", "combine"]);
    for op in ops {
        assert!(op["total"]["median_us"].as_f64().unwrap() > 0.0, "{op}");
        assert!(op["logical_gbps"].as_f64().is_some(), "{op}");
    }
    assert_eq!(doc["options"]["ranks"], 2);
    assert_eq!(doc["options"]["hidden"], 256);
    assert_eq!(doc["options"]["iters"], 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_ll_mode_runs() {
    let o = gin_ep(&[
        "bench",
        "--mode",
        "ll",
        "--ranks",
        "2",
        "--tokens",
        "8",
        "--hidden",
        "128",
        "--experts",
        "4",
        "--topk",
        "2",
        "--dtype",
        "fp8",
        "--iters",
        "2",
        "--warmup",
        "0",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("LL: 2 ranks"), "{out}");
}

#[test]
fn info_reports_this_machine() {
    let o = gin_ep(&["info"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for needle in ["cpus:", "gpus:", "nccl:", "kernels:", "backends:"] {
        assert!(out.contains(needle), "no `{needle}` in {out}");
    }
}
