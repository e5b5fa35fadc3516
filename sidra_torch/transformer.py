"""The fused kernels of PyTorch's transformer fast paths, as the ops they fuse.

In eval without gradients, `nn.MultiheadAttention` and `nn.TransformerEncoderLayer`
call one fused kernel (`_native_multi_head_attention`,
`_transformer_encoder_layer_fwd`) on any device PyTorch deems supported, which
includes a PrivateUse1 device. The CPU kernel would run the whole layer on the
host, so the chip would not be simulated at all. These runners compute the
same layer with the ops of the modules' own slow path (their projections on the
crossbar, attention, norms and activations on the engine), as CUDA's kernels
compute it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tensor import unwrap, wrap


def _attention(query, key, value, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
               mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    """Batch-first multi-head attention; `mask` as MultiheadAttention.merge_masks gives it (type 0:
    (L, S) attention mask, 1: (B, S) key padding mask, 2: the two merged, (B, H, L, S))."""
    attn_mask = key_padding_mask = None
    if mask is not None:
        if mask_type == 1:
            key_padding_mask = mask
        elif mask_type == 2:
            attn_mask = mask.reshape(-1, *mask.shape[-2:])  # (B H, L, S), as the slow path takes it
        else:
            attn_mask = mask
    # (L, B, E) for the slow path; self-attention keeps q, k, v one tensor, so the packed projection
    # is one crossbar MVM, not three on slices of its weight
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else value.transpose(0, 1)
    out, weights = F.multi_head_attention_forward(
        q, k, v, embed_dim, num_heads,
        qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias, training=False,
        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights)
    return out.transpose(0, 1), weights


def _encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first,
                   eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                   ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """nn.TransformerEncoderLayer's forward (batch first, eval): post- or pre-norm."""

    def attend(x):
        return _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                          False, True, mask_type)[0]

    def feed_forward(x):
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm(x, w, b):
        return F.layer_norm(x, (embed_dim,), w, b, eps)

    x = src
    if norm_first:
        x = x + attend(norm(x, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attend(x), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def _runner(layer):
    """A runner computing `layer` on the device tensors themselves (each op dispatched to the chip as
    usual), returning the unwrapped results as runners do."""

    def run(func, args, uargs, ukwargs):
        kwargs = {k: wrap(v) if isinstance(v, torch.Tensor) else v for k, v in ukwargs.items()}
        out = layer(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(None if o is None else unwrap(o) for o in out)
        return unwrap(out)

    run.__name__ = layer.__name__.lstrip("_")
    return run


native_multi_head_attention = _runner(_attention)
transformer_encoder_layer = _runner(_encoder_layer)
