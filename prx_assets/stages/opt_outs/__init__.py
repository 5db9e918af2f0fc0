"""Opt-outs: requests from three doors, resolved once into the audited `opt_outs` table.

Data flow (one writer of request files, one parser, one resolver):

    a file dropped in the folder ───────────────────────────────┐
    `prx-assets opt-out ID... --reason R` ─┐                    │
    the browser (an authenticated curator) ┴ requests.write_requests
                                                                v
    Storage.opt_outs_dir: `*.csv|*.jsonl`, one request per row: {"key_type", "value",
    "timestamp", "reference"} (+ `source`, `requested_by`, `door`)
                                                                v
    resolution.resolve_opt_outs(storage, sources) -> Resolution (audit rows, record)
      the `opt_outs` table's rows for the files its record resolved against the input
      versions of now; every other file parsed (requests) and resolved (opt_outs.resolve)
                                                                v
    readers, each through `resolve_opt_outs`:
      defs.opt_outs `opt_outs` asset   writes the Resolution as the audited table (rows,
                                       and the record in its schema metadata)
      defs.opt_outs `opt_out_sensor`   the sources hit by the files new to its cursor
      defs.skip_lists `skip_lists`     the `optout` ids of its source
      guard.recorded_opt_outs          the loader's guard (loader.opt_out_guard) and the
                                       `opt_outs_applied` check (guard.pending_opt_outs)

- `requests`: the file format, the parser and `write_requests`, the writer of the CLI and
  browser doors (one new file per call, each row checked by the parser first).
- `opt_outs`: the matching (`resolve`, by id, bytes, source key or url, extended to the
  same bytes and phash copies in any source) and the audit schema.
- `resolution`: `resolve_opt_outs`, the only caller of `resolve`, and of the parser but
  for `files_requesting` (the browser's "requested" note on a sample page, which reads its
  own door's files). The `opt_outs` table carries in its schema metadata what it resolved
  (file fingerprints, malformed rows, input table versions), so a reader takes from the
  table what it already resolved and resolves only the rest: a file dropped, rewritten or
  written by a door after the table's last materialisation, or everything once an input
  table (a source's raw_images, duplicates) has a new version. A request not yet in the
  table therefore still blocks its id in the loader: fail closed.
- `guard`: the opt-outs recorded so far with when they landed, where they sit in a source's
  current tree, and which of them a reader could still stream.
- `rights`: skip reason `rights` as every reader applies it (the skip lists, the loader's
  guard, the browser): the reservations ingest recorded, the domain list under
  `Storage.rights_dir`, and curators' clearances written through `write_requests` into
  their own folder (docs/rights.md).
"""
