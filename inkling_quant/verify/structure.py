"""Structure checks: the input directories, the index and every shard's header (`Files`) and the
--against source (`Source`). The layout check (the exact tensor set) is experts.py's."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..errors import InklingQuantError, short_repr
from ..io.checkpoint import (CONFIG_NAME, CONVERSION_KEY, HF_QUANT_CONFIG, INDEX_NAME, MERGE_RECORD_KEY, PRODUCER,
                             RESUME_MANIFEST, SINGLE_NAME, Checkpoint, add_unlisted, read_json, safe_child, unlisted_draft_file)
from ..io.safetensors import Header, check_count, read_header
from ..model.layout import Layout, detect, max_tensors, model_config, oriented
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
# The most tensors verify lists when config.json cannot say (model.layout.max_tensors): ~3x the
# published Inkling 2 Small config's bound, ~10x what a 1 TB checkpoint holds (~100k).
UNCONFIGURED_MAX_TENSORS = 1 << 20


def tensor_bound(root: Path) -> int:
    """model.layout.max_tensors of config.json, read here before the index and the headers are (the
    config check reads it again and reports its defects); UNCONFIGURED_MAX_TENSORS without one."""
    try:
        path = safe_child(root, CONFIG_NAME)
        return max_tensors(model_config(read_json(path, CONFIG_NAME), str(path)))
    except Exception:  # noqa: BLE001 - any defect: the config check reports it
        return UNCONFIGURED_MAX_TENSORS


def check_index(run: Recorder, root: Path, bound: int = UNCONFIGURED_MAX_TENSORS) -> Files:
    """The `index` check (and a `header[F]` check per shard): every shard and every tensor
    exactly once, no stray shard, no unfinished conversion; an index or headers holding more than
    `bound` tensors (tensor_bound) refused before their entries are built."""
    c = run.new("index", "structure", "the index covers every shard and every tensor exactly once")
    weight_map: dict[str, str] = {}
    headers: dict[str, Header] = {}
    tensors: dict[str, Located] = {}
    meta, indexed = run.guard(c, _index_body, run, c, root, weight_map, headers, tensors, bound) or (None, 0)
    return Files(weight_map, headers, tensors, index_ok=c.status == PASS, index_metadata=meta, indexed_bytes=indexed)


def _index_body(run: Recorder, c: Check, root: Path, weight_map: dict, headers: dict, tensors: dict,
                room: int) -> tuple[dict, int] | None:
    """Fills weight_map, headers and tensors (as far as they can be read). Returns the index's
    metadata and the bytes of the tensors it lists (None: no usable index)."""
    if (root / CONVERT_MANIFEST).exists():
        c.fail(root / CONVERT_MANIFEST, None, "a conversion into this directory is unfinished "
               "(resume manifest present): run `inkling-quant convert --resume`")
    index = root / INDEX_NAME
    if index.exists():
        obj = _read_index(c, root, index, weight_map, room)
        if obj is None:
            return None
        meta = _metadata(c, index, obj)
    elif (root / SINGLE_NAME).exists():
        _single_file(run, c, root, weight_map, headers, tensors, room)
        return None
    else:
        c.fail(root, None, f"neither {INDEX_NAME} nor {SINGLE_NAME} found")
        return None
    shards = list(dict.fromkeys(weight_map.values()))
    if (unlisted := unlisted_draft_file(root, shards)) is not None:
        _add_unlisted(c, root, unlisted, weight_map, room)
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
    _cross_check(run, c, root, present, weight_map, headers, tensors, room)
    data = sum(e.entry.nbytes for e in tensors.values())
    c.figures.update(shards=len(shards), tensors=len(weight_map), tensor_bytes=data)
    return meta, data - sum(e.entry.nbytes for e in tensors.values() if e.shard == unlisted)


def _single_file(run: Recorder, c: Check, root: Path, weight_map: dict, headers: dict, tensors: dict,
                 room: int) -> None:
    """A checkpoint without an index: its one model.safetensors (and a draft's mtp.safetensors
    beside it, io.checkpoint.DRAFT_FILE), no other shard."""
    unlisted = unlisted_draft_file(root, [SINGLE_NAME])
    for p in sorted(root.glob("*.safetensors")):
        if p.name not in (SINGLE_NAME, unlisted):
            c.fail(p, None, f"shard beside {SINGLE_NAME} without an index")
    for s in (SINGLE_NAME, unlisted) if unlisted else (SINGLE_NAME,):
        h = _header(run, root, s, room - len(tensors))
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


def _add_unlisted(c: Check, root: Path, name: str, weight_map: dict, room: int) -> None:
    """The tensors of a weight file the index omits (mtp.safetensors: io.checkpoint.DRAFT_FILE),
    read all the same, into `weight_map`; a malformed header is its header check's to report."""
    c.figures["unlisted_weight_files"] = [name]
    try:
        names = read_header(safe_child(root, name, "shard"), max(room - len(weight_map), 0)).tensors
    except InklingQuantError:
        return
    try:
        add_unlisted(root, name, names, weight_map)
    except InklingQuantError as e:
        c.fail(e.path or root / name, e.tensor, e.message)


def _read_index(c: Check, root: Path, index: Path, weight_map: dict, room: int) -> dict | None:
    """The index's weight map into `weight_map` (safe shard names only); returns the index's
    object, None if it is unusable (or lists more than `room` tensors)."""
    obj = load_json(index, "index", c)
    if obj is None:
        return None
    wm = obj.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        c.fail(index, None, "'weight_map' must be a non-empty object")
        return None
    try:
        check_count(len(wm), room, index, "the index lists")
    except InklingQuantError as e:
        c.fail(index, None, e.message)
        return None
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
    return obj


def _metadata(c: Check, index: Path, obj: dict) -> dict | None:
    """The index's `metadata` ({} when it has none), which transformers' from_pretrained reads as an
    object (5.25, utils/hub.py `get_checkpoint_shard_files`: KeyError without one, TypeError on
    null or a list): one that is not an object fails (None); none at all is a note (vLLM and
    SGLang read only the weight map)."""
    if "metadata" not in obj:
        c.note("no 'metadata' object: transformers' from_pretrained cannot load this index (vLLM and SGLang "
               "read only its weight_map)")
        return {}
    meta = obj["metadata"]
    if not isinstance(meta, dict):
        got = "null" if meta is None else short_repr(meta)
        c.fail(index, None, f"'metadata' must be an object, got {got} (transformers' from_pretrained fails on it)")
        return None
    return meta


def check_total_size(run: Recorder, files: Files, conf: Conf) -> None:
    """Part of the `index` check, once the configs are read: metadata.total_size against the bytes
    of the tensors the index lists. huggingface_hub writes the bytes of each tensor's storage (a
    view's whole storage) and nothing reads the figure (transformers 5.25 loads an index whose
    figure is wrong), so another writer's figure that differs is a note; every index of ours
    records the exact sum (io.checkpoint.write_index), so in one of ours it must be exact."""
    meta = files.index_metadata
    if meta is None:
        return
    c, data = run.report.check("index"), files.indexed_bytes
    total = meta.get("total_size")
    # an index that omits mtp.safetensors (read all the same) may count its bytes or not
    exact = type(total) is int and total in (data, sum(t.entry.nbytes for t in files.tensors.values()))
    shown = total if total is None or type(total) is int else short_repr(total)  # a hostile value: megabytes
    c.figures.update(index_total_size=shown, index_total_size_matches=exact)
    if exact:
        return
    said = (f"metadata.total_size {short_repr(total)} does not match the {data} bytes of the tensors it lists"
            if "total_size" in meta else f"no metadata.total_size (the tensors it lists hold {data} bytes)")
    who = _ours(meta, conf)
    if who:
        c.fail(conf.root / INDEX_NAME, None, f"{said}: inkling-quant wrote this index ({who}) with the exact "
               f"sum; it was changed since")
    else:
        c.note(f"{INDEX_NAME}: {said} (informational: huggingface_hub writes each tensor's whole storage, "
               f"transformers does not read it)")


def _ours(meta: dict, conf: Conf) -> str | None:
    """What says inkling-quant wrote the checkpoint: the index's metadata (the producer, or a
    conversion's record) or hf_quant_config.json (the producer, or the converter entry); None: nothing."""
    hq = conf.hf_quant if isinstance(conf.hf_quant, dict) else {}
    records = {"metadata.producer": meta.get("producer"), f"{HF_QUANT_CONFIG}'s producer": hq.get("producer"),
               f"{HF_QUANT_CONFIG}'s converter": hq.get("converter")}
    who = next((k for k, r in records.items() if isinstance(r, dict) and r.get("name") == PRODUCER["name"]), None)
    return who or (f"metadata.{CONVERSION_KEY}" if CONVERSION_KEY in meta else None)


def _cross_check(run: Recorder, c: Check, root: Path, present: list[str], weight_map: dict, headers: dict,
                 tensors: dict, room: int) -> None:
    """Every present shard's header, and the index against them: each tensor exactly once; the
    headers together hold at most `room` tensors."""
    owner: dict[str, str] = {}
    held = 0
    for s in present:
        h = _header(run, root, s, room - held)
        if h is None:
            continue
        headers[s] = h
        held += len(h.tensors)
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


def _header(run: Recorder, root: Path, shard: str, room: int) -> Header | None:
    hc = run.new(f"header[{shard}]", "structure", f"{shard}: safetensors header well-formed")
    h = run.guard(hc, read_header, safe_child(root, shard, "shard"), max(room, 0))
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
        lay = replace(lay, source=source_quant(src_cfg or {}, str(root / "config.json"), list(tensors)))
    except InklingQuantError as e:
        c.error(e.path or root, f"source: {e.message}")
        return None
    c.figures["layout"] = lay.describe()
    return oriented(lay, {n: tuple(w.entry.shape) for n, w in tensors.items()}, conf.cfg)


def _open_source(c: Check, root: Path) -> tuple[dict[str, Header], dict[str, Located]] | None:
    try:
        hs = Checkpoint.open(root).headers(tensor_bound(root))
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
        nested = conf.cfg is not None and conf.cfg.family.modelopt_aliases  # Kimi-K3's form drops the text_config one
        for k, a, b in _differences(_unquantized(conf.config, nested), _unquantized(src_cfg, nested)):
            c.fail(conf.root / "config.json", None, f"key {k!r} differs from the source's config.json "
                   f"({short_repr(a, 60)} vs {short_repr(b, 60)})")
    c.figures.update(shards=n_shards, tensors=n_tensors)
    return src_cfg


def _unquantized(config: dict, nested: bool) -> dict:
    """A config.json object without what a conversion rewrites: its quantization_config, and with
    `nested` text_config's (Kimi-K3's source keeps it there; its ModelOpt form removes it); and
    without `lora merge`'s record of the adapters merged (`lora_merged`), which a merge writes on
    purpose: a checkpoint merged by us and one merged by PEFT hold the same model."""
    out = {k: v for k, v in config.items() if k not in ("quantization_config", MERGE_RECORD_KEY)}
    if nested and isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


def _differences(mine, theirs, key: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, mine, theirs) of every leaf where two config objects differ (`text_config.rms_norm_eps`),
    so that a message names the key, not a nested object cut short."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(mine) | set(theirs), key=str)
                for d in _differences(mine.get(k), theirs.get(k), f"{key}.{k}" if key else str(k))]
    return [] if mine == theirs else [(key, mine, theirs)]
