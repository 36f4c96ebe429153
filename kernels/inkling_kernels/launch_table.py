"""Launch configurations of the dequant-GEMM kernel per shape: a committed table keyed by GPU
capability, path, format, kind (one dense matrix or the experts of a MoE layer), N, K and an
m bucket (launch_table.json beside this file), so that CI and cold starts never tune; and the
heuristic that fills gaps and wrote the table's first version. ``autotune.py`` regenerates the
table on a GPU by measurement (``tools/gpu_check.sh --tune``).

The table's entries say where they came from (``source``): ``heuristic`` (not measured) or
``tuned on <device>``. ``INKLING_KERNEL_TABLE=<path>`` makes a process use another table file
(a freshly tuned one, before it is committed).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import KernelError
from .formats import scale_block
from .paths import DECODE_MAX_M, PATH_BF16_MMA, PATH_SM100, PATH_SPLITK

TABLE_FILE = Path(__file__).with_name("launch_table.json")
TABLE_ENV = "INKLING_KERNEL_TABLE"
KINDS = ("dense", "moe")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MOE_DECODE_EXPERTS = 8     # M-blocks the heuristic expects in a MoE decode launch (top-8 routing)
INNERS = ("fma", "dot")


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of _dequant_gemm_kernel: tile sizes, split-K slices, the inner product
    ("fma": fp32 multiply-add GEMV style; "dot": tl.dot / tl.dot_scaled) and Triton options."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    inner: str = "dot"
    num_warps: int = 4
    num_stages: int = 3

    def check(self, scale_block: int) -> "LaunchConfig":
        """Raise KernelError unless the kernel can run this config for a format whose scales
        cover `scale_block` elements (16 NVFP4, 32 MXFP8)."""
        pow2 = [v for v in (self.block_m, self.block_n, self.block_k) if v < 1 or v & (v - 1)]
        why = []
        if pow2:
            why.append(f"tile sizes must be powers of two, got {pow2}")
        if self.inner not in INNERS:
            why.append(f"inner must be one of {INNERS}, got {self.inner!r}")
        if self.inner == "dot" and min(self.block_m, self.block_n, self.block_k) < 16:
            why.append("tl.dot needs block_m, block_n and block_k >= 16")
        if self.block_k < max(scale_block, 16):
            why.append(f"block_k must be >= {max(scale_block, 16)} (whole scale blocks and int32 words)")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            why.append("split_k, num_warps and num_stages must be >= 1")
        if why:
            raise KernelError(f"invalid launch config {self}: " + "; ".join(why))
        return self

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def m_bucket(m: int) -> int:
    """The table's m bucket: the smallest bucket >= m (512 for anything larger)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def table_key(capability, path: str, fmt: str, kind: str, n: int, k: int, m: int) -> str:
    return f"sm{capability[0]}{capability[1]}/{path}/{fmt}/{kind}/n{n}/k{k}/m{m_bucket(m)}"


def _block_k(k: int, widest: int) -> int:
    """The widest power-of-two K step <= `widest` that divides K (whole steps keep the loads
    unmasked and vectorized); 64 when none of 512..64 divides K (the K tail is masked)."""
    for bk in (512, 256, 128, 64):
        if bk <= widest and k % bk == 0:
            return bk
    return 64


def _split_for(programs: int, steps: int, target: int, most: int = 8) -> int:
    """Fewest K slices that bring `programs` up to `target`, preferring divisors of the number
    of K steps (equal slices); at most `most` and at most `steps`."""
    if programs >= target:
        return 1
    want = -(-target // max(programs, 1))
    cands = [d for d in range(1, min(most, steps) + 1)]
    divisors = [d for d in cands if steps % d == 0]
    for d in divisors:
        if d >= want:
            return d
    return max(divisors[-1] if divisors else 1, min(want, most, steps))


def heuristic_config(path: str, fmt: str, kind: str, n: int, k: int, m: int, sm_count: int = 132) -> LaunchConfig:
    """Untuned GPU launch config for `path` (a paths.PATH_* value) at rows m (dense: M; moe:
    tokens per expert). Decode (split-K path): GEMV-style fp32 FMA for m <= 2, a 16-row MMA
    above; N slices narrow enough and K split enough that the grid holds >= 2 programs per SM.
    MMA path: M tile pow2(m) in [16, 128], N tile 128 (64 when that fills the GPU better),
    split-K until the grid holds one program per SM. sm100: 128x128 tcgen05 tiles."""
    sb = scale_block(fmt)
    blocks_m = MOE_DECODE_EXPERTS if kind == "moe" else 1
    if path == PATH_SPLITK:
        bk = _block_k(k, 256)
        if m <= 2:
            bm, bn, inner = (1 if m <= 1 else 2), 16, "fma"
        else:
            bm, bn, inner = 16, 32, "dot"
        programs = blocks_m * -(-n // bn)
        split = _split_for(programs, -(-k // bk), 2 * sm_count)
        return LaunchConfig(bm, bn, bk, split, inner, 4, 3).check(sb)
    if path == PATH_SM100:
        bk = 128
        programs = max(blocks_m, -(-m // 128)) * -(-n // 128)
        return LaunchConfig(128, 128, bk, _split_for(programs, -(-k // bk), sm_count, 4), "dot", 4, 3).check(sb)
    bm = _pow2_clamp(m, 16, 128)
    bk = _block_k(k, 128)
    m_tiles = -(-m // bm) * (blocks_m if kind == "moe" else 1)
    bn = 128 if m_tiles * -(-n // 128) >= sm_count else 64
    split = _split_for(m_tiles * -(-n // bn), -(-k // bk), sm_count, 4)
    warps, stages = (4, 4) if bm <= 64 else (8, 3)
    return LaunchConfig(bm, bn, bk, split, "dot", warps, stages).check(sb)


def interpreter_config(path: str, fmt: str, kind: str, n: int, k: int, m: int) -> LaunchConfig:
    """The Triton CPU interpreter costs about one numpy call per tl op per program: big tiles and
    few programs. Same structure as the GPU configs (FMA for m <= 2 on the split-K path, dot
    otherwise), no split-K (tests ask for it explicitly)."""
    sb = scale_block(fmt)
    bk = _pow2_clamp(k, 2 * sb, 512)
    bn = min(_pow2_clamp(n, 16, 1024), _pow2_clamp(131072 // bk, 128, 1024))  # ~64-128 Ki weights a step
    if path == PATH_SPLITK and m <= 2:
        return LaunchConfig(_pow2_clamp(m, 1, 2), bn, bk, 1, "fma", 4, 1).check(sb)
    return LaunchConfig(_pow2_clamp(m, 16, 64), bn, bk, 1, "dot", 4, 1).check(sb)


def table_file() -> Path:
    env = os.environ.get(TABLE_ENV)
    return Path(env) if env else TABLE_FILE


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict[str, LaunchConfig]:
    """{key: LaunchConfig} from a table file (default: table_file()); {} when it is absent."""
    p = Path(path) if path else table_file()
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if data.get("version") != 1:
        raise KernelError(f"{p}: unknown launch table version {data.get('version')!r}")
    out = {}
    for entry in data["entries"]:
        cfg = LaunchConfig.from_dict(entry["config"])
        out[entry["key"]] = cfg.check(scale_block(entry["fmt"]))
    return out


def launch_config(path: str, fmt: str, kind: str, n: int, k: int, m: int, *, capability=None,
                  sm_count: int = 132, interpreted: bool = False) -> LaunchConfig:
    """The config a launch uses: the interpreter's; else the table's entry for (capability,
    path, fmt, kind, n, k, m bucket); else heuristic_config."""
    if interpreted:
        return interpreter_config(path, fmt, kind, n, k, m)
    if capability is not None:
        hit = load_table().get(table_key(capability, path, fmt, kind, n, k, m))
        if hit is not None:
            return hit
    return heuristic_config(path, fmt, kind, n, k, m, sm_count)


#: Inkling 2 Small's expert dimensions (inkling_quant's configs/inkling-2-small.json, text_config;
#: tests/test_kernels_formats.py holds them to that file)
INKLING2_SMALL = {"hidden_size": 4608, "moe_intermediate_size": 2304}


def real_shapes(config_json: Path | None = None) -> dict[str, tuple[int, int]]:
    """{projection: (N, K)} of Inkling 2 Small's experts (INKLING2_SMALL, or the text_config of
    a config.json given): gate_up (2 * moe_intermediate, hidden), down (hidden, moe_intermediate)."""
    t = json.loads(Path(config_json).read_text())["text_config"] if config_json else INKLING2_SMALL
    h, i = t["hidden_size"], t["moe_intermediate_size"]
    return {"gate_up": (2 * i, h), "down": (h, i)}


def table_entry(capability, path, fmt, kind, n, k, m, cfg: LaunchConfig, source: str, **extra) -> dict:
    return dict(key=table_key(capability, path, fmt, kind, n, k, m), capability=f"{capability[0]}.{capability[1]}",
                path=path, fmt=fmt, kind=kind, n=n, k=k, m_bucket=m_bucket(m), config=cfg.as_dict(),
                source=source, **extra)


def heuristic_table(capability=(9, 0), sm_count: int = 132, device: str = "NVIDIA H200") -> dict:
    """The table as the heuristic fills it for one GPU kind, at the real expert shapes: what was
    committed before any tuning run (every entry's source says so)."""
    entries = []
    paths = [PATH_SM100] if capability[0] == 10 else [PATH_SPLITK, PATH_BF16_MMA]
    for path in paths:
        for fmt in ("nvfp4", "mxfp8"):
            for kind in KINDS:
                for (n, k) in real_shapes().values():
                    for m in M_BUCKETS:
                        if (path == PATH_SPLITK) != (m <= DECODE_MAX_M):
                            continue
                        cfg = heuristic_config(path, fmt, kind, n, k, m, sm_count)
                        entries.append(table_entry(capability, path, fmt, kind, n, k, m, cfg,
                                                   f"heuristic (not measured; {sm_count} SMs assumed)"))
    return dict(version=1, device=device, note="regenerate with tools/gpu_check.sh --tune on that GPU",
                entries=entries)


def write_table(table: dict, path: Path) -> None:
    """Write a table as JSON with one entry per line (reviewable diffs when it is regenerated)."""
    head = {k: v for k, v in table.items() if k != "entries"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "entries": [']
    entries = table["entries"]
    lines += ["  " + json.dumps(e) + ("," if i < len(entries) - 1 else "") for i, e in enumerate(entries)]
    Path(path).write_text("\n".join(lines + [" ]", "}"]) + "\n")


if __name__ == "__main__":  # python -m inkling_kernels.launch_table: rewrite the heuristic table
    write_table(heuristic_table(), TABLE_FILE)
    print(f"wrote {TABLE_FILE}")
