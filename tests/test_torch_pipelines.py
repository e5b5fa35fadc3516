"""transformers.pipeline(task, model=folder, device="sidra:0") on local model folders (tests/hf_local.py):
on the ideal chip each pipeline gives the CPU pipeline's answer, and its model's work ran on the crossbars."""

from __future__ import annotations

import pytest

from conftest_torch import DEV, SENTENCES, Delta, ideal, max_abs_diff, restore_chip  # noqa: F401

import transformers
pytest.register_assert_rewrite("hf_local")
from hf_local import PROMPTS, SOURCES  # noqa: E402

pytest_plugins = ("hf_local",)
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

SCORE_TOL = 1e-4


def _pipelines(task, folder):
    """The same local folder loaded as a CPU pipeline and as a sidra:0 pipeline."""
    cpu = transformers.pipeline(task, model=str(folder), tokenizer=str(folder), device="cpu")
    dev = transformers.pipeline(task, model=str(folder), tokenizer=str(folder), device="sidra:0")
    assert dev.device == DEV and dev.model.device == DEV
    assert all(p.device == DEV for p in dev.model.parameters())
    return cpu, dev


def _run_on_chip(pipe, *args, **kwargs):
    """Run a sidra pipeline and check its model multiplied on the crossbars."""
    with Delta() as d:
        out = pipe(*args, **kwargs)
    assert d["mvms"] > 0, d
    return out


def test_feature_extraction_minilm_matches_cpu(ideal, minilm_dir):
    cpu, dev = _pipelines("feature-extraction", minilm_dir)
    kw = dict(return_tensors=True, batch_size=4)  # padded batches: the attention mask matters
    ref = cpu(SENTENCES[:8], **kw)
    out = _run_on_chip(dev, SENTENCES[:8], **kw)
    assert len(out) == len(ref) == 8
    for o, r in zip(out, ref):
        assert o.shape == r.shape and r.shape[-1] == 384
        assert max_abs_diff(o, r) <= SCORE_TOL


def test_text_classification_matches_cpu(ideal, bert_cls_dir):
    cpu, dev = _pipelines("text-classification", bert_cls_dir)
    texts = SENTENCES[:4]
    ref = cpu(texts, top_k=None, batch_size=2)
    out = _run_on_chip(dev, texts, top_k=None, batch_size=2)
    for o, r in zip(out, ref):
        assert [x["label"] for x in o] == [x["label"] for x in r]
        assert {x["label"] for x in o} == {"negative", "neutral", "positive"}
        assert max(abs(a["score"] - b["score"]) for a, b in zip(o, r)) <= SCORE_TOL


def test_fill_mask_matches_cpu(ideal, bert_mlm_dir):
    cpu, dev = _pipelines("fill-mask", bert_mlm_dir)
    texts = ["The cat [MASK] a book today.", "My friend opens the [MASK] again."]
    ref = cpu(texts, top_k=5, batch_size=2)
    out = _run_on_chip(dev, texts, top_k=5, batch_size=2)
    for o, r in zip(out, ref):
        assert [x["token"] for x in o] == [x["token"] for x in r]
        assert [x["sequence"] for x in o] == [x["sequence"] for x in r]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(o, r)) <= SCORE_TOL


def test_text_generation_gpt2_greedy_matches_cpu(ideal, gpt2_dir):
    cpu, dev = _pipelines("text-generation", gpt2_dir)
    kw = dict(max_new_tokens=8, do_sample=False, batch_size=2, return_tensors=True)  # left-padded batch
    ref = cpu(PROMPTS, **kw)
    out = _run_on_chip(dev, PROMPTS, **kw)
    ids = [o[0]["generated_token_ids"] for o in out]
    assert ids == [r[0]["generated_token_ids"] for r in ref]
    prompt_lens = [len(dev.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert [len(i) for i in ids] == [max(prompt_lens) + 8] * 2  # the pipeline keeps the batch's left padding


@pytest.mark.skipif("translation" not in transformers.pipelines.SUPPORTED_TASKS,
                    reason="transformers 5 removed the translation pipeline; test_torch_generate.py::"
                           "test_opus_mt_shape_translates_like_cpu runs what it did")
def test_translation_opus_mt_shape_matches_cpu(ideal, opus_mt_dir):
    cpu, dev = _pipelines("translation", opus_mt_dir)
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=1, return_tensors=True)
    ref = cpu(SOURCES, **kw)
    out = _run_on_chip(dev, SOURCES, **kw)
    assert [o["translation_token_ids"].tolist() for o in out] == [r["translation_token_ids"].tolist() for r in ref]
