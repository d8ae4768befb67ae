"""A stand-in for llama.cpp's llama-server, standard library only, for the unit tests of the llama-server peer.

It takes llama-server's command line (``-m``, ``--port``, ``--spec-type``, ...), prints a ``--help`` that lists a
few of the real flags, answers ``/health`` and streams ``/completion`` like the real one: ``data: {...}`` lines
with ``tokens``, a last chunk with ``stop``, ``stop_type`` and ``timings``. Its "model" continues a prompt with
``(last + 1) % 50``, ends with token 2 when it reaches it (the end token, not streamed, like the real server),
and with ``--spec-type`` streams its tokens in bursts of three (one pass: two accepted drafts and a bonus) and
reports ``draft_n`` / ``draft_n_accepted``. ``FAKE_LLAMA_SERVER_FAIL=1`` makes it exit at start with a message.
"""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HELP = """----- common params -----
-m,    --model FNAME
-t,    --threads N
--spec-type none,draft-simple,ngram-simple,ngram-map-k,ngram-mod,ngram-cache
--spec-ngram-mod-n-min N
--spec-ngram-mod-n-max N
--spec-ngram-mod-n-match N
--spec-ngram-simple-size-n N
--spec-draft-n-max N
--spec-draft-model FNAME
"""


def main() -> int:
    argv = sys.argv[1:]
    if "--help" in argv:
        print(HELP)
        return 0
    if os.environ.get("FAKE_LLAMA_SERVER_FAIL"):
        print("error: failed to load model 'broken.gguf'", flush=True)
        return 1
    opts = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("-")}
    spec = opts.get("--spec-type", "none") != "none"
    with open(os.environ.get("FAKE_LLAMA_SERVER_ARGS", os.devnull), "w") as fh:
        json.dump(argv, fh)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/health":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"status":"ok"}')
            else:
                self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/completion" or not isinstance(body.get("prompt"), list):
                self.send_error(400)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            last, out, stop_type = body["prompt"][-1], [], "limit"
            while len(out) < body["n_predict"]:
                last = (last + 1) % 50
                if last == 2:
                    stop_type = "eos"
                    break
                out.append(last)
            burst = 3 if spec else 1
            for i in range(0, len(out), burst):
                # passes far apart next to the microseconds between one pass's tokens, so that a loaded machine
                # (another test beside this one) cannot blur where one ends: 5 ms apart did, once, under
                # pytest-xdist, and so did three writes per pass at 50 ms (this thread descheduled between them)
                time.sleep(0.1)
                # one chunk per token, a pass's chunks sent in one write
                self.wfile.write(b"".join(f"data: {json.dumps({'tokens': [tok], 'stop': False})}\n\n".encode()
                                          for tok in out[i:i + burst]))
                self.wfile.flush()
            timings = {"predicted_n": len(out)}
            if spec:
                passes = (len(out) + 2) // 3
                timings.update(draft_n=3 * passes, draft_n_accepted=len(out) - passes)
            final = {"tokens": [], "stop": True, "stop_type": stop_type, "timings": timings}
            self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())

    ThreadingHTTPServer(("127.0.0.1", int(opts["--port"])), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
