"""The official Inkling 2 Small checkpoints as checkpoints: which one a directory holds (read
from its shard headers, or from the quantization its config declares), and the figures SGLang's
cookbook publishes for them beside ours. What each variant stores and how many bytes that is:
`plan.inkling2.VARIANTS` and `release_expert_bytes`; docs/budget.md, "The official checkpoints"."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..units import GB, GiB, cdiv
from .inkling2 import COOKBOOK, RECIPE_DRAFT_GB, VARIANTS, ServingPlan, plan
from .units import in_units

if TYPE_CHECKING:
    from ..model.inkling2 import Inkling2Config
    from .hf import HFModel


def stored_variant(root, cfg: Inkling2Config) -> tuple[str | None, str]:
    """(the official variant, or None; what the checkpoint directory `root` says of its routed
    experts). The format of each layer's experts is read from the shard headers (the stacked
    `w13_weight` under the original names, matched against what each format writes) when the
    directory holds weights, else from the quantization its config declares (config.json's
    `quantization_config` or hf_quant_config.json, as vLLM's ModelOpt loader resolves it for the
    layer's experts module); a variant is the one whose scheme gives every layer that format."""
    from ..io.checkpoint import INDEX_NAME, SINGLE_NAME
    from ..model.tensors import TensorName
    from ..schemes import get_scheme

    root, t = Path(root), cfg.text
    found, where = None, "the shard headers"
    if (root / INDEX_NAME).exists() or (root / SINGLE_NAME).exists():
        found = _header_formats(root, t)
    if found is None:
        found, where = _declared_formats(root, t), "the quantization config"
    if found is None:
        return None, ("neither stacked expert tensors under the original names nor a quantization config naming "
                      "the experts modules: the variant cannot be read from this directory")
    for v in VARIANTS.values():
        scheme = get_scheme(v.scheme)
        if all(scheme.format_name(t, TensorName(f"layers.{i}.mlp.experts", "expert", i)) == f
               for i, f in found.items()):
            return v.name, f"routed experts stored as variant {v.name!r} ({v.repo}) stores them, read from {where}"
    spans: dict[str, list[int]] = {}
    for i, f in found.items():
        spans.setdefault(f, []).append(i)
    held = ", ".join(f"{f} in {len(ls)} layer(s) from {ls[0]}" for f, ls in spans.items())
    return None, f"{where} give routed experts {held}: not an official variant"


def held_draft_bytes(root) -> int | None:
    """The bytes of the DSpark draft tensors (`mtp.*`) a checkpoint directory's shard headers
    list, 0 when it holds none; None when the directory lists no weights (a config alone, or an
    index whose shards are not there yet)."""
    from ..errors import CheckpointError
    from ..io.checkpoint import Checkpoint
    from ..model.dspark import is_draft

    try:
        ck = Checkpoint.open(Path(root))
        headers = ck.headers()
    except CheckpointError:
        return None
    return sum(e.nbytes for h in headers.values() for n, e in h.tensors.items() if is_draft(n))


def _header_formats(root, t) -> dict[int, str] | None:
    """layer -> the format whose stored weight is the layer's stacked `w13_weight` (shape and
    dtype); None when the checkpoint does not hold them so (another naming, expert storage or dtype),
    or its shards are not all there (an index and configs downloaded before the weights)."""
    from ..errors import CheckpointError
    from ..formats import FORMATS
    from ..io.checkpoint import Checkpoint
    from ..model.inkling2 import BF16, experts_module

    try:
        ck = Checkpoint.open(root)
    except CheckpointError:
        return None
    headers, out = {}, {}
    for i in range(t.num_hidden_layers):
        name = f"{experts_module(i)}.w13_weight"
        shard = ck.weight_map.get(name)
        if shard is None:
            return None
        if shard not in headers:
            headers[shard] = ck.header(shard)
        e = headers[shard].tensors[name]
        for f in FORMATS.values():
            o = f.out_specs((2 * t.moe_intermediate_size, t.hidden_size), BF16)["weight"]
            if (t.n_routed_experts, *o.shape) == tuple(e.shape) and o.dtype == e.dtype:
                out[i] = f.name
                break
        else:
            return None  # a dtype or shape no format of ours writes (an fp32 source, say)
    return out


def _declared_formats(root, t) -> dict[int, str] | None:
    """layer -> the format the directory's config.json (or hf_quant_config.json) declares for the
    layer's experts module, as vLLM's ModelOpt loader resolves it; None when it declares none, or
    lists modules per expert only (ModelOpt's per-module form: not an official checkpoint)."""
    from ..errors import ConfigError
    from ..export.modelopt import MIXED_PRECISION, format_of, read_quantization
    from ..io.checkpoint import CONFIG_NAME, read_json, safe_child
    from ..model.inkling2 import experts_module

    q = read_quantization(root, read_json(safe_child(root, CONFIG_NAME), CONFIG_NAME, ConfigError))
    if q is None:
        return None
    found = {i: format_of(q, experts_module(i)) for i in range(t.num_hidden_layers)}
    if q.get("quant_algo") == MIXED_PRECISION and not any(found.values()):
        return None
    return {i: getattr(f, "name", "passthrough") for i, f in found.items()}


def choose_variant(cfg: Inkling2Config | HFModel, path: str | None, variant: str | None,
                   scheme: str | None) -> tuple[str | None, str | None, tuple[str, ...]]:
    """(variant, scheme, notes) to plan for the checkpoint directory `path` with --variant /
    --scheme as given: the variant the directory holds unless --scheme asks for a conversion (a
    --variant that disagrees with it is an error); a directory of experts no official checkpoint
    holds (a BF16 source, say) is planned as `convert --scheme default` would write it."""
    if not cfg.family.strict or path is None or not Path(path).is_dir():
        return variant, scheme, ()
    stored, how = stored_variant(path, cfg)
    if variant is not None and stored is not None and variant != stored:
        raise UsageError(f"--variant {variant} disagrees with the checkpoint ({how})")
    if variant is None and scheme is None:
        if stored is not None:
            return stored, None, (f"variant {stored}: {how}",)
        if "not an official variant" in how:
            return None, "default", (f"checkpoint: {how}; planned as `convert --scheme default` would write it",)
    return variant, scheme, (f"checkpoint: {how}",)


def cookbook_rows(cfg: Inkling2Config, p: ServingPlan) -> list[dict]:
    """SGLang's cookbook's figures for p's variant beside ours: bytes on disk, and weights per GPU
    at TP4 (EP4), ours (every weight where vLLM's Inkling places it) and two readings of its
    figure: the checkpoint spread evenly over 4 GPUs, and the routed experts of one EP4 rank
    alone. Decimal GB, as the cookbook writes; a figure is reproduced when ours rounds to it."""
    v = VARIANTS[p.variant]
    q = plan(cfg, p.gpu.name, 4, variant=v.name, include_draft=True, utilization=p.utilization,
             reserve_gib=p.reserve_bytes / GiB, block_size=p.block_size)
    w = q.weights
    disk, per_gpu, experts, draft = w.disk_total, w.per_gpu_total, w.per_gpu_part("expert"), w.per_gpu_part("draft")
    n = cdiv(cfg.text.n_routed_experts, 4)

    def row(claim: str, ours: str, nbytes: int, want: int) -> dict:
        return {"claim": claim, "recipe": f"~{want} GB", "ours": ours, "reproduced": round(nbytes / GB) == want,
                "source": COOKBOOK}

    return [
        row(f"on disk, {v.repo}", f"{in_units(disk, 'GB')} GB (with the recipe's {RECIPE_DRAFT_GB} GB draft)", disk,
            v.cookbook_disk_gb),
        row(f"weights per GPU at TP4, {v.name} variant", f"{in_units(per_gpu, 'GB')} GB ({in_units(per_gpu, 'GiB')} "
            f"GiB): experts {in_units(experts, 'GB')} + the rest as vLLM places it "
            f"{in_units(per_gpu - experts - draft, 'GB')} + draft {in_units(draft, 'GB')}", per_gpu, v.cookbook_tp4_gb),
        row("  read as: the checkpoint split evenly over 4", f"{in_units(disk // 4, 'GB')} GB "
            f"({in_units(disk // 4, 'GiB')} GiB)", disk // 4, v.cookbook_tp4_gb),
        row(f"  read as: routed experts only ({n} per EP4 rank)", f"{in_units(experts, 'GB')} GB (the rest and the "
            f"draft left out)", experts, v.cookbook_tp4_gb),
    ]
