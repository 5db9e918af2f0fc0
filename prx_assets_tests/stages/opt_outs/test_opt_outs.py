import lance
import pyarrow as pa

from prx_assets.stages.dedup.dedup import DUPLICATES_SCHEMA
from prx_assets.stages.opt_outs.opt_outs import (
    ResolutionInputs,
    affected_sources,
    ids_for_source,
    resolve,
)
from prx_assets.stages.opt_outs.requests import parse_directory, parse_file
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import Location

SHA_A = "a" * 64
SHA_B = "b" * 64


def test_malformed_rows_are_reported_with_line_numbers_and_valid_rows_kept(tmp_path):
    (tmp_path / "r1.csv").write_text(
        "key_type,value,timestamp,reference\n"
        "id,web:1,2026-11-01T10:00:00Z,ticket 1\n"
        "colour,red,2026-11-01T10:00:00Z,ticket 2\n"
        "\n"
        "sha256,XYZ,2026-11-01,ticket 3\n"
        "source_key,a/b.jpg,yesterday,ticket 4\n"
        "url,https://x.org/a.jpg,2026-11-02T00:00:00+01:00\n"
        'sha256,' + SHA_A.upper() + ',2026-11-03,"multi\nline ref"\n'
        "id,,2026-11-01,ticket 7\n")
    (tmp_path / "r2.jsonl").write_text(
        '{"key_type": "url", "value": "https://x.org/a.jpg", "timestamp": "2026-11-02", '
        '"reference": "mail"}\n'
        "{not json\n"
        "[1, 2]\n"
        '{"key_type": "id", "value": "nocolon", "timestamp": "2026-11-02", "reference": ""}\n'
        '{"key_type": "source_key", "value": "k", "source": "art", "timestamp": "2026-11-02",'
        ' "reference": "r"}\n')
    (tmp_path / "notes.txt").write_text("not a request file")
    parsed = parse_directory(Location.of(tmp_path))
    assert [(r.file, r.line, r.key_type) for r in parsed.requests] == [
        ("r1.csv", 2, "id"), ("r1.csv", 8, "sha256"), ("r2.jsonl", 1, "url"),
        ("r2.jsonl", 5, "source_key")]
    assert parsed.requests[1].value == SHA_A and parsed.requests[1].reference == "multi\nline ref"
    assert parsed.requests[3].source == "art"
    errors = {(e.file, e.line): e.message for e in parsed.errors}
    assert set(errors) == {("r1.csv", 3), ("r1.csv", 5), ("r1.csv", 6), ("r1.csv", 7),
                           ("r1.csv", 10), ("r2.jsonl", 2), ("r2.jsonl", 3), ("r2.jsonl", 4)}
    assert "colour" in errors[("r1.csv", 3)]
    assert "64 hex" in errors[("r1.csv", 5)]
    assert "ISO 8601" in errors[("r1.csv", 6)]
    assert "columns" in errors[("r1.csv", 7)]
    assert "not valid JSON" in errors[("r2.jsonl", 2)]


def test_csv_without_the_required_header_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,web:1\n")
    parsed = parse_file(Location.of(path))
    assert not parsed.requests
    assert [str(e) for e in parsed.errors] == [
        "bad.csv:1: header lacks column(s) key_type, value, timestamp, reference"]


def _raw(root, source, rows):
    schema = pa.schema([("id", pa.string()), ("source_key", pa.string()),
                        ("sha256", pa.string()), ("url", pa.string())])
    lance.write_dataset(pa.Table.from_pylist(rows, schema=schema),
                        Storage(root).table("raw_images", source).uri)


def test_every_key_type_resolves_and_copies_elsewhere_are_removed_too(tmp_path):
    root = tmp_path
    _raw(root, "web", [
        {"id": "web:1", "source_key": "a.jpg", "sha256": SHA_A, "url": "https://x/1"},
        {"id": "web:2", "source_key": "b.jpg", "sha256": "c" * 64, "url": None},
        {"id": "web:3", "source_key": "c.jpg", "sha256": "d" * 64, "url": "https://x/3"},
        {"id": "web:4", "source_key": "k", "sha256": "e" * 64, "url": None}])
    _raw(root, "art", [
        {"id": "art:1", "source_key": "k", "sha256": SHA_B, "url": None},
        {"id": "art:2", "source_key": "z", "sha256": SHA_A, "url": None},  # same bytes as web:1
        {"id": "art:3", "source_key": "y", "sha256": "f" * 64, "url": None}])
    _raw(root, "stock", [{"id": "stock:9", "source_key": "q", "sha256": "9" * 64, "url": None}])
    # web:2 and art:3 are one phash group (kept art:3); stock:9 is alone.
    lance.write_dataset(pa.Table.from_pylist([
        {"id": "web:2", "kept_id": "art:3", "phash": 42, "group_size": 2},
        {"id": "art:3", "kept_id": "art:3", "phash": 42, "group_size": 2}],
        schema=DUPLICATES_SCHEMA), Storage(root).table("duplicates").uri)
    requests = root / "opt_outs"
    requests.mkdir()
    (requests / "batch.jsonl").write_text("\n".join([
        '{"key_type": "id", "value": "web:2", "timestamp": "2026-11-01", "reference": "r1"}',
        '{"key_type": "sha256", "value": "' + SHA_A + '", "timestamp": "2026-11-01", '
        '"reference": "r2"}',
        '{"key_type": "source_key", "value": "k", "source": "art", "timestamp": "2026-11-01", '
        '"reference": "r3"}',
        '{"key_type": "url", "value": "https://x/3", "timestamp": "2026-11-01", "reference": "r4"}',
        '{"key_type": "id", "value": "web:404", "timestamp": "2026-11-01", "reference": "r5"}']))
    parsed = parse_directory(Location.of(requests))
    assert not parsed.errors
    audit = resolve(parsed.requests, ResolutionInputs.pin(root, ["web", "art", "stock"]),
                    batch_rows=2)
    by_request = {}
    for row in audit.to_pylist():
        by_request.setdefault(row["reference"], set()).add((row["id"], row["via"]))
    assert by_request == {
        "r1": {("web:2", "direct"), ("art:3", "duplicate")},  # its copy in another source
        "r2": {("web:1", "direct"), ("art:2", "direct")},  # same bytes in two sources
        "r3": {("art:1", "direct")},  # source_key narrowed to art: web:4 stays
        "r4": {("web:3", "direct")},
        "r5": {(None, "no_match")}}
    assert affected_sources(audit) == ["art", "web"]
    assert ids_for_source(audit, "art") == {"art:1", "art:2", "art:3"}


def test_request_files_in_a_bucket_are_listed_fingerprinted_and_parsed(s3_server, s3_root):
    """Under an s3:// root the request folder is a prefix: listed (hidden files and other
    suffixes ignored), fingerprinted by content, parsed; the browser's request is one put."""
    from prx_assets.stages.opt_outs.requests import (
        files_requesting,
        fingerprint,
        request_files,
        write_request,
    )
    from prx_assets.storage import object_store

    store = Storage(s3_root)
    folder = store.opt_outs_dir
    assert folder.uri == f"{s3_root}/opt_outs" and request_files(folder) == []  # none yet
    _, bucket, prefix = object_store.split_uri(folder.uri)
    client = s3_server.client()
    for name, body in (("a.csv", "key_type,value,timestamp,reference\nid,web:1,2026-11-01,t\n"),
                       ("b.jsonl", '{"key_type": "id", "value": "web:2"}\n'),
                       (".hidden.csv", "x"), ("notes.txt", "x")):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body.encode())
    files = request_files(folder)
    assert [f.name for f in files] == ["a.csv", "b.jsonl"]
    parsed = parse_directory(folder)
    assert [r.value for r in parsed.requests] == ["web:1"]
    assert [(e.file, e.line) for e in parsed.errors] == [("b.jsonl", 1)]  # fields missing
    before = fingerprint(files[0])
    client.put_object(Bucket=bucket, Key=f"{prefix}/a.csv",
                      Body=b"key_type,value,timestamp,reference\nid,web:3,2026-11-01,t\n")
    assert fingerprint(files[0]) != before

    written = write_request(store, "web:9", "from the browser", door="browser")
    assert written.uri.startswith(f"{folder}/browser-")
    assert files_requesting(store, "web:9") == [written.name]
    assert [r.value for r in parse_file(written).requests] == ["web:9"]
