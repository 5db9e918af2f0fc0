"""`prx-assets`: build the demo corpus, run the pipeline end to end, print what it made."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_DEMO_DIR = Path("demo_corpus")


def _make_demo_corpus(args: argparse.Namespace) -> int:
    from prx_assets.demo import make_demo_corpus

    sources = make_demo_corpus(Path(args.dir), scale=args.scale)
    print(f"demo corpus written; sources file: {sources}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Materialise every asset for every source of the demo corpus, then summarise."""
    from prx_assets.core.sources import sources_path
    from prx_assets.demo import make_demo_corpus

    corpus = Path(args.dir)
    if not (corpus / "sources.yaml").exists() or args.rebuild:
        print(f"building the demo corpus in {corpus}/ ...")
        make_demo_corpus(corpus)
    # The repo's sources.yaml points at the demo corpus; PRX_SOURCES may name another file.
    sources_file = sources_path()
    os.environ["PRX_SOURCES"] = str(sources_file)
    from prx_assets.runner import materialize_all, print_summary

    results = materialize_all(sources_file)
    print_summary(results)
    return 0 if all(r.success for r in results) else 1


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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
