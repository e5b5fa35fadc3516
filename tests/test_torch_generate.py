"""AutoModel*.from_pretrained(folder).to("sidra:0") with tokenizer(...).to("sidra:0"), and generate() on the
device with the KV cache (GPT-2 and Marian, local folders from tests/hf_local.py): equal to CPU on the ideal
chip, valid tokens with the crossbar work in the profiler on the noisy y1 chip."""

from __future__ import annotations

import pytest
import torch

import sidra_torch

from conftest_torch import D, DEV, Delta, ideal, int8, max_abs_diff, restore_chip, y1  # noqa: F401

import transformers
pytest.register_assert_rewrite("hf_local")
from hf_local import PROMPTS, SOURCES, TARGETS  # noqa: E402

pytest_plugins = ("hf_local",)
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

HF_TOL = 1e-4
NEW = 6  # generated tokens per test

# name -> (fixture giving the folder, Auto class, inputs: the tokenizer's arguments)
MODELS = {
    "bert": ("bert_mlm_dir", transformers.AutoModelForMaskedLM, dict(text=["The cat [MASK] a book.", "A dog reads."])),
    "gpt2": ("gpt2_dir", transformers.AutoModelForCausalLM, dict(text=PROMPTS)),
    "marian": ("marian_dir", transformers.AutoModelForSeq2SeqLM, dict(text=SOURCES, text_target=TARGETS)),
}
DECODING = {"greedy": dict(do_sample=False), "beam": dict(do_sample=False, num_beams=3)}
# crossbar matmuls per decoding step with the cache: GPT-2's c_attn, c_proj, c_fc, mlp.c_proj per layer; Marian's
# self-attention q, k, v, o, cross-attention q, o, fc1, fc2 per decoder layer; then lm_head
STEP_MVMS = {"gpt2": 2 * 4 + 1, "marian": 2 * 8 + 1}


def _load(request, name, device):
    """(model, tokenizer, encoded inputs) from the model's folder, model and inputs moved with `.to(device)`."""
    fixture, auto, text = MODELS[name]
    folder = str(request.getfixturevalue(fixture))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = auto.from_pretrained(folder).eval().to(device)
    inputs = tok(**text, return_tensors="pt", padding=True).to(device)
    return model, tok, inputs


def _generate(model, inputs, **kw):
    """generate() with the KV cache, NEW tokens exactly, scores kept."""
    if "labels" in inputs:
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
    return model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, use_cache=True,
                          return_dict_in_generate=True, output_scores=True, **kw)


def _cache_tensors(cache) -> list[torch.Tensor]:
    """The key and value tensors of a DynamicCache, or of both halves of an EncoderDecoderCache."""
    parts = [cache]
    if hasattr(cache, "cross_attention_cache"):
        parts = [cache.self_attention_cache, cache.cross_attention_cache]
    return [t for part in parts for layer in part.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_pretrained_to_device_matches_cpu(ideal, request, name):
    cpu, _, enc = _load(request, name, "cpu")
    dev, _, encd = _load(request, name, D)
    assert type(encd).__name__ == "BatchEncoding" and all(v.device == DEV for v in encd.values())
    assert all(p.device == DEV for p in dev.parameters())
    assert dev.get_output_embeddings().weight is dev.get_input_embeddings().weight  # still tied after .to
    with torch.no_grad():
        ref = cpu(**enc)
        with Delta() as d:
            out = dev(**encd)
    assert out.logits.device == DEV and out.logits.shape == ref.logits.shape
    assert max_abs_diff(out.logits, ref.logits) <= HF_TOL
    if name == "marian":  # labels given: the loss is computed on the device too
        assert out.loss.device == DEV and abs(out.loss.item() - ref.loss.item()) <= HF_TOL
    assert d["mvms"] > 0


@pytest.mark.parametrize("decoding", sorted(DECODING))
@pytest.mark.parametrize("name", ["gpt2", "marian"])
def test_generate_with_kv_cache_matches_cpu(ideal, request, name, decoding):
    cpu, _, enc = _load(request, name, "cpu")
    dev, _, encd = _load(request, name, D)
    ref = _generate(cpu, enc, **DECODING[decoding])
    out = _generate(dev, encd, **DECODING[decoding])
    assert out.sequences.device == DEV
    assert torch.equal(out.sequences.cpu(), ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW
    for s, r in zip(out.scores, ref.scores):  # -inf where a logits processor banned a token
        assert s.device == DEV
        torch.testing.assert_close(s.cpu(), r, rtol=0, atol=HF_TOL)
    cache = _cache_tensors(out.past_key_values)
    assert cache and all(t.device == DEV for t in cache)  # the KV cache lives in device memory


@pytest.mark.parametrize("name", ["gpt2", "marian"])
def test_kv_cache_saves_crossbar_reads(ideal, request, name):
    """With the cache each step feeds only the new token through the crossbars: same tokens, fewer row reads."""
    dev, _, encd = _load(request, name, D)
    kw = {k: v for k, v in encd.items() if k != "labels"}
    runs = {}
    for use_cache in (True, False):
        with Delta() as d:
            seqs = dev.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=use_cache)
        runs[use_cache] = seqs.cpu(), d["tile_reads"]
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1] < 0.6 * runs[False][1], runs


def test_opus_mt_shape_translates_like_cpu(ideal, opus_mt_dir):
    """The translation pipeline's steps (tokenize, generate, decode; the pipeline is gone in transformers 5)
    at opus-mt-en-tr's size."""
    tok = transformers.AutoTokenizer.from_pretrained(str(opus_mt_dir))
    cpu = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(opus_mt_dir)).eval()
    dev = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(opus_mt_dir)).to(D)
    cfg = dev.config
    assert cfg.encoder_layers == cfg.decoder_layers == 6 and cfg.encoder_attention_heads == 8
    enc = tok(SOURCES, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=1)
    ref = cpu.generate(**enc, **kw)
    with Delta() as d:
        out = dev.generate(**enc.to(D), **kw)
    assert out.device == DEV and torch.equal(out.cpu(), ref)
    assert tok.batch_decode(out, skip_special_tokens=True) == tok.batch_decode(ref, skip_special_tokens=True)
    assert d["mvms"] >= 6 * 6 + 8 * (6 * 8 + 1)  # encoder once; per step: self + cross attention, ffn, lm_head


@pytest.mark.parametrize("name", ["gpt2", "marian"])
def test_generate_on_y1_gives_valid_tokens_from_the_crossbars(y1, request, name):
    dev, _, encd = _load(request, name, D)
    with sidra_torch.profiler.profile() as prof:
        out = _generate(dev, encd)
    seqs = out.sequences
    batch, prompt = encd["input_ids"].shape
    assert seqs.device == DEV and seqs.dtype == torch.long
    if name == "gpt2":  # the prompt, then the new tokens
        assert seqs.shape == (batch, prompt + NEW)
        assert torch.equal(seqs[:, :prompt].cpu(), encd["input_ids"].cpu())
    else:  # the decoder start token, then the new tokens
        assert seqs.shape == (batch, 1 + NEW)
        assert (seqs[:, 0].cpu() == dev.config.decoder_start_token_id).all()
    ids = seqs.cpu()
    assert ids.min().item() >= 0 and ids.max().item() < dev.config.vocab_size
    rows = {r.name: r for r in prof.key_averages()}
    crossbar = {n: r for n, r in rows.items() if r.where == "crossbar"}
    assert set(crossbar) & {"sidra::addmm", "sidra::mm", "sidra::linear"}, sorted(crossbar)
    assert sum(r.calls for r in crossbar.values()) >= NEW * STEP_MVMS[name]
    assert prof.total.programming > 0  # the weights were written by ISPP on first use


# ---------------------------------------------------------------------------
# regression: the fp16 engine stored an fp32 finfo.min attention mask as -inf, so a fully masked row (left
# padding under a causal mask) softmaxed to NaN, and 0 * NaN spread it through the next layer's attention


def test_engine_storage_saturates_instead_of_overflowing(int8):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 4)
    mask[0] = torch.finfo(torch.float32).min  # row 0 fully masked, as HF's eager attention builds it
    out = (x.to(D) + mask.to(D)).softmax(-1).cpu()
    assert torch.equal(out[0], torch.full((4,), 0.25))  # as on the host: uniform, not NaN
    torch.testing.assert_close(out[1], x[1].softmax(-1), rtol=0, atol=2e-3)
    big = torch.finfo(torch.float16).max
    y = (torch.tensor([1e6, -1e6, float("-inf"), float("nan"), 3.0]).to(D) * 1.0).cpu()
    assert y[:2].tolist() == [big, -big] and y[2] == float("-inf") and y[3].isnan() and y[4] == 3.0


def test_generate_eager_attention_with_left_padding_on_int8(int8, gpt2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(gpt2_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gpt2_dir), attn_implementation="eager").to(D)
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to(D)
    assert (enc["attention_mask"].cpu()[:, 0] == 0).any()  # a left-padded row
    torch.manual_seed(0)
    out = _generate(model, enc, do_sample=True, top_k=5)  # sampling refused NaN probabilities
    assert out.sequences.shape == (2, enc["input_ids"].shape[1] + NEW)
    assert not any(s.cpu().isnan().any() for s in out.scores)
