//! One scrape of a pgio daemon's /metrics, in the protobuf exposition: the same samples as
//! the text (see `exposition`), already structured, so nothing here parses text.
use std::time::{Duration, Instant};

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
use prost::Message;

use crate::http::PROTOBUF;

/// A /metrics larger than this is not a pgio daemon's (a busy node's is a few MB).
const MAX_BODY: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error(
        "{url}: not an http:// URL (pgio serves plain HTTP; e.g. http://127.0.0.1:9435/metrics)"
    )]
    BadUrl { url: String },
    #[error("cannot reach {url}")]
    Unreachable { url: String, source: ureq::Error },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error(
        "{url} is not a pgio daemon's /metrics: it answered {content_type:?}, not the protobuf exposition"
    )]
    NotPgio { url: String, content_type: String },
    #[error("{url}: the protobuf exposition does not decode")]
    Decode {
        url: String,
        source: prost::DecodeError,
    },
}

pub struct Scrape {
    pub at: Instant,
    pub families: Vec<pb::MetricFamily>,
}

pub struct Scraper {
    agent: ureq::Agent,
    pub url: String,
}

impl Scraper {
    pub fn new(url: &str, timeout: Duration) -> Result<Scraper, ScrapeError> {
        if !url.starts_with("http://") {
            return Err(ScrapeError::BadUrl { url: url.into() });
        }
        let config = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build();
        Ok(Scraper {
            agent: ureq::Agent::new_with_config(config),
            url: url.to_owned(),
        })
    }

    pub fn fetch(&self) -> Result<Scrape, ScrapeError> {
        let url = || self.url.clone();
        let unreachable = |source| ScrapeError::Unreachable { url: url(), source };
        let mut response = self
            .agent
            .get(&self.url)
            .header("Accept", PROTOBUF)
            .call()
            .map_err(unreachable)?;
        let at = Instant::now();
        let status = response.status().as_u16();
        if status != 200 {
            return Err(ScrapeError::Status { url: url(), status });
        }
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        if !content_type.starts_with("application/vnd.google.protobuf")
            || !content_type.contains("io.prometheus.client.MetricFamily")
        {
            return Err(ScrapeError::NotPgio {
                url: url(),
                content_type,
            });
        }
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(unreachable)?;
        let mut rest = &body[..];
        let mut families = Vec::new();
        while !rest.is_empty() {
            families.push(
                pb::MetricFamily::decode_length_delimited(&mut rest)
                    .map_err(|source| ScrapeError::Decode { url: url(), source })?,
            );
        }
        Ok(Scrape { at, families })
    }
}
