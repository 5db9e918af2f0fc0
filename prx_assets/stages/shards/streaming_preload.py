"""Imported once by the fork server of the `leaves_stream` check (`verify.streamed_counts`):
the module and streaming's two classes, loaded before any check's child is forked."""

from prx_assets.stages.shards.verify import streaming_dataset_classes

streaming_dataset_classes()
