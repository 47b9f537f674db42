#!/usr/bin/env python3
"""Runs llama.cpp's own HTTP server (in-process, via the `xllamacpp` wheel) on
127.0.0.1:PORT until SIGTERM or SIGINT. Used by the real-engine tests, demo and
bench as one inference replica: CPU only, prompt caching on, /metrics on."""
import argparse
import signal
import threading

import xllamacpp as xlc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=16384, help="KV cache tokens, shared by the slots")
    ap.add_argument("--cache-ram-mib", type=int, default=2048,
                    help="host-RAM prompt cache (llama.cpp's default, 8 GiB, would fill a small box)")
    ap.add_argument("--alias", default="tiny")
    a = ap.parse_args()

    p = xlc.CommonParams()
    p.model.path = a.model
    p.model_alias = {a.alias}
    p.hostnames = ["127.0.0.1"]
    p.port = a.port
    p.n_parallel = a.slots
    p.n_ctx = a.ctx
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.cache_prompt = True
    p.cache_ram_mib = a.cache_ram_mib
    p.endpoint_metrics = True
    p.warmup = False
    p.sampling.seed = 1
    server = xlc.Server(p)
    print(f"listening {server.listening_address}", flush=True)

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


if __name__ == "__main__":
    main()
