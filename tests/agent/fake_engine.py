"""A stand-in engine for the supervisor's tests, run as a real process by custom templates.

    python fake_engine.py PORT [--marker PATH] [--ignore-term] [--exit-after-first]
                          [--loading N] [--worker] [--bind-when PATH] [--serves NAME]

It prints its CUDA_VISIBLE_DEVICES, answers 200 to every GET on 127.0.0.1:PORT, writes
"SIGTERM" to the marker file when it gets SIGTERM (then exits 0, or carries on with
--ignore-term), and with --exit-after-first exits 1 after its first answer (a crash loop).
With --loading N it answers 503 to its first N requests, as llama.cpp does while it loads;
with --worker it first starts a child that sleeps, as vLLM starts tensor-parallel workers.
With --bind-when PATH it binds its port only once PATH exists, as vLLM binds only after it
has loaded its weights (a test decides when). Its `data` lists NAME with --serves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import FrameType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--exit-after-first", action="store_true")
    parser.add_argument("--loading", type=int, default=0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--bind-when", type=Path)
    parser.add_argument("--serves", default="")
    args = parser.parse_args()
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)

    def on_term(signum: int, frame: FrameType | None) -> None:
        if args.marker is not None:
            args.marker.write_text("SIGTERM")
        if not args.ignore_term:
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    if args.worker:  # in our process group; it ignores SIGTERM, so only the group kill ends it
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", code])
    answered = 0

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal answered
            answered += 1
            listed = [{"id": args.serves, "object": "model"}] if args.serves else []
            body = json.dumps({"object": "list", "data": listed}).encode()
            status = 503 if answered <= args.loading else 200
            print(f"GET {self.path} {status}", flush=True)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if args.exit_after_first:
                self.wfile.flush()
                os._exit(1)

        def log_message(self, format: str, *values: object) -> None:
            return

    while args.bind_when is not None and not args.bind_when.exists():
        time.sleep(0.02)  # "loading": the test says when it is done
    server = HTTPServer(("127.0.0.1", args.port), Handler)
    print("serving", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
