//! `/metrics` (Prometheus text, or OpenMetrics when the Accept header asks for it) and
//! `/healthz`.
use std::sync::Arc;

use axum::{
    Router,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};

use crate::{collector::Collector, exposition::Format};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

pub fn router(collector: Arc<Collector>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move |headers: HeaderMap| metrics(collector.clone(), headers)),
        )
        .route("/healthz", get(|| async { "ok\n" }))
}

fn format_asked(headers: &HeaderMap) -> Format {
    let om = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if om {
        Format::OpenMetrics
    } else {
        Format::Prometheus
    }
}

async fn metrics(collector: Arc<Collector>, headers: HeaderMap) -> Response {
    let format = format_asked(&headers);
    // Reading the maps is a few syscalls per entry: keep it off the async workers.
    let encoded = tokio::task::spawn_blocking(move || collector.scrape(format)).await;
    let content_type = match format {
        Format::OpenMetrics => OPENMETRICS,
        Format::Prometheus => PROMETHEUS_TEXT,
    };
    match encoded {
        Ok(text) => ([(header::CONTENT_TYPE, content_type)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}
