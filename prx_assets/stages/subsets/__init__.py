"""Named fine-tuning subsets: the definitions file (`definitions.py`), the selection over
attributes, labels, tiers, sources and concepts (`select.py`), the subset's own MDS tree
(`tree.py`) and one build with its card and lineage (`build.py`)."""
