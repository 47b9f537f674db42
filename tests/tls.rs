//! TLS: termination with certificates chosen by SNI, ALPN h2, certificates
//! reloaded on SIGHUP, and verified TLS to backends (a second gateway acts as
//! the TLS backend). Certificates come from a CA the test generates.

mod common;

use common::*;
use std::path::Path;
use std::sync::Arc;
use tokio_rustls::rustls;

fn tls_section(dir: &Path, port: u16) -> String {
    let d = dir.display();
    format!(
        "  tls:\n    listen: [\"127.0.0.1:{port}\"]\n    h2: true\n    certificates:\n      - {{ cert: \"{d}/a.test.pem\", key: \"{d}/a.test.key\", server_names: [a.test] }}\n      - {{ cert: \"{d}/b.test.pem\", key: \"{d}/b.test.key\", server_names: [\"b.test\", \"*.b.test\"] }}\n"
    )
}

/// The certificate (DER) a TLS handshake with `sni` is answered with.
async fn served_cert(pki: &Pki, port: u16, sni: &str) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.ca.der().clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let tls = connector
        .connect(name, tcp)
        .await
        .expect("handshake verifies against the test CA");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

async fn tls_gateway(pki_dir: &Path, sims: &[&SimBackend]) -> (Gateway, u16) {
    let tls_port = free_port();
    let gw = Gateway::start_with(
        &[tier("default", true, &[], sims)],
        |_| tls_section(pki_dir, tls_port),
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    (gw, tls_port)
}

#[tokio::test]
async fn sni_picks_the_certificate_h2_is_negotiated_and_sighup_reloads_certificates() {
    let pki = Pki::new();
    let certs = tempfile::tempdir().unwrap();
    let a = pki.leaf(certs.path(), "a.test");
    let b = pki.leaf(certs.path(), "b.test");
    let sim = SimBackend::start("vllm-0", &[]);
    let (gw, tls_port) = tls_gateway(certs.path(), &[&sim]).await;

    assert_eq!(served_cert(&pki, tls_port, "a.test").await, a);
    assert_eq!(served_cert(&pki, tls_port, "b.test").await, b);

    // HTTP/2 over TLS, end to end, with affinity.
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .resolve("b.test", ([127, 0, 0, 1], tls_port).into())
        .build()
        .unwrap();
    for turn in 0..2 {
        let resp = client
            .post(format!("https://b.test:{tls_port}/v1/chat/completions"))
            .header("x-session-id", "secure")
            .json(&chat_body("m", turn))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.version(), reqwest::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()["x-agent-serve-affinity-hit"],
            if turn == 0 { "false" } else { "true" }
        );
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["x_agent_serve"]["backend"], "vllm-0");
    }

    // New certificate for a.test, picked up by SIGHUP without a restart.
    let a2 = pki.leaf(certs.path(), "a.test");
    assert_ne!(a, a2);
    gw.reload("success", 1.0).await;
    assert_eq!(served_cert(&pki, tls_port, "a.test").await, a2);
}

#[tokio::test]
async fn backends_can_be_reached_over_verified_tls() {
    let pki = Pki::new();
    let certs = tempfile::tempdir().unwrap();
    pki.leaf(certs.path(), "a.test");
    pki.leaf(certs.path(), "b.test");
    let ca_path = certs.path().join("ca.pem");
    std::fs::write(&ca_path, &pki.ca_pem).unwrap();
    let sim = SimBackend::start("vllm-0", &[]);
    // The TLS backend: another gateway terminating TLS in front of the sim.
    let (_inner, tls_port) = tls_gateway(certs.path(), &[&sim]).await;

    for (sni, should_work) in [("a.test", true), ("wrong.test", false)] {
        let dir = tempfile::tempdir().unwrap();
        let (port, mport) = (free_port(), free_port_pair());
        let yaml = format!(
            "server:\n  listen: [\"127.0.0.1:{port}\"]\n  upstream_ca_file: \"{}\"\n  pid_file: \"{d}/p\"\n  upgrade_sock: \"{d}/s\"\n\
             tiers:\n  default:\n    backends:\n      - {{ id: tls-backend, addr: \"127.0.0.1:{tls_port}\", tls: true, sni: \"{sni}\" }}\n\
             metrics:\n  listen: \"127.0.0.1:{mport}\"\nadmin:\n  listen: \"127.0.0.1:{}\"\n{FAST_HEALTH}{}",
            ca_path.display(),
            mport + 1,
            affinity_yaml(1800),
            d = dir.path().display(),
        );
        let outer = Gateway::start_yaml(dir, port, mport, &yaml).await;
        let r = chat(
            &client(),
            &outer,
            &[("x-session-id", "s")],
            &chat_body("m", 0),
        )
        .await;
        if should_work {
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(
                r.sim_backend.as_deref(),
                Some("vllm-0"),
                "reached the sim through TLS"
            );
            assert_eq!(r.backend.as_deref(), Some("tls-backend"));
        } else {
            // The certificate does not match the name: health checks and
            // connections fail verification, so nothing is sent.
            assert!(r.status == 503 || r.status == 502, "{}", r.status);
            assert_eq!(
                sim.stats().await["requests"].as_u64().unwrap(),
                1,
                "no request got through"
            );
        }
    }
}
