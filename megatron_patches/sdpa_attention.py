"""A torch-SDPA core attention for Megatron's local (non-Transformer-Engine) layer specs.

Upstream (megatron-core 0.16.1): the local spec's `DotProductAttention` does not accept the
`k_channels` / `v_channels` arguments that `MLASelfAttention` passes, so Multi-Latent Attention
(DeepSeek-V3: q/k head dim 192, v head dim 128) cannot run without Transformer Engine at all.
(Its CUDA-only score buffer is handled by `cuda_calls_on_cpu`; dense models run with it too.)

Not a monkeypatch: `mrl.models` puts `SDPACoreAttention` into the layer spec's `core_attention`
slot whenever the local spec is used. It handles MHA, GQA, unequal q/k and v head dims, the built-in
causal mask or an explicit one, and context parallelism (what each does: `SDPACoreAttention`).

Drop when: megatron-core's local `DotProductAttention` runs on CPU and accepts MLA's unequal head
dims (not the case up to 0.16.1).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

CPU_ONLY = False


class SDPACoreAttention(MegatronModule):
    """Core attention: softmax(q k^T * scale + mask) v with torch's scaled_dot_product_attention.

    Shapes (Megatron convention): query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv]
    for this TP rank's heads; returns [sq, b, np * hv].

    MHA, GQA (query groups are repeated to the heads, as Megatron's own attention does) and unequal
    q/k and v head dims, with the causal mask built in or an explicit Megatron-style boolean mask
    (True = masked out). Context parallelism (CP > 1): each rank holds two of a sequence's 2·CP
    chunks (Megatron's load-balanced split, `chunk_positions`), all-gathers K and V over the CP group
    (gradients reduce-scattered back) and masks by each query's and key's position in the whole
    sequence (or by the explicit mask of packed rows, given in those positions). Megatron's own CP
    attention is Transformer Engine's; this is the plain all-gather form of it, for the local spec.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp = config.context_parallel_size
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention does not support packed sequences (thd).")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention_bias.")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, batch, heads, _ = query.shape
        groups = key.shape[2]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        if self.cp > 1:  # before the query groups are repeated: fewer bytes to gather
            k, v = self._whole_sequence(k, v, mask_type)
            if mask is None:
                mask = causal_mask(sq * self.cp, self.cp, _cp_rank(), k.dtype, k.device)
            causal = False
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        # [b, n, sq, hv] -> [sq, b, n * hv]
        return out.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    def _whole_sequence(self, k: torch.Tensor, v: torch.Tensor,
                        mask_type: AttnMaskType) -> tuple[torch.Tensor, torch.Tensor]:
        """CP: this rank's K and V [b, n, s/CP, d] → the whole sequence's, in gather order (an
        explicit mask must then be this rank's queries over the keys in that order: mrl's packed
        rows, mrl.megatron.training.attention_mask; without one, `causal_mask`)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"SDPACoreAttention with context parallelism supports causal attention only, "
                                      f"not {mask_type.name}: set parallel.cp 1 for it.")
        group = ps.get_context_parallel_group()
        # all-gather along the sequence (dim 0 of [s, b, n, d]); backward: reduce-scatter
        return tuple(gather_from_sequence_parallel_region(t.permute(2, 0, 1, 3).contiguous(), True, group)
                     .permute(1, 2, 0, 3) for t in (k, v))


def _cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()


@functools.lru_cache(maxsize=1)
def causal_mask(seq: int, size: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """CP rank `rank`'s queries over the gathered keys [s/CP, s]: 0 where a key is at or before the
    query, -inf elsewhere, in the query's dtype. Additive and cached: SDPA saves the mask for
    backward, and a boolean one it would convert anew in every layer (a [s/CP, s] copy per layer,
    1.2 GB each at 34,816 tokens and CP2); every layer and micro-batch of a pass shares this one
    (mrl.megatron.context_parallel.release_mask drops it after the pass)."""
    queries = chunk_positions(seq, size, rank)
    keys = gathered_positions(seq, size)
    hidden = (keys.unsqueeze(0) > queries.unsqueeze(1)).to(device)
    return torch.zeros(len(queries), seq, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def chunk_positions(seq: int, size: int, rank: int) -> torch.Tensor:
    """The positions of a `seq`-token sequence that CP rank `rank` of `size` holds, in its order:
    chunk `rank`, then chunk 2·size-1-rank, of 2·size equal chunks (Megatron's load balancing:
    get_batch_on_this_cp_rank, and the rotary embedding's get_pos_emb_on_this_cp_rank)."""
    if seq % (2 * size):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2·CP = {2 * size} equal chunks: pad it to a "
                         f"multiple of {2 * size}")
    chunk = seq // (2 * size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])


def gathered_positions(seq: int, size: int) -> torch.Tensor:
    """The positions in the order an all-gather over the CP group returns a sequence's pieces."""
    return torch.cat([chunk_positions(seq, size, rank) for rank in range(size)])
