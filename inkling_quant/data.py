"""Token rows from data files, for the commands that run the model (calibrate, eval).

Files, read as UTF-8 (nothing is downloaded):
- `.jsonl`: one sample a line, `{"text": str}`, `{"messages": [{"role", "content"}, ...]}` (rendered
  with the checkpoint's own chat template, `apply_chat_template(..., tokenize=False)`), or
  `{"input_ids": [int, ...]}` (pre-tokenized: used as it is, so it must fit `seq_len`);
- anything else: plain text, the whole file one sample.

Text is tokenized with the checkpoint's own tokenizer (tokenizer.json beside its config, read by
transformers' `AutoTokenizer` with `local_files_only`), no special tokens added. Each text
sample is one row, truncated to `seq_len` (`pack=False`, ModelOpt's calibration loaders' rule),
or all of them are packed (`pack=True`): concatenated, the tokenizer's EOS between samples, cut
into rows of exactly `seq_len` (a last shorter piece dropped). Rows are then taken in file order,
the first `samples` of them, and grouped into micro-batches of equal length (no padding: every
row is attended to in full). `digest` is the SHA-256 of the rows used, what a calibration records
of its data.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

MAX_LINE = 1 << 26      # bytes in one JSONL line / one plain-text file: larger is refused, named


@dataclass
class Rows:
    """The token rows of a data set and what was done to make them."""
    rows: list[list[int]]
    files: list[str]
    packed: bool
    truncated: int = 0                   # text samples cut to seq_len
    dropped_tokens: int = 0              # packing's last partial row
    sources: list[str] = field(default_factory=list)  # per row: "file line N"

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for r in self.rows:
            h.update(len(r).to_bytes(8, "little"))
            h.update(b"".join(int(t).to_bytes(4, "little") for t in r))
        return "sha256:" + h.hexdigest()

    def describe(self) -> dict:
        return {"files": self.files, "samples": len(self.rows), "tokens": self.tokens, "digest": self.digest,
                "packing": "packed" if self.packed else "truncated", "truncated_samples": self.truncated,
                "dropped_tokens": self.dropped_tokens}

    def micro_batches(self, batch_rows: int):
        """The rows as int64 tensors [b, L] of at most `batch_rows` rows of one length, in order
        of first appearance of each length."""
        import torch

        by_len: dict[int, list[list[int]]] = {}
        for r in self.rows:
            by_len.setdefault(len(r), []).append(r)
        out = []
        for rows in by_len.values():
            for i in range(0, len(rows), batch_rows):
                out.append(torch.tensor(rows[i:i + batch_rows], dtype=torch.int64))
        return out


def _tokenizer(root: Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to build it: say where we looked
        raise UsageError(f"text data needs the checkpoint's tokenizer (tokenizer.json beside config.json), which "
                         f"cannot be read: {str(e).splitlines()[0][:200]}; give pre-tokenized samples "
                         f'(JSONL lines {{"input_ids": [...]}}) instead', path=root) from None


def _samples(path: Path):
    """(where, kind, value) of each sample of a file: kind "text", "messages" or "ids"."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read data file: {e.strerror or e}", path=path) from None
    if path.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            where = f"line {n}"
            if len(line) > MAX_LINE:
                raise UsageError(f"line {n} is over {MAX_LINE} bytes", path=path)
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise UsageError(f"line {n} is not UTF-8 (byte {e.start})", path=path) from None
            except json.JSONDecodeError as e:
                raise UsageError(f"line {n} is not JSON ({e.msg})", path=path) from None
            keys = [k for k in ("text", "messages", "input_ids") if isinstance(obj, dict) and k in obj]
            if len(keys) != 1:
                raise UsageError(f"line {n} needs exactly one of 'text', 'messages', 'input_ids'", path=path)
            yield where, {"text": "text", "messages": "messages", "input_ids": "ids"}[keys[0]], obj[keys[0]]
        return
    if len(raw) > MAX_LINE:
        raise UsageError(f"plain-text file over {MAX_LINE} bytes: split it, or give JSONL samples", path=path)
    try:
        yield "the file", "text", raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"not UTF-8 (byte {e.start})", path=path) from None


def load_rows(files: list[str], root: Path, seq_len: int, vocab_size: int, samples: int | None = None,
              pack: bool = False) -> Rows:
    """The token rows of `files` (module doc); UsageError naming the file (and line) for an
    empty, unreadable, non-UTF-8, malformed or over-long sample, an id outside the vocabulary,
    and for data too short for `samples` rows."""
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    tok = None
    rows, sources, truncated = [], [], 0
    stream: list[int] = []
    stream_from: list[str] = []
    for f in files:
        path = Path(f)
        n_before = len(rows) + len(stream)
        for where, kind, value in _samples(path):
            if kind == "ids":
                if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                       for t in value):
                    raise UsageError(f"{where}: input_ids must be a non-empty list of integers", path=path)
                bad = next((t for t in value if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise UsageError(f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                                     path=path)
                if len(value) > seq_len:
                    raise UsageError(f"{where}: {len(value)} input_ids, over --seq-len {seq_len} (pre-tokenized "
                                     f"samples are used as they are)", path=path)
                rows.append(list(value))
                sources.append(f"{path} {where}")
                continue
            if kind == "text" and (not isinstance(value, str) or not value.strip()):
                raise UsageError(f"{where}: empty text", path=path)
            tok = tok or _tokenizer(root)
            if kind == "messages":
                if not isinstance(value, list) or not value:
                    raise UsageError(f"{where}: messages must be a non-empty list", path=path)
                try:
                    value = tok.apply_chat_template(value, tokenize=False)
                except Exception as e:  # noqa: BLE001 - the template's own error, named with the line
                    raise UsageError(f"{where}: the chat template cannot render it: {str(e)[:200]}", path=path) from None
            if not isinstance(value, str) or not value.strip():
                raise UsageError(f"{where}: empty text", path=path)
            ids = tok(value, add_special_tokens=False)["input_ids"]
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise UsageError(f"{where}: the tokenizer gives id {bad}, outside the model's vocabulary "
                                 f"(0..{vocab_size - 1}): another model's tokenizer?", path=path)
            if pack:
                if stream and tok.eos_token_id is not None:
                    stream.append(tok.eos_token_id)
                stream += ids
                stream_from.append(f"{path} {where}")
                continue
            truncated += len(ids) > seq_len
            rows.append(ids[:seq_len])
            sources.append(f"{path} {where}")
        if len(rows) + len(stream) == n_before:
            raise UsageError("holds no samples", path=path)
    dropped = 0
    if pack:
        whole = len(stream) // seq_len * seq_len
        dropped = len(stream) - whole
        for i in range(0, whole, seq_len):
            rows.append(stream[i:i + seq_len])
            sources.append(f"packed from {stream_from[0]}..")
    if not rows:
        raise UsageError(f"the data gives no row of --seq-len {seq_len} tokens ({len(stream)} tokens packed): "
                         f"too short", path=files[0] if files else None)
    if samples is not None:
        if len(rows) < samples:
            raise UsageError(f"too short: --samples {samples} wants {samples} rows, the data gives {len(rows)}"
                             f"{' (packed into rows of ' + str(seq_len) + ' tokens)' if pack else ''}",
                             path=files[0] if len(files) == 1 else None)
        rows, sources = rows[:samples], sources[:samples]
    return Rows(rows, [str(f) for f in files], pack, truncated, dropped, sources)
