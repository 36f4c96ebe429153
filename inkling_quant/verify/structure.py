"""Structure checks: the input directories, the index and every shard's header (`Files`) and the
--against source (`Source`). The layout check (the exact tensor set) is experts.py's."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..errors import InklingQuantError, short_repr
from ..io.checkpoint import (INDEX_NAME, RESUME_MANIFEST, SINGLE_NAME, Checkpoint, add_unlisted, safe_child,
                             unlisted_draft_file)
from ..io.safetensors import Header, read_header
from ..model.layout import Layout, detect, oriented
from ..model.sources import source_quant
from .inventory import Conf, Files, Located, Source, load_json
from .report import PASS, Check, Recorder

CONVERT_MANIFEST = RESUME_MANIFEST


# ============================================================================ input
def check_input(run: Recorder, root: Path, src_root: Path | None) -> tuple[bool, Path | None]:
    """(the checkpoint can be read, the source to use). An unreadable source only drops the
    --against checks (the report still ends in exit 2)."""
    c = run.new("input", "input", "the checkpoint (and source) directories can be read")
    ok = True
    for what, p in (("checkpoint", root), ("source", src_root)):
        if p is None:
            continue
        problem = ("directory does not exist" if not p.exists() else "is not a directory" if not p.is_dir()
                   else "directory is not readable" if not os.access(p, os.R_OK | os.X_OK) else None)
        if problem:
            c.error(str(p), f"{what} {problem}")
            if what == "checkpoint":
                ok = False
            else:
                src_root = None
    return ok, src_root


# ============================================================================ index + headers
def check_index(run: Recorder, root: Path) -> Files:
    """The `index` check (and a `header[F]` check per shard): every shard and every tensor
    exactly once, no stray shard, no unfinished conversion."""
    c = run.new("index", "structure", "the index covers every shard and every tensor exactly once")
    weight_map: dict[str, str] = {}
    headers: dict[str, Header] = {}
    tensors: dict[str, Located] = {}
    run.guard(c, _index_body, run, c, root, weight_map, headers, tensors)
    return Files(weight_map, headers, tensors, index_ok=c.status == PASS)


def _index_body(run: Recorder, c: Check, root: Path, weight_map: dict, headers: dict, tensors: dict) -> None:
    """Fills weight_map, headers and tensors (as far as they can be read)."""
    if (root / CONVERT_MANIFEST).exists():
        c.fail(root / CONVERT_MANIFEST, None, "a conversion into this directory is unfinished "
               "(resume manifest present): run `inkling-quant convert --resume`")
    index = root / INDEX_NAME
    if index.exists():
        if not _read_index(c, root, index, weight_map):
            return
    elif (root / SINGLE_NAME).exists():
        _single_file(run, c, root, weight_map, headers, tensors)
        return
    else:
        c.fail(root, None, f"neither {INDEX_NAME} nor {SINGLE_NAME} found")
        return
    shards = list(dict.fromkeys(weight_map.values()))
    if (unlisted := unlisted_draft_file(root, shards)) is not None:
        _add_unlisted(c, root, unlisted, weight_map)
        shards.append(unlisted)
    present = []
    for s in shards:
        if not (root / s).is_file():
            bad = [n for n, f in weight_map.items() if f == s]
            c.fail(index, bad[0], f"shard {s} named in the index does not exist "
                   f"({len(bad)} tensor(s) point to it)")
        else:
            present.append(s)
    for p in sorted(root.glob("*.safetensors")):
        if p.name not in shards:
            c.fail(p, None, "shard is not referenced by the index (a stray or renamed file)")
    _cross_check(run, c, root, present, weight_map, headers, tensors)
    data = sum(e.entry.nbytes for e in tensors.values())
    c.figures.update(shards=len(shards), tensors=len(weight_map), tensor_bytes=data)
    if c.figures.get("index_total_size") is not None:  # informational: HF does not enforce it
        c.figures["index_total_size_matches"] = c.figures["index_total_size"] == data


def _single_file(run: Recorder, c: Check, root: Path, weight_map: dict, headers: dict, tensors: dict) -> None:
    """A checkpoint without an index: its one model.safetensors (and a draft's mtp.safetensors
    beside it, io.checkpoint.DRAFT_FILE), no other shard."""
    unlisted = unlisted_draft_file(root, [SINGLE_NAME])
    for p in sorted(root.glob("*.safetensors")):
        if p.name not in (SINGLE_NAME, unlisted):
            c.fail(p, None, f"shard beside {SINGLE_NAME} without an index")
    for s in (SINGLE_NAME, unlisted) if unlisted else (SINGLE_NAME,):
        h = _header(run, root, s)
        if h is None:
            continue
        headers[s] = h
        for n, e in h.tensors.items():
            if n in weight_map:
                c.fail(root / s, n, f"tensor also stored in {weight_map[n]} (must appear exactly once)")
                continue
            weight_map[n] = s
            tensors[n] = Located(s, e)
    if unlisted:
        c.figures["unlisted_weight_files"] = [unlisted]


def _add_unlisted(c: Check, root: Path, name: str, weight_map: dict) -> None:
    """The tensors of a weight file the index omits (mtp.safetensors: io.checkpoint.DRAFT_FILE),
    read all the same, into `weight_map`; a malformed header is its header check's to report."""
    c.figures["unlisted_weight_files"] = [name]
    try:
        names = read_header(safe_child(root, name, "shard")).tensors
    except InklingQuantError:
        return
    try:
        add_unlisted(root, name, names, weight_map)
    except InklingQuantError as e:
        c.fail(e.path or root / name, e.tensor, e.message)


def _read_index(c: Check, root: Path, index: Path, weight_map: dict) -> bool:
    """The index's weight map into `weight_map` (safe shard names only); False if unusable."""
    obj = load_json(index, "index", c)
    if obj is None:
        return False
    wm = obj.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        c.fail(index, None, "'weight_map' must be a non-empty object")
        return False
    safe: dict[str, bool] = {}
    for name, fname in wm.items():
        if not isinstance(fname, str):
            c.fail(index, name, f"maps to non-string {fname!r}")
            continue
        if fname not in safe:
            try:
                safe_child(root, fname, f"shard (for tensor {name!r})")
                safe[fname] = True
            except InklingQuantError as e:
                safe[fname] = False
                c.fail(index, name, str(e))
                continue
        if not safe[fname]:
            c.fail(index, name, f"maps to the unsafe file name {fname!r}")
            continue
        weight_map[name] = fname
    total = (obj.get("metadata") or {}).get("total_size") if isinstance(obj.get("metadata"), dict) else None
    c.figures["index_total_size"] = total
    return True


def _cross_check(run: Recorder, c: Check, root: Path, present: list[str], weight_map: dict, headers: dict,
                 tensors: dict) -> None:
    """Every present shard's header, and the index against them: each tensor exactly once."""
    owner: dict[str, str] = {}
    for s in present:
        h = _header(run, root, s)
        if h is None:
            continue
        headers[s] = h
        for name, e in h.tensors.items():
            if name in owner:
                c.fail(root / s, name, f"tensor also stored in {owner[name]} (must appear exactly once)")
                continue
            owner[name] = s
            indexed = weight_map.get(name)
            if indexed is None:
                c.fail(root / s, name, "tensor is not in the index")
            elif indexed != s:
                c.fail(root / s, name, f"tensor is indexed under {indexed}")
            tensors[name] = Located(s, e)
    for name, s in weight_map.items():
        if s in headers and name not in headers[s].tensors:
            c.fail(root / s, name, "index lists this tensor, the shard lacks it")


def _header(run: Recorder, root: Path, shard: str) -> Header | None:
    hc = run.new(f"header[{shard}]", "structure", f"{shard}: safetensors header well-formed")
    h = run.guard(hc, read_header, safe_child(root, shard, "shard"))
    if h is not None:
        hc.figures.update(tensors=len(h.tensors), bytes=h.file_size)
    return h


# ============================================================================ source
def check_source(run: Recorder, src_root: Path, conf: Conf) -> Source:
    """The `source` check (--against): the source opens and has the same config.json, and
    its layout is detected (where its experts are, how stored)."""
    c = run.new("source", "numerics", "the source checkpoint opens and has the same config")
    opened = run.guard(c, _open_source, c, src_root)
    headers, tensors = opened if opened is not None else ({}, {})
    layout = None
    if opened is not None:
        src_cfg = run.guard(c, _compare_source_config, c, src_root, conf, len(headers), len(tensors))
        if conf.cfg is not None:
            layout = run.guard(c, _source_layout, c, src_root, conf, tensors, src_cfg)
    return Source(src_root, headers, tensors, ok=c.status == PASS, layout=layout)


def _source_layout(c: Check, root: Path, conf: Conf, tensors: dict[str, Located], src_cfg: dict | None) -> Layout | None:
    """The source's detected layout, a stacked storage's orientation settled, and how it stores
    quantized weights by its own config.json (an FP8 or MXFP4 source: model.sources); None (an
    error in `c`: nothing can be compared) when its tensors fit no layout."""
    try:
        lay = detect(list(tensors), conf.cfg, str(root))
        lay = replace(lay, source=source_quant(src_cfg or {}, str(root / "config.json")))
    except InklingQuantError as e:
        c.error(e.path or root, f"source: {e.message}")
        return None
    c.figures["layout"] = lay.describe()
    return oriented(lay, {n: tuple(w.entry.shape) for n, w in tensors.items()}, conf.cfg)


def _open_source(c: Check, root: Path) -> tuple[dict[str, Header], dict[str, Located]] | None:
    try:
        hs = Checkpoint.open(root).headers()
    except InklingQuantError as e:
        c.error(root, f"source cannot be read: {e}")
        return None
    return hs, {n: Located(s, e) for s, h in hs.items() for n, e in h.tensors.items()}


def _compare_source_config(c: Check, root: Path, conf: Conf, n_shards: int, n_tensors: int) -> None:
    probe = Check("source-config", "numerics", "")
    src_cfg = load_json(root / "config.json", "source config.json", probe)
    if src_cfg is None:
        for p in probe.problems:
            c.error(p.file, p.message)  # the source is an input: unreadable means exit 2
        return
    if conf.config is not None:
        mine = {k: v for k, v in conf.config.items() if k != "quantization_config"}
        theirs = {k: v for k, v in src_cfg.items() if k != "quantization_config"}
        for k, a, b in _differences(mine, theirs):
            c.fail(conf.root / "config.json", None, f"key {k!r} differs from the source's config.json "
                   f"({short_repr(a, 60)} vs {short_repr(b, 60)})")
    c.figures.update(shards=n_shards, tensors=n_tensors)
    return src_cfg


def _differences(mine, theirs, key: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, mine, theirs) of every leaf where two config objects differ (`text_config.rms_norm_eps`),
    so that a message names the key, not a nested object cut short."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(mine) | set(theirs), key=str)
                for d in _differences(mine.get(k), theirs.get(k), f"{key}.{k}" if key else str(k))]
    return [] if mine == theirs else [(key, mine, theirs)]
