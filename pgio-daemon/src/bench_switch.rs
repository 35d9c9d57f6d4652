//! The benchmark's switch (`--bench-switch`, hidden): detaches and re-attaches the programs
//! attached at start on request, so that `cargo xtask bench` can compare 100 ms slices with and
//! without them next to each other within one `pgbench` run. This VM's speed wanders by
//! ±10 % from one second to the next, independently on each CPU; only alternation faster than
//! that wander resolves a 1 % effect (BENCHMARKS.md §2). The maps, the daemon and its
//! per-binary uprobes stay: only the programs' hooks come and go. Attaching them all takes a
//! few ms; a tracepoint's link takes ~60 ms to close here (the kernel waits for an RCU grace
//! period, one tracepoint at a time), so the links close in parallel threads, which halves it
//! to ~1 s for pgio's.
//!
//! Protocol: a line `off` or `on` on stdin; once done, the same word on stdout (or
//! `error <what>`).
use std::{
    io::{BufRead as _, Write as _},
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    programs::{BtfTracePoint, TracePoint, tp_btf::BtfTracePointLink, trace_point::TracePointLink},
};

/// Where one attached program hooks in.
#[derive(Clone, Debug)]
pub enum Hook {
    TracePoint { category: String, name: String },
    BtfTracePoint,
}

/// An attachment's link, owned here: dropping it detaches the program.
#[derive(Debug)]
enum Link {
    TracePoint(#[allow(dead_code)] TracePointLink),
    BtfTracePoint(#[allow(dead_code)] BtfTracePointLink),
}

/// One attachment of a program (a program may have several: the floor's).
#[derive(Debug)]
struct Attachment {
    program: String,
    hook: Hook,
    link: Option<Link>,
}

/// What was attached at start, with its links while attached.
#[derive(Debug, Default)]
pub struct Attachments(Vec<Attachment>);

impl Attachments {
    /// Attaches the loaded `program` at `hook` and remembers the link.
    pub fn attach(&mut self, ebpf: &mut Ebpf, program: &str, hook: Hook) -> Result<()> {
        let link = attach(ebpf, program, &hook)?;
        self.0.push(Attachment {
            program: program.to_owned(),
            hook,
            link: Some(link),
        });
        Ok(())
    }

    /// Detaches every attachment (`on = false`) or attaches them again.
    pub fn set(&mut self, ebpf: &mut Ebpf, on: bool) -> Result<()> {
        if on {
            for a in self.0.iter_mut().filter(|a| a.link.is_none()) {
                a.link = Some(attach(ebpf, &a.program, &a.hook)?);
            }
            return Ok(());
        }
        let links: Vec<Link> = self.0.iter_mut().filter_map(|a| a.link.take()).collect();
        std::thread::scope(|s| {
            for link in links {
                s.spawn(move || drop(link));
            }
        });
        Ok(())
    }
}

fn attach(ebpf: &mut Ebpf, program: &str, hook: &Hook) -> Result<Link> {
    let p = ebpf
        .program_mut(program)
        .with_context(|| format!("program {program} missing from the eBPF object"))?;
    Ok(match hook {
        Hook::TracePoint { category, name } => {
            let p: &mut TracePoint = p.try_into()?;
            let id = p
                .attach(category, name)
                .with_context(|| format!("attaching {program} to {category}/{name}"))?;
            Link::TracePoint(p.take_link(id)?)
        }
        Hook::BtfTracePoint => {
            let p: &mut BtfTracePoint = p.try_into()?;
            let id = p
                .attach()
                .with_context(|| format!("attaching tp_btf {program}"))?;
            Link::BtfTracePoint(p.take_link(id)?)
        }
    })
}

/// Serves the switch on stdin/stdout from a thread of its own until stdin closes.
pub fn spawn(ebpf: Arc<Mutex<Ebpf>>, mut attachments: Attachments) -> Result<()> {
    std::thread::Builder::new()
        .name("bench-switch".into())
        .spawn(move || {
            let mut out = std::io::stdout();
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                let on = match line.trim() {
                    "on" => true,
                    "off" => false,
                    other => {
                        let _ = writeln!(out, "error unknown command {other:?}");
                        continue;
                    }
                };
                let result = match ebpf.lock() {
                    Ok(mut e) => attachments.set(&mut e, on),
                    Err(_) => Err(anyhow::anyhow!("the eBPF object's lock is poisoned")),
                };
                let _ = match result {
                    Ok(()) => writeln!(out, "{}", line.trim()),
                    Err(e) => writeln!(out, "error {e:#}"),
                };
                let _ = out.flush();
            }
        })
        .context("starting the bench switch thread")?;
    Ok(())
}
