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
        "rank 5 is not below the 2 ranks",
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
fn ll_across_nccl_nodes_is_accepted() {
    // Not refused as a usage error (exit 2): it fails later, for want of a GPU (or of the
    // plugin beside the binary), or runs where there is one.
    if gin_ep::backend::cuda::driver::probe().is_ok() {
        return;
    }
    let bench: &[&str] = &[
        "bench",
        "--gpus",
        "1",
        "--vnodes",
        "2",
        "--node-size",
        "1",
        "--mode",
        "ll",
        "--tokens",
        "8",
        "--hidden",
        "128",
        "--iters",
        "1",
    ];
    // One process per GPU, each its own NCCL node (no GPU shared).
    let check: &[&str] = &["check", "--gpus", "2", "--nccl-node-size", "1", "--mode", "ll"];
    for args in [bench, check] {
        let o = gin_ep(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("does not apply"), "{args:?}: {err}");
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

/// After a failure the summary counts the cases that passed before it, under either
/// launcher: cases 0 and 1 pass, then rank 1 dies in case 2.
#[test]
fn the_summary_after_a_failure_counts_the_cases_that_passed() {
    for launch in ["processes", "threads"] {
        let o = Command::new(EXE)
            .args([
                "check",
                "--launch",
                launch,
                "--ranks",
                "2",
                "--cases",
                "4",
                "--timeout",
                "5",
            ])
            .env("GIN_EP_FAULT", "1:combine")
            .env("GIN_EP_FAULT_CASE", "2")
            .output()
            .unwrap();
        let (out, err) = text(&o);
        let all = format!("{out}\n{err}");
        assert_eq!(o.status.code(), Some(1), "{launch}: {all}");
        assert!(out.contains("2 passed, 1 failed"), "{launch}: {all}");
        assert!(all.contains("case 2"), "{launch}: {all}");
    }
}

#[test]
fn check_ht_across_nodes_passes_on_threads_and_processes() {
    for (launch, node_size, ranks, want) in [
        ("threads", "2", "4,6", "6 passed, 0 failed"),
        ("threads", "1", "4", "3 passed, 0 failed"),
        ("processes", "2", "4", "3 passed, 0 failed"),
    ] {
        let o = gin_ep(&[
            "check",
            "--launch",
            launch,
            "--node-size",
            node_size,
            "--ranks",
            ranks,
            "--cases",
            "3",
            "--mode",
            "ht",
            "--timeout",
            "30",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
        assert!(
            out.contains(&format!("in nodes of {node_size} (HT across nodes)")),
            "{out}"
        );
        assert!(out.contains(want), "{out}");
    }
}

#[test]
fn a_bad_node_size_on_the_host_is_refused_naming_it() {
    usage_error(&["check", "--node-size", "0"], "--node-size 0");
    usage_error(
        &["check", "--node-size", "2", "--ranks", "2,3"],
        "--node-size 2 does not divide --ranks 3",
    );
    usage_error(
        &["check", "--launch", "processes", "--node-size", "5"],
        "--node-size 5",
    );
    usage_error(&["check", "--node-size", "2", "--mode", "ll"], "--node-size");
    usage_error(&["check", "--node-size", "x"], "--node-size");
    usage_error(
        &["bench", "--node-size", "3", "--ranks", "4"],
        "--node-size 3 does not divide --ranks 4",
    );
    usage_error(&["bench", "--node-size", "0"], "--node-size 0");
    usage_error(&["bench", "--node-size", "2", "--mode", "ll"], "--node-size");
}

#[test]
fn bench_ht_across_nodes_runs_on_the_host_and_says_so() {
    let o = gin_ep(&[
        "bench",
        "--mode",
        "ht",
        "--node-size",
        "2",
        "--ranks",
        "4",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--iters",
        "2",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("4 ranks in 2 nodes of 2 (across nodes"), "{out}");
    // The across-node phases are timed: the combine's node partials and their sum.
    assert!(out.contains("combine reduce"), "{out}");
    let flat = gin_ep(&[
        "bench", "--mode", "ht", "--ranks", "4", "--tokens", "64", "--hidden", "256", "--iters", "2",
    ]);
    let (out, _) = text(&flat);
    assert!(flat.status.success() && !out.contains("combine reduce"), "{out}");
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
fn a_rank_killed_at_the_forward_is_named_with_its_node() {
    // 2 nodes of 2 processes: rank 3 exits at the forward; rank 2 (its node) waits for the
    // rows rank 3 owes it and names rank 3 and node 1.
    let t0 = Instant::now();
    let o = Command::new(EXE)
        .args([
            "check",
            "--launch",
            "processes",
            "--ranks",
            "4",
            "--node-size",
            "2",
            "--mode",
            "ht",
            "--cases",
            "1",
            "--timeout",
            "2",
        ])
        .env("GIN_EP_FAULT", "3:forward")
        .output()
        .unwrap();
    let took = t0.elapsed();
    let (out, err) = text(&o);
    let all = format!("{out}\n{err}");
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(took < Duration::from_secs(15), "took {took:?}: {all}");
    assert!(all.contains("rank 3 exits at phase `forward`"), "{all}");
    assert!(all.contains("rank 3 of node 1"), "{all}");
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

#[test]
fn negative_numbers_are_refused_naming_the_flag() {
    for (args, flag) in [
        (&["bench", "--tokens", "-1"][..], "--tokens"),
        (&["bench", "--iters", "-2"][..], "--iters"),
        (&["check", "--seed", "-5"][..], "--seed"),
        (&["check", "--cases", "-1"][..], "--cases"),
        (&["alltoall", "--iters", "-1"][..], "--iters"),
    ] {
        let o = gin_ep(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains("negative"), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn huge_counts_are_refused_before_any_allocation() {
    let t0 = Instant::now();
    usage_error(&["bench", "--iters", "99999999999"], "iters = 99999999999");
    usage_error(&["bench", "--warmup", "99999999999"], "warmup = 99999999999");
    usage_error(&["check", "--cases", "99999999999"], "cases = 99999999999");
    usage_error(&["check", "--iters", "99999999999"], "iters = 99999999999");
    usage_error(&["bench", "--tokens", "99999999999999999999999"], "--tokens");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn the_memory_estimate_covers_more_than_the_heaps() {
    // Small heaps (about 1.5 GiB) but expert-major LL buffers of 16384 local experts × 4
    // ranks × 2^20 tokens: terabytes. The check used to count the heaps alone and let the
    // OOM killer end the run without a message.
    let t0 = Instant::now();
    let args = [
        "bench",
        "--mode",
        "ll",
        "--experts",
        "65536",
        "--max-tokens",
        "1048576",
        "--tokens",
        "1",
        "--hidden",
        "8",
    ];
    usage_error(&args, "inputs and per-iteration buffers");
    usage_error(&args, "MemAvailable");
    usage_error(&args, "--max-tokens");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn options_that_do_not_apply_are_refused_not_ignored() {
    let cases: &[(&[&str], &[&str])] = &[
        // GPU-only options without --gpus.
        (&["check", "--stall", "2:ht-combine"], &["--stall", "--gpus"]),
        (&["check", "--variants", "all"], &["--variants", "--gpus"]),
        (&["check", "--random-only"], &["--random-only", "--gpus"]),
        (&["bench", "--sms", "4"], &["--sms", "--gpus"]),
        (&["bench", "--sweep"], &["--sweep", "--gpus"]),
        (&["bench", "--sweep-list", "sms=32"], &["--sweep-list", "--gpus"]),
        (
            &["bench", "--ht-sizing", "static"],
            &["--ht-sizing static", "--gpus"],
        ),
        // Options of the other mode.
        (
            &["bench", "--ll-combine-order", "rank-first"],
            &["--ll-combine-order", "--mode ll", "--mode ht"],
        ),
        (
            &["bench", "--mode", "ll", "--alignment", "4"],
            &["--alignment", "--mode ll"],
        ),
        (
            &["bench", "--gpus", "2", "--mode", "ll", "--ht-sizing", "exact"],
            &["--ht-sizing exact", "--mode ll"],
        ),
        // Host-only options with --gpus, and options another one replaces.
        (&["bench", "--gpus", "2", "--ranks", "2"], &["--ranks", "--gpus"]),
        (&["check", "--gpus", "2", "--launch", "processes"], &["--launch"]),
        (&["check", "--gpus", "2", "--iters", "3"], &["--iters"]),
        (&["check", "--gpus", "2", "--case", "1"], &["--case"]),
        (
            &["check", "--gpus", "2", "--mode", "ll", "--seed", "3"],
            &["--seed", "--mode ll"],
        ),
        (
            &["check", "--gpus", "2", "--stall", "1:ht-combine", "--cases", "3"],
            &["--cases", "--stall"],
        ),
        (
            &["bench", "--gpus", "2", "--sweep-list", "sms=32"],
            &["--sweep-list", "--sweep"],
        ),
        // LL has one kernel path: no variant sweep, no variant list to check.
        (
            &["bench", "--gpus", "2", "--mode", "ll", "--sweep"],
            &["--sweep", "--mode ll"],
        ),
        (
            &["check", "--gpus", "2", "--mode", "ll", "--variants", "all"],
            &["--variants", "--mode ll"],
        ),
        (
            &["check", "--gpus", "2", "--mode", "ll", "--random-only"],
            &["--random-only", "--mode ll"],
        ),
    ];
    for (args, needles) in cases {
        for needle in *needles {
            usage_error(args, needle);
        }
    }
}

#[test]
fn bench_path_is_checked_before_any_gpu_process() {
    // A bad value is named.
    usage_error(&["bench", "--gpus", "1", "--path", "sideways"], "sideways");
    // GPU runs only, and never with the sweep (it times the HT driver's variants).
    for needle in ["--path driver", "--gpus"] {
        usage_error(&["bench", "--path", "driver"], needle);
    }
    for needle in ["--path ep", "--sweep"] {
        usage_error(&["bench", "--gpus", "1", "--sweep", "--path", "ep"], needle);
    }
    // What only the drivers' benchmark does is refused on the path through Ep, named, in
    // both spellings of the default.
    for path in [&[][..], &["--path", "ep"][..]] {
        let mut args = vec!["bench", "--gpus", "1", "--mode", "ll"];
        args.extend_from_slice(path);
        let o = Command::new(EXE)
            .args(&args)
            .env("GIN_EP_LL_STAMPS", "edges")
            .output()
            .expect("run gin-ep");
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\nstdout: {out}\nstderr: {err}");
        for needle in ["GIN_EP_LL_STAMPS", "edges", "--path driver"] {
            assert!(
                err.contains(needle),
                "{args:?}: stderr does not name `{needle}`: {err}"
            );
        }
    }
    // HT has no stamps to refuse: the variable only matters to LL.
    let o = Command::new(EXE)
        .args(["bench", "--gpus", "1", "--mode", "ht", "--path", "sideways"])
        .env("GIN_EP_LL_STAMPS", "edges")
        .output()
        .expect("run gin-ep");
    let err = text(&o).1;
    assert!(
        err.contains("sideways") && !err.contains("GIN_EP_LL_STAMPS"),
        "{err}"
    );
}

#[test]
fn check_mode_ll_runs_only_ll_on_the_host() {
    let o = gin_ep(&["check", "--mode", "ll", "--ranks", "1-3", "--cases", "3"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("operations LL only"), "{out}");
    assert!(out.contains("9 passed, 0 failed"), "{out}");
    let o = gin_ep(&["check", "--ranks", "2", "--cases", "1"]);
    assert!(text(&o).0.contains("operations HT and LL"), "{:?}", text(&o));
}

#[test]
fn bench_banner_tells_whether_the_kernels_are_in_this_build() {
    let info = text(&gin_ep(&["info"])).0;
    let absent = info
        .lines()
        .any(|l| l.starts_with("kernels:") && l.contains("absent"));
    let o = gin_ep(&[
        "bench",
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
        "--iters",
        "1",
        "--warmup",
        "0",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let banner = out.lines().next().unwrap_or("");
    assert!(
        banner.starts_with("backend: host") && banner.contains("no --gpus"),
        "{banner}"
    );
    let want = if absent {
        "this build has no CUDA kernels"
    } else {
        "this build has the CUDA kernels"
    };
    assert!(
        banner.contains(want),
        "info says kernels absent = {absent}: {banner}"
    );
    // The shape comes before the run's tables.
    let shape = out.find("HT: 2 ranks").expect("shape line");
    assert!(shape < out.find("median µs").expect("table"), "{out}");
}

#[test]
fn long_runs_print_progress_lines_into_a_log() {
    let o = Command::new(EXE)
        .args([
            "bench",
            "--ranks",
            "2",
            "--tokens",
            "512",
            "--hidden",
            "1024",
            "--experts",
            "8",
            "--iters",
            "40",
            "--warmup",
            "0",
        ])
        .env("GIN_EP_PROGRESS_SECS", "0.02")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        err.lines().any(|l| l.starts_with("bench: ")),
        "no progress line: {err}"
    );
    let o = Command::new(EXE)
        .args(["check", "--ranks", "1-4", "--cases", "4"])
        .env("GIN_EP_PROGRESS_SECS", "0.02")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        err.lines().any(|l| l.starts_with("check: ranks")),
        "no progress line: {err}"
    );
}

#[test]
fn an_unwritable_json_path_is_bad_input() {
    usage_error(
        &["bench", "--tokens", "8", "--json", "/nonexistent-dir/bench.json"],
        "--json /nonexistent-dir/bench.json",
    );
}

#[test]
fn steep_zipf_routing_runs_in_time() {
    // Rejection sampling needed about 1e9 draws per token here, so the run printed nothing
    // and a peer's deadline blamed "rank 1".
    let t0 = Instant::now();
    let o = gin_ep(&[
        "bench",
        "--routing",
        "zipf:10",
        "--ranks",
        "4",
        "--tokens",
        "4096",
        "--hidden",
        "128",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--timeout",
        "20",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
}

#[test]
fn virtual_node_and_gin_options_are_refused_where_they_do_not_apply() {
    let lsa = "HT reaches peers by load/store only";
    let ll_gin = "LL crosses gin-ep nodes over GIN, which needs several NCCL nodes";
    let cases: &[(&[&str], &[&str])] = &[
        // GPU-only options without --gpus.
        (&["check", "--vnodes", "2"], &["--vnodes", "--gpus"]),
        // (check --node-size on the host backend is HT across nodes.)
        (&["check", "--kill", "1:5"], &["--kill", "--gpus"]),
        (&["bench", "--vnodes", "2"], &["--vnodes", "--gpus"]),
        (
            &["bench", "--mode", "ll", "--node-size", "2"],
            &["--node-size", "--mode ht only"],
        ),
        (&["alltoall", "--vnodes", "2"], &["--vnodes", "--gpus"]),
        (&["alltoall", "--node-size", "2"], &["--node-size", "--gpus"]),
        // GIN has no host backend, and bench does not time it.
        (&["check", "--mode", "gin"], &["--mode gin", "--gpus"]),
        (&["bench", "--mode", "gin"], &["--mode gin", "gin-ep check"]),
        (&["bench", "--gpus", "1", "--mode", "gin"], &["--mode gin"]),
        // --kill in every GPU mode, on a launch the mode can run on; --stall, --cases,
        // --variants never with it.
        (
            &["check", "--gpus", "1", "--vnodes", "2", "--kill", "1:5"],
            &["--mode ht across NCCL nodes", "needs --node-size 2"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--node-size",
                "1",
                "--mode",
                "ht",
                "--kill",
                "2:5",
            ],
            &["--kill", "rank 2 of 2 ranks"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--node-size",
                "1",
                "--mode",
                "ll",
                "--kill",
                "2:5",
            ],
            &["--kill", "rank 2 of 2 ranks"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--mode",
                "ll",
                "--kill",
                "1:3",
                "--stall",
                "1:ll-dispatch",
            ],
            &["--kill", "--stall"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--mode",
                "gin",
                "--stall",
                "1:ht-combine",
            ],
            &["--stall", "--mode gin"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--cases", "3",
            ],
            &["--cases", "--mode gin"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--mode",
                "gin",
                "--variants",
                "all",
            ],
            &["--variants", "--mode gin"],
        ),
        // HT and LL across virtual nodes, or with a node other than the LSA team.
        (
            &["check", "--gpus", "1", "--vnodes", "2"],
            &["--mode ht across NCCL nodes (--vnodes, --nccl-node-size) needs --node-size 2"],
        ),
        // HT bench across gin-ep nodes runs through `Ep` only, with exact sizing (`check`
        // runs HT across gin-ep nodes too; LL takes any node size).
        (
            &[
                "bench",
                "--gpus",
                "2",
                "--nccl-node-size",
                "1",
                "--node-size",
                "1",
                "--mode",
                "ht",
                "--path",
                "driver",
            ],
            &["--node-size 1", "Use --node-size 2", lsa, "through `Ep`"],
        ),
        (
            &[
                "bench",
                "--gpus",
                "1",
                "--vnodes",
                "4",
                "--node-size",
                "2",
                "--ht-sizing",
                "static",
            ],
            &["--ht-sizing static", "across gin-ep nodes", "exactly"],
        ),
        (
            &["check", "--gpus", "2", "--node-size", "1"],
            &["--node-size 1", lsa],
        ),
        (&["bench", "--gpus", "1", "--vnodes", "2"], &["--vnodes 2", lsa]),
        (
            &["bench", "--gpus", "2", "--mode", "ll", "--node-size", "1"],
            &["--node-size 1", "--mode ll", ll_gin],
        ),
        (
            &["check", "--nccl-node-size", "1"],
            &["--nccl-node-size", "--gpus"],
        ),
        (
            &["alltoall", "--nccl-node-size", "1"],
            &["--nccl-node-size", "use them with --gpus N"],
        ),
        (
            &[
                "alltoall",
                "--gpus",
                "2",
                "--vnodes",
                "2",
                "--nccl-node-size",
                "3",
            ],
            &["nccl-node-size: 3", "must divide the 4 ranks"],
        ),
        // HT is benched across NCCL nodes as gin-ep nodes that --node-size names.
        (
            &["bench", "--gpus", "2", "--nccl-node-size", "1"],
            &[
                "--mode ht across NCCL nodes",
                "needs --node-size 2",
                "CUDA-IPC-mapped",
            ],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "4",
                "--nccl-node-size",
                "3",
                "--mode",
                "ll",
            ],
            &["nccl-node-size", "3", "must divide the 4 ranks"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "2",
                "--nccl-node-size",
                "2",
                "--mode",
                "ll",
            ],
            &["nccl-node-size", "at most one rank per GPU"],
        ),
        // Bad shapes and bad --kill values, named.
        (
            &["check", "--gpus", "1", "--vnodes", "49", "--mode", "gin"],
            &["vnodes", "49"],
        ),
        (
            &[
                "check",
                "--gpus",
                "1",
                "--vnodes",
                "4",
                "--node-size",
                "3",
                "--mode",
                "gin",
            ],
            &["node-size", "3"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--kill", "5:3",
            ],
            &["--kill", "rank 5 is out of range for 2 ranks"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--iters", "100", "--kill", "1:500",
            ],
            &["--kill", "iteration 500 is never reached"],
        ),
        (
            &["check", "--gpus", "1", "--mode", "gin", "--kill", "0:1"],
            &["--kill", "at least 2 ranks"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--kill", "two:3",
            ],
            &["kill = `two:3`", "RANK"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--kill", "1",
            ],
            &["RANK:ITER"],
        ),
        (
            &[
                "check", "--gpus", "1", "--vnodes", "2", "--mode", "gin", "--iters", "0",
            ],
            &["iters = 0"],
        ),
    ];
    for (args, needles) in cases {
        for needle in *needles {
            usage_error(args, needle);
        }
    }
    // Shapes that do apply pass the refusals (then fail for want of a GPU, not for usage).
    for args in [
        &["check", "--gpus", "2", "--node-size", "2", "--cases", "1"][..],
        &["check", "--gpus", "1", "--vnodes", "1", "--mode", "ll"][..],
    ] {
        let o = gin_ep(args);
        let (_, err) = text(&o);
        assert_ne!(o.status.code(), Some(2), "{args:?} refused: {err}");
    }
}

#[test]
fn the_gin_check_without_a_gpu_fails_clearly_and_in_time() {
    if gin_ep::backend::cuda::driver::probe().is_ok() {
        return;
    }
    let t0 = Instant::now();
    let o = gin_ep(&[
        "check",
        "--gpus",
        "1",
        "--vnodes",
        "2",
        "--mode",
        "gin",
        "--iters",
        "1",
        "--timeout",
        "10",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout: {out}\nstderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    // Either the plugin is not beside the binary, or it is and the ranks find no GPU.
    assert!(
        err.contains("libnccl_net_ginep.so") || err.contains("unavailable"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

#[test]
fn a_fault_on_a_rank_no_group_has_is_refused() {
    let o = Command::new(EXE)
        .args(["check", "--ranks", "2", "--cases", "1"])
        .env("GIN_EP_FAULT", "7:combine")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("GIN_EP_FAULT rank 7") && err.contains("never fire"),
        "{err}"
    );
}

#[test]
fn a_failed_checks_reproduce_line_keeps_the_fault_and_the_timeout() {
    let o = Command::new(EXE)
        .args([
            "check",
            "--ranks",
            "2",
            "--cases",
            "1",
            "--timeout",
            "1.5",
            "--mode",
            "ht",
        ])
        .env("GIN_EP_FAULT", "1:combine")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout: {out}\nstderr: {err}");
    let line = err
        .lines()
        .find(|l| l.contains("reproduce with"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains(
            "`GIN_EP_FAULT='1:combine' GIN_EP_FAULT_CASE=0 gin-ep check --launch threads --ranks 2"
        ) && line.contains("--timeout 1.5"),
        "{line}"
    );
}

#[test]
fn alltoall_refuses_bad_values_before_looking_for_a_gpu() {
    for (args, flag) in [
        (&["alltoall", "-f", "1"][..], "-f/--factor"),
        (&["alltoall", "-b", "2G", "-e", "1G"], "-b/--min-bytes"),
        (&["alltoall", "--iters", "0"], "--iters"),
        (&["alltoall", "--unroll", "3"], "--unroll"),
        (
            &["alltoall", "--json", "/nonexistent-dir/a2a.json"],
            "--json /nonexistent-dir/a2a.json",
        ),
    ] {
        usage_error(args, flag);
    }
}

#[test]
fn alltoall_and_bench_take_json_the_same_way() {
    for cmd in ["alltoall", "bench"] {
        let help = text(&gin_ep(&[cmd, "--help"])).0;
        assert!(help.contains("--json <FILE>"), "{cmd} --help: {help}");
    }
}

#[test]
fn the_ll_token_limit_in_the_help_is_the_gpu_kernels_and_the_host_takes_more() {
    let help = text(&gin_ep(&["bench", "--help"])).0;
    let limit = gin_ep::backend::cuda::ll::MAX_TOKENS;
    assert!(help.contains(&format!("1-{limit} tokens per rank")), "{help}");
    let o = gin_ep(&[
        "bench",
        "--mode",
        "ll",
        "--ranks",
        "1",
        "--tokens",
        "300",
        "--hidden",
        "128",
        "--experts",
        "4",
        "--topk",
        "2",
        "--iters",
        "1",
        "--warmup",
        "0",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("LL: 1 rank × 300 tokens"), "{out}");
}

#[test]
fn counts_of_one_are_singular() {
    let o = gin_ep(&["check", "--ranks", "1", "--cases", "1"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("check: 1 case passed (ranks 1, threads)"), "{out}");
}

#[test]
fn info_prints_words_not_debug_text() {
    let out = text(&gin_ep(&["info"])).0;
    for debug in ["PythonWheel(", "Env(\"", "AlreadyLoaded", "LoaderPath", "Some("] {
        assert!(!out.contains(debug), "`{debug}` in {out}");
    }
}

/// The `--timeout` default README.md and docs/cli.md quote is the one the help prints.
#[test]
fn the_docs_quote_the_timeout_default_of_the_help() {
    let help = text(&gin_ep(&["check", "--help"])).0;
    let at = help.find("--timeout").unwrap_or_else(|| panic!("{help}"));
    let tail = &help[at..];
    let d = tail.find("[default: ").unwrap_or_else(|| panic!("{tail}")) + "[default: ".len();
    let secs: String = tail[d..].chars().take_while(|c| c.is_ascii_digit()).collect();
    for cmd in ["bench", "alltoall"] {
        let h = text(&gin_ep(&[cmd, "--help"])).0;
        assert!(h.contains(&format!("[default: {secs}]")), "{cmd} --help: {h}");
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    for doc in ["docs/troubleshooting.md", "docs/cli.md"] {
        let t = std::fs::read_to_string(format!("{root}/{doc}")).unwrap();
        assert!(
            t.contains(&format!("default {secs} s")),
            "{doc} does not say `default {secs} s`"
        );
    }
}

/// README's NCCL table states the supported set in the words `gin-ep info` prints.
#[test]
fn the_readme_states_the_supported_nccl_as_info_does() {
    let supported = gin_ep::ep::probe::supported_text();
    let info = text(&gin_ep(&["info"])).0;
    assert!(info.contains(&format!("supported: {supported}")), "{info}");
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    assert!(
        readme.contains(&supported),
        "README.md does not say `{supported}`"
    );
}

/// The floor of `op` ("gin-ep dispatch", ...) of the `n`-th table in `ht-bytes` output:
/// (GIN µs, NVLink µs).
fn ht_bytes_floor(out: &str, op: &str, n: usize) -> (f64, f64) {
    let line = out
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("{op}:")))
        .nth(n)
        .unwrap_or_else(|| panic!("no floor line {n} of {op}: {out}"));
    let num = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.trim_start()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("number after {key} in {line}"))
    };
    (num("GIN"), num("NVLink"))
}

#[test]
fn ht_bytes_prints_every_size_and_routing_with_floors_that_follow_the_rates() {
    let args = [
        "ht-bytes",
        "--ranks",
        "4,8",
        "--node-size",
        "2",
        "--tokens",
        "512",
        "--hidden",
        "256",
        "--experts",
        "16",
        "--topk",
        "4",
        "--routing",
        "uniform,zipf:1",
    ];
    let o = gin_ep(&args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(out.contains("no RDMA NIC"), "{out}");
    for head in [
        "EP4 (2 nodes of 2), 512 tokens per rank, hidden 256, top-4 of 16, fp8 dispatch, routing uniform",
        "EP4 (2 nodes of 2), 512 tokens per rank, hidden 256, top-4 of 16, fp8 dispatch, routing zipf:1",
        "EP8 (4 nodes of 2), 512 tokens per rank, hidden 256, top-4 of 16, fp8 dispatch, routing uniform",
        "EP8 (4 nodes of 2), 512 tokens per rank, hidden 256, top-4 of 16, fp8 dispatch, routing zipf:1",
    ] {
        assert!(out.contains(head), "missing `{head}`: {out}");
    }
    // FP8 row 256 + 2 * 4 = 264: forward 264 + 32 + 4 + 8, receive 264 + 32 + 4.
    assert!(
        out.contains("forward 308 B, receive 300 B, combine 528 B"),
        "{out}"
    );
    // Every rank's row with --per-rank: 4 + 8 rank rows per routing.
    let o = gin_ep(&[&args[..], &["--per-rank"]].concat());
    let per = text(&o).0;
    let rows = per
        .lines()
        .filter(|l| l.contains(" | ") && !l.contains("rank |"))
        .count();
    let short = out
        .lines()
        .filter(|l| l.contains(" | ") && !l.contains("rank |"))
        .count();
    assert_eq!(rows, short + 2 * (4 + 8), "{per}");
    // Half the NIC rate doubles the GIN floors and leaves NVLink's.
    let o = gin_ep(&[&args[..], &["--nic-gbs", "25"]].concat());
    let slow = text(&o).0;
    for op in ["gin-ep dispatch", "gin-ep combine", "DeepEP dispatch"] {
        for n in 0..4 {
            let (g50, v50) = ht_bytes_floor(&out, op, n);
            let (g25, v25) = ht_bytes_floor(&slow, op, n);
            assert!(g50 > 0.0, "{op} {n}: {out}");
            // Printed to 0.1 µs: each figure is within 0.05 of its value.
            assert!((g25 - 2.0 * g50).abs() <= 0.16, "{op} {n}: {g25} against {g50}");
            assert_eq!(v25, v50, "{op} {n}");
        }
    }
    // One node: nothing crosses the network.
    let o = gin_ep(&[
        "ht-bytes",
        "--ranks",
        "4",
        "--node-size",
        "4",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--experts",
        "16",
        "--topk",
        "4",
        "--routing",
        "uniform",
    ]);
    let one = text(&o).0;
    assert_eq!(o.status.code(), Some(0), "{one}");
    let (gin, nvl) = ht_bytes_floor(&one, "gin-ep dispatch", 0);
    assert_eq!(gin, 0.0, "{one}");
    assert!(nvl > 0.0, "{one}");
}

#[test]
fn ht_bytes_refuses_bad_values_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["ht-bytes", "--ranks", "0"], "--ranks"),
        (&["ht-bytes", "--ranks", "16,x"], "--ranks"),
        (&["ht-bytes", "--ranks", "16,"], "--ranks"),
        (&["ht-bytes", "--ranks", "-16"], "--ranks"),
        (&["ht-bytes", "--ranks", "12"], "--node-size"),
        (&["ht-bytes", "--node-size", "0"], "--node-size"),
        (&["ht-bytes", "--node-size", "-8"], "--node-size"),
        (&["ht-bytes", "--nic-gbs", "0"], "--nic-gbs"),
        (&["ht-bytes", "--nic-gbs", "fast"], "--nic-gbs"),
        (&["ht-bytes", "--nic-gbs", "inf"], "--nic-gbs"),
        (&["ht-bytes", "--nvlink-gbs", "-400"], "--nvlink-gbs"),
        (&["ht-bytes", "--nvlink-gbs", "NaN"], "--nvlink-gbs"),
        (&["ht-bytes", "--dtype", "fp7"], "--dtype"),
        (&["ht-bytes", "--routing", "uniform,zipf:0"], "--routing"),
        (&["ht-bytes", "--routing", "skewed"], "--routing"),
        (&["ht-bytes", "--experts", "250"], "--experts"),
        (&["ht-bytes", "--tokens", "0"], "--tokens"),
        (&["ht-bytes", "--topk", "0"], "--topk"),
        (&["ht-bytes", "--hidden", "100"], "--hidden"),
        (
            &[
                "ht-bytes",
                "--ranks",
                "512",
                "--experts",
                "512",
                "--tokens",
                "1048576",
            ],
            "--tokens",
        ),
    ];
    for (args, needle) in cases {
        usage_error(args, needle);
    }
    // A bad size among good ones is refused before anything is printed.
    let o = gin_ep(&["ht-bytes", "--ranks", "16,12"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).0.is_empty(), "{}", text(&o).0);
}
