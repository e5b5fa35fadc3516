"""The SIDRA documentation chapter's code examples (shared/seed), run as written where torch allows:
the package is `sidra_torch` (not `sidra_pytorch`), which registers the device on import (the
chapter's `torch.register_privateuse1_backend` is spelled `torch.utils.rename_privateuse1_backend`
in torch), models are built locally instead of downloaded, and sizes are small."""

from __future__ import annotations

import time

import pytest
import torch

import sidra_torch

from conftest_torch import D, int8, max_abs_diff, restore_chip  # noqa: F401

import transformers
transformers.logging.set_verbosity_error()


def test_backend_initialise_and_tensor_in_device_memory(int8):
    torch.utils.rename_privateuse1_backend("sidra")  # already done by `import sidra_torch`: a no-op
    device = torch.device("sidra:0")
    tensor = torch.randn(10, 10, device=device)  # in SIDRA memory
    assert tensor.device == device and torch.sidra.memory_allocated() >= 400


def test_graph_mode_decorated_function(int8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(D)
    x = torch.randn(2, 16).to(D)

    @torch.compile(backend="sidra")
    def model_fn(x):
        return model(x)

    with torch.no_grad():
        ref = model(x)
        assert max_abs_diff(model_fn(x), ref) <= 1e-6


def test_quantization_aware_int8_model(int8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    quantized_model = torch.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    quantized_model.to("sidra:0")
    torch.sidra.reset_counters()
    y = quantized_model(torch.randn(3, 16).to(D))
    assert y.device == torch.device(D) and torch.sidra.counters()["mvms"] == 2


def test_hybrid_execution_falls_back_for_an_exotic_op(int8):
    layer1, layer2 = torch.nn.Linear(8, 8).to(D), torch.nn.Linear(8, 8).to(D)

    def custom_op(x):
        return torch.special.i0e(x)  # no device kernel: the host runs it

    def forward(x):
        x = layer1(x)  # SIDRA
        x = custom_op(x)  # CPU fallback (auto)
        x = layer2(x)  # SIDRA
        return x

    torch.sidra.reset_counters()
    with torch.no_grad():
        y = forward(torch.randn(2, 8).to(D))
    c = torch.sidra.counters()
    assert y.device == torch.device(D) and c["mvms"] == 2 and c["fallback_ops"] >= 1


def test_benchmark_loop_and_profiler(int8):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=100, max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # attention as its ops, so the table has the chapter's softmax
    model = transformers.BertModel(cfg).eval().to("sidra:0")  # load_model("bert-base"), small
    x = torch.randn(1, 32, 64).to("sidra:0")
    with torch.no_grad():
        for _ in range(2):  # warmup
            y = model(inputs_embeds=x)
        torch.sidra.synchronize()
        start, end = torch.sidra.Event(enable_timing=True), torch.sidra.Event(enable_timing=True)
        t0 = time.time()
        start.record()
        for _ in range(3):
            y = model(inputs_embeds=x)
        end.record()
        torch.sidra.synchronize()
        t1 = time.time()
        assert t1 > t0 and start.elapsed_time(end) > 0  # ms on the simulated clock
        with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.SIDRA]
        ) as prof:
            y = model(inputs_embeds=x)
        print(prof.key_averages().table())
    # "matmul 2.1 ms, softmax 0.3 ms, ...": the device ops with their device time
    table = prof.key_averages().table()
    assert "Self SIDRA" in table
    device_us = {e.key: e.device_time_total for e in prof.key_averages()}
    assert device_us["addmm"] > 0 and device_us["_softmax"] > 0
    assert y.last_hidden_state.shape == (1, 32, 64)


def test_thirty_second_experiment(int8, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=100, max_position_embeddings=64, num_labels=2)
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path)  # "bert-base-uncased", local
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    model = model.to("sidra:0")
    inputs = {"input_ids": torch.tensor([[2, 17, 42, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    inputs = transformers.BatchEncoding(inputs).to("sidra:0")  # tokenizer("Hello SIDRA", return_tensors="pt")
    outputs = model(**inputs)
    assert outputs.logits.shape == (1, 2) and outputs.logits.device == torch.device("sidra:0")
