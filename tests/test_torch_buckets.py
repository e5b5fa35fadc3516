"""Row buckets through the PyTorch bridge: a whole all-MiniLM-L6 forward on sidra:0 gives the bits it
gives with every op at its own shape, and a stream of sentences of many lengths builds a program per
bucket, not per length."""

from __future__ import annotations

import torch

import sidra_torch
from conftest_torch import D, load_minilm, restore_chip, y1  # noqa: F401 (fixtures)
from sidra_core import buckets, compiles, engine, host


def _forward(model, ids, mask):
    sidra_torch.manual_seed(3)
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state.cpu()


def test_minilm_forward_padded_gives_the_unpadded_bits(y1, monkeypatch):
    model, tok = load_minilm()
    model = model.to(D)
    enc = tok(["A sentence of some thirteen tokens, give or take one or two.",
               "And a shorter one."], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].to(D), enc["attention_mask"].to(D)
    assert buckets.size(ids.numel()) != ids.numel()  # its rows are padded
    _forward(model, ids, mask)  # programs the weights (which draws from the noise stream)
    padded = _forward(model, ids, mask)
    monkeypatch.setattr(buckets, "size", lambda n: int(n))
    exact = _forward(model, ids, mask)
    torch.testing.assert_close(padded, exact, rtol=0, atol=0)


def test_sentences_of_many_lengths_build_a_program_per_bucket(y1):
    """28 lengths (5-59 tokens), one sentence each: the MVM programs grow with the buckets."""
    model, _ = load_minilm()
    model = model.to(D)
    lengths = list(range(5, 61, 2))
    with compiles.record() as built, torch.inference_mode():
        for n in lengths:
            model(input_ids=torch.randint(1000, 20000, (1, n)).to(D), attention_mask=torch.ones(1, n, dtype=torch.long).to(D))
    # MiniLM's MVM shapes: q/k/v/o (384 x 384), the FFN's two (384 x 1536, 1536 x 384); the pooler
    # reads one row whatever the length
    shapes, rows = 3, len({buckets.size(n) for n in lengths})
    assert built.programs["jit(mvm)"] <= shapes * rows + 1 < len(lengths)
    assert built.programs["jit(layer_norm)"] <= rows
    # attention goes straight to the VNNI kernel where it runs (no program at any length), else a
    # program per padded length (masked where padding, unmasked at a bucket's own length)
    if host.vnni_dots():
        assert built.programs["jit(attention)"] == 0
    else:
        assert 0 < built.programs["jit(attention)"] <= 2 * len({engine.padded_length(n) for n in lengths})
