"""DSpark draft: extract the bundled speculator as a checkpoint of its own, or strip it off.

  inkling-quant draft extract SRC OUT   OUT = the drafter: config.json, its tensors in shards,
                                        index, checksums
  inkling-quant draft strip SRC OUT     OUT = the target without `mtp.*` tensors (its
                                        `mtp.safetensors`) and without `dspark_config`; shards
                                        without draft tensors hardlinked

The draft is bundled with an Inkling 2 checkpoint as inkling_quant.model.dspark spells it: named as
vLLM's DSpark drafter names it, under `mtp.`, in `mtp.safetensors` (found whether or not the index
lists it), its speculators-format config under `dspark_config`; extract writes that config and the
names without `mtp.`. Both work on a BF16
source and on a converted checkpoint (the converter passes the draft through unchanged). Bytes
are copied, never re-encoded: one tensor at a time through one reused buffer. OUT is built in
OUT.partial and renamed into place when complete. docs/draft.md has the layout and the reasons
for each choice.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from .model import dspark
from .errors import CheckpointError, ConfigError, UnknownTensorError, UsageError
from .formats import FORMATS
from .io.checkpoint import (HF_QUANT_CONFIG, INDEX_NAME, Checkpoint, numbered, read_json, safe_child, shard_name,
                            write_index, write_json_atomic)
from .io.derive import carry_checksums, copy_other_files, rewrite_shard, source_checksums
from .io.output import CHECKSUMS, link_or_copy, staged_output, write_checksums
from .io.safetensors import DTYPE_NAMES, ShardWriter, TensorBuffer, TensorEntry, sha256_file
from .io.shards import ShardReaders, plan_shards
from .model.inkling2 import TEXT_PREFIX, Inkling2Config, transformers_name
from .model.layout import max_tensors
from .model.tensors import TensorSpec

QUANT_CONFIG = HF_QUANT_CONFIG
STRIPPED_KEY = "dspark_stripped"          # the note strip leaves in config.json
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9       # HF's default "5GB": the reference draft fits one shard
_FLOAT_DTYPES = FORMATS["passthrough"].source_dtypes  # the draft is passed through, never quantized


# --------------------------------------------------------------------------- source
class Source(SimpleNamespace):
    """A validated source checkpoint: ckpt, headers, config (dict), cfg (Inkling2Config), and
    draft = [(shard, TensorEntry)] of its `mtp.*` tensors in file order."""


def open_source(src: str | Path) -> Source:
    """Open SRC, validate every shard header against the index and the draft against
    dspark_config; raise a clear error when there is no draft to work on."""
    ckpt = Checkpoint.open(src)
    config_path = safe_child(ckpt.root, "config.json")
    config = read_json(config_path, "config.json")
    cfg = Inkling2Config.from_dict(config, str(config_path))
    headers = ckpt.headers(max_tensors(cfg))  # the config's bound, before any header's entries are built
    draft = [(s, e) for s in ckpt.shards for e in headers[s].tensors.values() if dspark.is_draft(e.name)]
    if cfg.draft is None:
        if draft:
            raise ConfigError(f"missing key 'dspark_config', but the checkpoint has {len(draft)} {dspark.PREFIX}* "
                              f"tensors (e.g. {draft[0][1].name!r} in {draft[0][0]})", path=config_path)
        why = (f"`draft strip` removed it (config.json's {STRIPPED_KEY!r} records that)" if STRIPPED_KEY in config
               else "this checkpoint never held one (transformers' save_pretrained writes none; the release ships "
                    "its draft in mtp.safetensors)")
        raise CheckpointError(f"no DSpark draft: config.json has no 'dspark_config' and no tensor name starts with "
                              f"{dspark.PREFIX!r}: {why}", path=ckpt.root)
    if not draft:
        raise CheckpointError(f"no DSpark draft tensors: config.json has a 'dspark_config' "
                              f"but no tensor name starts with {dspark.PREFIX!r}", path=ckpt.root)
    _check_draft(ckpt.root, {s.name: s for s in dspark.draft_tensors(cfg.draft, dspark.PREFIX)}, draft,
                 f"transformer_layer_config.num_hidden_layers={cfg.draft.num_hidden_layers}")
    return Source(ckpt=ckpt, headers=headers, config=config, cfg=cfg, draft=draft)


def _check_draft(root: Path, expected: dict[str, TensorSpec], draft: list[tuple[str, TensorEntry]],
                 depth: str) -> None:
    """Every draft tensor is one dspark_config implies, with its shape, unquantized; none missing."""
    for shard, e in draft:
        path, where = root / shard, f"tensor {e.name!r}"
        try:
            dspark.classify(e.name)
        except UnknownTensorError as err:
            raise UnknownTensorError(f"{err} (the draft is never quantized)", path=path, tensor=err.tensor) from None
        spec = expected.get(e.name)
        if spec is None:
            raise UnknownTensorError(f"{where} does not exist in a draft with this dspark_config "
                                     f"({depth})", path=path, tensor=e.name)
        if tuple(e.shape) != spec.shape:
            raise CheckpointError(f"{where}: shape {list(e.shape)}, dspark_config implies {list(spec.shape)}",
                                  path=path, tensor=e.name)
        if e.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{where}: dtype {DTYPE_NAMES[e.dtype]} is not a float type "
                                  f"(a quantized draft? the draft is never quantized)", path=path, tensor=e.name)
    missing = sorted(set(expected) - {e.name for _, e in draft})
    if missing:
        raise CheckpointError(f"draft incomplete: {len(missing)} tensor(s) of dspark_config missing, "
                              f"e.g. {missing[0]!r}", path=root)


def shared_tensor_names() -> dict[str, str]:
    """The target tensors the drafter uses but does not own, by role: vLLM shares them
    (VL/v1/worker/gpu/spec_decode/dspark/utils.py:133-149; docs/draft.md)."""
    return {"embed_tokens": TEXT_PREFIX + "embed.weight", "lm_head": TEXT_PREFIX + "unembed.weight"}


def draft_specs(dc: dict, source: str = "draft config.json") -> list[TensorSpec]:
    """The tensors an extracted draft's config.json (a speculators-format config) implies."""
    return list(dspark.draft_tensors(dspark.DSparkConfig.from_dict(dc, source)))


# --------------------------------------------------------------------------- extract
def _check_draft_shards(source: Source) -> None:
    """The shards holding the draft still match the source's checksums.sha256 (where it has one):
    a corrupt draft is refused, not extracted and blessed with fresh checksums."""
    sums = source_checksums(source.ckpt.root)
    for shard in dict.fromkeys(s for s, _ in source.draft):
        if sums is not None and shard in sums and sha256_file(source.ckpt.root / shard) != sums[shard]:
            raise CheckpointError(f"does not match {CHECKSUMS}: the shard is corrupt", path=source.ckpt.root / shard)


def extract(src: str | Path, out: str | Path, *, overwrite: bool = False, progress: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write the bundled DSpark drafter of SRC to OUT as a standalone checkpoint."""
    if max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    source = open_source(src)
    root, headers = source.ckpt.root, source.headers
    shared = []
    for name in shared_tensor_names().values():  # under the checkpoint's naming: original, or transformers'
        found = next((n for n in (name, transformers_name(name)) if n in source.ckpt.weight_map), None)
        if found is None:
            raise CheckpointError(f"the drafter shares the target's {name!r} ({transformers_name(name)!r} under "
                                  f"transformers' names), which the checkpoint lacks", path=root)
        shared.append(found)
    _check_draft_shards(source)
    # vLLM's speculators config, verbatim; the names without the bundle's prefix
    dconf = source.config[dspark.CONFIG_KEY]

    def rename(name: str) -> str:
        return name[len(dspark.PREFIX):]

    plan = plan_shards(source.draft, max_shard_bytes, size=lambda item: item[1].nbytes)
    total = sum(e.nbytes for _, e in source.draft)

    weight_map: dict[str, str] = {}
    sums: dict[str, str] = {}
    buf = TensorBuffer()
    buf.view(max(e.nbytes for _, e in source.draft))  # sized once: growing it would hold two at a time
    with staged_output(out, [root], overwrite) as tmp, ShardReaders(root, headers) as readers, \
            tqdm(total=total, unit="B", unit_scale=True, desc="draft extract", disable=not progress) as bar:
        for i, group in enumerate(plan):
            name = shard_name(i, len(plan))
            specs = [(rename(e.name), e.dtype, e.shape) for _, e in group]
            with ShardWriter(tmp / name, specs, {"format": "pt"}, direct=True) as w:
                for shard, e in group:
                    w.write(rename(e.name), readers.get(shard).get(e.name, buf))
                    weight_map[rename(e.name)] = name
                    bar.update(e.nbytes)
                sums[name] = w.commit()
        write_json_atomic(tmp / "config.json", dconf)
        write_index(tmp / INDEX_NAME, weight_map, total)
        write_checksums(tmp / CHECKSUMS, sums)
    return {"action": "extract", "source": str(src), "output": str(out), "tensors": len(weight_map),
            "bytes": total, "shards": len(plan), "shared_by_reference": shared}


# --------------------------------------------------------------------------- strip
def stripped_config(config: dict, source: Source) -> dict:
    """config.json without dspark_config; in its place a note that keeps it for a re-merge."""
    note = {"note": "DSpark draft removed by `inkling-quant draft strip`; serve it from a checkpoint made "
                    "by `inkling-quant draft extract` (docs/draft.md)",
            "tensors": len(source.draft), "bytes": sum(e.nbytes for _, e in source.draft),
            "dspark_config": config["dspark_config"]}
    return {(STRIPPED_KEY if k == "dspark_config" else k): (note if k == "dspark_config" else v)
            for k, v in config.items()}


def _plan_strip(source: Source) -> tuple[list[tuple[str, str]], dict[str, str], int]:
    """Per source shard: link (no draft tensor), rewrite (some) or drop (only draft tensors: the
    release's `mtp.safetensors`). Returns the kept (shard, action) pairs, their output names and
    the number dropped. Files keep their names, except that when a numbered shard
    (model-0000k-of-0000N) of an indexed checkpoint goes, the numbered ones left are renumbered
    so "-of-N" stays true."""
    headers = source.headers
    actions = []
    for s in source.ckpt.shards:
        n_draft = sum(dspark.is_draft(n) for n in headers[s].tensors)
        kind = "link" if n_draft == 0 else ("drop" if n_draft == len(headers[s].tensors) else "rewrite")
        actions.append((s, kind))
    kept = [(s, k) for s, k in actions if k != "drop"]
    if not kept:
        raise CheckpointError("every shard holds only draft tensors: nothing would be left", path=source.ckpt.root)
    renumber = (source.ckpt.root / INDEX_NAME).exists() and any(k == "drop" and numbered(s) for s, k in actions)
    left = [s for s, _ in kept if numbered(s)] if renumber else []
    out_names = {s: s for s, _ in kept} | {s: shard_name(i, len(left)) for i, s in enumerate(left)}
    return kept, out_names, len(actions) - len(kept)


def strip(src: str | Path, out: str | Path, *, overwrite: bool = False, progress: bool = False,
          copy: bool = False) -> dict:
    """Write SRC without its DSpark draft to OUT."""
    source = open_source(src)
    ckpt, headers = source.ckpt, source.headers
    root = ckpt.root
    sums_in = source_checksums(root)
    kept, out_names, dropped = _plan_strip(source)
    indexed = (root / INDEX_NAME).exists()
    total = sum(e.nbytes for s, _ in kept for e in headers[s].tensors.values() if not dspark.is_draft(e.name))
    bar_total = sum(headers[s].file_size if k == "link" else
                    sum(e.nbytes for e in headers[s].tensors.values() if not dspark.is_draft(e.name)) for s, k in kept)

    weight_map: dict[str, str] = {}
    sums: dict[str, str] = {}
    counts = {"linked": 0, "copied": 0, "rewritten": 0, "dropped": dropped}
    buf = TensorBuffer()
    buf.view(max([e.nbytes for s, k in kept if k == "rewrite" for e in headers[s].tensors.values()
                  if not dspark.is_draft(e.name) or (sums_in is not None and s in sums_in)], default=0))
    with staged_output(out, [root], overwrite) as tmp, ShardReaders(root, headers) as readers, \
            tqdm(total=bar_total, unit="B", unit_scale=True, desc="draft strip", disable=not progress) as bar:
        for s, kind in kept:
            name = out_names[s]
            expected = sums_in.get(s) if sums_in is not None else None
            if kind == "link":
                digest, how = link_or_copy(root / s, tmp / name, copy, expected, sums_in is not None, bar)
                counts[how] += 1
            else:
                digest = rewrite_shard(readers.get(s), tmp / name, drop=dspark.is_draft, expected=expected, buf=buf,
                                       bar=bar)
                counts["rewritten"] += 1
            if digest is not None:
                sums[name] = digest
            for e in headers[s].tensors.values():
                if not dspark.is_draft(e.name):
                    weight_map[e.name] = name
        if indexed:
            write_index(tmp / INDEX_NAME, weight_map, total, ckpt.metadata)
        write_json_atomic(tmp / "config.json", stripped_config(source.config, source))
        copy_other_files(ckpt, tmp, also=[QUANT_CONFIG])
        if sums_in is not None:
            # every shard of OUT, and every other file the source listed that OUT still has
            carry_checksums(sums_in, tmp, sums, also=sums)
    return {"action": "strip", "source": str(src), "output": str(out), "tensors_removed": len(source.draft),
            "bytes_removed": sum(e.nbytes for _, e in source.draft), "shards": len(kept), **counts,
            "checksums": sums_in is not None}


# --------------------------------------------------------------------------- CLI
