"""The model file of an eager-mode archive (``--model-file``) for TorchServe's stock text_classifier: the
EmbeddingBag + linear classifier of TorchServe's text classification example, tiny."""

import torch
from torch import nn


class TextClassifier(nn.Module):
    def __init__(self, vocab_size=64, classes=2):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, 8, mode="mean")
        self.fc = nn.Linear(8, classes)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


def token_vocabulary(texts):
    """Every token and bigram of ``texts`` as the stock handler's own clean-up and tokenizer produce them."""
    from ts.handler_utils.text_utils import ngrams_iterator
    from ts.torch_handler.text_classifier import TextClassifier as StockHandler

    handler = StockHandler()

    def tokens(text):
        text = handler._expand_contractions(handler._remove_html_tags(text).lower())
        return handler._tokenize(handler._remove_punctuation(handler._remove_accented_characters(text)))

    entries = sorted({entry for text in texts for entry in ngrams_iterator(tokens(text), 2)})
    return {entry: index for index, entry in enumerate(entries)}


def save_weights(path, seed=0):
    torch.manual_seed(seed)
    torch.save(TextClassifier().state_dict(), path)
    return path
