"""Checked reads of an untrusted config object (config.json and the configs nested in it): every
value typed and bounded before a shape or a loop is derived from it, every defect a ConfigError
naming the file and the key. Used by inkling2 (the model's config) and dspark (the draft's)."""
from __future__ import annotations

from ..errors import ConfigError
from ..errors import short_repr as _short

MAX_DIM = 1 << 24      # any one tensor dimension (vocab, hidden, heads, ...)
MAX_LAYERS = 1 << 12   # decoder layers, vision layers, draft layers


class ConfigFields:
    """One config object at `where` (a key path such as "text_config.") in the file `source`.
    `limits` bounds named integer keys (default bound: MAX_DIM)."""

    def __init__(self, obj, where: str, source: str, limits: dict[str, int] | None = None):
        if not isinstance(obj, dict):
            raise ConfigError(f"{where.rstrip('.') or 'config'} must be a JSON object, got {_short(obj)}", path=source)
        self.obj, self.where, self.source, self.limits = obj, where, source, limits or {}

    def need(self, key: str):
        if key not in self.obj:
            raise ConfigError(f"missing key {self.where}{key!r}", path=self.source)
        return self.obj[key]

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int | None = None) -> int:
        v = self.obj.get(key, default) if default is not None else self.need(key)
        hi = hi if hi is not None else self.limits.get(key, MAX_DIM)
        if type(v) is not int:  # not bool, not 4096.0, not "4096"
            raise ConfigError(f"{self.where}{key} must be an integer, got {_short(v)}", path=self.source)
        if not lo <= v <= hi:
            raise ConfigError(f"{self.where}{key} must be between {lo} and {hi}, got {_short(v)}", path=self.source)
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.obj.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}{key} must be true or false, got {_short(v)}", path=self.source)
        return v

    def layer_list(self, key: str, layers: int = MAX_LAYERS) -> list[int]:
        """A list of layer indices (`mlp_only_layers`, `moe_layers`), each a layer of the model's
        `layers`: transformers 5.25 types it list[int] and lets an index past the depth or below 0
        name no layer; a config holding one is malformed, and refused."""
        v = self.obj.get(key) or []
        if not isinstance(v, list) or not all(type(i) is int and 0 <= i < layers for i in v):
            raise ConfigError(f"{self.where}{key} must be a list of layer indices below {layers} (num_hidden_layers), "
                              f"got {_short(v)}", path=self.source)
        return v

    def string(self, key: str) -> str | None:
        """An optional string (absent or null: None)."""
        v = self.obj.get(key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{self.where}{key} must be a string, got {_short(v)}", path=self.source)
        return v

    def choice(self, key: str, choices, default: str) -> str:
        """A string that must be one of `choices` (a dtype name, say)."""
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str) or v not in choices:
            raise ConfigError(f"{self.where}{key} {_short(v)} is not one of {', '.join(choices)}", path=self.source)
        return v
