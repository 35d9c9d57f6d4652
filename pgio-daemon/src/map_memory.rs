//! The kernel memory of pgio's maps: estimated from the object and the config before anything
//! is loaded (`pgio-daemon check`; `run` refuses to start when it does not fit the memory
//! cgroup), and measured once loaded (`memlock` of each map's fdinfo, the kernel's own
//! account) for `pgio_bpf_map_memory_bytes`. Per-CPU maps cost their values once per
//! *possible* CPU, which is why the estimate takes that count as an argument.
use std::{
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::Ebpf;

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    probes,
    provisional::Provisional,
};

// `enum bpf_map_type` values of the kinds pgio uses.
const HASH: u32 = 1;
const ARRAY: u32 = 2;
const PERCPU_HASH: u32 = 5;
const PERCPU_ARRAY: u32 = 6;
const LRU_HASH: u32 = 9;
const LRU_PERCPU_HASH: u32 = 10;
const RINGBUF: u32 = 27;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_MMAPABLE: u32 = 1 << 10;
const PAGE: u64 = 4096;

/// `sizeof(struct htab_elem)` before its key (64-bit kernels).
const HTAB_ELEM: u64 = 48;
/// `sizeof(struct bucket)`: a list head and a spinlock.
const HTAB_BUCKET: u64 = 16;

/// The shape of one map as the kernel allocates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShape {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

fn round8(n: u32) -> u64 {
    (u64::from(n) + 7) & !7
}

impl MapShape {
    /// Bytes the kernel allocates for this map with `cpus` possible CPUs: the formulas of
    /// `htab_map_mem_usage`, `array_map_mem_usage` and `ringbuf_map_mem_usage` (Linux 6.4+,
    /// the `memlock` of fdinfo), without their few hundred bytes of fixed header.
    pub fn bytes(&self, cpus: u32) -> u64 {
        let cpus = u64::from(cpus);
        let entries = u64::from(self.max_entries);
        let key = round8(self.key_size);
        let value = round8(self.value_size);
        match self.map_type {
            HASH | PERCPU_HASH | LRU_HASH | LRU_PERCPU_HASH => {
                let percpu = matches!(self.map_type, PERCPU_HASH | LRU_PERCPU_HASH);
                let lru = matches!(self.map_type, LRU_HASH | LRU_PERCPU_HASH);
                let buckets = entries.next_power_of_two() * HTAB_BUCKET;
                // HASHTAB_MAP_LOCK_COUNT (8) ints per CPU.
                let locks = 8 * 4 * cpus;
                if self.flags & BPF_F_NO_PREALLOC != 0 {
                    return buckets + locks;
                }
                let elem = HTAB_ELEM + key + if percpu { 8 } else { value };
                // A plain hash keeps one spare element per CPU for in-place updates.
                let extra = if !percpu && !lru { cpus } else { 0 };
                let mut usage = buckets + locks + elem * (entries + extra);
                if percpu {
                    usage += value * cpus * entries;
                } else if lru {
                    usage += 8 * cpus;
                }
                usage
            }
            PERCPU_ARRAY => entries * 8 + entries * value * cpus,
            // A mappable array's values start on a page of their own and fill whole pages.
            ARRAY if self.flags & BPF_F_MMAPABLE != 0 => {
                PAGE + (entries * value).div_ceil(PAGE) * PAGE
            }
            ARRAY => entries * value,
            RINGBUF => {
                // Its data pages, 3 pages of positions and header, and the page pointers (the
                // data pages are mapped twice, so they are listed twice).
                const META_PAGES: u64 = 3;
                let data_pages = u64::from(self.max_entries) / PAGE;
                (META_PAGES + data_pages) * PAGE + (META_PAGES + 2 * data_pages) * 8
            }
            _ => entries * (key + value),
        }
    }
}

/// `(map, shape)` of every map of the object as `config` loads it (section maps of globals
/// included), in the object's order.
pub fn shapes(config: &Config) -> Result<Vec<(String, MapShape)>> {
    let bytes = probes::object();
    if bytes.is_empty() {
        bail!("pgio-daemon was built without its eBPF object (AYA_BUILD_SKIP)");
    }
    let obj = aya_obj::Object::parse(bytes).context("parsing the eBPF object")?;
    let sizes = probes::map_sizes(config);
    let mut out: Vec<(String, MapShape)> = obj
        .maps
        .iter()
        .map(|(name, m)| {
            let max_entries = sizes
                .iter()
                .find(|(n, _)| n == name)
                .map_or(m.max_entries(), |(_, size)| *size);
            let shape = MapShape {
                map_type: m.map_type(),
                key_size: m.key_size(),
                value_size: m.value_size(),
                max_entries,
                flags: m.map_flags(),
            };
            (name.clone(), shape)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The node's possible CPUs (`/sys/devices/system/cpu/possible`): per-CPU maps take this
/// many copies of each value, online or not.
pub fn possible_cpus() -> Result<u32> {
    let n = aya::util::nr_cpus().map_err(|(path, e)| anyhow::anyhow!("reading {path}: {e}"))?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// Estimated kernel memory of all maps with `config` and `cpus` possible CPUs, and the
/// largest maps (name, bytes), largest first.
pub fn estimate(config: &Config, cpus: u32) -> Result<(u64, Vec<(String, u64)>)> {
    let mut on_that_node = config.clone();
    on_that_node.possible_cpus = cpus;
    let mut maps: Vec<(String, u64)> = shapes(&on_that_node)?
        .into_iter()
        .map(|(name, s)| (name, s.bytes(cpus)))
        .collect();
    maps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok((maps.iter().map(|m| m.1).sum(), maps))
}

pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One line for `check` and the start-up log: the total, the possible CPUs and the largest
/// maps.
pub fn describe(total: u64, maps: &[(String, u64)], cpus: u32) -> String {
    let largest: Vec<String> = maps
        .iter()
        .take(4)
        .map(|(n, b)| format!("{n} {}", mib(*b)))
        .collect();
    format!(
        "eBPF maps: {} of kernel memory with {cpus} possible CPUs (largest: {})",
        mib(total),
        largest.join(", ")
    )
}

/// Memory the cgroup of this process may still take (`memory.max` − `memory.current` on
/// cgroup v2, `limit_in_bytes` − `usage_in_bytes` on v1), with the file that sets the limit;
/// `None` without a limit.
pub fn cgroup_headroom() -> Option<(u64, PathBuf)> {
    cgroup_memory().map(|m| (m.limit.saturating_sub(m.usage), m.limit_file))
}

/// The memory cgroup's limit and what it holds now (kernels ≥ 5.11 charge pgio's maps to it,
/// besides its RSS and page cache).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMemory {
    pub limit: u64,
    pub usage: u64,
    pub limit_file: PathBuf,
}

/// The limit and usage of this process' memory cgroup; `None` without a limit.
pub fn cgroup_memory() -> Option<CgroupMemory> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        // In a container the hierarchy is often mounted at the container's own cgroup, while
        // /proc/self/cgroup names it from the host's root (no cgroup namespace, cgroup v1:
        // podman, Kubernetes on v1 nodes): then the mount's root is the cgroup.
        let at = |root: &str, limit: &str, usage: &str| {
            headroom(&Path::new(root).join(path), limit, usage)
                .or_else(|| headroom(Path::new(root), limit, usage))
        };
        let found = if controllers.is_empty() {
            ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
                .iter()
                .find_map(|root| at(root, "memory.max", "memory.current"))
        } else if controllers.split(',').any(|c| c == "memory") {
            at(
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            None
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

fn headroom(dir: &Path, limit_file: &str, usage_file: &str) -> Option<CgroupMemory> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let limit = read(limit_file)?;
    // "max" (v2), or v1's page-rounded i64::MAX: no limit.
    let limit: u64 = limit.trim().parse().ok().filter(|l| *l < 1 << 60)?;
    let usage: u64 = read(usage_file)?.trim().parse().ok()?;
    Some(CgroupMemory {
        limit,
        usage,
        limit_file: dir.join(limit_file),
    })
}

/// Fails when the maps cannot fit what the memory cgroup has left (kernels ≥ 5.11 charge map
/// memory to it): a clear refusal instead of an OOM kill half-way through loading.
pub fn require_fits(config: &Config) -> Result<String> {
    let cpus = possible_cpus()?;
    let (total, maps) = estimate(config, cpus)?;
    let line = describe(total, &maps, cpus);
    if let Some((left, limit)) = cgroup_headroom()
        && total > left
    {
        bail!(
            "{line}, but the memory cgroup has {} left ({}): raise the pod's memory limit \
             or lower hist_map_max_entries",
            mib(left),
            limit.display()
        );
    }
    Ok(line)
}

/// `memlock` of each loaded map's fdinfo: what the kernel accounts to it.
pub fn measured(ebpf: &Ebpf) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = ebpf
        .maps()
        .filter_map(|(name, map)| {
            let fd = map_fd(map)?;
            let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
            let bytes = text
                .lines()
                .find_map(|l| l.strip_prefix("memlock:")?.trim().parse().ok())?;
            Some((name.to_owned(), bytes))
        })
        .collect();
    out.sort();
    out
}

fn map_fd(map: &aya::maps::Map) -> Option<i32> {
    use aya::maps::Map;
    let data = match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::RingBuf(d) => d,
        _ => return None,
    };
    Some(data.fd().as_fd().as_raw_fd())
}

static MAP_MEMORY: MetricFamily = MetricFamily {
    name: "pgio_bpf_map_memory_bytes",
    help: "Kernel memory of each of pgio's eBPF maps, as the kernel accounts it (fdinfo memlock), measured at start.",
    kind: Kind::Gauge,
};
static CGROUP_LIMIT: MetricFamily = MetricFamily {
    name: "pgio_memory_cgroup_limit_bytes",
    help: "The memory limit of pgio's cgroup (memory.max, or v1's limit_in_bytes), read at each scrape; absent without a limit.",
    kind: Kind::Gauge,
};
static CGROUP_USAGE: MetricFamily = MetricFamily {
    name: "pgio_memory_cgroup_usage_bytes",
    help: "What pgio's memory cgroup holds now (memory.current, or v1's usage_in_bytes): its eBPF maps (kernels >= 5.11 charge them there), RSS and page cache; absent without a limit.",
    kind: Kind::Gauge,
};
static POSSIBLE_CPUS: MetricFamily = MetricFamily {
    name: "pgio_possible_cpus",
    help: "Possible CPUs of this node (/sys/devices/system/cpu/possible): per-CPU maps hold one value per possible CPU.",
    kind: Kind::Gauge,
};

/// The maps' memory, measured once at start (it does not change: every map is preallocated).
#[derive(Clone, Debug, Default)]
pub struct MapMemory {
    pub maps: Vec<(String, u64)>,
    pub possible_cpus: u32,
    /// Read at each scrape (`Source::read`).
    pub cgroup: Option<CgroupMemory>,
}

impl MapMemory {
    pub fn measure(ebpf: &Ebpf) -> MapMemory {
        MapMemory {
            maps: measured(ebpf),
            possible_cpus: possible_cpus().unwrap_or(0),
            cgroup: None,
        }
    }

    pub fn total(&self) -> u64 {
        self.maps.iter().map(|m| m.1).sum()
    }
}

impl Source for MapMemory {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        Box::new(MapMemory {
            cgroup: cgroup_memory(),
            ..self.clone()
        })
    }
}

impl Snapshot for MapMemory {
    fn encode(&self, _: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut f = enc.family(&MAP_MEMORY);
        for (name, bytes) in &self.maps {
            f.gauge([("map", name.as_str())], *bytes as i64);
        }
        enc.family(&POSSIBLE_CPUS)
            .gauge((), i64::from(self.possible_cpus));
        if let Some(m) = &self.cgroup {
            let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
            enc.family(&CGROUP_LIMIT).gauge((), bytes(m.limit));
            enc.family(&CGROUP_USAGE).gauge((), bytes(m.usage));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(map_type: u32, key_size: u32, value_size: u32, max_entries: u32) -> MapShape {
        MapShape {
            map_type,
            key_size,
            value_size,
            max_entries,
            flags: 0,
        }
    }

    #[test]
    fn per_cpu_values_grow_with_possible_cpus_shared_ones_do_not() {
        // The histogram maps before and after: 65,536 keys of 8 bytes, 24-byte buckets.
        let per_cpu = shape(PERCPU_HASH, 8, 24, 65_536);
        let shared = shape(HASH, 8, 24, 65_536);
        let mib = |b: u64| b as f64 / 1048576.0;
        // 1.5 MiB of values per possible CPU.
        let grow = per_cpu.bytes(128) - per_cpu.bytes(2);
        assert_eq!(grow, 126 * 24 * 65_536 + 126 * 32);
        assert!(
            mib(per_cpu.bytes(128)) > 190.0,
            "{}",
            mib(per_cpu.bytes(128))
        );
        // 65,536 × (48 + 8 + 24) plus the buckets: ~6 MiB whatever the CPUs.
        assert!(mib(shared.bytes(128)) < 6.1, "{}", mib(shared.bytes(128)));
        assert!(shared.bytes(128) - shared.bytes(2) < 20_000);
    }

    #[test]
    fn arrays_and_ring_buffers() {
        assert_eq!(shape(ARRAY, 4, 2, 4_194_304).bytes(128), 4_194_304 * 8);
        assert_eq!(
            shape(PERCPU_ARRAY, 4, 528, 256).bytes(4),
            256 * 8 + 256 * 528 * 4
        );
        assert_eq!(
            shape(RINGBUF, 0, 0, 1 << 20).bytes(64),
            (3 + 256) * 4096 + (3 + 512) * 8
        );
    }
}
