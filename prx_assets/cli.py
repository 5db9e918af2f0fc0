"""`prx-assets`: build the demo corpus, run the pipeline end to end, print what it made."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prx_assets.storage.refs import TableRef

DEFAULT_DEMO_DIR = Path("demo_corpus")


def _make_demo_corpus(args: argparse.Namespace) -> int:
    from prx_assets.demo.corpus import make_demo_corpus

    sources = make_demo_corpus(Path(args.dir), scale=args.scale)
    print(f"demo corpus written; sources file: {sources}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Materialise every asset for every source of the demo corpus, then summarise."""
    from prx_assets.demo.console import NoticeFilter, quiet_third_party

    for note in quiet_third_party():  # before Lance or Ray are imported
        print(note)
    with NoticeFilter():
        try:
            return _demo_runs(args)
        finally:  # Ray's processes print through the driver until Ray stops: inside the filter
            from prx_assets.engine import ray_runtime

            ray_runtime.disconnect()


def _demo_runs(args: argparse.Namespace) -> int:
    from prx_assets.demo.corpus import make_demo_corpus
    from prx_assets.stages.ingest.sources import sources_path

    corpus = Path(args.dir)
    if not (corpus / "sources.yaml").exists() or args.rebuild:
        print(f"building the demo corpus in {corpus}/ (a few minutes) ...", flush=True)
        make_demo_corpus(corpus, progress=lambda line: print(f"   {line}", flush=True))
    # The repo's sources.yaml points at the demo corpus; PRX_SOURCES may name another file.
    sources_file = sources_path()
    os.environ["PRX_SOURCES"] = str(sources_file)
    import dagster as dg

    from prx_assets.demo.runner import materialize_all, print_summary

    # Partitioned asset checks are a Dagster preview feature this project uses on purpose;
    # its warning, repeated per definition build, tells a demo user nothing to act on.
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    results = materialize_all(sources_file, semantic=True)
    print_summary(results, sources_file)
    return 0 if all(r.success for r in results) else 1


def _corpus() -> TableRef:
    from prx_assets.storage.layout import Storage
    from prx_assets.storage.tables import CORPUS

    return Storage.from_env().table(CORPUS)


def _search(args: argparse.Namespace) -> int:
    from prx_assets.stages.corpus.search import SearchError, format_hits, search_text

    try:
        hits = search_text(_corpus(), args.text, k=args.k, source=args.source,
                           label=args.label, where=args.where)
    except SearchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_hits(hits))
    return 0


def _similar(args: argparse.Namespace) -> int:
    from prx_assets.stages.corpus.search import SearchError, format_hits, similar

    try:
        hits = similar(_corpus(), args.id, k=args.k, source=args.source, label=args.label,
                       where=args.where)
    except SearchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_hits(hits))
    return 0


def _browse(args: argparse.Namespace) -> int:
    from prx_assets.browser.app import UnsafeBind, check_bind, serve
    from prx_assets.browser.auth import AuthConfigError, Curators
    from prx_assets.storage.layout import Storage

    try:
        curators = Curators.load(args.curator_tokens) if args.curator_tokens \
            else Curators.from_env()
        check_bind(args.host, curators)
    except (AuthConfigError, UnsafeBind) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    storage = Storage.from_env()
    writes = (f"writes by {len(set(curators.by_digest.values()))} curator(s)" if curators
              else "read-only (no curator tokens)")
    print(f"corpus browser on http://{args.host}:{args.port}/ over {storage.root}; {writes}")
    serve(storage, host=args.host, port=args.port, curators=curators)
    return 0


def _opt_out(args: argparse.Namespace) -> int:
    """One request file for the ids, under this user's name: the sensor's next tick
    requests the skip-list runs, as for a dropped file or the browser."""
    import getpass

    from prx_assets.stages.opt_outs.requests import write_requests
    from prx_assets.storage.layout import Storage

    try:
        written = write_requests(Storage.from_env(), list(args.ids), args.reason,
                                 requested_by=getpass.getuser(), door="cli")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(args.ids)} opt-out request(s) recorded in {written}")
    return 0


def _clear_rights(args: argparse.Namespace) -> int:
    """A curator's clearance of constrained samples (docs/rights.md), audited like an
    opt-out request; applied by the next skip_lists run and every loader opened after."""
    import getpass

    from prx_assets.stages.opt_outs.rights import clear
    from prx_assets.storage.layout import Storage

    try:
        written = clear(Storage.from_env(), list(args.ids), args.reason, door="cli",
                        cleared_by=getpass.getuser())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(args.ids)} clearance(s) recorded in {written}")
    return 0


def _mds_uri(args: argparse.Namespace) -> int:
    """The current tree's location: `StreamingDataset(remote=<it>/<tier>/<W>x<H>)` reads it.
    With `--lease HOURS`, a reader lease keeps that tree for HOURS (its id on stderr)."""
    import time

    from prx_assets.storage.layout import Storage
    from prx_assets.storage.trees import current_tree_uri, hold_current_tree, hold_tree

    if (args.source is None) == (args.subset is None):
        print("error: name a SOURCE or --subset NAME (one of them)", file=sys.stderr)
        return 2
    refusal = _mds_uri_refusal(args)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    storage = Storage.from_env()
    try:
        if args.subset is not None:
            from prx_assets.stages.subsets.build import current_subset_uri
            from prx_assets.stages.subsets.tree import subset_store

            if args.lease is None:
                print(current_subset_uri(storage, args.subset))
                return 0
            tree, lease = hold_tree(subset_store(storage.mds_root, args.subset),
                                    args.lease * 3600)
        elif args.lease is None:
            print(current_tree_uri(storage, args.source))
            return 0
        else:
            tree, lease = hold_current_tree(storage.mds_root, args.source, args.lease * 3600)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(tree.uri)
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(lease.expires_at))
    print(f"reader lease {lease.lease_id} holds tree {lease.version} until {until} "
          f"({lease.location}; delete it to release early)", file=sys.stderr)
    return 0


def _mds_uri_refusal(args: argparse.Namespace) -> str | None:
    """Why `mds-uri`'s arguments cannot be used (a name that is no source or subset name
    would reach paths outside the trees, and a lease file path), None when they can."""
    import math

    from prx_assets.stages.ingest.sources import NAME_PATTERN

    name = args.source if args.source is not None else args.subset
    if not NAME_PATTERN.match(name):
        return f"{name!r} is not a source or subset name ([a-z0-9_]+)"
    if args.lease is not None and not (math.isfinite(args.lease) and 0 < args.lease <= 8760):
        return f"--lease {args.lease}: a number of hours above 0, at most 8760 (a year)"
    return None


MAX_RESULTS = 10_000


def _result_count(text: str) -> int:
    """`--k`: a whole number from 1 to MAX_RESULTS (Lance refused 0 and below with a
    traceback)."""
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_RESULTS:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1 to {MAX_RESULTS}")
    return int(text)


def _add_query_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", help="only this source")
    parser.add_argument("--label", choices=["visual", "text", "nsfw"], help="only this label")
    parser.add_argument("--k", type=_result_count, default=10,
                        help=f"how many results (default 10, at most {MAX_RESULTS})")
    parser.add_argument("--where", action="append", default=[], metavar="CONDITION",
                        help="an attribute condition, repeatable: medium=photo, "
                             "subjects=animal,food, watermark=false, aesthetic_quality>=4, "
                             "people=unknown (not known: null, never read as 'no')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prx-assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("make-demo-corpus", help="write the demo sources and sources.yaml")
    corpus.add_argument("dir", nargs="?", default=str(DEFAULT_DEMO_DIR))
    corpus.add_argument("--scale", type=int, default=1)
    corpus.set_defaults(func=_make_demo_corpus)
    demo = sub.add_parser("demo", help="build the demo corpus and materialise every asset")
    demo.add_argument("--dir", default=str(DEFAULT_DEMO_DIR))
    demo.add_argument("--rebuild", action="store_true", help="regenerate the demo corpus")
    demo.set_defaults(func=_demo)
    search = sub.add_parser("search", help="full-text search over the corpus captions")
    search.add_argument("text")
    _add_query_args(search)
    search.set_defaults(func=_search)
    near = sub.add_parser("similar", help="images whose captions are nearest to ID's")
    near.add_argument("id")
    _add_query_args(near)
    near.set_defaults(func=_similar)
    uri = sub.add_parser("mds-uri", help="print the URI of SOURCE's current MDS tree (a "
                                          "folder or s3:// prefix; <uri>/<tier>/<W>x<H> is a "
                                          "stream)")
    uri.add_argument("source", nargs="?")
    uri.add_argument("--subset", metavar="NAME", help="a subset's tree instead (subsets.yaml)")
    uri.add_argument("--lease", type=float, metavar="HOURS",
                     help="hold the tree for HOURS with a reader lease (not removed meanwhile, "
                          "whatever its retention); the lease id goes to stderr")
    uri.set_defaults(func=_mds_uri)
    browse = sub.add_parser("browse", help="serve the corpus browser (a web app over the tables)")
    browse.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    browse.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    browse.add_argument("--curator-tokens", metavar="WHERE",
                        help="curator tokens for writes: a file of '<curator> <token>' lines "
                             "or env:VAR (default: $PRX_CURATOR_TOKENS; none: read-only)")
    browse.set_defaults(func=_browse)
    opt_out = sub.add_parser("opt-out", help="record opt-out requests for sample ids (applied "
                                             "by the opt-out sensor's next tick)")
    opt_out.add_argument("ids", nargs="+", metavar="ID", help="sample ids (<source>:<hash>)")
    opt_out.add_argument("--reason", required=True, help="why (a ticket, an e-mail id)")
    opt_out.set_defaults(func=_opt_out)
    clearance = sub.add_parser("clear-rights", help="clear constrained training reservations "
                                                    "of sample ids after reading their terms "
                                                    "(prohibitions cannot be cleared)")
    clearance.add_argument("ids", nargs="+", metavar="ID", help="sample ids (<source>:<hash>)")
    clearance.add_argument("--reason", required=True, help="what was checked (a licence, a "
                                                           "ticket)")
    clearance.set_defaults(func=_clear_rights)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
