"""The DSpark draft bundled with a published-layout (Inkling 2) checkpoint: its config and its
tensors, named as vLLM 0.33's DSpark drafter names them.

**Not published.** The published Inkling 2 config has no draft key and vLLM 0.33 has no
Inkling 2 drafter (transformers 5.25 models/inkling2/ defines no draft; vLLM 0.33 has no
`vllm/models/inkling2`), so the names below are our choice:
the only DSpark drafter vLLM 0.33 loads from a checkpoint of its own is the Qwen3 one
(`Qwen3DSparkModel`), and we name every draft tensor and config key exactly as it loads them.
Line numbers: vLLM 0.33.0 (the PyPI wheel), `VL` = its package directory `vllm/`.

* **Config** = a speculators-format config.json, as `SpeculatorsConfig` reads it
  (VL/transformers_utils/configs/speculators/base.py:46-63, 77-94) with the `dspark` updater
  (VL/transformers_utils/configs/speculators/algos.py:152-209): `speculators_model_type`
  "dspark", `transformer_layer_config` (the Qwen3 decoder the drafter builds), `speculators_config`
  (`proposal_methods[0].speculative_tokens`, `verifier.name_or_path`), and the DSpark keys
  `aux_hidden_state_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`, `block_size`,
  `enable_confidence_head`, `confidence_head_with_markov`, `use_aux_hidden_state`,
  `target_hidden_size`, `draft_vocab_size`, `sample_from_anchor`, `architectures`.
* **Bundled** in the target's config.json under `dspark_config` (that dict, verbatim) and its
  tensors under the prefix `mtp.` (`mtp.` + the drafter's own name) in a weight file of their
  own, `mtp.safetensors` (`FILE`), the file the release ships its draft in (the seekr-org/Inkling-
  2-Small-FP8-ROCm card: "... vision weights, and mtp.safetensors are included"); the prefix is our
  reading of that name (vLLM's bundled DeepSeek-V4.1 DSpark keeps its stages under `mtp.*`,
  VL/config/speculative.py:1480-1484), and `draft extract` is a prefix strip plus a copy of the
  dict. The release's tensor names are not public: ours are the drafter's own (below). Not a
  top-level `speculators_config`: vLLM would then take the *target* for a speculators model
  (VL/transformers_utils/config.py:837-840).
* **Dimensions** vLLM (and DeepSpec's `build_draft_config`, which deep-copies the target's
  config) take from the target come from `text_config`: hidden size, attention heads, KV heads,
  head_dim, vocabulary, rms_norm_eps, max positions, the `fc` input (`target_hidden_size` x
  number of aux layers, VL/model_executor/models/qwen3_dflash.py:84-93). The rest comes from the
  draft config (`DRAFT_DEFAULTS`, DeepSpec's config/dspark/dspark_qwen3_4b_online.py), and the
  MLP width, which a dense Qwen3 target would give and the MoE Inkling 2 has not, is our rule:
  the target's per-token routed width, num_experts_per_tok x moe_intermediate_size.
* **Shared with the target, not stored**: `embed_tokens` (shared when the draft vocabulary is
  not larger than the target's, VL/v1/worker/gpu/spec_decode/dspark/utils.py:133-134), `lm_head`
  (shared when the draft's output vocabulary equals the target's, utils.py:136-149; a reduced
  vocabulary would need its own lm_head and `d2t`, VL/model_executor/models/qwen3_dspark.py:
  341-357, which this spec does not cover), `mask_embedding` (dropped, qwen3_dspark.py:359).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from .fields import MAX_LAYERS, ConfigFields
from ..errors import ConfigError, UnknownTensorError
from ..io.checkpoint import DRAFT_FILE
from ..errors import short_repr as _short
from .tensors import TensorName, TensorSpec

PREFIX = "mtp."                  # the draft's tensors inside the target's checkpoint
FILE = DRAFT_FILE                # ... and the weight file that holds them (docs/layout.md "Files")
CONFIG_KEY = "dspark_config"     # the draft's config inside the target's config.json
SPECULATORS_TYPE = "dspark"      # algos.py:152 @register_speculator("dspark")
ARCHITECTURE = "Qwen3DSparkModel"  # algos.py:176-186 (its default)
VERIFIER = "thinkingmachines/Inkling-2-Small"
BF16, FP32 = torch.bfloat16, torch.float32
ROPE_THETA = 1000000.0           # DFlashQwen3DecoderLayer's default (qwen3_dflash.py:311)

#: the Markov heads the DSpark implementations build (SGLang 0.5.23
#: srt/speculative/dspark_components/dspark_config.py:22; NeMo AutoModel 0.7.0
#: components/speculative/dspark/markov_head.py:297-320), compared lower-cased as both do
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

#: the draft config's own choices (DeepSpec config/dspark/dspark_qwen3_4b_online.py:10-25)
DRAFT_DEFAULTS = {"num_hidden_layers": 5, "block_size": 7, "num_aux_layers": 5, "markov_rank": 256,
                  "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}



def is_draft(name: str) -> bool:
    return name.startswith(PREFIX)


@dataclass(frozen=True)
class DSparkConfig:
    """The dimensions a speculators-format DSpark config gives vLLM's Qwen3 DSpark drafter."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # markov_w1 rows, the input vocabulary
    draft_vocab_size: int                # markov_w2 / lm_head rows
    target_hidden_size: int
    aux_hidden_state_layer_ids: tuple[int, ...]
    markov_rank: int
    use_aux_hidden_state: bool
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    attention_bias: bool
    block_size: int | None
    markov_head_type: str = "vanilla"

    @classmethod
    def from_dict(cls, d, source: str = "draft config.json", where: str = "") -> "DSparkConfig":
        r = ConfigFields(d, where, source)
        if r.need("speculators_model_type") != SPECULATORS_TYPE:  # base.py:51-56
            raise ConfigError(f"{where}speculators_model_type must be {SPECULATORS_TYPE!r}, "
                              f"got {_short(d['speculators_model_type'])}", path=source)
        spec = ConfigFields(r.need("speculators_config"), where + "speculators_config.", source)  # base.py:77-94
        methods = spec.need("proposal_methods")
        if not isinstance(methods, list) or not methods:
            raise ConfigError(f"{where}speculators_config.proposal_methods must be a non-empty list", path=source)
        tokens = ConfigFields(methods[0], where + "speculators_config.proposal_methods[0].", source).int(
            "speculative_tokens")
        name = ConfigFields(spec.need("verifier"), where + "speculators_config.verifier.", source).need("name_or_path")
        if not isinstance(name, str):
            raise ConfigError(f"{where}speculators_config.verifier.name_or_path must be a string", path=source)
        t = ConfigFields(r.need("transformer_layer_config"), where + "transformer_layer_config.", source)
        hidden, heads = t.int("hidden_size"), t.int("num_attention_heads")
        vocab = t.int("vocab_size")
        if d.get("mask_token_id") is not None:  # algos.py:164: the parallel-drafting mask token, a token id
            r.int("mask_token_id", lo=0, hi=vocab - 1)
        ids = r.need("aux_hidden_state_layer_ids")  # algos.py:192 (required)
        if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i <= MAX_LAYERS for i in ids):
            raise ConfigError(f"{where}aux_hidden_state_layer_ids must be a non-empty list of layer numbers, "
                              f"got {_short(ids)}", path=source)
        block = r.int("block_size") if d.get("block_size") is not None else None
        _check_width(tokens, block, r.bool("sample_from_anchor", False), where, source)  # algos.py:188: default False
        return cls(
            hidden_size=hidden, num_hidden_layers=t.int("num_hidden_layers", hi=MAX_LAYERS),
            num_attention_heads=heads, num_key_value_heads=t.int("num_key_value_heads"),
            head_dim=t.int("head_dim", hidden // heads or 1),  # qwen3_dflash.py:199
            intermediate_size=t.int("intermediate_size"), vocab_size=vocab,
            draft_vocab_size=r.int("draft_vocab_size", vocab),  # qwen3_dspark.py:206-208
            target_hidden_size=r.int("target_hidden_size", hidden),  # qwen3_dflash.py:90-92
            aux_hidden_state_layer_ids=tuple(ids), markov_rank=r.int("markov_rank"),  # qwen3_dspark.py:212
            use_aux_hidden_state=r.bool("use_aux_hidden_state", True),  # qwen3_dflash.py:436-439
            enable_confidence_head=r.bool("enable_confidence_head", False),  # qwen3_dspark.py:220
            confidence_head_with_markov=r.bool("confidence_head_with_markov", False),
            attention_bias=t.bool("attention_bias", False),  # qwen3_dflash.py:339
            block_size=block, markov_head_type=_markov_head_type(r))

    def check_target(self, text, source: str, where: str = CONFIG_KEY + ".") -> None:
        """The pairing a bundled draft must satisfy with the target's `text_config` (an
        inkling2.TextConfig): the target's embedding and LM head serve as the draft's."""
        need = {"transformer_layer_config.hidden_size": (self.hidden_size, text.hidden_size),
                "target_hidden_size": (self.target_hidden_size, text.hidden_size),
                "transformer_layer_config.vocab_size": (self.vocab_size, text.vocab_size),
                "draft_vocab_size": (self.draft_vocab_size, text.vocab_size)}
        for key, (ours, theirs) in need.items():
            if ours != theirs:
                raise ConfigError(f"{where}{key} is {ours}, the target's text_config gives {theirs} (the draft "
                                  f"shares the target's embedding and LM head; a reduced-vocabulary draft with its "
                                  f"own lm_head and d2t is not supported)", path=source)
        ids = self.aux_hidden_state_layer_ids
        if list(ids) != sorted(set(ids)) or ids[-1] > text.num_hidden_layers:
            raise ConfigError(f"{where}aux_hidden_state_layer_ids {list(ids)} must be strictly increasing, each at "
                              f"most num_hidden_layers ({text.num_hidden_layers})", path=source)


def _markov_head_type(r: ConfigFields) -> str:
    """markov_head_type: required, one of MARKOV_HEAD_TYPES (lower-cased): SGLang 0.5.23 refuses a
    missing one (markov_rank > 0) and any other (dspark_config.py:265-274), as NeMo AutoModel 0.7.0
    does (config.py:44, markov_head.py:320). vLLM 0.33's Qwen3 drafter builds the vanilla head
    whatever it says (qwen3_dspark.py:209-218); the other two carry tensors it does not load."""
    v = r.need("markov_head_type")
    if not isinstance(v, str) or v.lower() not in MARKOV_HEAD_TYPES:
        raise ConfigError(f"{r.where}markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, got {_short(v)}",
                          path=r.source)
    return v.lower()


def _check_width(tokens: int, block: int | None, from_anchor: bool, where: str, source: str) -> None:
    """The draft's speculative width against its trained block: vLLM 0.33 defaults
    num_speculative_tokens to block_size (config/speculative.py:1592-1599) and requires the two
    equal for the drafter it validates, one that samples from the anchor (speculative.py:198-202,
    319-324); SGLang 0.5.23 drafts block_size tokens and warns when asked for another number
    (dspark_config.py:96-117). With the anchor a bonus token (sample_from_anchor false) vLLM's
    speculators updater says the block yields block_size - 1 tokens (algos.py:171-174): that
    value is accepted there too."""
    if block is None:
        return
    allowed = (block,) if from_anchor else (block - 1, block)
    if tokens not in allowed:
        raise ConfigError(f"{where}speculators_config.proposal_methods[0].speculative_tokens is {tokens}, the trained "
                          f"block_size is {block}: a DSpark draft proposes {' or '.join(map(str, allowed))} tokens "
                          f"(sample_from_anchor {str(from_anchor).lower()})", path=source)


# --------------------------------------------------------------------------- config
def default_target_layer_ids(n_layers: int, k: int) -> list[int]:
    """DeepSpec's spread (Qwen3-4B, 36 layers: [1, 9, 17, 25, 33]): k target layers from 1 to
    n-3 in even steps; the last k layers when the model is too shallow for that."""
    k = min(k, n_layers)
    span = n_layers - 4
    if k > 1 and span >= k - 1:
        return [1 + i * span // (k - 1) for i in range(k)]
    return list(range(n_layers - k, n_layers))


def make_draft_config(text, raw_text: dict | None = None, overrides: dict | None = None) -> dict:
    """The speculators-format config of a DSpark draft for the target whose `text_config` is
    `text` (an inkling2.TextConfig; `raw_text` its JSON, for rms_norm_eps and hidden_act)."""
    o = {**DRAFT_DEFAULTS, **(overrides or {})}
    raw_text = raw_text or {}
    target_ids = default_target_layer_ids(text.num_hidden_layers, o["num_aux_layers"])
    layer = {"model_type": "qwen3", "hidden_size": text.hidden_size, "num_hidden_layers": o["num_hidden_layers"],
             "num_attention_heads": text.num_attention_heads, "num_key_value_heads": text.num_key_value_heads,
             "head_dim": text.head_dim,
             "intermediate_size": o.get("intermediate_size", text.num_experts_per_tok * text.moe_intermediate_size),
             "hidden_act": raw_text.get("hidden_act", "silu"), "rms_norm_eps": raw_text.get("rms_norm_eps", 1e-6),
             "vocab_size": text.vocab_size, "max_position_embeddings": text.max_position_embeddings,
             "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}, "attention_bias": False,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    # DeepSpec's mask token for Qwen3 (151669) is the embedding's first row past the tokenizer's
    # vocabulary; Inkling 2's is unpadded_vocab_size
    mask = text.unpadded_vocab_size if text.unpadded_vocab_size < text.vocab_size else text.vocab_size - 1
    return {
        "architectures": [ARCHITECTURE], "speculators_model_type": SPECULATORS_TYPE, "torch_dtype": "bfloat16",
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [i + 1 for i in target_ids],  # algos.py:192-195: target layer = id - 1
        "target_hidden_size": text.hidden_size, "draft_vocab_size": text.vocab_size, "mask_token_id": mask,
        "block_size": o["block_size"], "markov_rank": o["markov_rank"], "markov_head_type": o["markov_head_type"],
        "enable_confidence_head": o["enable_confidence_head"],
        "confidence_head_with_markov": o["confidence_head_with_markov"],
        "use_aux_hidden_state": True, "sample_from_anchor": False,
        "speculators_config": {"algorithm": SPECULATORS_TYPE, "default_proposal_method": SPECULATORS_TYPE,
                               "proposal_methods": [{"proposal_type": SPECULATORS_TYPE,
                                                     "speculative_tokens": o["block_size"]}],
                               "verifier": {"name_or_path": VERIFIER,
                                            "architectures": ["Inkling2ForConditionalGeneration"]}},
    }


# --------------------------------------------------------------------------- tensors
def draft_tensors(d: DSparkConfig, prefix: str = "") -> Iterator[TensorSpec]:
    """Every tensor of the drafter under the names Qwen3DSparkForCausalLM.load_weights takes
    (qwen3_dspark.py:312-371; it adds "model." itself), in module order."""
    H, hd = d.hidden_size, d.head_dim
    q, kv, inter = d.num_attention_heads * hd, d.num_key_value_heads * hd, d.intermediate_size
    for k in range(d.num_hidden_layers):  # DFlashQwen3DecoderLayer (qwen3_dflash.py:298-362)
        p = f"{prefix}layers.{k}."
        # q/k/v_proj stack into qkv_proj (qwen3_dflash.py:403-409, 205-213), o_proj (214-220)
        for name, shape in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, q))):
            yield TensorSpec(f"{p}self_attn.{name}.weight", shape, BF16)
            if d.attention_bias:
                yield TensorSpec(f"{p}self_attn.{name}.bias", shape[:1], BF16)
        yield TensorSpec(p + "self_attn.q_norm.weight", (hd,), BF16)  # per-head RMSNorm (265-266)
        yield TensorSpec(p + "self_attn.k_norm.weight", (hd,), BF16)
        # Qwen2MLP: gate/up stack into gate_up_proj (qwen3_dflash.py:352-358, 407-408)
        yield TensorSpec(p + "mlp.gate_proj.weight", (inter, H), BF16)
        yield TensorSpec(p + "mlp.up_proj.weight", (inter, H), BF16)
        yield TensorSpec(p + "mlp.down_proj.weight", (H, inter), BF16)
        yield TensorSpec(p + "input_layernorm.weight", (H,), BF16)  # (359-362)
        yield TensorSpec(p + "post_attention_layernorm.weight", (H,), BF16)
    if d.use_aux_hidden_state:  # fc: target hidden x aux layers -> hidden (qwen3_dflash.py:476-487, 84-93)
        yield TensorSpec(prefix + "fc.weight", (H, d.target_hidden_size * len(d.aux_hidden_state_layer_ids)), BF16)
    yield TensorSpec(prefix + "hidden_norm.weight", (H,), BF16)  # (488-491)
    yield TensorSpec(prefix + "norm.weight", (H,), BF16)  # (492-495)
    # DSparkMarkovHead (qwen3_dspark.py:61-80, 209-218)
    r = d.markov_rank
    yield TensorSpec(prefix + "markov_head.markov_w1.weight", (d.vocab_size, r), BF16)
    yield TensorSpec(prefix + "markov_head.markov_w2.weight", (d.draft_vocab_size, r), BF16)
    # the gated and RNN heads' own Linear (with bias): SGLang 0.5.23 models/dspark.py:310-345,
    # NeMo AutoModel 0.7.0 markov_head.py:104-156; vLLM 0.33's drafter has neither
    extra = {"gated": ("gate_proj", r, H + r), "rnn": ("joint_proj", 3 * r, 2 * r + H)}.get(d.markov_head_type)
    if extra is not None:
        yield TensorSpec(f"{prefix}markov_head.{extra[0]}.weight", extra[1:], BF16)
        yield TensorSpec(f"{prefix}markov_head.{extra[0]}.bias", extra[1:2], BF16)
    if d.enable_confidence_head:  # DSparkConfidenceHead: fp32 ReplicatedLinear with bias (164-189, 219-230)
        width = H + (d.markov_rank if d.confidence_head_with_markov else 0)
        yield TensorSpec(prefix + "confidence_head.proj.weight", (1, width), FP32)
        yield TensorSpec(prefix + "confidence_head.proj.bias", (1,), FP32)


def param_count(d: DSparkConfig) -> int:
    return sum(s.numel for s in draft_tensors(d))


_NAME = re.compile(re.escape(PREFIX)
                   + r"(?:layers\.(?P<layer>\d+)\.)?(?P<module>[A-Za-z0-9_.]+?)\.(?P<suffix>weight|bias)")


def classify(name: str) -> TensorName:
    """A bundled draft tensor (`mtp.` + the drafter's name), part "draft"."""
    if m := _NAME.fullmatch(name):
        layer = int(m["layer"]) if m["layer"] is not None else None
        return TensorName(name, "draft", layer, None, m["module"].rsplit(".", 1)[-1], m["suffix"])
    raise UnknownTensorError(f"tensor {name!r} is not a tensor of a DSpark draft (docs/draft.md)")
