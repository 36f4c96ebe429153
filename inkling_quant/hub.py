"""Sources on the Hugging Face Hub: `org/name[@revision]` resolves to a local snapshot holding
the small files first (config, index, tokenizer...); each shard is downloaded only when a worker
needs it. huggingface_hub honours HF_HOME, HF_HUB_OFFLINE and its cache, so a re-run or a
resumed conversion downloads nothing twice."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import UsageError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_repo_id(src: str) -> bool:
    return not Path(src).exists() and bool(REPO_ID.match(src))


def resolve(src: str) -> tuple[Path, str | None, str | None]:
    """(local dir, repo id or None, revision). For a repo id, download the non-weight files."""
    if not is_repo_id(src):
        p = Path(src)
        if not p.exists():
            raise UsageError("no such directory (and not a hub repo id org/name[@revision])", path=src)
        return p, None, None
    repo, _, rev = src.partition("@")
    from huggingface_hub import snapshot_download  # lazy: only hub sources need it

    try:
        local = snapshot_download(repo, revision=rev or None, ignore_patterns=["*.safetensors", "*.bin", "*.pt"])
    except Exception as e:  # network, auth, missing repo: one clear line
        raise UsageError(f"{src}: cannot fetch from the hub: {type(e).__name__}: {e}") from None
    return Path(local), repo, rev or None


def fetch_shard(repo: str, revision: str | None, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, revision=revision))


def tensor_listing(repo: str, revision: str | None) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """shard -> {tensor: (safetensors dtype, shape)} read from the shard headers over HTTP range
    requests (huggingface_hub.get_safetensors_metadata), so planning downloads no weights."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(repo, revision=revision)
    except Exception as e:
        raise UsageError(f"{repo}: cannot read safetensors headers from the hub: {type(e).__name__}: {e}") from None
    return {fname: {n: (t.dtype, list(t.shape)) for n, t in fm.tensors.items()}
            for fname, fm in meta.files_metadata.items()}
