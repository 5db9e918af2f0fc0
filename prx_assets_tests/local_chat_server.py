"""A local OpenAI-compatible chat-completions server for the tests: it answers with a label
chosen by keywords, fails on demand, and records what it was sent."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


class ChatServerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.failures_left: dict[str, int] = {}  # caption keyword -> 503s still to send

    def answer(self, caption: str) -> str:
        lowered = caption.lower()
        if "gibberish" in lowered:
            return "I think this is a lovely picture"
        if "nude" in lowered or "explicit" in lowered:
            return "nsfw"
        if "screenshot" in lowered or "page" in lowered:
            return "text"
        return "Visual."


def _handler(state: ChatServerState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            caption = payload["messages"][-1]["content"]
            with state.lock:
                state.requests.append(payload)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                flaky = next((k for k, n in state.failures_left.items()
                              if n > 0 and k in caption), None)
                if flaky:
                    state.failures_left[flaky] -= 1
            time.sleep(0.05)
            with state.lock:
                state.in_flight -= 1
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            if flaky:
                return self._send(503, {"error": "overloaded"})
            text = state.answer(caption)
            top = [{"token": text, "logprob": -0.1}, {"token": "text", "logprob": -2.5}]
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                   "content": text},
                                          "logprobs": {"content": [{"token": text,
                                                                    "logprob": -0.1,
                                                                    "top_logprobs": top}]}}]})

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def chat_server() -> Iterator[tuple[str, ChatServerState]]:
    """(base_url, state) of a server on 127.0.0.1 running for the block."""
    state = ChatServerState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()
