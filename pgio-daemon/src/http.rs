//! `/metrics` in the format the scraper's Accept header prefers (Prometheus text by default,
//! OpenMetrics, or protobuf with native histograms), and `/healthz`.
//!
//! With basic auth configured, `/metrics` (and any other path but `/healthz`) needs
//! credentials. `/healthz` stays open: it is the kubelet's liveness and readiness probe, which
//! cannot send a password it does not have, and it tells no more than "ok" or why pgio is
//! unwell.
use std::sync::Arc;

use axum::{
    Router,
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
};

use crate::{
    collector::Collector,
    exposition::Format,
    health::Health,
    web_config::{BasicAuth, Verdict},
};

pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
pub const PROTOBUF: &str =
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited";

pub fn router(
    collector: Arc<Collector>,
    health: Arc<Health>,
    auth: Option<Arc<BasicAuth>>,
) -> Router {
    let router = Router::new().route(
        "/metrics",
        get(move |headers: HeaderMap| metrics(collector.clone(), headers)),
    );
    let router = match auth {
        // `layer`, not `route_layer`: unknown paths (the fallback) need credentials too.
        Some(auth) => router.layer(middleware::from_fn_with_state(auth, require_auth)),
        None => router,
    };
    // Added after the layer: not behind it.
    router.route("/healthz", get(move || healthz(health.clone())))
}

async fn require_auth(State(auth): State<Arc<BasicAuth>>, req: Request, next: Next) -> Response {
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match auth.check(authorization).await {
        Verdict::Allowed => next.run(req).await,
        Verdict::Missing | Verdict::Wrong => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"pgio\"")],
            "Unauthorized\n",
        )
            .into_response(),
        Verdict::Busy => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            "too many password checks in progress, retry\n",
        )
            .into_response(),
    }
}

/// 200 while pgio can read /proc and its maps; else 503 with the reason on one line.
async fn healthz(health: Arc<Health>) -> Response {
    match health.check() {
        Ok(()) => "ok\n".into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", reason.replace('\n', " ")),
        )
            .into_response(),
    }
}

/// The format of the media range with the highest `q` (the first on a tie) among those pgio
/// serves; Prometheus text when none is named or the header does not parse.
pub fn format_asked(headers: &HeaderMap) -> Format {
    let mut best: Option<(f32, Format)> = None;
    let ranges = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|range| range.trim().parse::<mime::Mime>().ok());
    for m in ranges {
        let param = |name: &str| m.get_param(name).map(|v| v.as_str().to_owned());
        let format = match (m.type_().as_str(), m.subtype().as_str()) {
            ("application", "openmetrics-text") => Format::OpenMetrics,
            ("application", "vnd.google.protobuf")
                if param("proto").as_deref() == Some("io.prometheus.client.MetricFamily")
                    && param("encoding").as_deref() == Some("delimited") =>
            {
                Format::Protobuf
            }
            ("text", "plain") => Format::Prometheus,
            _ => continue,
        };
        let q = param("q")
            .and_then(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        if q > 0.0 && best.is_none_or(|(b, _)| q > b) {
            best = Some((q, format));
        }
    }
    best.map_or(Format::Prometheus, |(_, f)| f)
}

async fn metrics(collector: Arc<Collector>, headers: HeaderMap) -> Response {
    let format = format_asked(&headers);
    // Reading the maps is a few syscalls per entry: keep it off the async workers.
    let encoded = tokio::task::spawn_blocking(move || collector.scrape(format)).await;
    let content_type = match format {
        Format::OpenMetrics => OPENMETRICS,
        Format::Prometheus => PROMETHEUS_TEXT,
        Format::Protobuf => PROTOBUF,
    };
    match encoded {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn asked(accept: &[&str]) -> Format {
        let mut h = HeaderMap::new();
        for a in accept {
            h.append(header::ACCEPT, HeaderValue::from_str(a).expect("header"));
        }
        format_asked(&h)
    }

    #[test]
    fn the_scrapers_preference_decides() {
        assert_eq!(asked(&[]), Format::Prometheus);
        assert_eq!(asked(&["*/*"]), Format::Prometheus);
        assert_eq!(asked(&["garbage;;;=,"]), Format::Prometheus);
        // Prometheus 2.42 without and with native histograms enabled.
        assert_eq!(
            asked(&[
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            ]),
            Format::OpenMetrics
        );
        assert_eq!(
            asked(&[
                "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            ]),
            Format::Protobuf
        );
        // Protobuf asked for with less preference than text.
        assert_eq!(
            asked(&[
                "text/plain;version=0.0.4;q=0.9",
                "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5"
            ]),
            Format::Prometheus
        );
        // A protobuf of another schema, or text encoding, is not what pgio writes.
        assert_eq!(
            asked(&["application/vnd.google.protobuf;proto=other.Message;encoding=delimited"]),
            Format::Prometheus
        );
        assert_eq!(
            asked(&[
                "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text"
            ]),
            Format::Prometheus
        );
        assert_eq!(
            asked(&["application/openmetrics-text;q=0"]),
            Format::Prometheus
        );
    }
}
