//! The probe-family contract. A family lives in one room per crate (`pgio-ebpf/src/<name>.rs`,
//! `pgio-common/src/<name>.rs`, `pgio-daemon/src/<name>.rs`) and fills in [`Family`] in its
//! daemon module: its programs, its maps, how the loader sets it up from the config, and what
//! it exports. `families::FAMILIES` lists them once; loading, `pgio-daemon check`, the map
//! shares, the object test and `run` loop over that list.
use std::{borrow::Cow, sync::Arc};

use anyhow::Result;
use aya::Ebpf;
use pgio_common::kernel_offsets::KernelOffsets;

use crate::{
    collector::Source,
    config::Config,
    hist::{Balanced, HistMapSpec},
};

/// How a program attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// `tp_btf/<program>`
    BtfTracePoint,
    /// `tracepoint/<category>/<program>`
    TracePoint(&'static str),
    /// A uretprobe on `function`, loaded now and attached to each postgres binary as it is
    /// found (`lifecycle::PostgresProbes`).
    URetProbeLater { function: &'static str },
    /// A uprobe on `function`'s entry, attached like `URetProbeLater`.
    UProbeLater { function: &'static str },
}

impl Attach {
    /// Attached per postgres binary at run time, not at start.
    pub const fn is_per_binary(self) -> bool {
        matches!(
            self,
            Attach::URetProbeLater { .. } | Attach::UProbeLater { .. }
        )
    }
}

/// One row of the probe table.
#[derive(Clone, Debug)]
pub struct Probe {
    /// The program's name in the eBPF object (= its tracepoint's name).
    pub program: Cow<'static, str>,
    pub attach: Attach,
    /// pgio still works on kernels without its hook, with less.
    pub optional: bool,
    /// Attached only once this program is (the syscall programs need `sched_switch`).
    pub requires: Option<&'static str>,
    /// Attached only when the config turns it on (not attached, it costs nothing).
    pub when: Option<fn(&Config) -> bool>,
    /// Attached only on kernels where this holds (another program does its work elsewhere).
    pub kernel: Option<fn(&KernelOffsets) -> bool>,
}

impl Probe {
    pub const fn new(program: &'static str, attach: Attach, optional: bool) -> Probe {
        Probe {
            program: Cow::Borrowed(program),
            attach,
            optional,
            requires: None,
            when: None,
            kernel: None,
        }
    }

    /// Attached only when `on(config)`.
    pub fn when(mut self, on: fn(&Config) -> bool) -> Probe {
        self.when = Some(on);
        self
    }

    /// Attached only once `program` is.
    pub fn after(mut self, program: &'static str) -> Probe {
        self.requires = Some(program);
        self
    }

    /// Whether `config` turns it on.
    pub fn is_on(&self, config: &Config) -> bool {
        self.when.is_none_or(|on| on(config))
    }

    /// Attached only on kernels where `needed(kernel)`.
    pub fn on_kernels(mut self, needed: fn(&KernelOffsets) -> bool) -> Probe {
        self.kernel = Some(needed);
        self
    }

    /// Whether this kernel needs it.
    pub fn fits(&self, kernel: &KernelOffsets) -> bool {
        self.kernel.is_none_or(|needed| needed(kernel))
    }
}

/// What the loader writes into the object before it creates the maps.
#[derive(Debug, Default)]
pub struct Setup {
    /// `(map, max_entries)`.
    pub map_sizes: Vec<(&'static str, u32)>,
    /// `(global, value)`: each global's bytes, exactly its size in the object.
    pub globals: Vec<(&'static str, Vec<u8>)>,
}

/// What a family exports once its maps are taken.
#[derive(Default)]
pub struct Taken {
    /// Read at every scrape (and folded once a second), in `FAMILIES` order.
    pub source: Option<Box<dyn Source>>,
    /// Its histogram map, shared among owners by `key_quota`.
    pub balanced: Option<Arc<dyn Balanced>>,
}

pub trait Family: Sync {
    /// The room's name, the same in the three crates.
    fn name(&self) -> &'static str;

    /// Its keys of pgio.toml, declared in its module (`settings` lists every key).
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        &[]
    }

    /// Its programs, in attach order.
    fn probes(&self) -> Vec<Probe>;

    /// Every map its kernel side declares (the object test checks both ways).
    fn maps(&self) -> &'static [&'static str];

    /// The globals of its kernel side that `setup` writes.
    fn globals(&self) -> &'static [&'static str] {
        &[]
    }

    /// Its histogram map under the key quota.
    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        None
    }

    /// Map sizes and global values from the config.
    fn setup(&self, _config: &Config) -> Setup {
        Setup::default()
    }

    /// Takes its maps out of the loaded object.
    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken>;
}
