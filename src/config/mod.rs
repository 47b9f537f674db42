//! The YAML file (SPEC §6) and the validated, typed [`Config`] the rest of the
//! gateway trusts. Every error names the key that is wrong.

mod file;
mod validate;

use file::FileConfig;
use std::path::Path;

mod types;

pub use types::*;

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![err(
                "",
                format!("cannot read {}: {e}", path.display()),
            )])
        })?;
        let config = Config::from_yaml(&text)?;
        // A keys file that does not load is refused with the config: with
        // `auth.required` no one could get in.
        if let Some(keys) = &config.auth.keys_file {
            if let Err(e) = crate::auth::Auth::default().load(keys) {
                return Err(ConfigErrors(vec![err("auth.keys_file", e)]));
            }
        }
        Ok(config)
    }

    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        if let Err(message) = shape_check(text) {
            return Err(ConfigErrors(vec![err("", message)]));
        }
        let de = serde_yaml::Deserializer::from_str(text);
        let file: FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let key = if key == "." { String::new() } else { key };
            ConfigErrors(vec![err(key, e.into_inner().to_string())])
        })?;
        validate::validate(file)
    }

    /// Whether requests carry a tenant (client keys, or `affinity.tenant_*`)
    /// whose stored responses and cached prompts others must not reach.
    pub fn separates_tenants(&self) -> bool {
        self.auth.keys_file.is_some() || self.affinity.tenant != TenantSource::None
    }

    pub fn default_tier(&self) -> &TierConfig {
        self.tiers
            .iter()
            .find(|t| t.default)
            .expect("validated config has a default tier")
    }
}

/// Refuse, before parsing, what no real config looks like and what would
/// make the YAML parser work for minutes (its cost grows with the square of
/// the nesting depth).
fn shape_check(text: &str) -> Result<(), String> {
    const MAX_BYTES: usize = 1024 * 1024;
    const MAX_DEPTH: usize = 32;
    const MAX_INDENT: usize = 128;
    if text.len() > MAX_BYTES {
        return Err(format!("the file is over {MAX_BYTES} bytes"));
    }
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        if indent > MAX_INDENT {
            return Err(format!(
                "line {}: nested deeper than any config needs ({indent} columns of indentation)",
                i + 1
            ));
        }
    }
    let (mut depth, mut quote) = (0usize, None::<char>);
    for c in text.chars() {
        match (quote, c) {
            // A comment runs to the end of its line.
            (Some('#'), '\n') => quote = None,
            (None, '#') => quote = Some('#'),
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '{') => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(format!(
                        "brackets nested deeper than {MAX_DEPTH} levels: no config needs that"
                    ));
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const GOOD: &str = r#"
server:
  listen: ["127.0.0.1:8080"]
tiers:
  default:
    default: true
    models: ["qwen3-8b"]
    backends:
      - { id: vllm-0, addr: "127.0.0.1:8001", weight: 1 }
      - { id: vllm-1, addr: "127.0.0.1:8002", weight: 2 }
affinity:
  sticky_ttl_seconds: 1800
  session_headers: [x-session-id, X-Dynamo-Session-Id]
  parent_session_headers: [x-parent-session-id]
  hash_key: "64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813"
health:
  path: /health
  interval_ms: 1000
metrics:
  listen: "127.0.0.1:9091"
"#;

    /// A fleet secret for configurations written in a test.
    const SECRET: &str = "affinity: { hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\" }\n";

    fn keys(text: &str) -> Vec<String> {
        Config::from_yaml(text)
            .unwrap_err()
            .0
            .into_iter()
            .map(|e| e.key)
            .collect()
    }

    #[test]
    fn a_tier_lists_backends_or_names_discovery() {
        let tier = |d: &str| {
            format!(
                "{SECRET}tiers:\n  default:\n    default: true\n    discovery: {d}\n\
                 discovery:\n  resolvers: [\"127.0.0.1:5353\", \"10.0.0.10\"]\n"
            )
        };
        let c = Config::from_yaml(&tier("{ dns: vllm.default.svc.cluster.local, port: 8000 }"))
            .unwrap();
        let d = c.tiers[0].discovery.as_ref().unwrap();
        assert_eq!(
            d.target,
            DnsTarget::Host {
                name: "vllm.default.svc.cluster.local".into(),
                port: 8000
            }
        );
        assert_eq!(d.refresh, Duration::from_secs(5));
        assert!(c.tiers[0].backends.is_empty());
        assert_eq!(c.resolvers[1], "10.0.0.10:53".parse().unwrap());
        let c = Config::from_yaml(&tier("{ srv: _http._tcp.vllm, refresh_ms: 1000 }")).unwrap();
        assert_eq!(
            c.tiers[0].discovery.as_ref().unwrap().target,
            DnsTarget::Srv {
                name: "_http._tcp.vllm".into()
            }
        );
        for (d, key) in [
            ("{ dns: vllm }", "tiers.default.discovery.port"),
            (
                "{ srv: _h._tcp.vllm, port: 80 }",
                "tiers.default.discovery.port",
            ),
            (
                "{ dns: vllm, srv: _h._tcp.vllm, port: 80 }",
                "tiers.default.discovery",
            ),
            ("{ dns: \"bad name\", port: 80 }", "tiers.default.discovery"),
            (
                "{ dns: vllm, port: 80, refresh_ms: 10 }",
                "tiers.default.discovery.refresh_ms",
            ),
        ] {
            assert_eq!(keys(&tier(d)), vec![key.to_string()], "{d}");
        }
        let both = GOOD.replace(
            "    backends:\n",
            "    discovery: { dns: vllm, port: 80 }\n    backends:\n",
        );
        assert_eq!(keys(&both), vec!["tiers.default.discovery".to_string()]);
        let bad_resolver = format!("{GOOD}discovery:\n  resolvers: [\"dns.example\"]\n");
        assert_eq!(keys(&bad_resolver), vec!["discovery.resolvers".to_string()]);
    }

    #[test]
    fn what_becomes_of_a_hung_backends_requests_is_named() {
        assert_eq!(
            Config::from_yaml(GOOD).unwrap().outlier.on_hung,
            OnHung::Resend
        );
        let fail = format!("{GOOD}outlier:\n  on_hung: fail\n");
        assert_eq!(
            Config::from_yaml(&fail).unwrap().outlier.on_hung,
            OnHung::Fail
        );
        let bad = format!("{GOOD}outlier:\n  on_hung: retry\n");
        assert_eq!(keys(&bad), vec!["outlier.on_hung".to_string()]);
    }

    #[test]
    fn cache_salt_is_off_unless_asked_for_and_needs_tenants() {
        let c = Config::from_yaml(GOOD).unwrap();
        assert_eq!(c.auth.cache_salt, CacheSalt::Off);
        let keyed = format!("{GOOD}auth:\n  keys_file: /k.yaml\n  cache_salt: tenant\n");
        assert_eq!(
            Config::from_yaml(&keyed).unwrap().auth.cache_salt,
            CacheSalt::Tenant
        );
        let by_header = GOOD.replace("affinity:\n", "affinity:\n  tenant_header: x-tenant\n")
            + "auth:\n  cache_salt: tenant\n";
        assert_eq!(
            Config::from_yaml(&by_header).unwrap().auth.cache_salt,
            CacheSalt::Tenant
        );
        let no_tenants = format!("{GOOD}auth:\n  cache_salt: tenant\n");
        assert_eq!(keys(&no_tenants), vec!["auth.cache_salt".to_string()]);
        let unknown = format!("{GOOD}auth:\n  keys_file: /k.yaml\n  cache_salt: key\n");
        assert_eq!(keys(&unknown), vec!["auth.cache_salt".to_string()]);
    }

    #[test]
    fn a_stream_over_its_tenants_limit_finishes_unless_cut_is_asked_for() {
        let auth = |v: &str| format!("{GOOD}auth:\n  stream_over_limit: {v}\n");
        let c = Config::from_yaml(GOOD).unwrap();
        assert_eq!(c.auth.stream_over_limit, StreamOverLimit::Finish);
        let c = Config::from_yaml(&auth("cut")).unwrap();
        assert_eq!(c.auth.stream_over_limit, StreamOverLimit::Cut);
        assert_eq!(
            keys(&auth("stop")),
            vec!["auth.stream_over_limit".to_string()]
        );
    }

    #[test]
    fn telemetry_takes_the_files_endpoint_else_the_otel_variables() {
        let run = |yaml: &str, vars: &[(&str, &str)]| {
            let file: file::FileTelemetry = serde_yaml::from_str(yaml).unwrap();
            let env = |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            };
            let mut errors = Vec::new();
            let t = validate::validate_telemetry(&file, &env, &mut errors);
            (t, errors.into_iter().map(|e| e.key).collect::<Vec<_>>())
        };
        let url = |t: &TelemetryConfig| t.otlp.as_ref().map(|o| o.traces_url.clone());
        let (t, e) = run("{}", &[]);
        assert_eq!((url(&t), e.len()), (None, 0), "off without an endpoint");
        assert_eq!(t.service_name, "agent-gateway");
        let base = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")];
        assert_eq!(
            url(&run("{}", &base).0).as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        let traces = [("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom")];
        assert_eq!(
            url(&run("{}", &traces).0).as_deref(),
            Some("http://c:4318/custom")
        );
        let file = "otlp: { endpoint: \"http://127.0.0.1:4318\" }";
        assert_eq!(
            url(&run(file, &base).0).as_deref(),
            Some("http://127.0.0.1:4318/v1/traces"),
            "the file wins"
        );
        let keyed = [
            base[0],
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "api-key=s%3Dcret, x-team=edge",
            ),
        ];
        let (t, e) = run("{}", &keyed);
        let headers = &t.otlp.unwrap().headers;
        assert!(e.is_empty());
        assert_eq!(headers.len(), 2);
        assert_eq!(
            (headers[0].0.as_str(), headers[0].1.to_str().unwrap()),
            ("api-key", "s=cret")
        );
        let bad = [base[0], ("OTEL_EXPORTER_OTLP_HEADERS", "no-equals-sign")];
        assert_eq!(
            run("{}", &bad).1,
            vec!["OTEL_EXPORTER_OTLP_HEADERS".to_string()]
        );
        let disabled = [
            base[0],
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_SERVICE_NAME", "edge"),
        ];
        let (t, _) = run("{}", &disabled);
        assert_eq!((url(&t), t.service_name.as_str()), (None, "edge"));
        for (bad, key) in [
            (
                "otlp: { protocol: grpc, endpoint: \"http://c:4317\" }",
                "telemetry.otlp.protocol",
            ),
            (
                "otlp: { endpoint: \"https://c:4318\" }",
                "telemetry.otlp.endpoint",
            ),
            ("otlp: { endpoint: \"c:4318\" }", "telemetry.otlp.endpoint"),
            ("sample_ratio: 1.5", "telemetry.sample_ratio"),
            ("max_queued_spans: 0", "telemetry.max_queued_spans"),
        ] {
            assert_eq!(run(bad, &[]).1, vec![key.to_string()], "{bad}");
        }
    }

    #[test]
    fn spec_example_is_valid() {
        let c = Config::from_yaml(GOOD).unwrap();
        assert_eq!(c.tiers.len(), 1);
        assert_eq!(c.tiers[0].backends[1].weight, 2);
        assert_eq!(c.affinity.session_headers[1], "x-dynamo-session-id");
        assert_eq!(c.affinity.sticky_ttl, Some(Duration::from_secs(1800)));
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn header_names_are_validated_once_and_deduplicated() {
        let text = GOOD.replace(
            "session_headers: [x-session-id, X-Dynamo-Session-Id]",
            "session_headers: [x-session-id, X-Session-ID, \"bad header\"]\n  tenant_header: \"x:tenant\"",
        );
        assert_eq!(
            keys(&text),
            ["affinity.session_headers[2]", "affinity.tenant_header"]
        );
        let text = GOOD.replace("X-Dynamo-Session-Id", "X-Session-ID");
        let c = Config::from_yaml(&text).unwrap();
        assert_eq!(c.affinity.session_headers, ["x-session-id"]);
    }

    #[test]
    fn unknown_key_is_named() {
        let text = GOOD.replace("weight: 2", "wieght: 2");
        let e = Config::from_yaml(&text).unwrap_err();
        assert_eq!(e.0[0].key, "tiers.default.backends[1].wieght");
        assert!(e.0[0].message.contains("wieght"), "{}", e);
    }

    #[test]
    fn duplicate_ids_bad_addresses_and_empty_tiers_are_errors() {
        let text = GOOD.replace("id: vllm-1", "id: vllm-0");
        assert_eq!(keys(&text), vec!["tiers.default.backends[1].id"]);
        let text = GOOD.replace("127.0.0.1:8002", "not an address");
        assert_eq!(keys(&text), vec!["tiers.default.backends[1].addr"]);
        let text = format!("{SECRET}tiers:\n  a: {{ default: true, backends: [] }}\n");
        assert_eq!(keys(&text), vec!["tiers.a.backends"]);
    }

    #[test]
    fn kv_events_endpoints_are_places_to_connect_to() {
        let with = |events: &str| {
            GOOD.replace(
                "addr: \"127.0.0.1:8002\", weight: 2 }",
                &format!("addr: \"127.0.0.1:8002\", weight: 2, kv_events: {events} }}"),
            )
        };
        let c = Config::from_yaml(&with(
            r#"{ endpoint: "tcp://10.0.0.5:5557", replay: "tcp://10.0.0.5:5558" }"#,
        ))
        .unwrap();
        let kv = c.tiers[0].backends[1]
            .kv_events
            .as_ref()
            .expect("kv_events");
        assert_eq!(kv.endpoint, "tcp://10.0.0.5:5557");
        assert_eq!(kv.topic, "");
        assert!(Config::from_yaml(&with(r#"{ endpoint: "ipc:///run/kv.sock" }"#)).is_ok());
        // A publisher's bind-all, a missing port, another scheme, a typo'd key.
        for bad in [
            r#"{ endpoint: "tcp://*:5557" }"#,
            r#"{ endpoint: "tcp://10.0.0.5" }"#,
            r#"{ endpoint: "http://10.0.0.5:5557" }"#,
        ] {
            assert_eq!(
                keys(&with(bad)),
                vec!["tiers.default.backends[1].kv_events.endpoint"],
                "{bad}"
            );
        }
        assert_eq!(
            keys(&with(r#"{ endpoint: "tcp://h:1", replay: "h:2" }"#)),
            vec!["tiers.default.backends[1].kv_events.replay"]
        );
        assert!(Config::from_yaml(&with(r#"{ endpoint: "tcp://h:1", replays: "x" }"#)).is_err());
    }

    #[test]
    fn default_tier_rules() {
        let two = format!(
            "{SECRET}tiers:\n  a: {{ backends: [{{id: a0, addr: \"127.0.0.1:1\"}}] }}\n  \
             b: {{ backends: [{{id: b0, addr: \"127.0.0.1:2\"}}] }}\n"
        );
        assert_eq!(keys(&two), vec!["tiers"]);
        let one = format!(
            "{SECRET}tiers:\n  only: {{ backends: [{{id: a0, addr: \"127.0.0.1:1\"}}] }}\n"
        );
        let c = Config::from_yaml(&one).unwrap();
        assert!(c.default_tier().name == "only");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // Without a key: refused. A weak one: refused where response ids
        // are the gateway's (the default), a warning where the key only
        // places sessions.
        let bare = "tiers:\n  only: { backends: [{id: a0, addr: \"127.0.0.1:1\"}] }\n";
        assert_eq!(keys(bare), vec!["affinity.hash_key"]);
        let weak = format!("affinity: {{ hash_key: s3cret }}\n{bare}");
        assert_eq!(keys(&weak), vec!["affinity.hash_key"]);
        // A weak key retired still opens ids forged under it.
        let retired_weak = SECRET.replace(" }", ", retired_hash_keys: [change-me] }");
        assert_eq!(
            keys(&format!("{retired_weak}{bare}")),
            vec!["affinity.retired_hash_keys[0]"]
        );
        let placing = format!("affinity: {{ hash_key: s3cret, response_ids: engine }}\n{bare}");
        let c = Config::from_yaml(&placing).unwrap();
        assert!(c.warnings.iter().any(|w| w.contains("affinity.hash_key")));
    }

    #[test]
    fn ttl_zero_disables_affinity() {
        let c =
            Config::from_yaml(&GOOD.replace("sticky_ttl_seconds: 1800", "sticky_ttl_seconds: 0"))
                .unwrap();
        assert_eq!(c.affinity.sticky_ttl, None);
    }

    #[test]
    fn model_in_two_tiers_is_an_error() {
        let text = format!(
            "{SECRET}tiers:\n  a: {{ default: true, models: [m], backends: [{{id: a0, addr: \"127.0.0.1:1\"}}] }}\n  \
             b: {{ models: [m], backends: [{{id: b0, addr: \"127.0.0.1:2\"}}] }}\n"
        );
        assert_eq!(keys(&text), vec!["tiers.b.models"]);
    }

    #[test]
    fn an_admin_api_reachable_from_other_hosts_needs_a_token() {
        let open = format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n");
        assert_eq!(keys(&open), vec!["admin.listen"]);
        for ok in [
            format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n  token: t0ken\n"),
            format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n  insecure: true\n"),
            format!("{GOOD}admin:\n  listen: \"127.0.0.1:9092\"\n"),
        ] {
            assert!(Config::from_yaml(&ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn backend_ids_must_fit_in_a_header() {
        for bad in ["vllm é", "vllm 0", "vllm\\u0007"] {
            let text = GOOD.replace("id: vllm-1", &format!("id: \"{bad}\""));
            assert_eq!(keys(&text), vec!["tiers.default.backends[1].id"], "{bad}");
        }
    }

    #[test]
    fn the_store_section_is_checked() {
        let redis = GOOD.replace(
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n",
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n  store: { kind: redis, url: \"redis://127.0.0.1:6379\" }\n",
        );
        let c = Config::from_yaml(&redis).unwrap();
        assert_eq!(c.affinity.store.kind, crate::fleet::store::StoreKind::Redis);
        // A quarter of the 30-minute TTL, capped at a minute.
        assert_eq!(c.affinity.store.revalidate, Duration::from_secs(60));
        let bad = redis.replace("redis://127.0.0.1:6379", "http://x");
        assert_eq!(keys(&bad), vec!["affinity.store.url"]);
        let kind = redis.replace("kind: redis", "kind: etcd");
        assert_eq!(keys(&kind), vec!["affinity.store.kind"]);
        let unix = redis.replace("redis://127.0.0.1:6379", "redis+unix:///run/redis.sock");
        assert!(Config::from_yaml(&unix).is_ok());
        // TLS files need a rediss:// URL, and must be readable.
        let tls_on_plain = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /etc/hostname, url: \"redis://",
        );
        assert_eq!(keys(&tls_on_plain), vec!["affinity.store.url"]);
        let missing = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /nonexistent/ca.pem, url: \"rediss://",
        );
        assert_eq!(keys(&missing), vec!["affinity.store.url"]);
        let half = redis.replace(
            "url: \"redis://",
            "tls_cert_file: /etc/hostname, url: \"rediss://",
        );
        assert_eq!(keys(&half), vec!["affinity.store.url"]);
        // A file that is there but holds no PEM certificate is refused too.
        let garbage = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /etc/hostname, url: \"rediss://",
        );
        assert_eq!(keys(&garbage), vec!["affinity.store.url"]);
    }

    #[test]
    fn the_prefix_section_is_on_by_default_and_checked() {
        let c = Config::from_yaml(GOOD).unwrap();
        assert!(c.affinity.prefix.enabled);
        assert_eq!(c.affinity.prefix.max_memory_bytes, 64 << 20);
        let off = GOOD.replace(
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n",
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n  prefix: { enabled: false }\n",
        );
        assert!(!Config::from_yaml(&off).unwrap().affinity.prefix.enabled);
        let bad = GOOD.replace(
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n",
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n  prefix: { block_bytes: 4, max_memory_bytes: 10, ttl_seconds: 0 }\n",
        );
        assert_eq!(
            keys(&bad),
            vec![
                "affinity.prefix.block_bytes",
                "affinity.prefix.max_memory_bytes",
                "affinity.prefix.ttl_seconds"
            ]
        );
        let unknown = GOOD.replace(
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n",
            "  hash_key: \"64e38e9e473f1eebd4b85cf92d09e5e090ea05ac1e1fdbfc59399632386d0813\"\n  prefix: { blocks: 1 }\n",
        );
        assert_eq!(keys(&unknown), vec!["affinity.prefix.blocks"]);
    }
}
