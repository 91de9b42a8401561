//! The CLI's two kinds of failure and every exit code it ends with, in one place.

use std::fmt;

/// Exit codes of `gin-ep` (the README's Usage section states the same):
/// - 0: success (also `--help`, `--version`);
/// - 1 ([`EXIT_FAILED`]): a run failed: a mismatch with the oracle, a timeout, a dead rank,
///   no usable GPU, an I/O error during or after the run;
/// - 2 ([`EXIT_USAGE`]): bad input, refused before anything runs: a bad or out-of-range
///   value (naming the flag), an option that does not apply to this run, a run that would
///   not fit in memory, an unwritable `--json` path, clap's own errors (unknown flag);
/// - 141 ([`EXIT_BROKEN_PIPE`]): stdout closed (`gin-ep check | head -1`), as a shell
///   reports a program killed by SIGPIPE.
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_BROKEN_PIPE: u8 = 141;

/// A failed command: bad input ([`EXIT_USAGE`]) or a run that went wrong ([`EXIT_FAILED`]).
#[derive(Debug)]
pub enum CliError {
    /// The user's input is wrong; the message names the bad value.
    Usage(String),
    /// The run failed (mismatch, timeout, dead rank, I/O).
    Failed(String),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => EXIT_USAGE,
            CliError::Failed(_) => EXIT_FAILED,
        }
    }

    /// A library error; usage errors get a hint naming the flag that set the
    /// field, from `flag_of` (field name -> flag).
    pub fn from_lib(e: gin_ep::Error, flag_of: &dyn Fn(&str) -> Option<&'static str>) -> Self {
        if !e.is_usage() {
            return CliError::Failed(e.to_string());
        }
        let hint = match &e {
            gin_ep::Error::InvalidConfig { field, .. } => flag_of(field),
            _ => None,
        };
        match hint {
            Some(flag) => CliError::Usage(format!("{e} (set by {flag})")),
            None => CliError::Usage(e.to_string()),
        }
    }
}

impl From<gin_ep::Error> for CliError {
    fn from(e: gin_ep::Error) -> Self {
        CliError::from_lib(e, &|_| None)
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Failed(m) => f.write_str(m),
        }
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;

/// `--timeout`'s default on every command, in seconds: the library's own deadline
/// (`EpOptions::default().timeout`, Python's `timeout_s=`), which README.md and docs/cli.md
/// quote (a CLI test reads both).
pub const DEFAULT_TIMEOUT: &str = "100";

/// Parses `--timeout SECS` (fractions allowed) for clap.
pub fn parse_secs(s: &str) -> Result<std::time::Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| "not a number of seconds".to_string())?;
    if !(v > 0.0 && v <= 86_400.0) {
        return Err("must be more than 0 and at most 86400 seconds".into());
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// Parses a whole number for clap, refusing a negative one or a fraction in words that
/// name the problem (clap then names the flag and the value): `--tokens -3` gets
/// "invalid value '-3' for '--tokens': negative: must be a whole number, 0 or more".
pub fn parse_whole<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + num_bounds::Max,
{
    let t = s.trim();
    if t.starts_with('-') {
        return Err("negative: must be a whole number, 0 or more".into());
    }
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("`{s}` is not a whole number"));
    }
    t.parse::<T>()
        .map_err(|_| format!("too large: at most {}", T::MAX_TEXT))
}

/// The largest value of each integer type `parse_whole` reads, as text.
pub mod num_bounds {
    pub trait Max {
        const MAX_TEXT: &'static str;
    }
    impl Max for usize {
        const MAX_TEXT: &'static str = "18446744073709551615";
    }
    impl Max for u64 {
        const MAX_TEXT: &'static str = "18446744073709551615";
    }
    impl Max for u32 {
        const MAX_TEXT: &'static str = "4294967295";
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_timeout_default_is_the_librarys() {
        assert_eq!(
            super::parse_secs(super::DEFAULT_TIMEOUT),
            Ok(gin_ep::ep::EpOptions::default().timeout)
        );
    }
}
