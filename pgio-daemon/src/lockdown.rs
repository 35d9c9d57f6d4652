//! Kernel lockdown (the lockdown LSM): its mode, read from securityfs. `check` says what each
//! mode leaves pgio; tracefs names it when it is why tracefs cannot be read.

pub const LOCKDOWN: &str = "/sys/kernel/security/lockdown";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lockdown {
    None,
    Integrity,
    Confidentiality,
}

/// The mode in brackets of `none [integrity] confidentiality`.
pub fn parse_lockdown(text: &str) -> Option<Lockdown> {
    let mode = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))?;
    match mode {
        "none" => Some(Lockdown::None),
        "integrity" => Some(Lockdown::Integrity),
        "confidentiality" => Some(Lockdown::Confidentiality),
        _ => None,
    }
}

/// This node's mode; None when securityfs does not say (no lockdown LSM, or not mounted).
pub fn mode() -> Option<Lockdown> {
    parse_lockdown(&std::fs::read_to_string(LOCKDOWN).ok()?)
}
