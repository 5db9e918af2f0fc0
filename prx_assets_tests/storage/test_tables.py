import lance

from prx_assets.stages.images.stage import BUCKETED_SCHEMA
from prx_assets.stages.ingest.raw_rows import RAW_IMAGES_SCHEMA
from prx_assets.storage.lance_tables import create_empty
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import LANCE_COMPRESSION


def test_image_bytes_are_stored_uncompressed_in_the_tables_holding_them(tmp_path):
    """Lance takes a column's encoding from the schema the table was created with."""
    for name, schema in (("raw", RAW_IMAGES_SCHEMA), ("bucketed", BUCKETED_SCHEMA)):
        create_empty(TableRef.of(tmp_path / f"{name}.lance"), schema)
        field = lance.dataset(str(tmp_path / f"{name}.lance")).schema.field("image")
        assert (field.metadata or {}).get(LANCE_COMPRESSION) == b"none"
