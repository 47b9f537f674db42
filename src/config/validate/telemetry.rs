//! `telemetry`, validated: the OTLP endpoint, its headers, protocol and
//! sampling ratio.

use crate::config::file::*;
use crate::config::types::*;
use std::time::Duration;

/// `telemetry`: the OTLP endpoint (the file's, else the standard `OTEL_*`
/// variables `env` reads), its protocol and the sampling ratio.
pub(in crate::config) fn validate_telemetry(
    t: &FileTelemetry,
    env: &dyn Fn(&str) -> Option<String>,
    errors: &mut Vec<ConfigError>,
) -> TelemetryConfig {
    const TRACES: &str = "/v1/traces";
    let set = |k: &str| env(k).filter(|v| !v.trim().is_empty());
    let disabled = set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    // A base URL gets the traces path, as OTEL_EXPORTER_OTLP_ENDPOINT does;
    // the traces-only variable is the whole URL.
    let base = |url: &str| {
        let url = url.trim().trim_end_matches('/');
        if url.ends_with(TRACES) {
            url.to_string()
        } else {
            format!("{url}{TRACES}")
        }
    };
    let (key, url) = match &t.otlp.endpoint {
        Some(e) => ("telemetry.otlp.endpoint", Some(base(e))),
        None => match set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(e) => (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                Some(e.trim().to_string()),
            ),
            None => (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                set("OTEL_EXPORTER_OTLP_ENDPOINT").map(|e| base(&e)),
            ),
        },
    };
    let url = url.filter(|_| !disabled).and_then(|url| {
        match url.parse::<http::Uri>() {
            Ok(u) if u.scheme_str() == Some("http") && u.host().is_some() => Some(url),
            Ok(u) if u.scheme_str() == Some("https") => {
                errors.push(err(key, "https is not built in: point it at a collector over http (an agent or sidecar, port 4318)"));
                None
            }
            _ => {
                errors.push(err(key, format!("`{url}` is not an http:// URL")));
                None
            }
        }
    });
    match t.otlp.protocol.as_str() {
        "http/protobuf" => {}
        "grpc" => errors.push(err(
            "telemetry.otlp.protocol",
            "grpc is not built in: use http/protobuf (the collector's port 4318)",
        )),
        other => errors.push(err(
            "telemetry.otlp.protocol",
            format!("`{other}`: must be http/protobuf"),
        )),
    }
    if !(0.0..=1.0).contains(&t.sample_ratio) {
        errors.push(err("telemetry.sample_ratio", "must be between 0 and 1"));
    }
    if t.max_queued_spans == 0 || t.max_queued_spans > 1_000_000 {
        errors.push(err(
            "telemetry.max_queued_spans",
            "must be between 1 and 1000000",
        ));
    }
    if t.otlp.timeout_ms == 0 || t.otlp.timeout_ms > 600_000 {
        errors.push(err(
            "telemetry.otlp.timeout_ms",
            "must be between 1 and 600000",
        ));
    }
    let header_var = if set("OTEL_EXPORTER_OTLP_TRACES_HEADERS").is_some() {
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
    } else {
        "OTEL_EXPORTER_OTLP_HEADERS"
    };
    let headers = set(header_var)
        .map(|v| otlp_headers(header_var, &v, errors))
        .unwrap_or_default();
    TelemetryConfig {
        otlp: url.map(|traces_url| OtlpConfig {
            traces_url,
            timeout: Duration::from_millis(t.otlp.timeout_ms),
            headers,
        }),
        sample_ratio: t.sample_ratio.clamp(0.0, 1.0),
        max_queued_spans: t.max_queued_spans.clamp(1, 1_000_000),
        service_name: set("OTEL_SERVICE_NAME").unwrap_or_else(|| "agent-gateway".into()),
    }
}

/// `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs, comma-separated, values
/// percent-encoded (the OpenTelemetry convention).
fn otlp_headers(
    var: &str,
    v: &str,
    errors: &mut Vec<ConfigError>,
) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let decode = |s: &str| -> Option<String> {
        let b = s.trim().as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        String::from_utf8(out).ok()
    };
    v.split(',')
        .filter(|p| !p.trim().is_empty())
        .filter_map(|pair| {
            let parsed = pair.split_once('=').and_then(|(k, v)| {
                Some((
                    http::HeaderName::from_bytes(k.trim().as_bytes()).ok()?,
                    http::HeaderValue::from_str(&decode(v)?).ok()?,
                ))
            });
            if parsed.is_none() {
                errors.push(err(var, "must be key=value pairs separated by commas"));
            }
            parsed
        })
        .collect()
}
