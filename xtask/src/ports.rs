//! The integration tests listen on fixed ports (PostgreSQL clusters, daemons) inside Linux's
//! ephemeral range (32768-60999 by default), where any client connection of another test may
//! be given the same port as its local end: CI saw `could not bind IPv4 address "127.0.0.1":
//! Address already in use` for a cluster on 56532 after a test had opened 21,000 connections.
//! While the tests run, those ports are reserved (`net.ipv4.ip_local_reserved_ports`: never
//! handed out as ephemeral ports); the setting before is put back afterwards.
use std::path::Path;

use crate::util::step;

const SYSCTL: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// The ranges the tests' fixed ports are in (pgio-daemon/tests, pgio-testkit).
const TEST_PORTS: &str = "40000,55400-55600,56000-56700";

/// Reserves `TEST_PORTS` until dropped (as root; otherwise says why not and changes nothing).
pub struct ReservedPorts {
    before: Option<String>,
}

impl ReservedPorts {
    pub fn reserve() -> ReservedPorts {
        let before = std::fs::read_to_string(SYSCTL)
            .ok()
            .map(|s| s.trim().to_owned());
        let Some(before) = before else {
            step(format!("{SYSCTL} unreadable: test ports not reserved"));
            return ReservedPorts { before: None };
        };
        let wanted = if before.is_empty() {
            TEST_PORTS.to_owned()
        } else {
            format!("{before},{TEST_PORTS}")
        };
        match std::fs::write(Path::new(SYSCTL), &wanted) {
            Ok(()) => {
                step(format!(
                    "test ports {TEST_PORTS} reserved from ephemeral use while the tests run"
                ));
                ReservedPorts {
                    before: Some(before),
                }
            }
            Err(e) => {
                step(format!("cannot reserve the test ports ({SYSCTL}: {e})"));
                ReservedPorts { before: None }
            }
        }
    }
}

impl Drop for ReservedPorts {
    fn drop(&mut self) {
        // With a newline: an empty write never reaches the sysctl, which kept the ports.
        if let Some(before) = self.before.take()
            && let Err(e) = std::fs::write(SYSCTL, format!("{before}\n"))
        {
            step(format!("could not put {SYSCTL} back to {before:?}: {e}"));
        }
    }
}
