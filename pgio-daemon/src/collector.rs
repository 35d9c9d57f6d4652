//! One scrape: every registered source reads what it shows (its kernel maps, /sys, /proc)
//! without holding the series lock, then each writes its metric families with the series'
//! labels. A scrape changes nothing but the block sweep's lost requests: moving provisional
//! keys, deleting retired series' keys and freeing their ids is the once-a-second `pass`.
//! A probe family hands `run` its `Source` (`family::Taken`); it declares its metric
//! families next to the code that fills them.
use std::sync::{
    Mutex,
    atomic::{AtomicUsize, Ordering},
};

use anyhow::Result;
use pgio_common::SeriesId;
use tracing::warn;

use crate::{
    devices::Devices,
    exposition::{Encoder, Format},
    labels::Labels,
    lock,
    provisional::Provisional,
    series::{SharedTracked, Tracked},
};

pub trait Source: Send + Sync {
    /// What this source shows now. `routes` says where provisional series go.
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot>;

    /// Moves the keys of provisional series classified since out of the kernel maps, and
    /// deletes those of retired series (see `Collector::pass`); only histogram sources have
    /// any.
    fn fold(&self, _routes: &Provisional) -> Result<()> {
        Ok(())
    }

    /// Upkeep that scrapes should not wait for (the block sweep, relation names), once a
    /// second in `Collector::pass`; `tracked`: who pgio tracks now.
    fn housekeep(&self, _tracked: &SharedTracked) {}
}

/// One source's reading, encoded once the series lock is held.
pub trait Snapshot: Send {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder);
}

/// What encoding looks up: who each series is, and the block devices.
pub struct Scrape<'a> {
    pub tracked: &'a Tracked,
    /// Names and Longhorn volumes; the devices seen so far in this scrape.
    pub devices: &'a mut Devices,
}

impl Scrape<'_> {
    pub fn series(&self, id: SeriesId) -> &Labels {
        self.tracked.registry.exported(id)
    }
}

/// Encodes readings in order: a source that lists devices others saw (`devices::DeviceInfo`)
/// comes after them.
pub fn encode<'s>(
    snapshots: impl IntoIterator<Item = &'s dyn Snapshot>,
    tracked: &Tracked,
    devices: &mut Devices,
    enc: &mut Encoder,
) {
    devices.start_scrape();
    let mut scrape = Scrape { tracked, devices };
    for s in snapshots {
        s.encode(&mut scrape, enc);
    }
}

pub struct Collector {
    tracked: SharedTracked,
    /// One map-reading pass at a time (scrape or fold): a fold that deletes a retired
    /// series' keys frees its id, and no scrape may still hold it as retired once it is
    /// reused; a key moved out of a map must not be read twice.
    pass: Mutex<()>,
    devices: Mutex<Devices>,
    sources: Vec<Box<dyn Source>>,
    /// Size of the last exposition: the next one is written without reallocating.
    last_len: AtomicUsize,
}

impl Collector {
    pub fn new(tracked: SharedTracked, devices: Devices) -> Collector {
        Collector {
            tracked,
            pass: Mutex::new(()),
            devices: Mutex::new(devices),
            sources: Vec::new(),
            last_len: AtomicUsize::new(64 * 1024),
        }
    }

    pub fn register(&mut self, source: Box<dyn Source>) {
        self.sources.push(source);
    }

    /// /metrics in `format`.
    pub fn scrape(&self, format: Format) -> Vec<u8> {
        // A copy, so discovery is not held up while the maps are read; a process classified
        // meanwhile is still pending here and shown at the next scrape.
        let pass = lock(&self.pass);
        let routes = lock(&self.tracked).provisional.clone();
        let mut devices = lock(&self.devices);
        devices.refresh_volumes();
        let snapshots: Vec<Box<dyn Snapshot>> =
            self.sources.iter().map(|s| s.read(&routes)).collect();
        let mut enc = Encoder::new(format, self.last_len.load(Ordering::Relaxed) + 4096);
        // Before the pass lock goes: no fold may free (and discovery reuse) an id in between.
        let tracked = lock(&self.tracked);
        drop(pass);
        encode(
            snapshots.iter().map(|s| &**s),
            &tracked,
            &mut devices,
            &mut enc,
        );
        let out = enc.finish();
        self.last_len.store(out.len(), Ordering::Relaxed);
        out
    }

    /// One map pass (once a second, `run`): moves the events of processes classified since
    /// the last pass out of their provisional kernel keys (waiting for a scrape would let them
    /// pile up: under heavy connection churn, a thousand new backends a second and a 30 s
    /// scrape interval, they could fill the histogram maps), deletes retired series' keys and
    /// frees their ids (each source's `housekeep` first), then runs `then` (the map shares'
    /// balance) before a scrape reads the maps again.
    pub fn pass(&self, then: impl FnOnce()) {
        let _pass = lock(&self.pass);
        for s in &self.sources {
            s.housekeep(&self.tracked);
        }
        self.fold();
        then();
    }

    fn fold(&self) {
        let routes = {
            let t = lock(&self.tracked);
            if !t.provisional.has_closed() && t.provisional.retired.is_empty() {
                return;
            }
            t.provisional.clone()
        };
        for s in &self.sources {
            if let Err(e) = s.fold(&routes) {
                warn!(error = format!("{e:#}"), "folding provisional series");
            }
        }
        lock(&self.tracked).free_retired(&routes.retired);
    }
}
