//! User rules from the config: match comm / exe / cmdline by regex, assign app and role.
use regex::Regex;

use super::ProcessInfo;
use crate::labels::Labels;

/// The config's rules, compiled (their regexes were checked when the file was read).
pub fn compile(rules: &[crate::config::RuleConfig]) -> Vec<Rule> {
    let re =
        |s: &Option<toml::Spanned<String>>| s.as_ref().and_then(|s| Regex::new(s.get_ref()).ok());
    rules
        .iter()
        .map(|r| Rule {
            app: r.app.get_ref().clone(),
            role: r.role.clone(),
            comm: re(&r.comm),
            exe: re(&r.exe),
            cmdline: re(&r.cmdline),
        })
        .collect()
}

#[derive(Debug)]
pub struct Rule {
    pub app: String,
    pub role: String,
    pub comm: Option<Regex>,
    pub exe: Option<Regex>,
    pub cmdline: Option<Regex>,
}

impl Rule {
    /// Every matcher given must match; a rule with no matcher never matches (the config
    /// loader refuses it).
    pub fn apply(&self, p: &ProcessInfo) -> Option<Labels> {
        if self.comm.is_none() && self.exe.is_none() && self.cmdline.is_none() {
            return None;
        }
        let ok = self.comm.as_ref().is_none_or(|r| r.is_match(&p.comm))
            && self
                .exe
                .as_ref()
                .is_none_or(|r| p.exe.as_deref().is_some_and(|e| r.is_match(e)))
            && self.cmdline.as_ref().is_none_or(|r| r.is_match(&p.cmdline));
        ok.then(|| Labels::app_role(&self.app, &self.role))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(comm: &str, cmdline: &str, exe: Option<&str>) -> ProcessInfo {
        ProcessInfo {
            comm: comm.into(),
            cmdline: cmdline.into(),
            exe: exe.map(Into::into),
            kthread: false,
            ..Default::default()
        }
    }

    #[test]
    fn all_matchers_must_match() {
        let rule = Rule {
            app: "fio".into(),
            role: "bench".into(),
            comm: Some(Regex::new("^fio$").expect("regex")),
            exe: None,
            cmdline: Some(Regex::new("--rw=randread").expect("regex")),
        };
        assert_eq!(
            rule.apply(&info("fio", "fio --rw=randread", None)),
            Some(Labels::app_role("fio", "bench"))
        );
        assert_eq!(rule.apply(&info("fio", "fio --rw=write", None)), None);
        assert_eq!(rule.apply(&info("fiox", "fio --rw=randread", None)), None);
    }

    #[test]
    fn exe_rule_needs_a_readable_exe() {
        let rule = Rule {
            app: "x".into(),
            role: String::new(),
            comm: None,
            exe: Some(Regex::new("/bin/x$").expect("regex")),
            cmdline: None,
        };
        assert!(rule.apply(&info("x", "x", None)).is_none());
        assert!(rule.apply(&info("x", "x", Some("/usr/bin/x"))).is_some());
    }
}
