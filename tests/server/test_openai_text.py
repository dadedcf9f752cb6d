"""Streaming text of the OpenAI-compatible endpoints: the pieces each token adds join to the
decoded text, are a prefix of it at every step, and hold back incomplete UTF-8 characters; for a
byte-level BPE tokenizer (the built-in one) and a SentencePiece-style one (Metaspace, which drops
a leading space when a decode starts mid-text)."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ember.engine.builtin import build_tokenizer
from ember.server.routes.openai import text_pieces

TEXT = "Ünïcödé tëxt — with 漢字, emoji 🙂🚀 and plain words: the quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    byte_dir = tmp_path_factory.mktemp("bytelevel")
    build_tokenizer(byte_dir)
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                           show_progress=False))
    return {"bytelevel": PreTrainedTokenizerFast.from_pretrained(str(byte_dir)),
            "metaspace": PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>")}


@pytest.mark.parametrize("name", ["bytelevel", "metaspace"])
def test_pieces_add_up_to_the_text(tokenizers_, name):
    tok = tokenizers_[name]
    rng = random.Random(0)
    ids = tok(TEXT)["input_ids"]
    cases = [ids, ids[1:40], [rng.randrange(len(tok)) for _ in range(200)], []]
    for tokens in cases:
        text = tok.decode(tokens, skip_special_tokens=True)
        pieces = text_pieces(tok, tokens, text)
        assert len(pieces) == len(tokens)
        assert "".join(pieces) == text
        so_far = ""
        for p in pieces:
            so_far += p
            assert text.startswith(so_far)
            assert "\ufffd" not in p or "\ufffd" in text
    # a real text streams token by token, not all at the end
    text = tok.decode(ids, skip_special_tokens=True)
    assert sum(1 for p in text_pieces(tok, ids, text) if p) > len(ids) // 2


def test_byte_split_characters_are_held_back(tokenizers_):
    tok = tokenizers_["bytelevel"]
    ids = tok("🙂")["input_ids"]
    assert len(ids) > 1  # the emoji is not in the tiny vocabulary: its bytes are separate tokens
    pieces = text_pieces(tok, ids, tok.decode(ids))
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂"
