//! The CLI's two kinds of failure and their exit codes.

use std::fmt;

/// A failed command: bad input (exit 2) or a run that went wrong (exit 1).
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
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
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
