"""Runs killed or raced on purpose, in four files so `--dist loadfile` spreads them.

Everything is real: Dagster runs on an on-disk SQLite instance, embedded Ray, Lance
tables, MDS trees, and SIGKILL of a run's whole process group. A killed run is armed with one
of the stages' failpoints (`prx_assets.storage.failpoints`) and killed once its marker file
says it holds there: no kill waits for a sleep or races the run. The module's corpus
(faults/conftest.py) is built once; tests leave its store consistent for the next one.
"""
