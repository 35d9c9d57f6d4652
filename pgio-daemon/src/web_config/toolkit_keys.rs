//! exporter-toolkit keys beyond the certificate, so one `web.yml` serves pgio and the node's
//! other exporters: `cipher_suites`, `curve_preferences` and `prefer_server_cipher_suites` are
//! honoured (rustls' ring provider, narrowed); `http_server_config` is accepted only where pgio
//! does what it asks (HTTP/1.1, no extra headers) and otherwise refused, naming the key and its
//! line.
use std::collections::BTreeMap;

use rustls::{NamedGroup, SupportedCipherSuite, crypto::CryptoProvider};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpServerConfig {
    http2: Option<bool>,
    headers: Option<BTreeMap<String, String>>,
}

/// `key` (the first line that starts with it, indentation aside) in `text`, for errors about
/// values serde accepted.
pub fn at_line(text: &str, key: &str) -> String {
    text.lines()
        .position(|l| l.trim_start().starts_with(&format!("{key}:")))
        .map_or_else(|| key.to_owned(), |n| format!("{key} (line {})", n + 1))
}

/// Refuses what pgio's HTTP server does not do.
pub fn check_http_server_config(h: &HttpServerConfig, text: &str) -> Result<(), String> {
    if h.http2 == Some(true) {
        return Err(format!(
            "{}: pgio serves HTTP/1.1 only; set http2: false or remove it",
            at_line(text, "http2")
        ));
    }
    if h.headers.as_ref().is_some_and(|h| !h.is_empty()) {
        return Err(format!(
            "{}: pgio does not add response headers; remove them",
            at_line(text, "headers")
        ));
    }
    Ok(())
}

/// The ring provider with only the TLS 1.2 `cipher_suites` named (in that order; TLS 1.3
/// suites stay, as in Go, where the list applies to TLS 1.2 only) and only the key exchange
/// groups of `curve_preferences` (in that order).
pub fn provider(
    cipher_suites: Option<&[String]>,
    curves: Option<&[String]>,
    text: &str,
) -> Result<CryptoProvider, String> {
    let mut p = rustls::crypto::ring::default_provider();
    if let Some(names) = cipher_suites {
        let tls12 = |s: &SupportedCipherSuite| matches!(s, SupportedCipherSuite::Tls12(_));
        let offered: Vec<SupportedCipherSuite> =
            p.cipher_suites.iter().copied().filter(tls12).collect();
        let mut chosen: Vec<SupportedCipherSuite> = Vec::new();
        for name in names {
            // Go also names the ChaCha20 suites without their hash.
            let found = offered.iter().find(|s| {
                s.suite()
                    .as_str()
                    .is_some_and(|n| n == name.as_str() || n == format!("{name}_SHA256"))
            });
            match found {
                Some(s) => chosen.push(*s),
                None => {
                    return Err(format!(
                        "{}: {name} is not a TLS 1.2 suite pgio offers ({})",
                        at_line(text, "cipher_suites"),
                        suite_names(&offered)
                    ));
                }
            }
        }
        if chosen.is_empty() {
            return Err(format!(
                "{}: empty (leave it out for the defaults)",
                at_line(text, "cipher_suites")
            ));
        }
        chosen.extend(p.cipher_suites.iter().copied().filter(|s| !tls12(s)));
        p.cipher_suites = chosen;
    }
    if let Some(curves) = curves {
        let mut chosen = Vec::new();
        for curve in curves {
            let group = match curve.as_str() {
                "X25519" => NamedGroup::X25519,
                "CurveP256" => NamedGroup::secp256r1,
                "CurveP384" => NamedGroup::secp384r1,
                other => {
                    return Err(format!(
                        "{}: {other} is not offered (X25519, CurveP256, CurveP384)",
                        at_line(text, "curve_preferences")
                    ));
                }
            };
            if let Some(g) = p.kx_groups.iter().find(|g| g.name() == group) {
                chosen.push(*g);
            }
        }
        if chosen.is_empty() {
            return Err(format!(
                "{}: empty (leave it out for the defaults)",
                at_line(text, "curve_preferences")
            ));
        }
        p.kx_groups = chosen;
    }
    Ok(p)
}

fn suite_names(suites: &[SupportedCipherSuite]) -> String {
    suites
        .iter()
        .filter_map(|s| s.suite().as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suites_and_curves_narrow_the_provider() {
        let names = ["TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305".to_owned()];
        let p = provider(Some(&names), Some(&["CurveP256".to_owned()]), "").expect("provider");
        let tls12: Vec<_> = p
            .cipher_suites
            .iter()
            .filter(|s| matches!(s, SupportedCipherSuite::Tls12(_)))
            .filter_map(|s| s.suite().as_str())
            .collect();
        assert_eq!(tls12, ["TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256"]);
        assert!(p.cipher_suites.len() > 1, "TLS 1.3 suites stay");
        assert_eq!(p.kx_groups.len(), 1);
        assert_eq!(p.kx_groups[0].name(), NamedGroup::secp256r1);
    }

    #[test]
    fn what_pgio_cannot_do_is_refused_with_its_line() {
        let text = "tls_server_config:\n  cipher_suites: [TLS_RSA_WITH_AES_128_CBC_SHA]\n";
        let e = provider(
            Some(&["TLS_RSA_WITH_AES_128_CBC_SHA".to_owned()]),
            None,
            text,
        )
        .expect_err("a CBC suite");
        assert!(
            e.starts_with("cipher_suites (line 2): TLS_RSA_WITH_AES_128_CBC_SHA is not"),
            "{e}"
        );
        let e = provider(None, Some(&["CurveP521".to_owned()]), "").expect_err("P-521");
        assert!(e.contains("CurveP521 is not offered"), "{e}");
        let text = "http_server_config:\n  http2: true\n";
        let h: HttpServerConfig = serde_yaml_ng::from_str("http2: true").expect("yaml");
        let e = check_http_server_config(&h, text).expect_err("http2");
        assert!(
            e.starts_with("http2 (line 2): pgio serves HTTP/1.1 only"),
            "{e}"
        );
        let h: HttpServerConfig = serde_yaml_ng::from_str("http2: false").expect("yaml");
        assert!(check_http_server_config(&h, text).is_ok());
    }
}
