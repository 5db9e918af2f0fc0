"""opt_out_sensor: new opt-out request files -> skip-list runs for exactly the sources hit."""

import hashlib
import json

import dagster as dg

from prx_assets.s6_opt_outs.opt_outs import (
    affected_sources, fingerprint, opt_out_dir, parse_directory, request_files, resolve)
from prx_assets.storage.settings import data_root
from prx_assets.s1_ingest.sources import load_sources


def build_opt_out_sensor(sources_file: str) -> dg.SensorDefinition:
    @dg.sensor(
        name="opt_out_sensor",
        target=dg.AssetSelection.assets("skip_lists", "opt_outs"),
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Watches $PRX_DATA_ROOT/opt_outs/ for new or changed request files, "
                    "resolves them, and requests skip_lists runs for exactly the sources "
                    "whose images they remove (plus one run refreshing the opt_outs audit).",
    )
    def opt_out_sensor(context: dg.SensorEvaluationContext):
        seen = json.loads(context.cursor) if context.cursor else {}
        folder = opt_out_dir(data_root())
        current = {path.name: fingerprint(path) for path in request_files(folder)}
        new = {name: fp for name, fp in current.items() if seen.get(name) != fp}
        if not new:
            return dg.SkipReason(f"no new opt-out request files in {folder}")
        parsed = parse_directory(folder, names=new)
        for error in parsed.errors:
            context.log.warning(f"malformed opt-out row {error}")
        audit = resolve(parsed.requests, load_sources(sources_file).names, data_root())
        sources = affected_sources(audit)
        context.log.info(f"{len(parsed.requests)} new request(s) in {', '.join(sorted(new))} "
                         f"affect: {', '.join(sources) or 'no source'}")
        batch = hashlib.sha256(json.dumps(new, sort_keys=True).encode()).hexdigest()[:12]
        runs = [dg.RunRequest(run_key=f"opt_outs:{batch}",
                              asset_selection=[dg.AssetKey("opt_outs")])]
        runs += [dg.RunRequest(run_key=f"skip_lists:{source}:{batch}", partition_key=source,
                               asset_selection=[dg.AssetKey("skip_lists")],
                               tags={"prx/opt_out_files": ",".join(sorted(new))})
                 for source in sources]
        return dg.SensorResult(run_requests=runs, cursor=json.dumps({**seen, **new}))

    return opt_out_sensor
