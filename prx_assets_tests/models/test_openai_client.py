"""The shared endpoint client's retry rules, with the network replaced by a script (the
captions and labels tests run it against real local servers)."""

import dataclasses

import pytest

from prx_assets.models.openai_client import EndpointError, OpenAIClient
from prx_assets.testing.local_chat_server import chat_server

OK = {"choices": [{"message": {"content": "visual"}, "logprobs": {"content": []}}]}


@dataclasses.dataclass(frozen=True)
class ScriptedClient(OpenAIClient):
    """Answers from `script`: a dict is a completion, an EndpointError is raised."""

    script: list = dataclasses.field(default_factory=list)

    def post(self, body: bytes):
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def scripted(*answers, **settings) -> tuple[ScriptedClient, list[float]]:
    sleeps: list[float] = []
    client = ScriptedClient("http://x/v1", sleep=sleeps.append, script=list(answers),
                            **{"max_retries": 3, "backoff_s": 0.1, **settings})
    return client, sleeps


def busy() -> EndpointError:
    return EndpointError("HTTP 503 from http://x/v1/chat/completions", retryable=True)


def test_transient_failures_are_retried_with_exponential_backoff():
    client, sleeps = scripted(busy(), busy(), OK)
    reply = client.complete({"model": "m", "messages": []})
    assert (reply.content, reply.attempts) == ("visual", 3)
    assert reply.choice["logprobs"] == {"content": []}  # the whole choice comes back
    assert sleeps == pytest.approx([0.1, 0.2])


def test_giving_up_says_so_and_counts_the_attempts():
    client, sleeps = scripted(busy(), busy(), busy(), busy())
    with pytest.raises(EndpointError, match=r"gave up after 4 attempt\(s\): HTTP 503") as err:
        client.complete({})
    assert err.value.attempts == 4 and err.value.retryable and len(sleeps) == 3


@pytest.mark.parametrize("answer, message", [
    (EndpointError("HTTP 400 from x", retryable=False), "HTTP 400"),
    ({"choices": []}, "unexpected answer shape"),
    ({"error": "model not found"}, "unexpected answer shape"),
])
def test_answers_another_try_cannot_fix_fail_at_once(answer, message):
    client, sleeps = scripted(answer, OK)
    with pytest.raises(EndpointError, match=message) as err:
        client.complete({})
    assert (err.value.attempts, err.value.retryable, sleeps) == (1, False, [])


def test_jitter_spreads_retries_around_the_exponential_delay():
    client, _ = scripted(backoff_s=1.0, jitter=0.5)
    delays = [client.delay(3) for _ in range(200)]
    assert all(2.0 <= d < 6.0 for d in delays)  # 4 s, give or take half
    assert max(delays) - min(delays) > 1.0
    assert scripted(backoff_s=1.0)[0].delay(3) == 4.0  # no jitter: exactly the doubling


def test_a_missing_content_is_an_empty_answer_and_the_real_server_round_trips():
    client, _ = scripted({"choices": [{"message": {"content": None}}]})
    assert client.complete({}).content == ""
    with chat_server() as (url, state):
        reply = OpenAIClient(url, max_retries=0).complete(
            {"model": "m", "messages": [{"role": "user", "content": "A page of text."}]})
        with pytest.raises(EndpointError, match="HTTP 404") as err:
            OpenAIClient(url + "/nope", max_retries=3, sleep=lambda s: None).complete(
                {"messages": [{"role": "user", "content": "x"}]})
    assert reply.content == "text" and state.requests[0]["model"] == "m"
    assert err.value.attempts == 1  # a client error is not retried
