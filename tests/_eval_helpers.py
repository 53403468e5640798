"""Tiny planted models, a character tokenizer and a word tokenizer for the evaluation tests (no
trained weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ASSISTANT_START = 97
VOCAB = 98  # 0 = bos, 1..95 printable ASCII, 96 = newline, 97 = assistant start


class CharTokenizer:
    """One id per character; enough of the lockstep Tokenizer surface for the evaluators."""

    def get_bos_token_id(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        out = []
        for ch in text:
            if ch == "\n":
                out.append(96)
            elif 32 <= ord(ch) <= 126:
                out.append(ord(ch) - 31)
            else:
                raise ValueError(f"character {ch!r} is outside the test vocabulary")
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join("\n" if i == 96 else "" if i in (0, ASSISTANT_START) else chr(i + 31) for i in ids)

    def encode_special(self, name: str) -> int:
        return {"<|assistant_end|>": 96}[name]  # shares the newline's id: the vocabulary has no spare one

    def render_for_completion(self, conversation: dict) -> list[int]:
        user = [m for m in conversation["messages"] if m["role"] == "user"][-1]
        text = "".join(p["text"] for p in user["content"])
        return [0, *self.encode(text), ASSISTANT_START]


class BigramModel(torch.nn.Module):
    """Logits depend only on the current token: a table whose entries the test plants."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(VOCAB, VOCAB))

    def plant(self, tok: CharTokenizer, text: str, strength: float = 10.0) -> None:
        ids = tok.encode(text)
        with torch.no_grad():
            for a, b in zip(ids, ids[1:]):
                self.table[a, b] = strength

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        logits = self.table[idx]  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
        loss = loss.view(targets.shape)  # (B, T)
        return loss if loss_reduction == "none" else loss[targets >= 0].mean()


class WordTokenizer:
    """Longest match over `words`, else one id per printable character or newline; id 0 is BOS.
    Words that start with a space take the delimiter's space into them, as a BPE's would."""

    def __init__(self, words: tuple[str, ...]) -> None:
        self.words = sorted(words, key=len, reverse=True)
        self.vocab = ["<bos>", *(chr(c) for c in range(32, 127)), "\n", *words]
        self.ids = {t: i for i, t in enumerate(self.vocab)}

    def get_bos_token_id(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            word = next((w for w in self.words if text.startswith(w, i)), text[i])
            out.append(self.ids[word])
            i += len(word)
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i)
