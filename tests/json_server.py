"""A loopback JSON server for the tests that play a serving engine (tests/distill/test_server.py's
OpenAI-compatible server, tests/vllm_dumps.py's extract_hidden_states vLLM server).

A subclass answers `get(path)` and `post(path, body)` with (status, JSON body); this class runs the
HTTP side on 127.0.0.1 at a free port (`url`: its /v1 base) until close().
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NOT_FOUND = 404, {"error": {"message": "not found"}}


def chat_ids(target, messages: list[dict], shift: int = 0, template_kwargs: dict | None = None) -> list[int]:
    """/tokenize's answer for chat messages: the target's chat template with the generation prompt
    and the request's chat_template_kwargs (as vLLM renders them), each id moved by `shift` (a server
    whose tokenizer numbers tokens otherwise)."""
    ids = target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
    )
    return [t + shift for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


class JsonServer:
    def start(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(*server.get(self.path))

            def do_POST(self):
                self.reply(*server.post(self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def get(self, path: str) -> tuple[int, Any]:
        return NOT_FOUND

    def post(self, path: str, body: dict) -> tuple[int, Any]:
        return NOT_FOUND

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
