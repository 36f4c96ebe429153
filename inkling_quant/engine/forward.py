"""Inkling 2's forward, one decoder layer at a time, from the shards: transformers' own modules
and math (transformers >= 5.24 `models/inkling2/modeling_inkling2.py`), the routed experts replayed
expert by expert, so memory holds one layer's non-expert weights, one expert (and the next, read
ahead) and the activations of the samples.

What `Inkling2TextModel.forward` does, in its order (modeling_inkling2.py, transformers 5.25
l.1422-1486), with the batch cut into micro-batches and the loop turned inside out (layer outer,
micro-batch inner), so each layer's weights are read once for all samples:

- `embed_tokens` (`Inkling2NormedEmbedding`: the embedding, then its RMSNorm), position ids
  `arange(S)`, the three masks (`create_causal_mask`, `create_sliding_window_causal_mask`,
  `create_recurrent_attention_mask`) and the two relative-distance tables (`get_relative_distance`)
  computed once per micro-batch shape;
- per decoder layer (`Inkling2{Sliding,Full}DecoderLayer`), the part before the MoE block
  (`pre_moe`: the attention-residual inputs, attention, the post-attention short convolution, the
  residual, `mlp_input` over the block states, `post_attention_layernorm`), the router
  (`Inkling2TopKRouter`: fp32 sigmoid scores plus the correction bias, top-k), the routed experts
  (`Experts.run`: `Inkling2Experts.forward`'s loop, l.813-837: each hit expert in ascending order,
  its tokens' rows through `gate_up_proj[e]`, `_apply_gate` (the softcapped SwiGLU), `down_proj[e]`,
  times the routing weight, `index_add_` into an fp32 sum), and the part after (`post_moe`: the
  post-MLP short convolution, the residual); `block_states` gains the layer's input at each block
  boundary, as the text model carries it;
- `final_input` over the block states, `norm`, `lm_head` (the unpadded rows) and the logit
  softcap (`Inkling2ForConditionalGeneration.forward`, l.1900-1901).

The glue of a decoder layer's forward (l.930-954 and l.991-1019) is spelled out in `pre_moe` and
`post_moe` so the experts can run across micro-batches between them; tests/test_engine.py holds
the whole to transformers' whole-model forward bit for bit (every layer's output, every MoE input,
the logits). Observers (`Observer`) see each expert's routed input rows and gated activations:
calibrate's statistics, eval's comparisons.
"""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F

from .weights import EMBED, FINAL, ExpertWeights, Weights


class Observer(Protocol):
    """What a pass over the experts reports (calibrate's statistics, eval's comparisons)."""

    def routed(self, layer: int, e: int, x: torch.Tensor, act: torch.Tensor) -> None:
        """Expert e's routed input rows (w13's input) and gated activations (w2's input) of one micro-batch."""

    def all_tokens(self, layer: int, e: int, x: torch.Tensor, act: torch.Tensor) -> None:
        """The same over every token of the micro-batch (statistics only; asked for by `wants_all`)."""


def _modules():
    from transformers.models.inkling2 import modeling_inkling2 as mi  # lazy: transformers is heavy to import
    from transformers.utils import logging

    logging.get_logger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    return mi


def text_config(cfg) -> "object":
    """transformers' Inkling2TextConfig of our config, eager attention (the reference path)."""
    from transformers import Inkling2Config as TFConfig

    text = TFConfig.from_dict(cfg.raw).text_config
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"
    return text


@dataclass
class Context:
    """What `Inkling2TextModel.forward` computes once for a batch shape: masks, relative distances,
    position ids (l.1441-1462)."""
    masks: dict
    relative: dict
    position_ids: torch.Tensor

    @classmethod
    def of(cls, text, embeds: torch.Tensor) -> "Context":
        from transformers.masking_utils import (create_causal_mask, create_recurrent_attention_mask,
                                                create_sliding_window_causal_mask)
        mi = _modules()
        pos = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
        kw = dict(config=text, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos)
        masks = {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw),
                 "linear_attention": create_recurrent_attention_mask(**kw)}
        rel = {"full_attention": mi.get_relative_distance(embeds, None, is_sliding=False),
               "sliding_attention": mi.get_relative_distance(embeds, None, is_sliding=True)}
        return cls(masks, rel, pos)


@dataclass
class MicroBatch:
    """One micro-batch's state between layers: the hidden states and the block states."""
    hidden: torch.Tensor
    blocks: torch.Tensor
    ctx: Context


def build_layer(text, i: int, state: dict[str, torch.Tensor], device) -> torch.nn.Module:
    """transformers' decoder layer i, its parameters the given tensors (dtypes kept: `assign`), its
    routed experts left out (run by `Experts`)."""
    mi = _modules()
    cls = mi.Inkling2FullDecoderLayer if text.layer_types[i] == "hybrid" else mi.Inkling2SlidingDecoderLayer
    with torch.device("meta"):
        layer = cls(text, i)
    layer.mlp.experts = None  # the experts stream in apart
    layer.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    return layer.eval()


def pre_moe(layer, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer's forward up to its MoE block (modeling_inkling2.py l.930-953 /
    l.991-1018): (the MoE block's input, the residual it is added to, the block states the layer's
    input is appended to at a block boundary)."""
    h, blocks, ctx = mb.hidden, mb.blocks, mb.ctx
    kind = layer.attention_type
    kwargs = {"position_ids": ctx.position_ids}
    dtype = h.dtype
    block_residual = h
    if hasattr(layer, "q_input_layernorm"):  # Inkling2FullDecoderLayer
        q = k = v = h
        if layer.attention_input is not None:
            q, k, v = layer.attention_input(blocks, h)
        a, _ = layer.self_attn(hidden_states=layer.q_input_layernorm(q).to(dtype),
                               key_hidden_states=layer.k_input_layernorm(k).to(dtype),
                               value_hidden_states=layer.v_input_layernorm(v).to(dtype),
                               attention_mask=ctx.masks[kind], relative_distance=ctx.relative[kind],
                               conv_mask=ctx.masks["linear_attention"], cache=None, **kwargs)
    else:
        x = layer.attention_input(blocks, h)[0] if layer.attention_input is not None else h
        a, _ = layer.self_attn(hidden_states=layer.input_layernorm(x).to(dtype), attention_mask=ctx.masks[kind],
                               relative_distance=ctx.relative[kind], conv_mask=ctx.masks["linear_attention"],
                               cache=None, **kwargs)
    a = layer.post_attention_convolution(a, cache=None, conv_mask=ctx.masks["linear_attention"], **kwargs)
    residual = hidden = a.float()
    if layer.is_block_boundary:
        blocks = torch.cat([blocks, block_residual.unsqueeze(-2)], dim=-2)
    else:
        residual = hidden = block_residual.float() + hidden
    hidden = layer.mlp_input(blocks, hidden)[0]
    return layer.post_attention_layernorm(hidden).to(dtype), residual, blocks


def post_moe(layer, moe_out: torch.Tensor, residual: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The decoder layer's forward after its MoE block (l.954-955 / l.1019-1020)."""
    ctx = mb.ctx
    h = layer.post_mlp_convolution(moe_out, cache=None, conv_mask=ctx.masks["linear_attention"],
                                   position_ids=ctx.position_ids)
    return (residual + h).to(mb.hidden.dtype)


@dataclass
class Routed:
    """One micro-batch's MoE input (flattened [T, H]), routing and fp32 output accumulator."""
    x: torch.Tensor
    weights: torch.Tensor
    index: torch.Tensor
    out: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.out = torch.zeros_like(self.x, dtype=torch.float32)  # Inkling2Experts: fp32 accumulation

    def rows(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_k_pos, token_idx) of expert e, in the order `torch.where(expert_mask[e])` gives them."""
        return torch.where(self.index.t() == e)


class Experts:
    """A layer's routed experts over every micro-batch, one expert at a time: the loop of
    `Inkling2Experts.forward` per micro-batch (the same ops in the same order, so the same bits),
    each expert's weights read once, the next one read ahead on a thread."""

    def __init__(self, weights: Weights, layer: int, num_experts: int, apply_gate: Callable, device,
                 wants_all: bool = False):
        self.weights, self.layer, self.num_experts = weights, layer, num_experts
        self.apply_gate, self.device, self.wants_all = apply_gate, device, wants_all
        self.bytes_read = 0

    def _load(self, e: int) -> ExpertWeights:
        w = self.weights.expert(self.layer, e)
        self.bytes_read += w.nbytes
        return ExpertWeights(w.gate_up.to(self.device), w.down.to(self.device))

    def run(self, batches: list[Routed], observers: list[Observer], pool: cf.ThreadPoolExecutor) -> None:
        hit = sorted({int(e) for r in batches for e in r.index.unique().tolist()} if not self.wants_all
                     else range(self.num_experts))
        hit = [e for e in hit if e < self.num_experts]
        ahead = pool.submit(self._load, hit[0]) if hit else None
        for k, e in enumerate(hit):
            w = ahead.result()
            ahead = pool.submit(self._load, hit[k + 1]) if k + 1 < len(hit) else None
            for r in batches:
                top_k_pos, token_idx = r.rows(e)
                if token_idx.numel():
                    current = r.x[token_idx]
                    act = self.apply_gate(F.linear(current, w.gate_up))
                    y = F.linear(act, w.down) * r.weights[token_idx, top_k_pos, None]
                    r.out.index_add_(0, token_idx, y.to(r.out.dtype))
                    for o in observers:
                        o.routed(self.layer, e, current, act)
                if self.wants_all:  # every token through the expert, for the statistics only
                    act_all = self.apply_gate(F.linear(r.x, w.gate_up))
                    for o in observers:
                        o.all_tokens(self.layer, e, r.x, act_all)
            del w


class Engine:
    """The layer-streaming forward of one checkpoint. `start(rows)` embeds token rows (lists of
    equal-length micro-batches of ids); `layer(i, state)` runs decoder layer i over every
    micro-batch; `logits(state)` the head. Weights are read through `Weights`; `device` is where
    they and the activations live."""

    def __init__(self, weights: Weights, device: str = "cpu"):
        self.weights, self.device = weights, torch.device(device)
        self.text = text_config(weights.cfg)
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="inkling-quant-read")
        self.bytes_read = 0
        self._next: tuple[int, cf.Future] | None = None

    def start(self, micro_batches: list[torch.Tensor]) -> list[MicroBatch]:
        mi = _modules()
        t = self.text
        with torch.device("meta"):
            embed = mi.Inkling2NormedEmbedding(t.vocab_size, t.hidden_size, t.pad_token_id, t.rms_norm_eps)
        embed.load_state_dict({k: v.to(self.device) for k, v in self.weights.model_level(EMBED).items()},
                              strict=True, assign=True)
        out, contexts = [], {}
        with torch.no_grad():
            for ids in micro_batches:
                h = embed(ids.to(self.device))
                key = tuple(ids.shape)
                if key not in contexts:
                    contexts[key] = Context.of(t, h)
                out.append(MicroBatch(h, h.new_zeros(*h.shape[:-1], 0, h.shape[-1]), contexts[key]))
        return out

    def _layer_state(self, i: int) -> dict[str, torch.Tensor]:
        if self._next is not None and self._next[0] == i:
            state = self._next[1].result()
        else:
            state = self.weights.layer(i)
        self._next = None
        self.bytes_read += sum(v.numel() * v.element_size() for v in state.values())
        return state

    def layer(self, i: int, state: list[MicroBatch], observers: list[Observer] = (), wants_all: bool = False,
              prefetch: int | None = None) -> None:
        """Decoder layer i over every micro-batch, in place; `prefetch`: the layer whose weights to
        read meanwhile."""
        layer = build_layer(self.text, i, self._layer_state(i), self.device)
        if prefetch is not None and prefetch < self.text.num_hidden_layers:
            self._next = (prefetch, self.pool.submit(self.weights.layer, prefetch))
        with torch.no_grad():
            pre = [pre_moe(layer, mb) for mb in state]
            routed = []
            for mb, (x, _, _) in zip(state, pre):
                flat = x.reshape(-1, x.shape[-1])
                _, w, idx = layer.mlp.gate(flat)
                routed.append(Routed(flat, w, idx))
            mi = _modules()
            act_fn = mi.Inkling2SoftcappedSwiGLU(self.text)

            def apply_gate(gate_up):  # Inkling2Experts._apply_gate
                gate, up = gate_up.chunk(2, dim=-1)
                return act_fn(gate, up)
            experts = Experts(self.weights, i, self.text.n_routed_experts, apply_gate, self.device, wants_all)
            experts.run(routed, list(observers), self.pool)
            self.bytes_read += experts.bytes_read
            for mb, (x, residual, blocks), r in zip(state, pre, routed):
                moe_out = r.out.to(x.dtype).reshape(x.shape)
                new = post_moe(layer, moe_out, residual, mb)
                if layer.is_block_boundary:
                    mb.blocks = blocks
                mb.hidden = new

    def logits(self, state: list[MicroBatch]) -> Iterator[torch.Tensor]:
        """Each micro-batch's logits, fp32 and softcapped, as Inkling2ForConditionalGeneration gives them."""
        mi = _modules()
        t = self.text
        with torch.device("meta"):
            final_input, norm = mi.Inkling2BlockAttentionResidual(t), mi.Inkling2RMSNorm(t.hidden_size, eps=t.rms_norm_eps)
        final_input.load_state_dict({k: v.to(self.device) for k, v in self.weights.model_level(FINAL[:1]).items()},
                                    strict=True, assign=True)
        norm.load_state_dict({k: v.to(self.device) for k, v in self.weights.model_level(FINAL[1:]).items()},
                             strict=True, assign=True)
        head = self.weights.lm_head().to(self.device)
        cap = mi.Inkling2Softcap(t.final_logit_softcapping)
        with torch.no_grad():
            for mb in state:
                h = final_input(mb.blocks, mb.hidden)[0]
                h = norm(h).to(mb.hidden.dtype)
                yield cap(F.linear(h, head).float())

    def close(self) -> None:
        self.pool.shutdown(wait=True)
