"""The global semantic steps without gathering the vectors: a fit on a bounded sample, then
a streamed assignment and a shuffle by cluster, in Ray tasks.

1. `space_inputs` pins every source's `image_embeddings` (and `phashes`, for the keep
   policy's pixels) and counts each fragment's rows of the encoder: a row's number in the
   space is its position in the sources' order, as if every table were concatenated.
2. `sample` draws a seeded sample of at most `sample_rows` vectors (each task keeps its
   chunk's rows of smallest key, a seeded hash of the id: `keys.id_keys`; the driver
   merges them), in key order: the fit's input, the same whatever order the tables store
   their rows in. When the space is no larger than the sample, the sample is every vector
   in key order, so the fit is the one the in-memory path (`semdedup.semantic_duplicates`)
   makes.
3. `scatter` assigns every vector to its nearest centroid in one task per chunk of rows
   and sends each cluster's rows to one of `buckets` outputs (cluster mod buckets);
   `reduce_buckets` runs one task per bucket over the rows the chunks sent it (Ray's
   object store moves them, spilling to disk when they do not fit).

The driver holds the sample, the centroids, per-cluster counts and object references: no
array that grows with the rows. The tasks write their own Lance fragments, committed by the
driver as one version (`storage.lance_tables.commit_fragments`).
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_assets.stages.semantic.keys import id_keys
from prx_assets.stages.semantic.kmeans import assign, normalise
from prx_assets.storage.filters import eq_filter, in_filter
from prx_assets.storage.lance_tables import write_task_fragments
from prx_assets.storage.layout import Storage
from prx_assets.storage.refs import TableRef
from prx_assets.storage.tables import IMAGE_EMBEDDINGS, PHASHES

DEFAULT_SAMPLE_ROWS = 1 << 20  # the fit's input: 2^20 768-d vectors are 3 GB
DEFAULT_CHUNK_ROWS = 1 << 18  # rows one assignment task reads
DEFAULT_BUCKET_ROWS = 1 << 18  # rows one per-cluster task receives, on average
IN_PROCESS_ROWS = 20_000  # a smaller space runs in the driver: Ray's task start costs more
FIT_CPUS = 4  # the k-means fit's task: faiss's threads
MAX_IN_FLIGHT = 8  # reduce tasks submitted ahead of the results read
# Ray returns a task's results under 100 KiB in its reply, into the caller's own memory
# (`max_direct_call_object_size`): a chunk's share of a bucket that small stays in the
# driver until its reduce ran. At 10^7 rows in 62,500-row chunks and 39 buckets, the
# concepts' shares (no vectors) were ~58 KB each: 360 MB of routed rows in the driver.
RAY_INLINE_BYTES = 100 * 1024
INLINED_BUDGET = 64 << 20  # routed bytes a space may leave in the driver
ROUTED_ROW_BYTES = 32  # a routed row without its vector: numbers, and an id of ~16 bytes
LOOKUP_IDS = 4096  # up to this many ids, the pixel lookup is one IN filter; past it a scan
SCAN_ROWS = 1 << 18  # rows per batch of that scan


@dataclass(frozen=True)
class Part:
    """One source's embeddings table (pinned), its rows of the encoder per fragment, and
    the space's row number of its first row."""

    source: str
    rank: int
    table: TableRef
    phashes: TableRef | None
    fragments: tuple[tuple[int, int], ...]  # (fragment id, rows of the encoder)
    offset: int

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.fragments)


@dataclass
class SpaceInputs:
    encoder: str
    parts: list[Part] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)  # input table -> version read
    missing: list[str] = field(default_factory=list)  # sources with no embeddings yet

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def phashes_by_rank(self) -> dict[int, TableRef]:
        return {p.rank: p.phashes for p in self.parts if p.phashes is not None}


@dataclass(frozen=True)
class Chunk:
    """Rows [start, start + rows) of the encoder's rows of one fragment."""

    part: Part
    fragment: int
    start: int
    rows: int
    offset: int  # the space's row number of its first row


def space_inputs(storage: Storage, sources: Sequence[str], encoder: str) -> SpaceInputs:
    """Every source's tables pinned at their latest version, with per-fragment counts."""
    inputs = SpaceInputs(encoder)
    offset = 0
    condition = eq_filter("encoder", encoder)
    for rank, source in enumerate(sources):
        table = storage.table(IMAGE_EMBEDDINGS, source)
        version = table.latest_version()
        if version is None:
            inputs.missing.append(source)
            continue
        table = table.at(version)
        inputs.versions[f"{IMAGE_EMBEDDINGS}/{source}"] = version
        dataset = table.open()
        counts = tuple((f.fragment_id, f.count_rows(condition)) for f in dataset.get_fragments())
        phashes = storage.table(PHASHES, source)
        hashes_version = phashes.latest_version()
        if hashes_version is not None:
            inputs.versions[f"{PHASHES}/{source}"] = hashes_version
        part = Part(source, rank, table, phashes.at(hashes_version) if hashes_version else None,
                    tuple((f, n) for f, n in counts if n), offset)
        inputs.parts.append(part)
        offset += part.rows
    return inputs


def chunks(inputs: SpaceInputs, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> list[Chunk]:
    out: list[Chunk] = []
    for part in inputs.parts:
        offset = part.offset
        for fragment, rows in part.fragments:
            for start in range(0, rows, chunk_rows):
                size = min(chunk_rows, rows - start)
                out.append(Chunk(part, fragment, start, size, offset + start))
            offset += rows
    return out


def read_chunk(chunk: Chunk, encoder: str, vectors: bool = True
               ) -> tuple[pa.Array, np.ndarray | None]:
    """(ids, unit vectors or None) of a chunk's rows, in row order."""
    fragment = chunk.part.table.open().get_fragment(chunk.fragment)
    if fragment is None:  # the table is pinned: its fragments stay
        raise FileNotFoundError(f"{chunk.part.table}: no fragment {chunk.fragment}")
    columns = ["id", "embedding"] if vectors else ["id"]
    table = fragment.to_table(columns=columns, filter=eq_filter("encoder", encoder),
                              offset=chunk.start, limit=chunk.rows)
    ids = table.column("id").combine_chunks()
    if not vectors:
        return ids, None
    flat = table.column("embedding").combine_chunks()
    values = flat.flatten().to_numpy(zero_copy_only=False)
    return ids, normalise(values.reshape(len(flat), flat.type.list_size))


# -- tasks: plain functions, run as Ray tasks or in this process ---------------------------

def node_id() -> str:
    """The Ray node running this code ("local" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def sample_chunk(chunk: Chunk, encoder: str, sample_rows: int, seed: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys, row numbers, vectors) of the chunk's `sample_rows` rows of smallest key (a
    seeded hash of the id: the same sample whatever runs it, and wherever a row is stored)."""
    ids, vectors = read_chunk(chunk, encoder)
    assert vectors is not None
    keys = id_keys(ids, seed)
    rows = np.arange(chunk.offset, chunk.offset + chunk.rows, dtype=np.int64)
    return _smallest(keys, rows, vectors, sample_rows)


def _smallest(keys: np.ndarray, rows: np.ndarray, vectors: np.ndarray, n: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(keys) <= n:
        return keys, rows, vectors
    chosen = np.argpartition(keys, n - 1)[:n]
    return keys[chosen], rows[chosen], vectors[chosen]


@dataclass
class Routed:
    """One bucket's share of a chunk: rows of the clusters `cluster % buckets == bucket`."""

    rows: np.ndarray  # int64 row numbers in the space
    ids: pa.Array
    rank: np.ndarray  # int32 source rank
    cluster: np.ndarray  # int32
    vectors: np.ndarray | None  # unit rows, or None where the reduce needs none


def route_chunk(chunk: Chunk, encoder: str, centroids: np.ndarray, buckets: int,
                with_vectors: bool) -> list[Any]:
    """[per-cluster counts, node, bucket 0's rows, ..., bucket B-1's rows]: the chunk's
    vectors assigned to their nearest centroid and split by cluster bucket."""
    ids, vectors = read_chunk(chunk, encoder)
    assert vectors is not None
    cluster = assign(vectors, centroids).astype(np.int32)
    counts = np.bincount(cluster, minlength=len(centroids))
    bucket = cluster % buckets
    rows = np.arange(chunk.offset, chunk.offset + chunk.rows, dtype=np.int64)
    out: list[Any] = [counts, node_id()]
    for b in range(buckets):
        mine = np.flatnonzero(bucket == b)
        out.append(Routed(rows[mine], ids.take(pa.array(mine)),
                          np.full(mine.size, chunk.part.rank, np.int32), cluster[mine],
                          vectors[mine] if with_vectors else None))
    return out


def merge_routed(parts: Sequence[Routed]) -> Routed:
    """One bucket's rows from every chunk, in row order."""
    parts = [p for p in parts if len(p.rows)]
    if not parts:
        return Routed(np.zeros(0, np.int64), pa.array([], pa.string()), np.zeros(0, np.int32),
                      np.zeros(0, np.int32), None)
    rows = np.concatenate([p.rows for p in parts])
    order = np.argsort(rows, kind="stable")
    ids = pa.concat_arrays([p.ids for p in parts]).take(pa.array(order))
    first = parts[0].vectors
    vectors = (np.concatenate([p.vectors for p in parts if p.vectors is not None])[order]
               if first is not None else None)
    return Routed(rows[order], ids, np.concatenate([p.rank for p in parts])[order],
                  np.concatenate([p.cluster for p in parts])[order], vectors)


def clusters_of(routed: Routed) -> Iterator[tuple[int, np.ndarray]]:
    """(cluster, positions in `routed`) per cluster present, clusters ascending, positions
    in row order."""
    order = np.argsort(routed.cluster, kind="stable")
    values = routed.cluster[order]
    bounds = np.flatnonzero(np.diff(values)) + 1
    for positions in np.split(order, bounds):
        if positions.size:
            yield int(routed.cluster[positions[0]]), positions


def pixels_of(ids: pa.Array, rank: np.ndarray, phashes: dict[int, TableRef]) -> np.ndarray:
    """Each id's pixels from its source's phashes (0 where it has none)."""
    out = np.zeros(len(ids), np.int64)
    for source_rank in np.unique(rank).tolist():
        table = phashes.get(int(source_rank))
        if table is None:
            continue
        positions = np.flatnonzero(rank == source_rank)
        out[positions] = lookup_pixels(table, ids.take(pa.array(positions)))
    return out


def lookup_pixels(table: TableRef, wanted: pa.Array) -> np.ndarray:
    """Each wanted id's pixels in `table` (0 where absent or null): up to `LOOKUP_IDS` ids
    through one IN filter (the key index serves it), more in one scan of the id and pixels
    columns joined here. A bucket's ids are spread over the whole table, and Lance reads
    about the whole columns for each IN filter of spread ids (4,096 of 2.5·10^6: as long as
    the scan), so filters of `LOOKUP_IDS` made the lookup grow with the table's rows times
    the ids' (docs/growth.md)."""
    unique = pc.unique(wanted)
    pixels = np.zeros(len(unique), np.int64)
    dataset = table.open()
    if len(unique) <= LOOKUP_IDS:
        batches: Iterable[pa.RecordBatch | pa.Table] = [dataset.to_table(
            columns=["id", "pixels"], filter=in_filter("id", unique.to_pylist()))]
    else:
        batches = dataset.to_batches(columns=["id", "pixels"], batch_size=SCAN_ROWS)
    for batch in batches:
        where = pc.index_in(batch.column("id"), value_set=unique)
        hit = where.is_valid()
        pixels[pc.filter(where, hit).to_numpy()] = pc.fill_null(
            pc.filter(batch.column("pixels"), hit), 0).to_numpy()
    return pixels[pc.index_in(wanted, value_set=unique).to_numpy()]


def write_rows(table: TableRef, rows: pa.Table, schema: pa.Schema) -> list[bytes]:
    """A task's rows as fragments of `table` (pickled metadata for the driver's commit)."""
    if rows.num_rows == 0:
        return []
    return [pickle.dumps(f) for f in write_task_fragments(table, rows.cast(schema), schema)]


# -- the driver: sample, scatter, reduce ------------------------------------------------

class Tasks:
    """Runs the task functions as Ray tasks (`use_ray`) or in this process."""

    def __init__(self, use_ray: bool, max_in_flight: int = MAX_IN_FLIGHT):
        self.use_ray = use_ray
        self.max_in_flight = max_in_flight
        self.nodes: set[str] = set()

    def put(self, value: Any) -> Any:
        """`value` in the object store once (under Ray), for many tasks to read."""
        if not self.use_ray:
            return value
        import ray

        return ray.put(value)

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> Iterator[Any]:
        """fn(*args) for each args, results in order, at most `max_in_flight` running."""
        if not self.use_ray:
            yield from (fn(*args) for args in calls)
            return
        import ray

        task = ray.remote(num_cpus=1)(fn)
        turns = node_turns()
        pending: list[Any] = []
        for args in calls:
            pending.append(task.options(scheduling_strategy=next(turns)).remote(*args))
            if len(pending) >= self.max_in_flight:
                yield ray.get(pending.pop(0))
        for ref in pending:
            yield ray.get(ref)

    def call(self, fn: Callable[..., Any], args: tuple, num_cpus: int = 1, num_gpus: int = 0
             ) -> Any:
        """fn(*args) as one task holding `num_cpus` and `num_gpus` (under Ray)."""
        if not self.use_ray:
            return fn(*args)
        import ray

        return ray.get(ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(fn).remote(*args))

    def scatter(self, fn: Callable[..., list[Any]], calls: Sequence[tuple], buckets: int
                ) -> tuple[Any, list[list[Any]]]:
        """fn(*args) -> [summary, node, bucket 0, ..., bucket B-1] per call: the sum of the
        summaries, and per call its buckets (object references under Ray)."""
        total: Any = 0
        outputs: list[list[Any]] = []
        if not self.use_ray:
            for args in calls:
                result = fn(*args)
                total = total + result[0]
                self.nodes.add(result[1])
                outputs.append(result[2:])
            return total, outputs
        import ray

        task = ray.remote(num_cpus=1)(fn)
        turns = node_turns()
        refs = [task.options(num_returns=buckets + 2, scheduling_strategy=next(turns))
                .remote(*args) for args in calls]
        for ref in refs:
            summary, node = ray.get(ref[:2])
            total = total + summary
            self.nodes.add(node)
            outputs.append(ref[2:])
        return total, outputs


def node_turns() -> Iterator[Any]:
    """Scheduling strategies that hand the tasks to the cluster's nodes with CPUs in turn.
    Ray's default keeps tasks on the driver's node until it is busy, and its SPREAD skips a
    node whose CPUs are taken at that instant (an earlier step's actors not yet gone): a
    global step could run on one node of an idle cluster. Soft: a node that left hands its
    task to another."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(node["NodeID"] for node in ray.nodes()
                   if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) > 0)
    if not nodes:
        return itertools.repeat("DEFAULT")
    return itertools.cycle([NodeAffinitySchedulingStrategy(node, soft=True) for node in nodes])


def fit_resources(use_gpu: bool | None) -> dict[str, int]:
    """What the k-means fit's task holds: up to `FIT_CPUS` CPUs (no more than a node has),
    and a GPU where asked or, by default, where the cluster has one."""
    import ray

    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    cpus = min(FIT_CPUS, max((int(r.get("CPU", 0)) for r in nodes), default=1))
    gpus = bool(use_gpu) or (use_gpu is None and any(r.get("GPU", 0) >= 1 for r in nodes))
    return {"num_cpus": max(1, cpus), "num_gpus": int(gpus)}


def bucket_count(rows: int, bucket_rows: int = DEFAULT_BUCKET_ROWS,
                 chunk_rows: int | None = None, row_bytes: int = ROUTED_ROW_BYTES) -> int:
    """Buckets of about `bucket_rows` rows; given the chunks' mean rows, fewer where a
    chunk's share of a bucket would fall under Ray's inline size (twice it, for margin)
    on a space whose routed rows are more than `INLINED_BUDGET`."""
    buckets = max(1, math.ceil(rows / max(1, bucket_rows)))
    if chunk_rows is None or rows * row_bytes <= INLINED_BUDGET:
        return buckets
    return max(1, min(buckets, chunk_rows * row_bytes // (2 * RAY_INLINE_BYTES)))


def routed_buckets(inputs: SpaceInputs, chunk_list: Sequence[Chunk], bucket_rows: int,
                   dim: int | None = None) -> int:
    """`bucket_count` for routing `chunk_list`, its rows with their `dim`-d vectors or
    without (None)."""
    rows = inputs.rows
    row_bytes = ROUTED_ROW_BYTES + (4 * dim if dim else 0)
    return bucket_count(rows, bucket_rows, rows // max(1, len(chunk_list)), row_bytes)


def sample(inputs: SpaceInputs, tasks: Tasks, sample_rows: int, seed: int,
           chunk_rows: int = DEFAULT_CHUNK_ROWS) -> np.ndarray:
    """At most `sample_rows` unit vectors drawn without replacement (seeded), in key
    order: every vector when the space holds no more."""
    drawn = Draw(sample_rows)
    calls = [(c, inputs.encoder, sample_rows, seed) for c in chunks(inputs, chunk_rows)]
    for keys, rows, vectors in tasks.map(sample_chunk, calls):
        drawn.add(keys, rows, vectors)
    return drawn.in_key_order()


class Draw:
    """The rows of smallest key seen so far, at most `size`, in one preallocated buffer:
    a chunk's rows replace the evicted ones in place (merging by concatenation held the
    sample three times over)."""

    def __init__(self, size: int):
        self.size = size
        self.filled = 0
        self.keys = np.zeros(0, np.uint64)
        self.rows = np.zeros(0, np.int64)
        self.vectors: np.ndarray | None = None

    def add(self, keys: np.ndarray, rows: np.ndarray, vectors: np.ndarray) -> None:
        if self.vectors is None:
            self.keys = np.empty(self.size, np.uint64)
            self.rows = np.empty(self.size, np.int64)
            self.vectors = np.empty((self.size, vectors.shape[1]), np.float32)
        both = np.r_[self.keys[:self.filled], keys]
        if both.size <= self.size:
            slots, incoming = np.arange(self.filled, both.size), np.arange(keys.size)
        else:
            chosen = np.zeros(both.size, bool)
            chosen[np.argpartition(both, self.size - 1)[:self.size]] = True
            incoming = np.flatnonzero(chosen[self.filled:])
            free = np.r_[np.flatnonzero(~chosen[:self.filled]),
                         np.arange(self.filled, self.size)]
            slots = free[:incoming.size]
        self.keys[slots], self.rows[slots] = keys[incoming], rows[incoming]
        self.vectors[slots] = vectors[incoming]
        self.filled = min(self.size, both.size)

    def in_key_order(self) -> np.ndarray:
        """The vectors drawn, by key (ties, equal ids only, by row number)."""
        if self.vectors is None:
            return np.zeros((0, 1), np.float32)
        return self.vectors[np.lexsort((self.rows[:self.filled], self.keys[:self.filled]))]
