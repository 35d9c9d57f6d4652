//! pgio's own series bookkeeping as a scrape shows it: label sets held, retired and
//! refused, processes held back or missed.
use super::Tracked;
use crate::exposition::{Encoder, Kind, MetricFamily};

static EXITS_MISSED: MetricFamily = MetricFamily {
    name: "pgio_exits_missed",
    help: "Tracked processes the periodic /proc rescan found gone although no exit event untracked them (lost lifecycle events). Should stay 0; until the rescan, such a process is still counted in pgio_tracked_processes.",
    kind: Kind::Counter,
};
static PROVISIONAL: MetricFamily = MetricFamily {
    name: "pgio_provisional_processes",
    help: "Processes whose events pgio holds back until it has classified them: a postmaster's new children until their title, a postmaster until its cluster is known. Their events appear in a later scrape, under the series they are classified as (role=\"starting\" if never).",
    kind: Kind::Gauge,
};
static SERIES: MetricFamily = MetricFamily {
    name: "pgio_series",
    help: "Label sets (series ids) pgio holds now, kernel and userspace: the live processes' label sets plus those within series_retention_secs of their last process, at most max_series (plus one overflow series per app).",
    kind: Kind::Gauge,
};
static SERIES_RETIRED: MetricFamily = MetricFamily {
    name: "pgio_series_retired",
    help: "Series dropped from the exposition series_retention_secs after their last process exited; their ids are reused.",
    kind: Kind::Counter,
};
static SERIES_REFUSED: MetricFamily = MetricFamily {
    name: "pgio_series_refused",
    help: "New label sets booked under their app's role=\"overflow\" series because max_series, max_series_per_app or max_series_per_group was reached, each counted once however often its processes are classified again.",
    kind: Kind::Counter,
};
static LABELS_TRUNCATED: MetricFamily = MetricFamily {
    name: "pgio_label_values_truncated",
    help: "Label sets with a value cut at max_label_len bytes.",
    kind: Kind::Counter,
};
static KERNEL_MAP_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_kernel_map_errors",
    help: "Failed writes of a process' or a postmaster's children's series into the kernel's maps (that process is booked as untracked). Should stay 0.",
    kind: Kind::Counter,
};

impl Tracked {
    /// Writes the families above (in `self_metrics`' order).
    pub fn encode_self(&self, enc: &mut Encoder) {
        enc.family(&EXITS_MISSED).counter((), self.exits_missed);
        enc.family(&PROVISIONAL)
            .gauge((), self.provisional.open() as i64);
        let registry = &self.registry;
        enc.family(&SERIES).gauge((), registry.len() as i64);
        enc.family(&SERIES_RETIRED)
            .counter((), registry.retired_total);
        let mut f = enc.family(&SERIES_REFUSED);
        for (app, n) in &registry.refused {
            f.counter([("app", app.as_str())], *n);
        }
        enc.family(&LABELS_TRUNCATED)
            .counter((), registry.truncated_total);
        enc.family(&KERNEL_MAP_ERRORS)
            .counter((), self.kernel_map_errors);
    }
}
