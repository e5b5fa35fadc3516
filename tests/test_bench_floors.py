"""benchmarks/floors.py: the floors the model benchmarks print are what they claim to be."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sidra_torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def floors():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("floors", BENCH / "floors.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32)
    return BertModel(cfg).eval()


def test_plain_jax_is_the_same_bert(floors):
    """The plain-JAX reference computes the torch model's forward (else its time bounds nothing)."""
    model = _bert()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    forward, params = floors.plain_jax(model)
    hidden, pooled = forward(params, np.asarray(ids.numpy()))
    with torch.no_grad():
        ref = model(input_ids=ids)
    np.testing.assert_allclose(np.asarray(hidden), ref.last_hidden_state.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(pooled), ref.pooler_output.numpy(), atol=1e-4)


def test_mvm_floor_runs_the_forwards_mvms(floors):
    """The MVM floor replays exactly the MVMs of one eager forward (weights and rows) and leaves the
    chip as it was."""
    model = _bert()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), sidra_torch.use_chip("int8"):
        dev = model.to("sidra:0")
        ids_d = ids.to("sidra:0")
        dev(input_ids=ids_d)
        chip = sidra_torch.current_chip()
        before = torch.sidra.counters()["mvms"]
        run = floors.mvm_floor(chip, lambda: dev(input_ids=ids_d))
        forward_mvms = torch.sidra.counters()["mvms"] - before
        assert "linear" not in vars(chip)  # the recording hook is gone
        outs = run()
    # 2 layers x 6 linears + the pooler; the pooler reads the batch's first tokens only
    assert forward_mvms == len(outs) == 13
    assert sorted(o.shape[0] for o in outs) == [2] + [32] * 12
