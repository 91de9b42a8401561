//! Printing that never panics, and progress lines for logs. `println!` panics when
//! stdout is a closed pipe (`gin-ep check | head -1`). A closed stdout ends the program
//! quietly with status 141 ([`crate::error::EXIT_BROKEN_PIPE`]), as a shell reports a
//! program killed by SIGPIPE; a failing stderr is ignored.

use crate::error::{EXIT_BROKEN_PIPE, EXIT_FAILED};
use std::fmt;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Writes one line to stdout.
pub fn line(args: fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|_| out.write_all(b"\n")) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(EXIT_BROKEN_PIPE.into());
        }
        let _ = writeln!(std::io::stderr(), "error: writing to stdout: {e}");
        std::process::exit(EXIT_FAILED.into());
    }
}

/// Writes one line to stderr, ignoring failure.
pub fn eline(args: fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// `println!` without the panic.
macro_rules! out {
    () => { $crate::output::line(format_args!("")) };
    ($($t:tt)*) => { $crate::output::line(format_args!($($t)*)) };
}

/// `eprintln!` without the panic.
macro_rules! err {
    ($($t:tt)*) => { $crate::output::eline(format_args!($($t)*)) };
}

/// Environment variable: seconds between progress lines of long runs (default 5).
pub const ENV_PROGRESS_SECS: &str = "GIN_EP_PROGRESS_SECS";

/// Seconds between progress lines: [`ENV_PROGRESS_SECS`] when it is a number in
/// (0, 3600], else 5.
pub fn progress_every() -> Duration {
    std::env::var(ENV_PROGRESS_SECS)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|&v| v > 0.0 && v <= 3600.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(5))
}

/// Writes `line(elapsed)` to stderr every [`progress_every`] until dropped, so a log of a
/// long run shows it is alive and where it is. Dropping it ends the thread at once.
pub struct Ticker {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    pub fn start(line: impl Fn(Duration) -> String + Send + 'static) -> Ticker {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let every = progress_every();
        let s = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("gin-ep-ticker".into())
            .spawn(move || {
                let t0 = Instant::now();
                let (lock, cv) = &*s;
                let Ok(mut stopped) = lock.lock() else {
                    return;
                };
                let mut next = every;
                loop {
                    let wait = next.saturating_sub(t0.elapsed());
                    match cv.wait_timeout(stopped, wait) {
                        Ok((g, _)) => stopped = g,
                        Err(_) => return,
                    }
                    if *stopped {
                        return;
                    }
                    if t0.elapsed() >= next {
                        eline(format_args!("{}", line(t0.elapsed())));
                        next += every;
                    }
                }
            })
            .ok();
        Ticker { stop, thread }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        if let Ok(mut g) = lock.lock() {
            *g = true;
        }
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `1 GPU`, `4 GPUs`: a count with its noun, plural unless the count is one.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod count_tests {
    #[test]
    fn one_is_singular() {
        assert_eq!(super::count(1, "GPU"), "1 GPU");
        assert_eq!(super::count(4, "case"), "4 cases");
        assert_eq!(super::count(0, "case"), "0 cases");
    }
}
