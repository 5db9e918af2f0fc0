"""One client for OpenAI-compatible chat-completions endpoints (a vLLM server, a hosted API).

Captioning and labelling both send one request per row from inside Ray actors, many rows in
flight at once. What they need from the endpoint is the same: transient failures
(connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential backoff, while
answers that another try cannot fix (HTTP 4xx, a body that is not JSON, a completion without
a message) fail at once; either way the caller gets an `EndpointError` saying what happened
and after how many attempts, and records it on the row instead of failing the batch.
The client is thread-safe: callers run `complete` from a thread pool.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prx_assets.engine.redact import redact


class EndpointError(RuntimeError):
    """A request that did not produce a completion. `retryable` says whether the last
    failure was transient; `attempts` counts the requests sent for it."""

    def __init__(self, message: str, retryable: bool, attempts: int = 1):
        super().__init__(redact(message))  # it ends in error columns and logs
        self.retryable = retryable
        self.attempts = attempts


@dataclass(frozen=True)
class ChatReply:
    """The first choice of a completion, and the attempts it took."""

    content: str
    choice: dict[str, Any]  # the whole choice, e.g. for its logprobs
    attempts: int


@dataclass(frozen=True)
class OpenAIClient:
    """`POST {base_url}/chat/completions` with retries.

    A request is tried `1 + max_retries` times at most; before retry k (from 1) it waits
    `backoff_s * 2 ** (k - 1)`, scaled by a random factor in `[1 - jitter, 1 + jitter)` so
    that many actors failing together do not retry in lockstep.
    """

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 4
    backoff_s: float = 0.5
    jitter: float = 0.0
    sleep: Callable[[float], Any] = field(default=time.sleep, repr=False, compare=False)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def complete(self, payload: dict[str, Any]) -> ChatReply:
        """The completion of `payload` (model, messages, sampling), or EndpointError."""
        body = json.dumps(payload).encode()
        for attempt in range(1, self.max_retries + 2):
            try:
                return _first_choice(self.post(body), attempt)
            except EndpointError as exc:
                if not exc.retryable:
                    raise EndpointError(f"{exc} (after {attempt} attempt(s))", False,
                                        attempt) from None
                if attempt > self.max_retries:
                    raise EndpointError(f"gave up after {attempt} attempt(s): {exc}", True,
                                        attempt) from None
            self.sleep(self.delay(attempt))
        raise AssertionError("unreachable")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 for the first retry)."""
        spread = 1.0 + self.jitter * (2.0 * random.random() - 1.0) if self.jitter else 1.0
        return self.backoff_s * 2 ** (retry - 1) * spread

    def post(self, body: bytes) -> Any:
        """One request; failures become EndpointError, marked retryable when transient."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            retryable = exc.code == 429 or exc.code >= 500
            raise EndpointError(f"HTTP {exc.code} from {self.url}", retryable) from None
        except json.JSONDecodeError:
            raise EndpointError(f"{self.url} answered with something that is not JSON",
                                False) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            raise EndpointError(f"{self.url}: {type(exc).__name__}: {exc}", True) from None


def _first_choice(completion: Any, attempts: int) -> ChatReply:
    try:
        choice = completion["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"unexpected answer shape: {str(completion)[:200]}",
                            False) from None
    return ChatReply(content or "", choice, attempts)
