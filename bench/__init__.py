"""The benchmarks (`make bench`, `python -m bench.<name>`)."""

import os

# Lance reads its log level once, when imported: a bench's fresh tables ("no existing
# dataset, it will be created", once a pass) are no warning.
os.environ.setdefault("LANCE_LOG", "error")
