//! Assembling the Pingora server: the proxy listeners, the health checks, the
//! metrics listener and the binding sweeper.

use crate::config::Config;
use crate::gateway::Gateway;
use crate::proxy::GatewayProxy;
use crate::upstream::health;
use async_trait::async_trait;
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::{Server, ShutdownWatch};
use pingora_core::services::background::{background_service, BackgroundService};
use pingora_core::services::listening::Service;
use std::sync::Arc;
use std::time::Duration;

/// Options from the command line that are not in the YAML file.
#[derive(Debug, Default, Clone)]
pub struct RunOptions {
    /// Take over listeners from a running instance (Pingora graceful upgrade).
    pub upgrade: bool,
    pub daemon: bool,
}

fn pingora_conf(config: &Config) -> ServerConf {
    let mut conf = ServerConf::new().expect("pingora's default configuration parses");
    conf.threads = if config.server.threads > 0 {
        config.server.threads
    } else {
        std::thread::available_parallelism().map_or(2, |n| n.get())
    };
    conf.pid_file = config.server.pid_file.clone();
    conf.upgrade_sock = config.server.upgrade_sock.clone();
    conf.grace_period_seconds = Some(config.server.grace_period_seconds);
    conf.graceful_shutdown_timeout_seconds = Some(config.server.graceful_shutdown_timeout_seconds);
    conf
}

/// Build a ready-to-run server for `config`.
pub fn build(config: Config, opts: &RunOptions) -> Result<(Server, Arc<Gateway>), String> {
    let config = Arc::new(config);
    let opt = Opt {
        upgrade: opts.upgrade,
        daemon: opts.daemon,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(opt, pingora_conf(&config));
    server.bootstrap();

    let check = health::ReloadableCheck::new(&config.health);
    let (registry, health_service) = health::registry_and_service(&config.health, &check);
    let gw = Gateway::new(Arc::clone(&config), registry, check)
        .map_err(|_| "too many tiers".to_string())?;

    let health_handle = server.add_service(background_service("health checks", health_service));

    let mut proxy = pingora_proxy::http_proxy_service_with_name(
        &server.configuration,
        GatewayProxy::new(Arc::clone(&gw)),
        "agent-gateway proxy",
    );
    for addr in &config.server.listen {
        proxy.add_tcp(&addr.to_string());
    }
    // Listeners open only after the first health pass, so the first request
    // already sees which backends are up.
    let proxy_handle = server.add_service(proxy);
    proxy_handle.add_dependency(&health_handle);

    let mut metrics = Service::new("metrics".into(), MetricsApp(Arc::clone(&gw)));
    metrics.add_tcp(&config.metrics.listen.to_string());
    let metrics_handle = server.add_service(metrics);
    metrics_handle.add_dependency(&health_handle);

    let mut admin = Service::new("admin".into(), crate::admin::AdminApp(Arc::clone(&gw)));
    admin.add_tcp(&config.admin.listen.to_string());
    let admin_handle = server.add_service(admin);
    admin_handle.add_dependency(&health_handle);

    server.add_service(background_service(
        "binding sweeper",
        Sweeper(Arc::clone(&gw)),
    ));
    Ok((server, gw))
}

/// `GET /metrics` (Prometheus text format) and `GET /healthz`.
pub struct MetricsApp(pub Arc<Gateway>);

#[async_trait]
impl ServeHttp for MetricsApp {
    async fn response(&self, session: &mut ServerSession) -> http::Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_string();
        let (status, ctype, body) = match path.as_str() {
            "/metrics" => {
                self.0.refresh_gauges();
                (200, "text/plain; version=0.0.4", self.0.metrics.encode())
            }
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            _ => (404, "text/plain", b"not found\n".to_vec()),
        };
        http::Response::builder()
            .status(status)
            .header("content-type", ctype)
            .header("content-length", body.len())
            .body(body)
            .expect("static response parts are valid")
    }
}

/// Removes expired bindings in the background, a bounded batch at a time.
struct Sweeper(Arc<Gateway>);

#[async_trait]
impl BackgroundService for Sweeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {
                    self.0.affinity.sweep();
                }
            }
        }
    }
}
