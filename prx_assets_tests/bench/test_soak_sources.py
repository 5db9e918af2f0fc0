"""The soak's model of its sources agrees with what ingest reads from them: after a run of
random changes (adds, removals, replacements, swaps, hostile files), the ids and captions
of the good rows are the model's, so a soak violation is the pipeline's, not the model's."""

from __future__ import annotations

import random

from bench.soak_sources import make_sources
from prx_assets.stages.ingest import listing
from prx_assets.stages.ingest.ingest import IngestOptions, _unit_rows
from prx_assets.stages.ingest.probe import STATUS_OK
from prx_assets.stages.ingest.sources import load_sources
from prx_assets.testing.sources import write_sources


def _read(sources_file, name: str) -> dict[str, str]:
    spec = load_sources(sources_file).get(name)
    location = listing.resolve_location(spec, spec.uri)
    return {row["id"]: row["original_caption"]
            for unit, signature in listing.list_unit_entries(spec, location)
            for row in _unit_rows(spec, location, unit, signature, IngestOptions())
            if row["status"] == STATUS_OK}


def test_the_model_is_what_ingest_reads_after_random_changes(tmp_path):
    sources = make_sources(tmp_path, random.Random(5))
    sources_file = write_sources(tmp_path / "sources.yaml", [s.entry() for s in sources])
    for _ in range(12):
        for source in sources:
            source.change()
    for source in sources:
        assert _read(sources_file, source.name) == source.expected(), source.name
