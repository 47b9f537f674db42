//! The Pingora floor: a pass-through proxy whose `upstream_peer` only returns
//! the one peer — no routing, no affinity, no metrics, no body handling.
//! Built from this crate's own Pingora version and release profile, so
//! `scripts/bench-proxy.sh` can measure what the gateway adds over Pingora.
//!
//!   cargo run --release --example bare_proxy -- LISTEN UPSTREAM [THREADS]

use async_trait::async_trait;
use pingora::prelude::*;
use pingora_core::server::configuration::{Opt, ServerConf};
use std::sync::Arc;

// The gateway's allocator, so the two differ only in what the gateway does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Bare {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();
    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _: &mut Session, _: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(listen), Some(upstream)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: bare_proxy LISTEN UPSTREAM [THREADS]");
        std::process::exit(2);
    };
    let mut conf = ServerConf::new().expect("pingora's default configuration parses");
    conf.threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(1);
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(
        &Arc::clone(&server.configuration),
        Bare {
            upstream: upstream.clone(),
        },
    );
    proxy.add_tcp(listen);
    server.add_service(proxy);
    server.run_forever();
}
