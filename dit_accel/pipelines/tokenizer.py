"""A word-level tokenizer built in code, for tiny pipelines that must never reach a hub.

It stands in for a real text encoder's tokenizer (T5's SentencePiece, Qwen's BPE): the same
`PreTrainedTokenizerFast` interface (padding, truncation, attention masks, save_pretrained), a
vocabulary of a few hundred lower-case words, and every other word mapped to `<unk>`. The ids it
produces are meaningless to a real encoder; to a random tiny one they are as good as any.
"""
from __future__ import annotations

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"

# Ids 0..2 are the special tokens (T5's order: pad 0, eos 1, unk 2); the words follow.
_WORDS = ("a an the of and in on with at to from by for is are cat dog bird fish horse person man woman child "
          "car boat tree flower sky sea river mountain city street house room light dark red green blue yellow "
          "white black small large fast slow running walking flying swimming sitting sunset night day rain snow "
          "video camera shot close wide slowly over under through").split()


def word_vocab(size: int) -> dict[str, int]:
    """`size` entries: the special tokens, the words above, then filler tokens `w<n>` up to `size`."""
    if size < 3 + len(_WORDS):
        raise ValueError(f"a vocabulary of {size} entries cannot hold the {3 + len(_WORDS)} built-in tokens")
    tokens = [PAD, EOS, UNK, *_WORDS]
    tokens += [f"w{i}" for i in range(size - len(tokens))]
    return {token: index for index, token in enumerate(tokens)}


def build_word_tokenizer(vocab_size: int, *, model_max_length: int = 512):
    """A `PreTrainedTokenizerFast` over `word_vocab(vocab_size)`: lower-cases, splits on white space and
    punctuation, appends `</s>`. Save it with `save_pretrained`; it loads back with no network."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = word_vocab(vocab_size)  # ids 0 .. vocab_size - 1, the special tokens first
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                        special_tokens=[(EOS, vocab[EOS])])
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=model_max_length, pad_token=PAD,
                                   eos_token=EOS, unk_token=UNK, padding_side="right")
