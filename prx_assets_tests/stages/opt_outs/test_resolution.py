"""`resolve_opt_outs` is the one resolver: the three doors' requests come out of it alike,
the audited table is read back instead of resolving again, and whatever the table does not
cover (a file dropped or rewritten after it, new input versions) is resolved on the fly."""

import pytest

from prx_assets.cli import main
from prx_assets.stages.opt_outs import resolution
from prx_assets.stages.opt_outs.guard import recorded_opt_outs
from prx_assets.stages.opt_outs.requests import write_request
from prx_assets.stages.opt_outs.resolution import resolve_opt_outs
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import OPT_OUTS
from prx_assets.testing.opt_outs import opt_out, record_opt_outs, write_raw_ids

IDS = [f"web:{i}" for i in range(6)]


@pytest.fixture()
def matched(monkeypatch) -> list[list[str]]:
    """The request ids each call of the matcher got (the matcher runs only inside
    `resolve_opt_outs`: what it gets is what was resolved on the fly)."""
    calls: list[list[str]] = []
    real = resolution.resolve

    def spy(requests, inputs, batch_rows=1 << 18):
        calls.append(sorted(r.request_id for r in requests))
        return real(requests, inputs, batch_rows)

    monkeypatch.setattr(resolution, "resolve", spy)
    return calls


def test_the_three_doors_resolve_alike_and_the_table_is_read_back(data_root, matched):
    storage = Storage(data_root)
    write_raw_ids(data_root, "web", IDS)
    opt_out(data_root, "ticket-1.jsonl", IDS[1])
    assert main(["opt-out", IDS[2], "--reason", "t2"]) == 0
    browser = write_request(storage, IDS[3], "t3", door="browser", requested_by="alice")

    first = record_opt_outs(data_root, ["web"])
    cli = next(n for n in first.resolved_now if n.startswith("cli-"))
    assert first.resolved_now == tuple(sorted(["ticket-1.jsonl", cli, browser.name]))
    assert matched == [sorted(["ticket-1.jsonl:1", f"{cli}:1", f"{browser.name}:1"])]
    assert sorted((r["id"], r["door"], r["reference"], r["via"])
                  for r in first.audit.to_pylist()) == [
        (IDS[1], "file", "ticket", "direct"), (IDS[2], "cli", "t2", "direct"),
        (IDS[3], "browser", "t3", "direct")]

    # Every reader now takes the table's rows: nothing is parsed or matched again.
    matched.clear()
    again = resolve_opt_outs(storage, ["web"])
    assert again.resolved_now == () and again.audit.equals(first.audit)
    assert set(recorded_opt_outs(storage, ["web"])) == {IDS[1], IDS[2], IDS[3]}
    assert matched == []


def test_what_the_table_does_not_cover_is_resolved_on_the_fly(data_root, matched):
    storage = Storage(data_root)
    write_raw_ids(data_root, "web", IDS)
    opt_out(data_root, "a.jsonl", IDS[1])
    opt_out(data_root, "b.jsonl", IDS[2])
    record_opt_outs(data_root, ["web"])

    # A file dropped after the table's resolution: it alone is resolved, and blocks its id.
    matched.clear()
    opt_out(data_root, "c.jsonl", IDS[3])
    late = resolve_opt_outs(storage, ["web"])
    assert late.resolved_now == ("c.jsonl",) and matched == [["c.jsonl:1"]]
    assert sorted(late.audit.column("id").to_pylist()) == IDS[1:4]
    assert IDS[3] not in storage.table(OPT_OUTS).to_table().column("id").to_pylist()

    # A recorded file rewritten: its new request replaces the recorded one.
    matched.clear()
    opt_out(data_root, "b.jsonl", IDS[4])
    rewritten = resolve_opt_outs(storage, ["web"])
    assert rewritten.resolved_now == ("b.jsonl", "c.jsonl")
    assert sorted(rewritten.audit.column("id").to_pylist()) == [IDS[1], IDS[3], IDS[4]]

    # A new version of an input table (an ingest): every request is resolved again, so an
    # image that arrived since is found (`a.jsonl` matched nothing before it did).
    opt_out(data_root, "a.jsonl", "web:new")
    record_opt_outs(data_root, ["web"])
    assert resolve_opt_outs(storage, ["web"]).audit.column("id").to_pylist()[0] is None
    matched.clear()
    write_raw_ids(data_root, "web", [*IDS, "web:new"])
    ingested = resolve_opt_outs(storage, ["web"])
    assert ingested.resolved_now == ("a.jsonl", "b.jsonl", "c.jsonl")
    assert "web:new" in ingested.audit.column("id").to_pylist()
    # Another set of sources is other inputs too (one without raw_images adds none).
    record_opt_outs(data_root, ["web"])
    assert resolve_opt_outs(storage, ["web", "art"]).resolved_now == ()
    assert resolve_opt_outs(storage, []).resolved_now == ("a.jsonl", "b.jsonl", "c.jsonl")


def test_malformed_rows_of_recorded_files_are_kept_with_the_record(data_root, matched):
    storage = Storage(data_root)
    write_raw_ids(data_root, "web", IDS)
    storage.opt_outs_dir.path.mkdir(parents=True)
    (storage.opt_outs_dir.path / "r.csv").write_text(
        "key_type,value,timestamp,reference\nid,web:1,2026-11-01,t\ncolour,red,2026-11-01,t\n")
    first = record_opt_outs(data_root, ["web"])
    assert [(e.file, e.line) for e in first.errors] == [("r.csv", 3)] and first.requests == 1
    matched.clear()
    again = resolve_opt_outs(storage, ["web"])
    assert again.resolved_now == () and matched == []
    assert again.errors == first.errors and again.requests == 1
