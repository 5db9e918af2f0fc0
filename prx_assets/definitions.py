"""The Dagster code location: `prx_assets.definitions:defs`."""

from prx_assets.defs import build_defs

defs = build_defs()
