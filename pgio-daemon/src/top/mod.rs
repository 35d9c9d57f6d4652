//! `pgio-daemon top`: a running daemon's histograms in a terminal, for a node without Grafana.
//! It scrapes /metrics (protobuf) every interval and shows what each filtered row did in it.
//! Live in a terminal (q quits), as plain text where the terminal cannot move the cursor,
//! `--once` for one interval, `--json` for scripts. HTTPS and basic auth for a daemon run with
//! `--web-config-file`.
mod interval;
mod parts;
mod render;
mod scrape;

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use crossterm::{
    cursor, event, execute, queue,
    style::Print,
    terminal::{self, ClearType},
};
use serde_json::json;

pub use interval::{Filter, Hist, Metric, Row};
use scrape::{Credentials, Scrape, Scraper, Trust};

/// The basic auth password of `--user` (not a flag: it would show in `ps`).
const PASSWORD_ENV: &str = "PGIO_TOP_PASSWORD";

#[derive(clap::Args, Debug)]
pub struct TopArgs {
    /// The daemon's /metrics: http://, or https:// for a daemon run with --web-config-file.
    #[arg(long, default_value = "http://127.0.0.1:9435/metrics")]
    pub url: String,
    /// https://: trust only the CA certificates in this PEM file (a private CA, or the
    /// daemon's self-signed certificate) instead of the system's.
    #[arg(long, value_name = "PEM", conflicts_with = "insecure")]
    pub ca_file: Option<std::path::PathBuf>,
    /// https://: do not verify the daemon's certificate.
    #[arg(long)]
    pub insecure: bool,
    /// Basic auth user; the password comes from the environment variable PGIO_TOP_PASSWORD.
    #[arg(long)]
    pub user: Option<String>,
    /// Seconds per interval.
    #[arg(long, default_value_t = 2.0, value_parser = positive_seconds)]
    pub interval: f64,
    /// Print one interval as plain text and exit.
    #[arg(long)]
    pub once: bool,
    /// Print each interval as one line of JSON (with --once: one object).
    #[arg(long)]
    pub json: bool,
    /// Histograms to show [default: syscall,futex,device; relation when --by names relation
    /// or kind; query,query-io when it names queryid; queue when it names culprit].
    #[arg(long, value_delimiter = ',')]
    pub metric: Vec<Metric>,
    /// Group rows by these labels (besides what each metric times: syscall/cache, device/op),
    /// e.g. `--by database,relation` for IO time per table and index (`relations = true`),
    /// `--by database,queryid` for query and IO time per pg_stat_statements query id,
    /// `--by device,culprit` for queue time per device and behind whose requests it was spent.
    #[arg(long, value_delimiter = ',', default_value = "app,role")]
    pub by: Vec<String>,
    /// At most this many rows, busiest first (0: all that fit; all with --once).
    #[arg(long, default_value_t = 0)]
    pub rows: usize,
    #[arg(long)]
    pub app: Option<String>,
    #[arg(long)]
    pub role: Option<String>,
    /// A PostgreSQL cluster (the `pg_cluster` label).
    #[arg(long = "pg-cluster", alias = "cluster")]
    pub cluster: Option<String>,
    #[arg(long)]
    pub database: Option<String>,
    #[arg(long)]
    pub device: Option<String>,
    /// A Longhorn volume (PV name): its read path's layers side by side.
    #[arg(long)]
    pub volume: Option<String>,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("expected seconds between 0.1 and 3600, got {s:?}")),
    }
}

impl TopArgs {
    /// `--metric`, or what `--by` asks for: relation time when it groups by relation.
    pub fn metrics(&self) -> Vec<Metric> {
        if !self.metric.is_empty() {
            return self.metric.clone();
        }
        if self.by.iter().any(|b| b == "relation" || b == "kind") {
            vec![Metric::Relation]
        } else if self.by.iter().any(|b| b == "queryid") {
            vec![Metric::Query, Metric::QueryIo]
        } else if self.by.iter().any(|b| b == "culprit") {
            vec![Metric::Queue]
        } else {
            vec![Metric::Syscall, Metric::Futex, Metric::Device]
        }
    }

    fn filter(&self) -> Filter {
        let pairs = [
            ("app", &self.app),
            ("role", &self.role),
            ("pg_cluster", &self.cluster),
            ("database", &self.database),
            ("device", &self.device),
            ("volume", &self.volume),
        ];
        Filter(
            pairs
                .into_iter()
                .filter_map(|(n, v)| Some((n.to_owned(), v.clone()?)))
                .collect(),
        )
    }
}

/// One interval, computed.
struct Interval {
    seconds: f64,
    rows: Vec<Row>,
    layers: Vec<interval::Layer>,
}

fn compute(args: &TopArgs, before: &Scrape, after: &Scrape) -> Interval {
    let seconds = after.at.duration_since(before.at).as_secs_f64();
    match &args.volume {
        Some(v) => Interval {
            seconds,
            rows: Vec::new(),
            layers: interval::volume_layers(before, after, v, args.cluster.as_deref()),
        },
        None => Interval {
            seconds,
            rows: parts::rows(before, after, &args.metrics(), &args.filter(), &args.by),
            layers: Vec::new(),
        },
    }
}

fn hist_json(h: &Hist, seconds: f64) -> serde_json::Value {
    let buckets: Vec<_> = h
        .le
        .iter()
        .zip(&h.counts)
        .filter(|(_, n)| **n > 0)
        .map(|(le, n)| json!({"le_seconds": if le.is_finite() { json!(le) } else { json!("+Inf") }, "count": n}))
        .collect();
    json!({
        "count": h.count(),
        "per_second": h.count() as f64 / seconds.max(1e-9),
        "sum_seconds": h.sum_seconds,
        "p50_seconds": h.quantile(0.5),
        "p99_seconds": h.quantile(0.99),
        "buckets": buckets,
    })
}

fn to_json(args: &TopArgs, i: &Interval) -> serde_json::Value {
    let mut v = json!({"url": args.url, "interval_seconds": i.seconds});
    if let Some(volume) = &args.volume {
        v["volume"] = json!(volume);
        v["layers"] = i
            .layers
            .iter()
            .map(|l| {
                let mut h = hist_json(&l.hist, i.seconds);
                h["layer"] = json!(l.name);
                h
            })
            .collect();
    } else {
        v["rows"] = i
            .rows
            .iter()
            .map(|r| {
                let mut h = hist_json(&r.hist, i.seconds);
                h["metric"] = json!(r.metric);
                h["family"] = json!(r.metric.family());
                h["labels"] = json!(r.key);
                if !r.parts.is_empty() {
                    h["parts_seconds"] = json!(r.parts);
                }
                h
            })
            .collect();
    }
    v
}

/// The interval as text lines, `width` columns, at most `height` lines (0: no limit).
fn to_lines(args: &TopArgs, i: &Interval, width: usize, height: usize) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(volume) = &args.volume {
        render::layers(&mut out, volume, &i.layers, i.seconds, width);
        return out;
    }
    if i.rows.is_empty() {
        out.push("(no matching IO in this interval)".into());
    }
    let limit = if args.rows == 0 {
        usize::MAX
    } else {
        args.rows
    };
    for r in i.rows.iter().take(limit) {
        let mut lines = Vec::new();
        render::row(&mut lines, r, i.seconds, width);
        if height > 0 && out.len() + lines.len() > height && !out.is_empty() {
            out.push(format!(
                "({} more rows: widen the terminal or filter)",
                i.rows.len()
            ));
            break;
        }
        out.extend(lines);
    }
    out
}

fn header(args: &TopArgs, seconds: f64, width: usize) -> String {
    render::clip(
        &format!("pgio top  {}  every {seconds:.1}s  q: quit", args.url),
        width,
    )
}

impl TopArgs {
    fn trust(&self) -> Trust {
        match (&self.ca_file, self.insecure) {
            (Some(pem), _) => Trust::CaFile(pem.clone()),
            (None, true) => Trust::Insecure,
            (None, false) => Trust::System,
        }
    }

    fn credentials(&self) -> Result<Option<Credentials>> {
        let Some(user) = &self.user else {
            return Ok(None);
        };
        anyhow::ensure!(
            !user.contains(':'),
            "--user {user:?}: a basic auth user name cannot contain ':'"
        );
        let password = std::env::var(PASSWORD_ENV)
            .with_context(|| format!("--user {user}: the password goes in {PASSWORD_ENV}"))?;
        Ok(Some(Credentials {
            user: user.clone(),
            password,
        }))
    }
}

pub fn run(args: TopArgs) -> Result<()> {
    let interval = Duration::from_secs_f64(args.interval);
    let scraper = Scraper::new(
        &args.url,
        interval.max(Duration::from_secs(5)),
        &args.trust(),
        args.credentials()?.as_ref(),
    )?;
    let live = !args.once
        && !args.json
        && std::io::stdout().is_terminal()
        && std::env::var("TERM").is_ok_and(|t| !t.is_empty() && t != "dumb");
    if live {
        return live_loop(&args, &scraper, interval);
    }
    let mut before = scraper.fetch()?;
    let mut stdout = std::io::stdout().lock();
    loop {
        std::thread::sleep(interval);
        let after = scraper.fetch()?;
        let i = compute(&args, &before, &after);
        if args.json {
            writeln!(stdout, "{}", to_json(&args, &i))?;
        } else {
            writeln!(stdout, "{}", header(&args, i.seconds, 80))?;
            for line in to_lines(&args, &i, 80, 0) {
                writeln!(stdout, "{line}")?;
            }
        }
        stdout.flush()?;
        if args.once {
            return Ok(());
        }
        if !args.json {
            writeln!(stdout)?;
        }
        before = after;
    }
}

/// Restores the terminal however `live_loop` ends.
struct RawScreen;

impl RawScreen {
    fn enter() -> Result<RawScreen> {
        terminal::enable_raw_mode().context("terminal raw mode")?;
        let screen = RawScreen;
        execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        )?;
        Ok(screen)
    }
}

impl Drop for RawScreen {
    fn drop(&mut self) {
        let _ = execute!(
            std::io::stdout(),
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

/// Waits up to `timeout` for a key; true if it asks to quit.
fn quit_pressed(timeout: Duration) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !event::poll(left)? {
            return Ok(false);
        }
        if let event::Event::Key(k) = event::read()? {
            let ctrl_c = k.code == event::KeyCode::Char('c')
                && k.modifiers.contains(event::KeyModifiers::CONTROL);
            if ctrl_c || matches!(k.code, event::KeyCode::Char('q') | event::KeyCode::Esc) {
                return Ok(true);
            }
        }
    }
}

/// Draws `lines` from the top, each cut to the terminal's `width` (a narrow terminal would
/// wrap them) and no more than its `height`.
fn draw(lines: &[String], width: usize, height: usize) -> Result<()> {
    let mut out = std::io::stdout().lock();
    for (y, line) in lines.iter().take(height).enumerate() {
        queue!(
            out,
            cursor::MoveTo(0, y as u16),
            Print(render::clip(line, width)),
            terminal::Clear(ClearType::UntilNewLine)
        )?;
    }
    queue!(out, terminal::Clear(ClearType::FromCursorDown))?;
    out.flush()?;
    Ok(())
}

fn live_loop(args: &TopArgs, scraper: &Scraper, interval: Duration) -> Result<()> {
    let _screen = RawScreen::enter()?;
    let mut before: Option<Scrape> = None;
    let mut shown: Vec<String> = Vec::new();
    loop {
        let (w, h) = terminal::size().unwrap_or((80, 24));
        let (screen_width, screen_height) = (w as usize, h as usize);
        // Laid out for at least 40 × 5, then cut to the screen.
        let (width, height) = (screen_width.max(40), screen_height.max(5));
        let top = header(args, args.interval, width);
        match scraper.fetch() {
            Ok(after) => {
                shown = match &before {
                    Some(b) => to_lines(args, &compute(args, b, &after), width, height - 2),
                    None => vec!["(first interval...)".into()],
                };
                draw(
                    &[&[top, String::new()][..], &shown].concat(),
                    screen_width,
                    screen_height,
                )?;
                before = Some(after);
            }
            // The daemon went away or restarted: say so over the last picture, keep trying.
            Err(e) => {
                let error = render::clip(&format!("error: {e}"), width);
                draw(
                    &[&[top, error][..], &shown].concat(),
                    screen_width,
                    screen_height,
                )?;
            }
        }
        if quit_pressed(interval)? {
            return Ok(());
        }
    }
}
