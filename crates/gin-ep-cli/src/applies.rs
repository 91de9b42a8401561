//! Which options apply to which run, so that nothing the user asks for is silently
//! ignored: each command lists its options with a [`Rule`] (GPU runs only, host runs
//! only, some modes only, only beside or never beside another option), and
//! [`refuse_inapplicable`] refuses the first given option whose rule this run breaks,
//! naming it. Owns only that rule; never decides what an option does.
//!
//! A new option plugs in as one more [`Opt`] row in its command's table.

use crate::bench_cmd::Mode;
use crate::error::{CliError, CliResult};

/// Where an option applies. Build with the `const fn`s: `Rule::ANY.gpus().modes(&[Mode::Ll])`.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    /// `Some(true)`: only with `--gpus`; `Some(false)`: only without.
    gpus: Option<bool>,
    /// Modes it applies to (empty: every mode).
    modes: &'static [Mode],
    /// Modes it applies to on GPU runs (empty: as `modes`).
    gpu_modes: &'static [Mode],
    /// An option it only works with.
    needs: Option<&'static str>,
    /// An option that replaces the run it would shape.
    not_with: Option<&'static str>,
}

impl Rule {
    /// Applies to every run of the command.
    pub const ANY: Rule = Rule {
        gpus: None,
        modes: &[],
        gpu_modes: &[],
        needs: None,
        not_with: None,
    };

    /// Only on GPUs (`--gpus N`).
    pub const fn gpus(self) -> Rule {
        Rule {
            gpus: Some(true),
            ..self
        }
    }

    /// Only on the host backend (no `--gpus`).
    pub const fn host(self) -> Rule {
        Rule {
            gpus: Some(false),
            ..self
        }
    }

    /// Only in these modes.
    pub const fn modes(self, modes: &'static [Mode]) -> Rule {
        Rule { modes, ..self }
    }

    /// On GPU runs, only in these modes.
    pub const fn gpu_modes(self, gpu_modes: &'static [Mode]) -> Rule {
        Rule { gpu_modes, ..self }
    }

    /// Only together with option `flag`.
    pub const fn needs(self, flag: &'static str) -> Rule {
        Rule {
            needs: Some(flag),
            ..self
        }
    }

    /// Never together with option `flag`.
    pub const fn not_with(self, flag: &'static str) -> Rule {
        Rule {
            not_with: Some(flag),
            ..self
        }
    }
}

/// One option of a command: its flag as the user wrote it (`--sms`, `--ht-sizing exact`),
/// whether it was given, and its rule.
pub struct Opt {
    pub flag: String,
    pub given: bool,
    pub rule: Rule,
}

impl Opt {
    pub fn new(flag: impl Into<String>, given: bool, rule: Rule) -> Opt {
        Opt {
            flag: flag.into(),
            given,
            rule,
        }
    }
}

/// The run the options are checked against.
pub struct Run {
    pub gpus: bool,
    pub mode: Mode,
}

pub fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Ht => "ht",
        Mode::Ll => "ll",
        Mode::Gin => "gin",
    }
}

fn mode_list(modes: &[Mode]) -> String {
    modes
        .iter()
        .map(|m| format!("--mode {}", mode_name(*m)))
        .collect::<Vec<_>>()
        .join(" or ")
}

/// Refuses the first given option of `opts` that does not apply to `run` (exit 2), naming
/// it and what it needs. Options named by `needs`/`not_with` are looked up in `opts` by
/// the flag's first word.
pub fn refuse_inapplicable(run: &Run, opts: &[Opt]) -> CliResult {
    let given = |flag: &str| {
        opts.iter()
            .any(|o| o.given && o.flag.split_whitespace().next() == Some(flag))
    };
    for o in opts.iter().filter(|o| o.given) {
        let r = &o.rule;
        let f = &o.flag;
        let why = match r.gpus {
            Some(true) if !run.gpus => Some(format!(
                "{f} applies to GPU runs only: add --gpus N (without it this run uses the \
                 host backend, which has no such option)"
            )),
            Some(false) if run.gpus => Some(format!("{f} applies to host runs only, not with --gpus N")),
            _ => None,
        };
        let why = why.or_else(|| {
            (!r.modes.is_empty() && !r.modes.contains(&run.mode)).then(|| {
                format!(
                    "{f} applies to {} only, not --mode {}",
                    mode_list(r.modes),
                    mode_name(run.mode)
                )
            })
        });
        let why = why.or_else(|| {
            (run.gpus && !r.gpu_modes.is_empty() && !r.gpu_modes.contains(&run.mode)).then(|| {
                format!(
                    "{f} does not apply to --gpus N with --mode {} (on GPUs it applies to {})",
                    mode_name(run.mode),
                    mode_list(r.gpu_modes)
                )
            })
        });
        let why = why.or_else(|| {
            r.needs
                .filter(|n| !given(n))
                .map(|n| format!("{f} applies only together with {n}"))
        });
        let why = why.or_else(|| {
            r.not_with
                .filter(|n| given(n))
                .map(|n| format!("{f} does not apply together with {n}"))
        });
        if let Some(why) = why {
            return Err(CliError::Usage(why));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(gpus: bool, mode: Mode, opts: &[Opt]) -> Result<(), String> {
        refuse_inapplicable(&Run { gpus, mode }, opts).map_err(|e| e.to_string())
    }

    #[test]
    fn each_rule_refuses_naming_the_flag() {
        let gpu = Opt::new("--sms", true, Rule::ANY.gpus());
        assert!(check(false, Mode::Ht, &[gpu])
            .unwrap_err()
            .contains("--sms applies to GPU"));
        let gpu = Opt::new("--sms", true, Rule::ANY.gpus());
        assert!(check(true, Mode::Ht, &[gpu]).is_ok());
        let host = Opt::new("--launch", true, Rule::ANY.host());
        assert!(check(true, Mode::Ht, &[host]).unwrap_err().contains("--launch"));
        let ll = Opt::new("--ll-combine-order", true, Rule::ANY.modes(&[Mode::Ll]));
        let e = check(false, Mode::Ht, &[ll]).unwrap_err();
        assert!(e.contains("--ll-combine-order") && e.contains("--mode ht"), "{e}");
        let list = || Opt::new("--sweep-list", true, Rule::ANY.gpus().needs("--sweep"));
        assert!(check(true, Mode::Ht, &[list()]).unwrap_err().contains("--sweep"));
        assert!(check(true, Mode::Ht, &[list(), Opt::new("--sweep", true, Rule::ANY)]).is_ok());
        let cases = || Opt::new("--cases", true, Rule::ANY.gpu_modes(&[Mode::Ht]));
        assert!(check(false, Mode::Ll, &[cases()]).is_ok());
        assert!(check(true, Mode::Ll, &[cases()]).unwrap_err().contains("--cases"));
        let not_given = Opt::new("--sms", false, Rule::ANY.gpus());
        assert!(check(false, Mode::Ht, &[not_given]).is_ok());
    }
}
