//! `pgio_device_info`: every block device a scrape saw, and every Longhorn volume device, with
//! its kernel major:minor and volume.
use pgio_common::block_io::{dev_major, dev_minor};

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Kind, MetricFamily},
    provisional::Provisional,
};

pub static DEVICE_INFO: MetricFamily = MetricFamily {
    name: "pgio_device_info",
    help: "Block devices seen by pgio, and Longhorn volume devices: name, kernel major:minor and the Longhorn volume it is, if any (value is always 1).",
    kind: Kind::Gauge,
};

/// `pgio_device_info`: register after the sources that see devices.
pub struct DeviceInfo;

impl Source for DeviceInfo {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        Box::new(DeviceInfo)
    }
}

impl Snapshot for DeviceInfo {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let devices = &*scrape.devices;
        let mut family = enc.family(&DEVICE_INFO);
        for (dev, name) in devices.seen() {
            let (major, minor) = (dev_major(dev).to_string(), dev_minor(dev).to_string());
            let labels = [
                ("device", name),
                ("major", &major),
                ("minor", &minor),
                ("volume", devices.volume(dev).unwrap_or("")),
            ];
            family.gauge(labels, 1);
        }
    }
}
