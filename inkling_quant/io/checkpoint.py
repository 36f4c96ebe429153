"""A Hugging Face checkpoint directory: its index, its shards, its other files.

File names come from untrusted index files, so every one is checked to stay inside the
directory (no separators, no `..`, no absolute paths, no symlink leaving it)."""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError, UnsafePathError, printable
from .files import atomic_file, check_line_safe
from .safetensors import Header, _encodable, _short, check_count, open_regular, parse_json_bytes, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A bundled draft's weight file of its own (docs/layout.md "Files"): the Inkling 2 release ships
# its draft as `mtp.safetensors`. We list it in the index we write (index-driven loaders read only
# the files the index names); one an index (or a lone model.safetensors) omits is still read
# (`Checkpoint.open`, verify), as SGLang 0.5.23 reads one for GLM-4 MoE checkpoints, calling the
# omission a packaging bug (model_loader/weight_utils.py `maybe_add_mtp_safetensors`).
DRAFT_FILE = "mtp.safetensors"
CONFIG_NAME = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's export record (export.py reads and writes it)
MERGE_RECORD_KEY = "lora_merged"  # config.json: the adapters `lora merge` merged (a record, not the model's config)
CHECKSUMS = "checksums.sha256"
RESUME_MANIFEST = ".inkling-quant-convert.json"  # convert's, present only while a conversion is unfinished
# In every index we write: who wrote it (verify holds such an index's total_size to the exact sum).
PRODUCER = {"name": "inkling-quant", "version": __version__}
# In a finished OUT's index metadata: what the conversion was (convert's fingerprint without the source
# files: the same conversion of a copied source, or of a hub repo, records the same), and which source
# files it read (their sizes and times; a hub repo's revision): a finished OUT is confirmed only for both
CONVERSION_KEY, SOURCE_KEY = "inkling_quant_conversion", "inkling_quant_source"
MAX_JSON_BYTES = 64 << 20


MAX_NAME_BYTES = 255  # NAME_MAX of every common file system


def safe_child(root: Path, name: str, what: str = "file", tensor: str | None = None) -> Path:
    """root/name, refusing names that could leave root (or that no file system can hold).
    `what` names the file in messages; `tensor`, the tensor it was named for (the error's field)."""
    if isinstance(name, str) and not _encodable(name):  # a listed file's bytes, or a JSON "\\udcff"
        shown = printable(name[:200]) + ("..." if len(name) > 200 else "")
        raise UnsafePathError(f"{what} name is not valid UTF-8: {shown}", path=root, tensor=tensor)
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name) or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise UnsafePathError(f"refusing {what} name {_short(name)}: must be a plain file name inside the "
                              f"checkpoint", path=root, tensor=tensor)
    check_line_safe(name, root, what, tensor)
    path = root / name
    try:
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(root.resolve()) and not _hub_blob(root, target):
                raise UnsafePathError(f"symlink points outside the checkpoint ({target})", path=path)
    except (OSError, RuntimeError) as e:  # a loop (RuntimeError before Python 3.13), a name too long
        raise UnsafePathError(f"symlink cannot be resolved: {getattr(e, 'strerror', None) or e}",
                              path=path) from None
    return path


def _hub_blob(root: Path, target: Path) -> bool:
    """huggingface_hub's cache links each file of snapshots/<commit>/ to ../../blobs/<hash>:
    a hub source's files (inkling_quant.hub) are such links, and only these are let through."""
    snapshots = root.resolve().parent
    return snapshots.name == "snapshots" and target.parent == snapshots.parent / "blobs"


def read_json(path: Path, what: str, error: type[Exception] = CheckpointError) -> dict:
    """A JSON object from an untrusted file, at most MAX_JSON_BYTES; any defect (not a regular
    file, not UTF-8, not JSON, a duplicate key, too deep, not an object) raises `error`."""
    blob = _read_capped(path, what, error)
    obj = parse_json_bytes(blob, path, what, error)
    if not isinstance(obj, dict):
        raise error(f"{what} must be a JSON object", path=path)
    return obj


def read_text(path: Path, what: str, error: type[Exception] = CheckpointError) -> str:
    """An untrusted UTF-8 text file of at most MAX_JSON_BYTES (a scheme's TOML); defects raise `error`."""
    try:
        return _read_capped(path, what, error).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what}: not UTF-8: {e}", path=path) from None


def _read_capped(path: Path, what: str, error: type[Exception]) -> bytes:
    """The bytes of a regular file of at most MAX_JSON_BYTES (never more read); defects raise `error`."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise error(f"{what} not found", path=path) from None
    except CheckpointError as e:  # not a regular file
        raise error(f"{e.message} ({what})", path=e.path, tensor=e.tensor) from None
    except OSError as e:  # kept as the cause: a reader may tell "cannot read" from "malformed"
        raise error(f"cannot read {what}: {e.strerror or e}", path=path) from e
    try:  # read what is there, in chunks: f.read(cap) would allocate the whole cap up front
        chunks, total = [], 0
        if os.fstat(fd).st_size > MAX_JSON_BYTES:
            total = MAX_JSON_BYTES + 1
        while total <= MAX_JSON_BYTES and (chunk := os.read(fd, min(1 << 20, MAX_JSON_BYTES + 1 - total))):
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", path=path) from e
    finally:
        os.close(fd)
    if total > MAX_JSON_BYTES:
        raise error(f"{what} larger than {MAX_JSON_BYTES} bytes", path=path)
    return b"".join(chunks)


def write_json_atomic(path: Path, obj) -> None:
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def write_index(path: Path, weight_map: dict[str, str], total_size: int, metadata: dict | None = None) -> None:
    """The index as every command of ours writes it: `metadata` (a source's, kept), total_size (the
    tensors' bytes, exactly) and PRODUCER, then the weight map. A source's `total_parameters`
    (transformers' save_pretrained: the model's parameter count) is dropped: it counted the
    source's tensors, not these (a stripped draft, packed codes)."""
    kept = {k: v for k, v in (metadata or {}).items() if k != "total_parameters"}
    meta = {**kept, "total_size": total_size, "producer": PRODUCER}
    write_json_atomic(path, {"metadata": meta, "weight_map": weight_map})


@dataclass
class Checkpoint:
    """A local checkpoint directory, its weight map validated against the shard headers."""

    root: Path
    weight_map: dict[str, str]   # tensor -> shard file name
    shards: list[str]            # in index order of first appearance (an unlisted DRAFT_FILE last)
    metadata: dict
    unlisted: tuple[str, ...] = ()  # weight files read though the index omits them (DRAFT_FILE)

    @classmethod
    def open(cls, root: str | Path) -> "Checkpoint":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError("not a checkpoint directory", path=root)
        index = root / INDEX_NAME
        if index.exists():
            obj = read_json(index, "index")
            wm = obj.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError("'weight_map' must be a non-empty object", path=index)
            checked: set[str] = set()
            for name, fname in wm.items():
                if not isinstance(fname, str):
                    raise CheckpointError(f"tensor {_short(name, 200)} maps to non-string {_short(fname)}",
                                          path=index, tensor=name)
                if fname not in checked:  # once per shard, not per tensor (55k tensors, 100s of shards)
                    safe_child(root, fname, f"shard (for tensor {_short(name, 200)})", name)
                    checked.add(fname)
            shards = list(dict.fromkeys(wm.values()))
            meta = obj.get("metadata")
            if meta is None:
                meta = {}
            if not isinstance(meta, dict):
                raise CheckpointError(f"'metadata' must be an object, got {_short(meta)}", path=index)
        elif (root / SINGLE_NAME).exists() or (root / SINGLE_NAME).is_symlink():
            h = read_header(safe_child(root, SINGLE_NAME, "shard"))
            wm = {n: SINGLE_NAME for n in h.tensors}
            shards, meta = [SINGLE_NAME], {}
        else:
            raise CheckpointError(f"neither {INDEX_NAME} nor {SINGLE_NAME} found", path=root)
        for s in shards:
            if not (root / s).is_file():
                what = "is not a regular file" if (root / s).exists() else "does not exist"
                raise CheckpointError(f"shard named in the index {what}", path=root / s)
        wm, unlisted = dict(wm), unlisted_draft_file(root, shards)
        if unlisted is not None:
            add_unlisted(root, unlisted, read_header(safe_child(root, unlisted, "shard")).tensors, wm)
            shards.append(unlisted)
        return cls(root, wm, shards, meta, () if unlisted is None else (unlisted,))

    def header(self, shard: str, max_tensors: int | None = None) -> Header:
        return read_header(safe_child(self.root, shard, "shard"), max_tensors)

    def headers(self, max_tensors: int | None = None) -> dict[str, Header]:
        """Every shard's header, cross-checked against the index (each tensor exactly once). With
        `max_tensors` (model.layout.max_tensors of the config), an index or shards holding more are
        refused before their entries are built: the work stays bounded by what the config allows."""
        if max_tensors is not None:
            check_count(len(self.weight_map), max_tensors, self.root / INDEX_NAME, "the index lists")
        out: dict[str, Header] = {}
        room = max_tensors
        for s in self.shards:
            out[s] = self.header(s, room)
            room = None if room is None else room - len(out[s].tensors)
        for s, h in out.items():
            for name in h.tensors:
                owner = self.weight_map.get(name)
                if owner is None:
                    raise CheckpointError(f"tensor {name!r} is not in the index", path=self.root / s, tensor=name)
                if owner != s:
                    raise CheckpointError(f"tensor {name!r} is indexed under {owner}", path=self.root / s, tensor=name)
        for name, s in self.weight_map.items():
            if name not in out[s].tensors:
                raise CheckpointError(f"index lists tensor {name!r}, the shard lacks it", path=self.root / s,
                                      tensor=name)
        return out

    def other_files(self) -> list[Path]:
        """Non-weight files to carry over unchanged (tokenizer, chat template, configs...): the
        top-level files (subdirectories, such as the `original/` some repos carry, are another
        form of the model and are not copied). Anything there that is neither a regular file nor
        a directory (a FIFO, a device) is refused, naming it: it would be dropped silently."""
        skip = {INDEX_NAME, CONFIG_NAME, HF_QUANT_CONFIG, CHECKSUMS}
        out = []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") or p.name in skip or p.name.endswith((".safetensors", ".partial")):
                continue
            if p.is_file():
                safe_child(self.root, p.name)
                out.append(p)
            elif not p.is_dir():
                raise CheckpointError("not a regular file (a FIFO, socket or device? a checkpoint's files are "
                                      "regular files)", path=p)
        return out


def unlisted_draft_file(root: Path, listed) -> str | None:
    """DRAFT_FILE when it lies beside the listed weight files (the index's, or the one
    model.safetensors) without being one of them, else None."""
    p = root / DRAFT_FILE
    return DRAFT_FILE if DRAFT_FILE not in listed and (p.exists() or p.is_symlink()) else None


def add_unlisted(root: Path, name: str, tensors, weight_map: dict[str, str]) -> None:
    """The tensors of the unlisted weight file `name` into `weight_map`; one the index already
    places elsewhere is an error naming both files."""
    for t in tensors:
        if t in weight_map:
            raise CheckpointError(f"tensor {t!r} is in {name} (which the index does not list) and, by the index, "
                                  f"in {weight_map[t]}: it must appear exactly once", path=root / name, tensor=t)
        weight_map[t] = name


def copy_file_atomic(src: Path, dst: Path) -> None:
    fd = open_regular(src)
    with os.fdopen(fd, "rb") as fi, atomic_file(dst) as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


_NUMBERED = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


def numbered(name: str) -> bool:
    """A shard named as `shard_name` names them (its "-of-N" counts the numbered shards)."""
    return _NUMBERED.fullmatch(name) is not None
