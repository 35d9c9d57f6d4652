//! Longhorn (v1 data engine) processes: the engine (`controller`), replicas, sync agents, the
//! instance manager and the `tgtd` iSCSI target, all `app="longhorn"`.
//!
//! Engine, replica and sync agent are the same Go binary with comm `longhorn` on every thread;
//! role and volume come from its argv (urfave/cli): global flags, then the subcommand.
//!
//! ```text
//! longhorn --engine-instance-name <vol>-e-0 controller <vol> --frontend tgt-blockdev … --listen 0.0.0.0:PORT
//! longhorn --volume-name <vol> replica /host/<disk>/replicas/<vol>-<8hex> --size … --replica-instance-name <vol>-r-<8hex> …
//! longhorn replica /host/<disk>/replicas/<vol>-<8hex> --volume-name <vol> …   (older: flag after the subcommand)
//! longhorn --volume-name <vol> sync-agent --listen …
//! ```
use super::ProcessInfo;
use crate::labels::Labels;

/// Global flags of the `longhorn` binary that take a value (`--debug` is boolean).
const GLOBAL_VALUE_FLAGS: &[&str] = &["url", "volume-name", "engine-instance-name"];
/// Global boolean flags.
const GLOBAL_BOOL_FLAGS: &[&str] = &["debug", "help", "h", "version", "v"];
/// Subcommands whose name tells a role (anything else is `other`).
const SUBCOMMANDS: &[&str] = &["controller", "replica", "sync-agent"];

pub fn classify(p: &ProcessInfo) -> Option<Labels> {
    // A binary replaced while running (an engine image upgrade) reads `… (deleted)`.
    let exe = p.exe.as_deref().unwrap_or_default();
    let exe = basename(exe.strip_suffix(" (deleted)").unwrap_or(exe));
    let argv0 = basename(p.argv.first().map(String::as_str).unwrap_or_default());
    let is = |comm: &str, name: &str| p.comm == comm || exe == name || argv0 == name;
    if is("longhorn-instan", "longhorn-instance-manager") {
        return Some(Labels::app_role("longhorn", "instance-manager"));
    }
    if is("tgtd", "tgtd") {
        // One target serves every volume on the node: no volume label.
        return Some(Labels::app_role("longhorn", "tgtd"));
    }
    if p.comm != "longhorn" && exe != "longhorn" {
        return None;
    }
    // An exiting process has lost its argv: nothing to tell role or volume from.
    if p.argv.is_empty() {
        return None;
    }
    Some(classify_argv(&p.argv[1..]))
}

/// Labels of a `longhorn` process from its arguments (argv without argv[0]).
fn classify_argv(args: &[String]) -> Labels {
    let mut labels = Labels::app_role("longhorn", "other");
    let (global, sub) = split_global(args);
    let global_volume = flag_value(global, "volume-name");
    let Some((name, rest)) = sub.split_first() else {
        labels.volume = global_volume.unwrap_or_default().to_owned();
        return labels;
    };
    let positional = rest.first().filter(|a| !a.starts_with('-'));
    let local_volume = || flag_value(rest, "volume-name").or(global_volume);
    let volume = match name.as_str() {
        "controller" => {
            labels.role = "engine".into();
            positional.map(String::as_str).or_else(local_volume)
        }
        "replica" => {
            labels.role = "replica".into();
            local_volume()
                .or_else(|| {
                    flag_value(rest, "replica-instance-name")
                        .and_then(|n| strip_hex_suffix(n, "-r-"))
                })
                .or_else(|| {
                    let dir = basename(positional?.trim_end_matches('/'));
                    Some(strip_hex_suffix(dir, "-").unwrap_or(dir))
                })
        }
        "sync-agent" => {
            labels.role = "sync-agent".into();
            local_volume()
        }
        _ => global_volume,
    };
    labels.volume = volume.unwrap_or_default().to_owned();
    labels
}

/// Splits the arguments into global flags and `[subcommand, its arguments…]`. Known value
/// flags take the next token (unless written `--flag=value`); an unknown flag takes it too
/// unless that token is a flag or a known subcommand (so an unknown boolean flag right before
/// the subcommand does not eat it).
fn split_global(args: &[String]) -> (&[String], &[String]) {
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            return (&args[..i], &args[i + 1..]);
        }
        let Some(flag) = flag_name(a) else {
            break;
        };
        i += 1;
        if a.contains('=') || GLOBAL_BOOL_FLAGS.contains(&flag) {
            continue;
        }
        let next_is_value = args.get(i).is_some_and(|n| {
            GLOBAL_VALUE_FLAGS.contains(&flag)
                || !(n.starts_with('-') || SUBCOMMANDS.contains(&n.as_str()))
        });
        if next_is_value {
            i += 1;
        }
    }
    (&args[..i.min(args.len())], &args[i.min(args.len())..])
}

/// `--name`, `-name`, `--name=value` → `name`; not a flag → None.
fn flag_name(arg: &str) -> Option<&str> {
    let name = arg
        .strip_prefix("--")
        .or_else(|| arg.strip_prefix('-'))
        .filter(|n| !n.is_empty() && !n.starts_with('-'))?;
    Some(name.split_once('=').map_or(name, |(n, _)| n))
}

/// The value of `--name value` / `--name=value` (also with one dash); the last one wins, as
/// in Go's flag package. An empty value counts as absent.
fn flag_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut found = None;
    for (i, a) in args.iter().enumerate() {
        if flag_name(a) != Some(name) {
            continue;
        }
        found = match a.split_once('=') {
            Some((_, v)) => Some(v),
            None => args.get(i + 1).map(String::as_str),
        };
    }
    found.filter(|v| !v.is_empty())
}

/// `<name><sep><8 hex digits>` → `<name>` (replica directories and instance names).
fn strip_hex_suffix<'a>(s: &'a str, sep: &str) -> Option<&'a str> {
    let split = s.len().checked_sub(8)?;
    let (head, hex) = (s.get(..split)?, s.get(split..)?);
    let name = head.strip_suffix(sep)?;
    (hex.bytes().all(|b| b.is_ascii_hexdigit()) && !name.is_empty()).then_some(name)
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(cmdline: &str) -> Vec<String> {
        cmdline.split(' ').map(String::from).collect()
    }

    fn lh(comm: &str, exe: Option<&str>, cmdline: &str) -> Option<Labels> {
        classify(&ProcessInfo {
            comm: comm.into(),
            cmdline: cmdline.into(),
            argv: argv(cmdline),
            exe: exe.map(Into::into),
            ..Default::default()
        })
    }

    fn role_volume(cmdline: &str) -> (String, String) {
        let l = lh(
            "longhorn",
            Some("/engine-binaries/longhornio-longhorn-engine-v1.9.1/longhorn"),
            cmdline,
        )
        .expect("longhorn");
        assert_eq!(l.app, "longhorn", "{cmdline}");
        (l.role, l.volume)
    }

    const VOL: &str = "pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11";

    #[test]
    fn engine_replica_sync_agent_command_lines() {
        let table: &[(&str, &str, &str)] = &[
            // Engine as the instance manager starts it (v1.5–1.9).
            (
                "/engine-binaries/longhornio-longhorn-engine-v1.9.1/longhorn --engine-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-e-0 controller pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 --frontend tgt-blockdev --disableRevCounter --size 10737418240 --current-size 0 --engine-replica-timeout 8 --file-sync-http-client-timeout 30 --snapshot-max-count 250 --snapshot-max-size 0 --replica tcp://10.42.1.17:10000 --replica tcp://10.42.2.9:10000 --listen 0.0.0.0:10001",
                "engine",
                VOL,
            ),
            // v1.10+: `--listen :PORT`.
            (
                "/engine-binaries/longhornio-longhorn-engine-v1.10.0/longhorn --engine-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-e-0 controller pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 --frontend tgt-blockdev --size 10737418240 --replica tcp://10.42.1.17:10000 --listen :10001",
                "engine",
                VOL,
            ),
            // Replica: --volume-name as a global flag (current).
            (
                "/engine-binaries/longhornio-longhorn-engine-v1.9.1/longhorn --volume-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 replica /host/var/lib/longhorn/replicas/pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-0f3c2a1b --size 10737418240 --disableRevCounter --replica-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-r-7e1d9c44 --snapshot-max-count 250 --snapshot-max-size 0 --sync-agent-port-count 7 --listen 0.0.0.0:10000",
                "replica",
                VOL,
            ),
            // v1.10+ replica.
            (
                "/engine-binaries/longhornio-longhorn-engine-v1.10.0/longhorn --volume-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 replica /host/var/lib/longhorn/replicas/pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-0f3c2a1b --size 10737418240 --replica-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-r-7e1d9c44 --listen :10000",
                "replica",
                VOL,
            ),
            // Older: --volume-name after the subcommand.
            (
                "longhorn replica /host/var/lib/longhorn/replicas/pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-0f3c2a1b --size 10737418240 --volume-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 --listen 0.0.0.0:10000",
                "replica",
                VOL,
            ),
            // `--flag=value` forms, global and after the subcommand.
            (
                "longhorn --volume-name=pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 replica /host/replicas/x-0f3c2a1b --listen=:10000",
                "replica",
                VOL,
            ),
            (
                "longhorn replica /host/replicas/x-0f3c2a1b --volume-name=pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11",
                "replica",
                VOL,
            ),
            (
                "longhorn --engine-instance-name=vol-a-e-0 --url=http://localhost:9501 controller vol-a --listen=:10001",
                "engine",
                "vol-a",
            ),
            // Only the replica instance name.
            (
                "longhorn replica /host/replicas/whatever --replica-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-r-7e1d9c44 --listen 0.0.0.0:10000",
                "replica",
                VOL,
            ),
            // Only the directory: basename minus -<8hex> (trailing slash tolerated).
            (
                "longhorn replica /host/var/lib/longhorn/replicas/pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-0f3c2a1b/ --size 1g --listen 0.0.0.0:10000",
                "replica",
                VOL,
            ),
            // A directory without the suffix is taken whole.
            ("longhorn replica /data/vol-b --size 1g", "replica", "vol-b"),
            // Sync agent (started by the replica).
            (
                "longhorn --volume-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11 sync-agent --listen 0.0.0.0:10002 --replica 0.0.0.0:10000 --listen-port-range 10003-10007 --replica-instance-name pvc-5ac1d2d9-6c2f-4f0d-9a39-3f8c1e2b7d11-r-7e1d9c44",
                "sync-agent",
                VOL,
            ),
            ("longhorn sync-agent --listen :10002", "sync-agent", ""),
            // --debug is boolean; unknown global flags, with and without values.
            (
                "longhorn --debug --volume-name vol-c replica /d/vol-c-0f3c2a1b",
                "replica",
                "vol-c",
            ),
            (
                "longhorn --debug=true --log-level debug controller vol-d --listen :1",
                "engine",
                "vol-d",
            ),
            (
                "longhorn --some-new-bool controller vol-e",
                "engine",
                "vol-e",
            ),
            (
                "longhorn -volume-name vol-f --some-new-bool sync-agent --listen :1",
                "sync-agent",
                "vol-f",
            ),
            ("longhorn -- controller vol-g", "engine", "vol-g"),
            // CLI invocations and anything else: other (with the volume when named).
            (
                "longhorn --url localhost:10001 --volume-name vol-h snapshot ls",
                "other",
                "vol-h",
            ),
            ("longhorn --url localhost:10001 info", "other", ""),
            ("longhorn", "other", ""),
            ("longhorn --debug", "other", ""),
            ("longhorn --volume-name", "other", ""),
            ("longhorn controller", "engine", ""),
            ("longhorn controller --listen :1", "engine", ""),
            ("longhorn replica", "replica", ""),
        ];
        for (cmdline, role, volume) in table {
            assert_eq!(
                role_volume(cmdline),
                (role.to_string(), volume.to_string()),
                "{cmdline}"
            );
        }
    }

    #[test]
    fn instance_manager_and_tgtd() {
        for (comm, exe, cmdline) in [
            (
                "longhorn-instan",
                Some("/usr/local/bin/longhorn-instance-manager"),
                "longhorn-instance-manager --debug daemon --listen 0.0.0.0:8500",
            ),
            // exe unreadable: comm alone.
            (
                "longhorn-instan",
                None,
                "longhorn-instance-manager daemon --listen :8500",
            ),
            // Renamed thread/comm: exe or argv[0] basename.
            (
                "instance-mgr",
                None,
                "/usr/local/bin/longhorn-instance-manager daemon",
            ),
        ] {
            let l = lh(comm, exe, cmdline).expect("instance manager");
            assert_eq!(
                (l.app.as_str(), l.role.as_str()),
                ("longhorn", "instance-manager")
            );
            assert_eq!(l.volume, "");
        }
        for (comm, exe) in [("tgtd", Some("/usr/sbin/tgtd")), ("tgtd", None)] {
            let l = lh(comm, exe, "tgtd -f --iscsi portal=127.0.0.1:3260").expect("tgtd");
            assert_eq!(
                (l.app.as_str(), l.role.as_str(), l.volume.as_str()),
                ("longhorn", "tgtd", "")
            );
        }
    }

    #[test]
    fn exe_named_longhorn_with_other_comm() {
        for exe in [
            "/usr/local/bin/longhorn",
            "/usr/local/bin/longhorn (deleted)",
        ] {
            let l = lh("thread-x", Some(exe), "longhorn controller v").expect("longhorn by exe");
            assert_eq!((l.role.as_str(), l.volume.as_str()), ("engine", "v"));
        }
    }

    #[test]
    fn not_longhorn_or_exiting() {
        assert!(
            lh(
                "longhorn-manag",
                Some("/usr/local/bin/longhorn-manager"),
                "longhorn-manager daemon"
            )
            .is_none()
        );
        assert!(lh("bash", Some("/bin/bash"), "bash -c longhorn controller vol").is_none());
        // Exiting: argv already gone.
        let exiting = ProcessInfo {
            comm: "longhorn".into(),
            ..Default::default()
        };
        assert!(classify(&exiting).is_none());
    }

    #[test]
    fn hex_suffix() {
        assert_eq!(strip_hex_suffix("vol-0f3c2a1b", "-"), Some("vol"));
        assert_eq!(strip_hex_suffix("vol-r-0f3c2a1b", "-r-"), Some("vol"));
        assert_eq!(strip_hex_suffix("vol-0f3c2a1", "-"), None);
        assert_eq!(strip_hex_suffix("vol-0f3c2a1g", "-"), None);
        assert_eq!(strip_hex_suffix("-0f3c2a1b", "-"), None);
        assert_eq!(strip_hex_suffix("0f3c2a1b", "-"), None);
        // Multi-byte characters never split a char boundary.
        assert_eq!(strip_hex_suffix("ü-ü0f3c2a1b", "-"), None);
        assert_eq!(strip_hex_suffix("üüüü", "-"), None);
    }
}
