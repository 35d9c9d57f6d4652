//! The exposition formats, written straight from pgio's data: Prometheus text 0.0.4 (the
//! default), OpenMetrics 1.0, and Prometheus' delimited protobuf, which alone carries native
//! histograms (see `native`). The two texts come from one writer; they differ only in how a
//! counter family is declared, HELP escaping and `# EOF`.
//!
//! prometheus-client 0.25 writes OpenMetrics only, and re-encodes a series' labels on every
//! bucket line; here a series' labels are escaped once and copied onto its bucket lines.
//! Numbers are formatted as prometheus-client formats them (`dtoa`, `itoa`), so the output
//! is byte for byte what pgio served before (checked against it in the tests).
use std::sync::LazyLock;

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
use prost::Message;

use crate::log2_hist::{Log2Hist, MAX_SLOT, MIN_SLOT, le_seconds};
use crate::native;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`
    Prometheus,
    /// `application/openmetrics-text; version=1.0.0`
    OpenMetrics,
    /// `application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily;
    /// encoding=delimited`: every histogram both classic and native.
    Protobuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A metric family, declared once next to the code that fills it. `name` has no `_total`:
/// counter samples get it in both formats.
#[derive(Debug)]
pub struct MetricFamily {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
}

/// A set of labels a sample carries. Empty values are left out (Prometheus treats an empty
/// label as absent).
pub trait LabelSet {
    fn write(&self, w: &mut LabelWriter<'_>);
}

pub enum LabelWriter<'a> {
    /// `name="value"` pairs, comma-separated and escaped.
    Text { out: &'a mut String, empty: bool },
    /// Protobuf label pairs: nothing to escape.
    Pairs(&'a mut Vec<pb::LabelPair>),
}

impl LabelWriter<'_> {
    pub fn label(&mut self, name: &str, value: &str) {
        if value.is_empty() {
            return;
        }
        match self {
            LabelWriter::Text { out, empty } => {
                if !*empty {
                    out.push(',');
                }
                *empty = false;
                out.push_str(name);
                out.push_str("=\"");
                escape_label_value(out, value);
                out.push('"');
            }
            LabelWriter::Pairs(pairs) => pairs.push(pb::LabelPair {
                name: name.to_owned(),
                value: value.to_owned(),
            }),
        }
    }
}

/// `\`, `"` and newline, as both formats want in label values.
fn escape_label_value(out: &mut String, value: &str) {
    if !value.bytes().any(|b| matches!(b, b'\\' | b'"' | b'\n')) {
        out.push_str(value);
        return;
    }
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

impl LabelSet for () {
    fn write(&self, _: &mut LabelWriter<'_>) {}
}

impl<const N: usize> LabelSet for [(&str, &str); N] {
    fn write(&self, w: &mut LabelWriter<'_>) {
        for (name, value) in self {
            w.label(name, value);
        }
    }
}

impl<T: LabelSet + ?Sized> LabelSet for &T {
    fn write(&self, w: &mut LabelWriter<'_>) {
        (**self).write(w)
    }
}

/// `le` of each finite bucket, formatted once.
static LE: LazyLock<Vec<String>> = LazyLock::new(|| {
    (MIN_SLOT..=MAX_SLOT)
        .map(|k| dtoa::Buffer::new().format(le_seconds(k)).to_owned())
        .collect()
});

/// Writes one scrape's exposition.
pub struct Encoder {
    out: String,
    format: Format,
    /// A series' escaped labels, reused for each of its lines.
    labels: String,
    /// The protobuf format's families, serialized at `finish`.
    families: Vec<pb::MetricFamily>,
}

impl Encoder {
    pub fn new(format: Format, capacity: usize) -> Encoder {
        Encoder {
            out: String::with_capacity(if format == Format::Protobuf {
                0
            } else {
                capacity
            }),
            format,
            labels: String::with_capacity(256),
            families: Vec::new(),
        }
    }

    /// Declares `family` (HELP and TYPE) and returns the writer of its samples.
    pub fn family(&mut self, family: &'static MetricFamily) -> FamilyEncoder<'_> {
        if self.format == Format::Protobuf {
            self.families.push(pb::MetricFamily {
                // Protobuf names a counter family by its samples' name.
                name: match family.kind {
                    Kind::Counter => format!("{}_total", family.name),
                    _ => family.name.to_owned(),
                },
                help: family.help.to_owned(),
                r#type: match family.kind {
                    Kind::Counter => pb::MetricType::Counter,
                    Kind::Gauge => pb::MetricType::Gauge,
                    Kind::Histogram => pb::MetricType::Histogram,
                } as i32,
                metric: Vec::new(),
                unit: String::new(),
            });
            return FamilyEncoder { enc: self, family };
        }
        let counter = family.kind == Kind::Counter;
        // 0.0.4 declares a counter under its sample name; OpenMetrics under the family name.
        let suffix = if counter && self.format == Format::Prometheus {
            "_total"
        } else {
            ""
        };
        let out = &mut self.out;
        for line in ["# HELP ", "# TYPE "] {
            out.push_str(line);
            out.push_str(family.name);
            out.push_str(suffix);
            out.push(' ');
            if line == "# HELP " {
                escape_help(out, family.help, self.format);
            } else {
                out.push_str(match family.kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                    Kind::Histogram => "histogram",
                });
            }
            out.push('\n');
        }
        FamilyEncoder { enc: self, family }
    }

    pub fn finish(mut self) -> Vec<u8> {
        match self.format {
            Format::Prometheus => {}
            Format::OpenMetrics => self.out.push_str("# EOF\n"),
            Format::Protobuf => {
                let len = self
                    .families
                    .iter()
                    .map(|f| f.encoded_len() + prost::length_delimiter_len(f.encoded_len()))
                    .sum();
                let mut out = Vec::with_capacity(len);
                for f in &self.families {
                    // Cannot fail: `out` has room for every message.
                    let _ = f.encode_length_delimited(&mut out);
                }
                return out;
            }
        }
        self.out.into_bytes()
    }
}

fn escape_help(out: &mut String, help: &str, format: Format) {
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if format == Format::OpenMetrics => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

/// The samples of one family.
pub struct FamilyEncoder<'a> {
    enc: &'a mut Encoder,
    family: &'static MetricFamily,
}

impl FamilyEncoder<'_> {
    /// Renders `labels` into the encoder's scratch buffer.
    fn set_labels(&mut self, labels: &impl LabelSet) {
        self.enc.labels.clear();
        labels.write(&mut LabelWriter::Text {
            out: &mut self.enc.labels,
            empty: true,
        });
    }

    /// In the protobuf format, adds one metric with `labels` to the family and returns true.
    fn push_metric(&mut self, labels: &impl LabelSet, fill: impl FnOnce(&mut pb::Metric)) -> bool {
        if self.enc.format != Format::Protobuf {
            return false;
        }
        let mut metric = pb::Metric::default();
        labels.write(&mut LabelWriter::Pairs(&mut metric.label));
        fill(&mut metric);
        if let Some(f) = self.enc.families.last_mut() {
            f.metric.push(metric);
        }
        true
    }

    /// `<name><suffix>{<labels>} ` with the labels set last.
    fn start_line(&mut self, suffix: &str) {
        let out = &mut self.enc.out;
        out.push_str(self.family.name);
        out.push_str(suffix);
        if !self.enc.labels.is_empty() {
            out.push('{');
            out.push_str(&self.enc.labels);
            out.push('}');
        }
        out.push(' ');
    }

    fn end_line(&mut self, value: &str) {
        self.enc.out.push_str(value);
        self.enc.out.push('\n');
    }

    pub fn counter(&mut self, labels: impl LabelSet, value: u64) {
        debug_assert_eq!(self.family.kind, Kind::Counter, "{}", self.family.name);
        if self.push_metric(&labels, |m| m.counter = Some(counter(value as f64))) {
            return;
        }
        self.set_labels(&labels);
        self.start_line("_total");
        self.end_line(itoa::Buffer::new().format(value));
    }

    pub fn counter_f64(&mut self, labels: impl LabelSet, value: f64) {
        debug_assert_eq!(self.family.kind, Kind::Counter, "{}", self.family.name);
        if self.push_metric(&labels, |m| m.counter = Some(counter(value))) {
            return;
        }
        self.set_labels(&labels);
        self.start_line("_total");
        self.end_line(dtoa::Buffer::new().format(value));
    }

    pub fn gauge(&mut self, labels: impl LabelSet, value: i64) {
        debug_assert_eq!(self.family.kind, Kind::Gauge, "{}", self.family.name);
        if self.push_metric(&labels, |m| {
            m.gauge = Some(pb::Gauge {
                value: value as f64,
            })
        }) {
            return;
        }
        self.set_labels(&labels);
        self.start_line("");
        self.end_line(itoa::Buffer::new().format(value));
    }

    /// `_sum`, `_count`, then cumulative `_bucket`s at `le = 2^k ns` and `+Inf`.
    pub fn histogram(&mut self, labels: impl LabelSet, h: &Log2Hist) {
        debug_assert_eq!(self.family.kind, Kind::Histogram, "{}", self.family.name);
        if self.push_metric(&labels, |m| m.histogram = Some(native::histogram(h))) {
            return;
        }
        self.set_labels(&labels);
        self.start_line("_sum");
        self.end_line(dtoa::Buffer::new().format(h.sum_seconds()));
        self.start_line("_count");
        self.end_line(itoa::Buffer::new().format(h.count()));
        let mut cumulative = 0u64;
        let les = LE.iter().map(String::as_str).chain(["+Inf"]);
        for (le, n) in les.zip(h.bucket_counts()) {
            cumulative += n;
            let out = &mut self.enc.out;
            out.push_str(self.family.name);
            out.push_str("_bucket{le=\"");
            out.push_str(le);
            out.push('"');
            if !self.enc.labels.is_empty() {
                out.push(',');
                out.push_str(&self.enc.labels);
            }
            out.push_str("} ");
            self.end_line(itoa::Buffer::new().format(cumulative));
        }
    }
}

fn counter(value: f64) -> pb::Counter {
    pb::Counter {
        value,
        exemplar: None,
        start_timestamp: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static COUNTER: MetricFamily = MetricFamily {
        name: "pgio_x",
        help: "Things.",
        kind: Kind::Counter,
    };
    static HIST: MetricFamily = MetricFamily {
        name: "pgio_h",
        help: "Lat.",
        kind: Kind::Histogram,
    };

    fn both(f: impl Fn(&mut Encoder)) -> [String; 2] {
        [Format::Prometheus, Format::OpenMetrics].map(|format| {
            let mut enc = Encoder::new(format, 0);
            f(&mut enc);
            String::from_utf8(enc.finish()).expect("text formats are UTF-8")
        })
    }

    #[test]
    fn counters_are_declared_by_sample_name_in_text_and_family_name_in_openmetrics() {
        let [text, om] = both(|enc| enc.family(&COUNTER).counter([("a", "b")], 3));
        assert_eq!(
            text,
            "# HELP pgio_x_total Things.\n# TYPE pgio_x_total counter\npgio_x_total{a=\"b\"} 3\n"
        );
        assert_eq!(
            om,
            "# HELP pgio_x Things.\n# TYPE pgio_x counter\npgio_x_total{a=\"b\"} 3\n# EOF\n"
        );
    }

    #[test]
    fn histogram_lines_put_le_first_and_count_cumulatively() {
        let mut h = Log2Hist::default();
        h.slots[MIN_SLOT] = 1;
        h.slots[MIN_SLOT + 2] = 2;
        h.slots[MAX_SLOT + 3] = 4;
        h.sum_ns = 500_000_000;
        let [text, _] = both(|enc| enc.family(&HIST).histogram([("x", "y"), ("e", "")], &h));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2], "pgio_h_sum{x=\"y\"} 0.5");
        assert_eq!(lines[3], "pgio_h_count{x=\"y\"} 7");
        assert_eq!(lines[4], "pgio_h_bucket{le=\"0.000001024\",x=\"y\"} 1");
        assert_eq!(lines[6], "pgio_h_bucket{le=\"0.000004096\",x=\"y\"} 3");
        assert_eq!(lines.last(), Some(&"pgio_h_bucket{le=\"+Inf\",x=\"y\"} 7"));
        assert_eq!(lines.len(), 4 + MAX_SLOT - MIN_SLOT + 2);
        let [unlabelled, _] = both(|enc| enc.family(&HIST).histogram((), &h));
        assert!(unlabelled.contains("\npgio_h_sum 0.5\n"), "{unlabelled}");
        assert!(
            unlabelled.contains("\npgio_h_bucket{le=\"+Inf\"} 7\n"),
            "{unlabelled}"
        );
    }

    #[test]
    fn hostile_label_values_stay_on_one_line() {
        let [text, om] = both(|enc| {
            enc.family(&COUNTER)
                .counter([("database", "we\"ird\nname\\ x"), ("user", "ü")], 1)
        });
        for t in [text, om] {
            assert_eq!(t.lines().filter(|l| !l.starts_with('#')).count(), 1, "{t}");
            assert!(
                t.contains(r#"database="we\"ird\nname\\ x",user="ü""#),
                "{t}"
            );
        }
    }
}
