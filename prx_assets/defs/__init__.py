"""The Dagster layer: one module per stage (its assets, checks, sensors, schedules and jobs,
each returning its own `dg.Definitions`), plus the resources, the Lance IO manager and the
partitions they share. `prx_assets.definitions` merges them into the code location."""
