#!/usr/bin/env python3
"""A minimal OTLP/HTTP traces receiver: decodes what a collector would
(`opentelemetry-proto`, installed by scripts/setup.sh into target/engine-venv)
and keeps the spans in memory.

    target/engine-venv/bin/python scripts/otlp-receiver.py PORT [--count-only]

POST /v1/traces  an ExportTraceServiceRequest (application/x-protobuf)
GET  /spans      every span received so far, as a JSON list (none kept with
                 --count-only, for benchmarks)
GET  /count      how many spans were received

Each span: trace_id, span_id, parent_span_id (hex; "" for a root), name, kind,
status (0 unset, 1 ok, 2 error), service (the resource's service.name) and
attributes (a flat object). Listens on 127.0.0.1 only; for tests and for a
look at what the gateway exports.
"""
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

spans = []
received = 0
keep = "--count-only" not in sys.argv[2:]
lock = threading.Lock()


def value(v):
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        req = trace_service_pb2.ExportTraceServiceRequest()
        try:
            req.ParseFromString(body)
        except Exception as e:  # a malformed export is the exporter's bug
            self.send_error(400, str(e))
            return
        got = []
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append({
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "status": s.status.code,
                        "service": resource.get("service.name"),
                        "scope": ss.scope.name,
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                    })
        global received
        with lock:
            received += len(got)
            if keep:
                spans.extend(got)
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        if self.path not in ("/spans", "/count"):
            self.send_error(404)
            return
        with lock:
            out = json.dumps(spans if self.path == "/spans" else received).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
