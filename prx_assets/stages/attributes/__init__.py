"""Structured attribute tags per kept image: a versioned JSON schema (`schema.py`), the
CPU default derived from captions (`caption_derived.py`), the model backends under
structured decoding (`backends.py`) and the incremental run (`runs.py`)."""
