"""Which samples skip reason `rights` withholds: reservations recorded at ingest, the domain
list re-read by every reader, and curators' clearances (audited like opt-out requests)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from prx_assets.stages.opt_outs import rights
from prx_assets.stages.opt_outs.requests import parse_directory
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.storage.tables import RAW_IMAGES

SCHEMA = pa.schema([("id", pa.string()), ("url", pa.string()), ("reservation", pa.string()),
                    ("reservation_signal", pa.string())])


def write_raw(storage: Storage, source: str, rows: list[tuple]) -> None:
    table = pa.Table.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows],
                                 schema=SCHEMA)
    overwrite_rows(storage.table(RAW_IMAGES, source), table, SCHEMA)


def test_prohibited_domains_and_uncleared_constraints_are_withheld(tmp_path: Path):
    storage = Storage(str(tmp_path))
    write_raw(storage, "web", [
        ("web:a", "https://a.org/1.jpg", "prohibited", "xmp=plus:DataMining=DMI-PROHIBITED"),
        ("web:b", "https://a.org/2.jpg", "constrained", "c2pa=cawg.ai_training=constrained"),
        ("web:c", "https://img.reserved.example/3.jpg", "none", None),
        ("web:d", None, "none", None),
        ("web:e", "https://a.org/5.jpg", "constrained", "tdmrep=tdm-reservation=1 tdm-policy=p"),
    ])
    assert set(rights.withheld_ids(storage, ["web"])) == {"web:a", "web:b", "web:e"}
    (rights.domains_dir(storage) / "spawning.txt").write_text("reserved.example\n")
    rights.clear(storage, ["web:b", "web:a"], "licence checked", door="browser",
                 cleared_by="curator@x")
    withheld = rights.withheld_ids(storage, ["web"])
    assert sorted(withheld) == ["web:a", "web:c", "web:e"]  # a clearance lifts no prohibition
    assert withheld["web:c"].signal == "domain=reserved.example"
    audit = parse_directory(rights.clearances_dir(storage)).requests
    assert {(r.value, r.requested_by, r.door) for r in audit} == {
        ("web:a", "curator@x", "browser"), ("web:b", "curator@x", "browser")}


def test_the_cli_records_a_clearance(data_root: Path, capsys):
    from prx_assets.cli import main

    assert main(["clear-rights", "web:b", "--reason", "policy read"]) == 0
    assert "1 clearance(s) recorded" in capsys.readouterr().out
    assert rights.cleared_ids(Storage(str(data_root))) == {"web:b"}
    assert main(["clear-rights", "not-an-id", "--reason", "x"]) == 2


def test_a_table_from_before_reservations_has_only_the_domain_list(tmp_path: Path):
    storage = Storage(str(tmp_path))
    old = pa.schema([("id", pa.string()), ("url", pa.string())])
    overwrite_rows(storage.table(RAW_IMAGES, "old"), pa.table(
        {"id": ["old:a", "old:b"], "url": ["https://x.org/a", None]}, schema=old), old)
    assert rights.withheld_ids(storage, ["old", "absent"]) == {}
    (rights.domains_dir(storage) / "list.txt").write_text("https://x.org/\n")
    assert set(rights.withheld_ids(storage, ["old"])) == {"old:a"}


def test_reservation_counts_per_value(tmp_path: Path):
    storage = Storage(str(tmp_path))
    write_raw(storage, "web", [("web:a", None, "prohibited", "x"), ("web:b", None, "none", None),
                               ("web:c", None, "none", None)])
    assert rights.reservation_counts(storage.table(RAW_IMAGES, "web")) == {
        "prohibited": 1, "none": 2}
