//! `/metrics` (Prometheus text, or OpenMetrics when the Accept header asks for it) and
//! `/healthz`.
use std::sync::Arc;

use axum::{
    Router,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus_client::registry::Registry;

use crate::exposition;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

pub fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move |headers: HeaderMap| metrics(registry.clone(), headers)),
        )
        .route("/healthz", get(|| async { "ok\n" }))
}

fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"))
}

async fn metrics(registry: Arc<Registry>, headers: HeaderMap) -> Response {
    let om = wants_openmetrics(&headers);
    // Reading the maps is a few syscalls per entry: keep it off the async workers.
    let encoded = tokio::task::spawn_blocking(move || exposition::openmetrics(&registry)).await;
    match encoded {
        Ok(Ok(text)) if om => ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Ok(Ok(text)) => (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            exposition::prometheus_text(&text),
        )
            .into_response(),
        _ => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}
