//! Assembling the Pingora server: the proxy listeners, the health checks, the
//! metrics listener and the binding sweeper.

use crate::config::Config;
use crate::gateway::Gateway;
use crate::proxy::GatewayProxy;
use crate::upstream::health;
use async_trait::async_trait;
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::l4::stream::L4BufferSettings;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::{Server, ShutdownWatch};
use pingora_core::services::background::{background_service, BackgroundService};
use pingora_core::services::listening::Service;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Each client connection's read buffer. Pingora's default, 64 KiB, is most
/// of what an idle connection costs (108 KB each, 5,000 idle: 526 MiB).
/// Pingora reads headers into a 4 KiB buffer of its own and bodies into
/// larger ones, and a read at least as large as this buffer bypasses it: a
/// larger one only adds copies and memory (8 KiB: 4 KB more an idle
/// connection; docs/benchmarks.md, issue 49, sixth session).
const CLIENT_READ_BUFFER: usize = 4 * 1024;
/// Pingora's default: one segment.
const CLIENT_WRITE_BUFFER: usize = 1460;

/// Options from the command line that are not in the YAML file.
#[derive(Debug, Default, Clone)]
pub struct RunOptions {
    /// Take over listeners from a running instance (Pingora graceful upgrade).
    pub upgrade: bool,
    pub daemon: bool,
    /// The config file, re-read on SIGHUP.
    pub config_path: Option<std::path::PathBuf>,
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
    conf.ca_file = config.server.upstream_ca_file.clone();
    conf
}

/// Build a ready-to-run server for `config`.
pub fn build(config: Config, opts: &RunOptions) -> Result<(Server, Arc<Gateway>), String> {
    // A SIGHUP before the lifecycle service handles it would end the process
    // (its default action): ignored until then, never fatal.
    // SAFETY: setting a signal's disposition to SIG_IGN, before any thread
    // of ours waits on it.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    let mut config = config;
    crate::discovery::first_answers(&mut config);
    let config = Arc::new(config);
    let opt = Opt {
        upgrade: opts.upgrade,
        daemon: opts.daemon,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(opt, pingora_conf(&config));
    server.bootstrap();

    let check = health::ReloadableCheck::new(&config);
    let (registry, health_service) = health::registry_and_service(&config.health, &check);
    let tls = match &config.server.tls {
        Some(t) => Some(crate::tls::SniResolver::new(&t.certificates)?),
        None => None,
    };
    let gw = Gateway::new(
        Arc::clone(&config),
        registry,
        check,
        opts.config_path.clone(),
        tls.clone(),
    )
    .map_err(|_| "too many tiers".to_string())?;
    if let Some(path) = &config.server.state_file {
        match crate::state::load(&gw, path) {
            Ok(n) => log::info!("restored {n} bindings from {}", path.display()),
            Err(e) => log::warn!("cannot read state file {}: {e}", path.display()),
        }
    }

    let health_handle = server.add_service(background_service("health checks", health_service));

    let mut http = pingora_proxy::HttpProxy::new(
        GatewayProxy::new(Arc::clone(&gw)),
        Arc::clone(&server.configuration),
    );
    http.handle_init_modules();
    let mut proxy = Service::new(
        "agent-gateway proxy".to_string(),
        crate::proxy::conn_guard::GuardedApp::new(http, Arc::clone(&gw)),
    );
    for addr in &config.server.listen {
        proxy.add_listener(
            pingora_core::listeners::ListenerConfig::tcp(addr.to_string()).l4_buffer(
                L4BufferSettings::new(CLIENT_READ_BUFFER, CLIENT_WRITE_BUFFER),
            ),
        );
    }
    if let (Some(t), Some(resolver)) = (&config.server.tls, &tls) {
        for addr in &t.listen {
            let mut settings = pingora_core::listeners::tls::TlsSettings::intermediate("", "")
                .map_err(|e| format!("TLS listener {addr}: {e}"))?;
            settings.set_cert_resolver(Arc::clone(resolver) as _);
            if t.h2 {
                settings.enable_h2();
            }
            // No read buffer under TLS: rustls reads the socket in 4 KiB
            // chunks into its own record buffer (a read of a buffer's size
            // bypasses it), and Pingora's 64 KiB default was most of an idle
            // TLS connection's 98.9 KB.
            proxy.add_listener(
                pingora_core::listeners::ListenerConfig::tcp(addr.to_string())
                    .tls(settings)
                    .l4_buffer(L4BufferSettings::new(0, CLIENT_WRITE_BUFFER)),
            );
        }
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
    if let Some(store) = gw.store.clone() {
        server.add_service(background_service(
            "binding store",
            StoreService(Arc::clone(&gw), store),
        ));
    }
    // Idle (a look each second) until a tier has `discovery`.
    server.add_service(background_service(
        "dns discovery",
        crate::discovery::Discovery(Arc::clone(&gw)),
    ));
    if let Some(t) = gw.telemetry.clone() {
        server.add_service(background_service(
            "span export",
            crate::telemetry::SpanExport(t),
        ));
    }
    // Idle (a look each second) until a backend has `kv_events`.
    server.add_service(background_service(
        "kv events",
        crate::kv::subscribe::KvSubscriptions(Arc::clone(&gw) as _),
    ));
    server.add_service(background_service(
        "load signals",
        crate::scraper::LoadScraper(Arc::clone(&gw)),
    ));
    let lifecycle = server.add_service(background_service(
        "lifecycle",
        Lifecycle {
            gw: Arc::clone(&gw),
            upgraded: opts.upgrade,
        },
    ));
    lifecycle.add_dependencies([&proxy_handle, &metrics_handle, &admin_handle]);
    Ok((server, gw))
}

/// Where the gateway serves, for its start-up log.
fn listening(config: &crate::config::Config) -> String {
    let mut proxy: Vec<String> = config
        .server
        .listen
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    if let Some(t) = &config.server.tls {
        proxy.extend(t.listen.iter().map(|a| format!("https://{a}")));
    }
    let backends: usize = config.tiers.iter().map(|t| t.backends.len()).sum();
    format!(
        "listening: proxy {}, metrics http://{}/metrics, admin http://{}/admin/backends; {} tier(s), {backends} backend(s)",
        proxy.join(" "),
        config.metrics.listen,
        config.admin.listen,
        config.tiers.len(),
    )
}

/// Wait (at most 10 s) until every configured listener accepts a connection.
async fn wait_listening(config: &crate::config::Config) {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let mut addrs: Vec<SocketAddr> = config.server.listen.clone();
    if let Some(t) = &config.server.tls {
        addrs.extend(&t.listen);
    }
    addrs.push(config.metrics.listen);
    addrs.push(config.admin.listen);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for mut addr in addrs {
        // A wildcard address is reached through loopback.
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if tokio::time::Instant::now() >= deadline {
                log::warn!("listener {addr} is not accepting yet; reporting ready anyway");
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Tell systemd (`Type=notify`) something, when it is listening.
fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let sent = if let Some(name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = sent {
        log::warn!("sd_notify({state}) failed: {e}");
    }
}

/// Starts once every listener is up: signals readiness to systemd, reloads
/// on SIGHUP, saves bindings periodically and at shutdown, and for a while
/// after start merges a state file that another instance (the one being
/// upgraded from) is still writing.
struct Lifecycle {
    gw: Arc<Gateway>,
    /// Started with `--upgrade`: this process takes over from the unit's
    /// main process, and tells systemd so (`MAINPID=`).
    upgraded: bool,
}

#[async_trait]
impl BackgroundService for Lifecycle {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        use tokio::signal::unix::{signal, SignalKind};
        let gw = &self.gw;
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                log::error!("cannot handle SIGHUP, reload disabled: {e}");
                None
            }
        };
        gw.lifecycle_started.store(true, Ordering::Relaxed);
        // Pingora marks a listening service ready when it starts, before its
        // sockets are bound: READY waits until each listener accepts.
        wait_listening(&gw.routing().config).await;
        log::info!("{}", listening(&gw.routing().config));
        if self.upgraded {
            // The unit's main process is draining away: this one is main now
            // (the unit needs NotifyAccess=all to accept it from here).
            sd_notify(&format!("MAINPID={}\nREADY=1", std::process::id()));
        } else {
            sd_notify("READY=1");
        }
        let started = std::time::Instant::now();
        let state_file = gw.routing().config.server.state_file.clone();
        let mut seen_mtime = state_file
            .as_deref()
            .and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        let mut last_save = std::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                Some(_) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    sd_notify("RELOADING=1");
                    let _ = gw.reload_from_file();
                    sd_notify("READY=1");
                }
                _ = tick.tick() => {
                    let Some(path) = state_file.as_deref() else { continue };
                    // Merge what a previous instance saves while it drains.
                    if started.elapsed() < Duration::from_secs(60) {
                        let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
                        if mtime.is_some() && mtime != seen_mtime {
                            seen_mtime = mtime;
                            match crate::state::load(gw, path) {
                                Ok(n) if n > 0 => log::info!("merged {n} bindings from {}", path.display()),
                                Ok(_) => {}
                                Err(e) => log::warn!("merging {}: {e}", path.display()),
                            }
                        }
                    }
                    let every = gw.routing().config.server.state_save_interval;
                    if last_save.elapsed() >= every {
                        last_save = std::time::Instant::now();
                        save_state(gw, path);
                        seen_mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
                    }
                }
            }
        }
        if let Some(path) = state_file.as_deref() {
            sd_notify("STOPPING=1");
            save_state(gw, path);
        }
    }
}

/// The shared binding store's subscription and outage recovery, and the
/// fleet's queue's background work.
struct StoreService(Arc<Gateway>, Arc<crate::fleet::store::SharedStore>);

#[async_trait]
impl BackgroundService for StoreService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let fleet = crate::fleet::Fleet {
            store: Arc::clone(&self.1),
        };
        let tiers: Arc<dyn crate::affinity::shared::Tiers> = Arc::clone(&self.0) as _;
        let slots = Arc::clone(&self.1).run_slots(Arc::clone(&self.0.admission));
        tokio::select! {
            _ = fleet.run(Arc::clone(&self.0.affinity) as Arc<dyn crate::affinity::shared::LocalBindings>, tiers) => {}
            _ = slots => {}
            _ = shutdown.changed() => {}
        }
    }
}

fn save_state(gw: &Gateway, path: &std::path::Path) {
    match crate::state::save(gw, path) {
        Ok(n) => log::debug!("saved {n} bindings to {}", path.display()),
        Err(e) => log::warn!("saving bindings to {}: {e}", path.display()),
    }
}

/// `GET /metrics` (Prometheus text format), `GET /healthz` and `GET /readyz`.
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
            "/healthz" => healthz(&self.0),
            "/readyz" => readiness(&self.0),
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

/// Where the gateway stands, as `/healthz` and `/readyz` both read it.
enum Standing {
    Starting,
    ConnectingStore,
    /// Serving, but its store does not answer (`required`: the operator
    /// asked for it to).
    StoreDown {
        required: bool,
    },
    Serving,
}

fn standing(gw: &Gateway) -> Standing {
    if !gw.lifecycle_started.load(Ordering::Relaxed) {
        return Standing::Starting;
    }
    match gw.store.as_deref() {
        Some(s) if !s.started() => Standing::ConnectingStore,
        Some(s) if !s.healthy() => Standing::StoreDown {
            required: s.config().required,
        },
        _ => Standing::Serving,
    }
}

/// Each tier's name, healthy backends and backends.
fn tiers_health(gw: &Gateway) -> Vec<(String, usize, usize)> {
    let routing = gw.routing();
    routing
        .tiers
        .iter()
        .map(|t| {
            let healthy = t.backends.iter().filter(|b| t.healthy(b)).count();
            (t.name.to_string(), healthy, t.backends.len())
        })
        .collect()
}

const STARTING: &[u8] = b"starting\n";
const CONNECTING_STORE: &[u8] = b"starting: connecting to the binding store\n";

/// `GET /healthz`: liveness. 503 while starting and while a required store
/// is unreachable; else 200, saying when it is degraded (the store
/// unreachable, or no backend of any tier healthy: a liveness probe must
/// not restart the gateway for its backends; `/readyz` fails then).
fn healthz(gw: &Gateway) -> (u16, &'static str, Vec<u8>) {
    let (status, body): (u16, &[u8]) = match standing(gw) {
        Standing::Starting => (503, STARTING),
        Standing::ConnectingStore => (503, CONNECTING_STORE),
        // Serving, but alone: say so, and fail the check when the operator
        // asked for the store to be required.
        Standing::StoreDown { required } => (
            if required { 503 } else { 200 },
            b"degraded: the binding store is unreachable; sessions are placed by this gateway alone\n",
        ),
        Standing::Serving if !tiers_health(gw).iter().any(|t| t.1 > 0) => (
            200,
            b"degraded: no backend of any tier is healthy (see /readyz)\n",
        ),
        Standing::Serving => (200, b"ok\n"),
    };
    (status, "text/plain", body.to_vec())
}

/// `GET /readyz`: whether a balancer should send this gateway requests.
/// Unlike `/healthz` (is the process alive and serving), it fails while no
/// backend of any tier is healthy, as well as while starting and, with
/// `affinity.store.required`, while the store is unreachable; its body
/// gives each tier's healthy backends.
fn readiness(gw: &Gateway) -> (u16, &'static str, Vec<u8>) {
    use std::fmt::Write;
    let refused: Option<&[u8]> = match standing(gw) {
        Standing::Starting => Some(STARTING),
        Standing::ConnectingStore => Some(CONNECTING_STORE),
        Standing::StoreDown { required: true } => {
            Some(b"the binding store is unreachable (affinity.store.required)\n")
        }
        Standing::StoreDown { required: false } | Standing::Serving => None,
    };
    if let Some(body) = refused {
        return (503, "text/plain", body.to_vec());
    }
    let tiers = tiers_health(gw);
    let mut text = String::new();
    for (name, healthy, all) in &tiers {
        let _ = writeln!(text, "tier {name}: {healthy} of {all} backends healthy");
    }
    match tiers.iter().any(|t| t.1 > 0) {
        true => (200, "text/plain", format!("ready\n{text}").into_bytes()),
        false => (
            503,
            "text/plain",
            format!("no healthy backend\n{text}").into_bytes(),
        ),
    }
}

/// Removes expired bindings in the background, a bounded batch at a time,
/// ends the probation of new keyless conversations that never went on, and
/// ejects backends that stopped answering.
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
                    self.0.prefix.sweep();
                    self.0.responses.sweep(crate::clock::now_ms());
                    self.0.eject_stalled();
                }
            }
        }
    }
}
