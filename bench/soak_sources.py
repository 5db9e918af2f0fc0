"""The soak's sources and their model: a folder of JPEGs with caption files, a folder of
WebDataset tars and a folder of Parquet files, each changed at random from the soak's seed
(files added, removed, replaced, swapped: same name, other bytes), and each keeping what a
correct pipeline must end with: the samples it holds (sample id -> caption).

`expected()` is the model: every image the source holds now, by the id ingest gives it
(`ids.sample_id` of its key: the file name, `<tar>/<member stem>`, the Parquet key column),
with its caption. Hostile files (the folder source's only) are not in it: their rows are
rejects and never reach a tree.
"""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Sizes that reach tier 512 (a smaller image is `too_small`): every image reaches the tree.
SIZES = [(512, 384), (640, 480), (600, 600), (480, 640)]
HOSTILE_KINDS = ("empty", "truncated", "text", "png_header")


def image(rng: random.Random) -> bytes:
    from prx_assets.testing.images import jpeg_bytes

    width, height = rng.choice(SIZES)
    return jpeg_bytes(width, height, rng.randrange(10**9))


def caption(rng: random.Random) -> str:
    return f"a generated test pattern number {rng.randrange(10**9)}"


@dataclass
class ModelSource:
    """One source: `name`, its folder, and what it holds (unit -> {key: caption})."""

    name: str
    folder: Path
    rng: random.Random
    units: dict[str, dict[str, str]] = field(default_factory=dict)
    made: int = 0

    kind = ""
    extra = ""  # sources.yaml fields beyond name, kind and uri

    def entry(self) -> str:
        return f"{{name: {self.name}, kind: {self.kind}, uri: {self.folder}{self.extra}}}"

    def expected(self) -> dict[str, str]:
        from prx_assets.stages.ingest.ids import sample_id

        return {sample_id(self.name, key): text for unit in self.units.values()
                for key, text in unit.items()}

    def new_name(self, suffix: str) -> str:
        self.made += 1
        return f"{self.name}{self.made:05d}{suffix}"

    def change(self) -> str:
        """One random change; returns what it did."""
        action = self.rng.choice(["add", "add", "remove", "replace", "swap"])
        if action != "add" and len(self.units) < 3:
            action = "add"
        if action == "add":
            return f"add {self.write(self.new_name(self.suffix))}"
        names = sorted(self.units)
        if action == "remove":
            name = self.rng.choice(names)
            self.remove(name)
            return f"remove {name}"
        if action == "replace":
            return f"replace {self.write(self.rng.choice(names))}"
        first, second = self.rng.sample(names, 2)
        self.swap(first, second)
        return f"swap {first} <-> {second}"

    suffix = ""

    def write(self, name: str) -> str:
        raise NotImplementedError

    def remove(self, name: str) -> None:
        (self.folder / name).unlink()
        del self.units[name]

    def swap(self, first: str, second: str) -> None:
        """The two files' bytes exchanged under their names (a copy over another)."""
        a, b = (self.folder / first).read_bytes(), (self.folder / second).read_bytes()
        (self.folder / first).write_bytes(b)
        (self.folder / second).write_bytes(a)
        self.units[first], self.units[second] = self.units[second], self.units[first]


class FolderSource(ModelSource):
    """`image_folder`: a unit is one JPEG (its key the file name), the caption beside it."""

    kind = "image_folder"
    suffix = ".jpg"

    def write(self, name: str) -> str:
        text = caption(self.rng)
        (self.folder / name).write_bytes(image(self.rng))
        (self.folder / name).with_suffix(".txt").write_text(text)
        self.units[name] = {name: text}
        return name

    def remove(self, name: str) -> None:
        super().remove(name)
        (self.folder / name).with_suffix(".txt").unlink()

    def swap(self, first: str, second: str) -> None:
        """The two images and their captions exchanged (the keys stay the names)."""
        texts = {name: self.units[name][name] for name in (first, second)}
        a, b = (self.folder / first).read_bytes(), (self.folder / second).read_bytes()
        (self.folder / first).write_bytes(b)
        (self.folder / second).write_bytes(a)
        for name, other in ((first, second), (second, first)):
            (self.folder / name).with_suffix(".txt").write_text(texts[other])
            self.units[name] = {name: texts[other]}

    def hostile(self) -> str:
        """A file ingest must reject (not in the model)."""
        from prx_assets.testing.images import jpeg_bytes

        kind = self.rng.choice(HOSTILE_KINDS)
        name = f"bad{self.rng.randrange(10**6):06d}-{kind}.jpg"
        data = {"empty": b"", "truncated": jpeg_bytes(300, 300, 1)[:200],
                "text": b"this is not an image\n" * 10,
                "png_header": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x7f\xff\xff\xff"
                              b"\x7f\xff\xff\xff\x08\x02\x00\x00\x00"}[kind]
        (self.folder / name).write_bytes(data)
        return name

    def change(self) -> str:
        hostile = sorted(self.folder.glob("bad*"))
        draw = self.rng.random()
        if draw < 0.15:
            return f"hostile {self.hostile()}"
        if draw < 0.25 and hostile:
            victim = self.rng.choice(hostile)
            victim.unlink()
            return f"remove hostile {victim.name}"
        return super().change()


class TarSource(ModelSource):
    """`webdataset`: a unit is a tar of 1-3 samples (`<stem>.jpg`, `<stem>.txt`), a key
    `<tar>/<stem>`: a swap moves the samples' keys with the bytes."""

    kind = "webdataset"
    suffix = ".tar"

    def write(self, name: str) -> str:
        samples = {f"s{self.rng.randrange(10**6):06d}": caption(self.rng)
                   for _ in range(self.rng.randint(1, 3))}
        self._tar(name, {stem: (image(self.rng), text) for stem, text in samples.items()})
        self.units[name] = {f"{name}/{stem}": text for stem, text in samples.items()}
        return name

    def _tar(self, name: str, samples: dict[str, tuple[bytes, str]]) -> None:
        from prx_assets.testing.tars import add_member

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for stem, (data, text) in samples.items():
                add_member(tar, f"{stem}.jpg", data)
                add_member(tar, f"{stem}.txt", text.encode())
        (self.folder / name).write_bytes(buffer.getvalue())

    def swap(self, first: str, second: str) -> None:
        super().swap(first, second)
        for name in (first, second):
            self.units[name] = {f"{name}/{key.split('/', 1)[1]}": text
                                for key, text in self.units[name].items()}


class ParquetSource(ModelSource):
    """`parquet`: a unit is a file of 1-3 rows (image bytes, key, caption); keys unique in
    the source, so a swap moves keys between units (each re-read under its new bytes)."""

    kind = "parquet"
    suffix = ".parquet"
    extra = ", key_column: k, caption_column: caption"
    keys_made: int = 0

    def write(self, name: str) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        old = self.units.get(name)
        keys = list(old) if old else []
        if not keys:
            for _ in range(self.rng.randint(1, 3)):
                self.keys_made += 1
                keys.append(f"k{self.keys_made:06d}")
        texts = [caption(self.rng) for _ in keys]
        pq.write_table(pa.table({"k": keys, "image": [image(self.rng) for _ in keys],
                                 "caption": texts}), self.folder / name)
        self.units[name] = dict(zip(keys, texts, strict=True))
        return name


SOURCE_CLASSES: dict[str, type[ModelSource]] = {"web": FolderSource, "tars": TarSource,
                                                "pq": ParquetSource}


def make_sources(root: Path, rng: random.Random, names: Iterable[str] = tuple(SOURCE_CLASSES)
                 ) -> list[ModelSource]:
    """The named sources (default all three) under `root/sources`, each with a few samples
    to start."""
    made = []
    for name, cls in SOURCE_CLASSES.items():
        if name not in names:
            continue
        source = cls(name, root / "sources" / name, rng)
        source.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            source.write(source.new_name(source.suffix))
        made.append(source)
    return made
