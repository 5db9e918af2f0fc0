"""The captioning backends through the real Ray Data path: a tiny random Qwen3-VL built from a
config (transformers), a local chat-completions server (openai), and the ray.data.llm
configuration for vLLM checked against the installed classes."""

import inspect
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lance
import numpy as np
import pyarrow as pa
import pytest
import ray.data
from PIL import Image

from prx_assets.demo.corpus import encode, photo_variant, real_photo_paths
from prx_assets.stages.captions import runs as caption_runs
from prx_assets.stages.captions.captioners import (
    CaptionerSpec,
    OpenAICaptioner,
    TransformersCaptioner,
    caption_stage,
    vllm_postprocess,
    vllm_preprocess,
    vllm_processor_config,
)
from prx_assets.stages.captions.captions import load_prompt
from prx_assets.stages.captions.runs import caption_source, pending_requests
from prx_assets.storage.refs import TableRef
from prx_assets.testing.tiny_vlm import build_tiny_qwen3_vl


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """Real photos as bucketed-style Q92 JPEGs, keyed by id."""
    rng = np.random.default_rng(3)
    paths = real_photo_paths()
    return {f"web:{i:02d}": encode(photo_variant(rng, Image.open(paths[i % len(paths)])),
                                   "JPEG", 92)
            for i in range(10)}


def bucketed_dataset(photos: dict[str, bytes], broken: tuple[str, ...] = ()) -> ray.data.Dataset:
    ids = list(photos) + list(broken)
    images = list(photos.values()) + [b"\xff\xd8 not really a jpeg"] * len(broken)
    return ray.data.from_arrow(pa.table({
        "id": ids, "status": ["ok"] * len(ids) + [], "image": pa.array(images, pa.large_binary())}))


def tiny_spec(model, **overrides) -> CaptionerSpec:
    values = dict(backend="transformers", model=str(model), max_tokens=24, temperature=0.0,
                  image_budget=96 * 96, batch_size=4, concurrency=1)
    return CaptionerSpec(**{**values, **overrides})


def rows_of(uri) -> list[dict]:
    return lance.dataset(str(uri)).to_table().to_pylist()


def test_transformers_in_ray_actors_caption_every_id_with_its_own_image(
        ray_session, tmp_path, tiny_vlm, photos):
    spec = tiny_spec(tiny_vlm, batch_size=1)
    uri = TableRef.of(tmp_path / "captions.lance")
    report = caption_source(pending_requests(bucketed_dataset(photos), None, uri, spec), uri, spec,
                            chunk_rows=4)
    rows = {r["id"]: r for r in rows_of(uri)}
    assert set(rows) == set(photos) and report.written == len(photos)
    assert report.chunks == 3  # 10 rows in chunks of 4
    assert len(lance.dataset(str(uri)).get_fragments()) == 1  # compacted after the run
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert {(r["model"], r["backend"], r["caption_version"]) for r in rows.values()} == \
        {(str(tiny_vlm), "transformers", spec.version())}
    assert all(r["n_words"] == len(r["caption"].split()) > 0 for r in rows.values())
    # Ordering: each id carries the caption of its own image (same model, called directly).
    direct = TransformersCaptioner(spec)
    for sample_id in list(photos)[:3]:
        expected = direct({"id": np.array([sample_id], dtype=object),
                           "image": np.array([photos[sample_id]], dtype=object)})["raw"][0]
        assert rows[sample_id]["caption"] == " ".join(expected.split()).strip()


def test_fixed_length_captions_have_exactly_max_tokens(tiny_vlm, photos):
    """The benchmarks' setting: no caption ends early (the tiny tokenizer has one token per
    character, and the model writes only letters, spaces and full stops)."""
    captioner = TransformersCaptioner(tiny_spec(tiny_vlm, max_tokens=16, fixed_length=True))
    ids, jpegs = list(photos)[:4], list(photos.values())[:4]
    out = captioner({"id": np.array(ids, dtype=object), "image": np.array(jpegs, dtype=object)})
    assert [len(raw) for raw in out["raw"]] == [16] * 4 and out["error"] == [None] * 4


def test_captions_leave_the_model_batch_by_batch(ray_session, tiny_vlm, photos):
    """Each model batch's captions reach the driver as their own block: a chunked commit of
    `chunk_rows` does not wait for later batches (a killed run loses at most a chunk)."""
    spec = tiny_spec(tiny_vlm, batch_size=4)
    captions = caption_stage(bucketed_dataset(photos).select_columns(["id", "image"]), spec)
    sizes = [batch.num_rows for batch in captions.iter_batches(batch_size=None,
                                                                batch_format="pyarrow")]
    assert sorted(sizes) == [2, 4, 4]  # 10 rows in model batches of 4, not one block of 10


def test_interrupted_run_resumes_without_duplicates(ray_session, tmp_path, tiny_vlm, photos):
    spec = tiny_spec(tiny_vlm)
    uri = TableRef.of(tmp_path / "captions.lance")
    bucketed = bucketed_dataset(photos)

    def crash_after_two_chunks(report):
        if report.chunks == 2:
            raise KeyboardInterrupt("run killed")

    with pytest.raises(KeyboardInterrupt):
        caption_source(pending_requests(bucketed, None, uri, spec), uri, spec, chunk_rows=3,
                       on_chunk=crash_after_two_chunks)
    committed = {r["id"] for r in rows_of(uri)}
    assert len(committed) == 6  # two chunks of three survived the crash

    resumed = pending_requests(bucketed, None, uri, spec)
    assert set(resumed.to_pandas()["id"]) == set(photos) - committed
    caption_source(resumed, uri, spec, chunk_rows=3)
    assert Counter(r["id"] for r in rows_of(uri)) == Counter(set(photos))  # each id once


def test_failed_rows_are_retried_and_versions_coexist(ray_session, tmp_path, photos):
    uri = TableRef.of(tmp_path / "captions.lance")
    bucketed = bucketed_dataset(dict(list(photos.items())[:4]), broken=("web:bad",))
    with ChatServer([]) as server:
        spec = openai_spec(server.url)
        caption_source(pending_requests(bucketed, None, uri, spec), uri, spec)
        bad = next(r for r in rows_of(uri) if r["id"] == "web:bad")
        assert bad["status"] == "failed" and "image:" in bad["error"]

        # Only the failed row is retried, and it replaces its failed row (never doubled).
        retry = pending_requests(bucketed, None, uri, spec)
        assert list(retry.to_pandas()["id"]) == ["web:bad"]
        caption_source(retry, uri, spec)
        assert Counter(r["id"] for r in rows_of(uri)) == Counter([*list(photos)[:4], "web:bad"])

        # A new caption version captions everything again, beside the old version.
        new_spec = openai_spec(server.url, temperature=0.7)
        caption_source(pending_requests(bucketed, None, uri, new_spec), uri, new_spec)
    versions = Counter(r["caption_version"] for r in rows_of(uri))
    assert versions == {spec.version(): 5, new_spec.version(): 5}


@pytest.mark.parametrize("broadcast_limit", [1_000_000, 0])  # 0: the Ray hash-join path
def test_original_backend_uses_the_source_caption(ray_session, tmp_path, monkeypatch,
                                                  broadcast_limit):
    monkeypatch.setattr(caption_runs, "BROADCAST_IDS", broadcast_limit)
    bucketed = ray.data.from_arrow(pa.table({
        "id": ["a:1", "a:2", "a:3"], "status": ["ok", "ok", "too_small"],
        "image": pa.array([b"x", b"y", b"z"], pa.large_binary())}))
    raw = ray.data.from_arrow(pa.table({"id": ["a:1", "a:2", "a:3"],
                                        "original_caption": ["A red door.", None, "tiny"]}))
    spec = CaptionerSpec()
    uri = TableRef.of(tmp_path / "captions.lance")
    caption_source(pending_requests(bucketed, raw, uri, spec), uri, spec)
    rows = {r["id"]: r for r in rows_of(uri)}
    assert set(rows) == {"a:1", "a:2"}  # rejected images are never captioned
    # Done ids are left out on the next run (anti-join), whichever path is taken.
    assert pending_requests(bucketed, raw, uri, spec).count() == 0
    assert (rows["a:1"]["caption"], rows["a:1"]["status"], rows["a:1"]["model"]) == \
        ("A red door.", "ok", "source caption")
    assert rows["a:2"]["status"] == "empty" and "no caption" in rows["a:2"]["error"]


# --- openai-compatible endpoint ---------------------------------------------------------

class ChatServer:
    """A chat-completions server on loopback with scripted failures per request."""

    def __init__(self, script: list):
        self.script = list(script)  # entries: "ok", an HTTP status, "slow", "garbage"
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    action = server.script.pop(0) if server.script else "ok"
                if action == "slow":
                    time.sleep(1.5)
                    action = "ok"
                if isinstance(action, int):
                    self.send_response(action)
                    self.end_headers()
                    return
                payload = b"<html>" if action == "garbage" else json.dumps({"choices": [
                    {"message": {"role": "assistant",
                                 "content": f"A photo seen at request {len(server.requests)}."}}]
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def openai_spec(url: str, **overrides) -> CaptionerSpec:
    values = dict(backend="openai", model="qwen3-vl", endpoint=url, image_budget=64 * 64,
                  max_retries=2, backoff_s=0.01, timeout_s=0.5, request_concurrency=2)
    return CaptionerSpec(**{**values, **overrides})


def test_openai_requests_carry_prompt_image_and_sampling(photos):
    with ChatServer(["ok"]) as server:
        captioner = OpenAICaptioner(openai_spec(server.url))
        raw, error = captioner.caption_one(next(iter(photos.values())))
    assert error is None and raw.startswith("A photo")
    body = server.requests[0]
    assert body["model"] == "qwen3-vl" and body["max_tokens"] == 320
    system, user = body["messages"]
    assert system == {"role": "system", "content": load_prompt()}
    assert user["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


@pytest.mark.parametrize("script, ok, attempts, error", [
    ([500, 503, "ok"], True, 3, None),  # transient errors are retried with backoff
    ([429, 429, 429], False, 3, "HTTP 429"),  # gives up after max_retries
    ([400], False, 1, "HTTP 400"),  # a client error is not retried
    (["slow", "ok"], True, 2, None),  # a timeout is retried
    (["garbage"], False, 1, "not JSON"),
])
def test_openai_errors_timeouts_and_retries(photos, script, ok, attempts, error):
    with ChatServer(script) as server:
        raw, err = OpenAICaptioner(openai_spec(server.url)).caption_one(next(iter(photos.values())))
        time.sleep(0.05)
        assert len(server.requests) == attempts
    assert (raw is not None) == ok
    if error:
        assert error in err


def test_openai_backend_through_ray(ray_session, photos):
    with ChatServer([500]) as server:
        ids = list(photos)[:5]
        requests = ray.data.from_arrow(pa.table({
            "id": ids, "image": pa.array([photos[i] for i in ids], pa.large_binary())}))
        rows = caption_stage(requests, openai_spec(server.url)).take_all()
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert {r["status"] for r in rows} == {"ok"} and {r["backend"] for r in rows} == {"openai"}


# --- vLLM through ray.data.llm (configuration only: no vLLM on this machine) --------------

def test_vllm_processor_configuration_matches_installed_ray_data_llm(photos):
    from ray.data.llm import (
        PrepareMultimodalStageConfig,
        build_processor,
        vLLMEngineProcessorConfig,
    )

    spec = CaptionerSpec(backend="vllm", model="Qwen/Qwen3-VL-8B-Instruct", batch_size=32,
                         concurrency=4, accelerator_type="H200",
                         engine_kwargs={"max_model_len": 16384, "gpu_memory_utilization": 0.9})
    config = vllm_processor_config(spec)
    assert isinstance(config, vLLMEngineProcessorConfig)
    assert (config.model_source, config.batch_size, config.concurrency, config.accelerator_type) \
        == ("Qwen/Qwen3-VL-8B-Instruct", 32, 4, "H200")
    assert config.should_continue_on_error is True
    assert config.engine_kwargs["max_model_len"] == 16384
    # One image and no video: vLLM's start-up profile is sized for what a request can hold.
    assert config.engine_kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    stage = PrepareMultimodalStageConfig.model_validate(config.prepare_multimodal_stage) \
        if isinstance(config.prepare_multimodal_stage, dict) else config.prepare_multimodal_stage
    assert stage.enabled and stage.chat_template_content_format == "openai"
    params = inspect.signature(build_processor).parameters
    assert {"config", "preprocess", "postprocess"} <= set(params)

    sample_id, jpeg = next(iter(photos.items()))
    request = vllm_preprocess(spec)({"id": sample_id, "image": jpeg})
    assert set(request) == {"id", "messages", "sampling_params"}  # no image bytes carried on
    system, user = request["messages"]
    assert system["content"] == load_prompt()
    image_part = user["content"][0]
    assert image_part["type"] == "image_pil" and isinstance(image_part["image_pil"], Image.Image)
    image = image_part["image_pil"]
    assert image.width * image.height <= spec.image_budget * 1.01
    assert request["sampling_params"] == {"max_tokens": 320, "temperature": 0.2, "top_p": 0.9,
                                          "repetition_penalty": 1.05, "seed": 0}
    assert vllm_postprocess({"id": "a", "generated_text": "A cat.", "__inference_error__": ""}) \
        == {"id": "a", "raw": "A cat.", "error": None}
    assert vllm_postprocess({"id": "a", "generated_text": "", "__inference_error__": "OOM"}) \
        == {"id": "a", "raw": None, "error": "OOM"}
