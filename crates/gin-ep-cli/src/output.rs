//! Printing that never panics: `println!` panics when stdout is a closed pipe
//! (`gin-ep check | head -1`). A closed stdout ends the program quietly with
//! status 141, as a shell reports a program killed by SIGPIPE; a failing stderr
//! is ignored.

use std::fmt;
use std::io::Write;

/// Writes one line to stdout.
pub fn line(args: fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|_| out.write_all(b"\n")) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        let _ = writeln!(std::io::stderr(), "error: writing to stdout: {e}");
        std::process::exit(1);
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
