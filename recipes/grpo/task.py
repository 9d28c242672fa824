"""A verifiable synthetic task with a character tokenizer: multi-digit addition.

Prompt ``<bos>07+45=``, answer ``52<eos>`` (or ``25<eos>`` with ``reverse_answer``). Operands are
zero-padded so every prompt has the same length (no padding inside a batch). Reward 1.0 if the
decoded response up to ``<eos>`` equals the answer exactly, else 0.0 (NeMo-RL's math env
convention).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

PAD, EOS, BOS = 0, 1, 2
_CHARS = "0123456789+="
_TOK = {c: i + 3 for i, c in enumerate(_CHARS)}
_CHR = {i: c for c, i in _TOK.items()}
VOCAB_SIZE = 3 + len(_CHARS)  # 15; the model's vocab may be larger


def encode(text: str) -> List[int]:
    return [_TOK[c] for c in text]


def decode(ids: Sequence[int]) -> str:
    """Characters up to the first ``<eos>`` (``<pad>``/``<bos>`` dropped)."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i in _CHR:
            out.append(_CHR[i])
    return "".join(out)


class AdditionTask:
    """``a + b`` with ``num_digits``-digit operands."""

    def __init__(self, num_digits: int = 2, reverse_answer: bool = False):
        self.num_digits = num_digits
        self.reverse_answer = reverse_answer
        self.prompt_len = 1 + 2 * num_digits + 2           # <bos> a + b =
        self.max_answer_len = num_digits + 1 + 1           # digits of the sum + <eos>

    def answer(self, a: int, b: int) -> str:
        s = str(a + b)
        return s[::-1] if self.reverse_answer else s

    def sample(self, n: int, gen: torch.Generator) -> Tuple[torch.Tensor, List[str]]:
        """``n`` random problems -> (prompt tokens ``[n, prompt_len]`` int64, answers)."""
        hi = 10 ** self.num_digits
        ab = torch.randint(0, hi, (n, 2), generator=gen).tolist()
        return self.encode_prompts(ab), [self.answer(a, b) for a, b in ab]

    def encode_prompts(self, ab) -> torch.Tensor:
        d = self.num_digits
        return torch.tensor([[BOS] + encode(f"{a:0{d}d}+{b:0{d}d}=") for a, b in ab], dtype=torch.long)

    def reward(self, response_ids: torch.Tensor, answers: Sequence[str]) -> torch.Tensor:
        """``[n, T]`` sampled tokens -> ``[n]`` float: 1.0 for an exact answer followed by
        ``<eos>`` (a response that never ends scores 0)."""
        out = torch.zeros(len(answers))
        for i, (ids, ans) in enumerate(zip(response_ids.tolist(), answers)):
            if EOS in ids and decode(ids) == ans:
                out[i] = 1.0
        return out

    def sft_batch(self, n: int, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forcing batch: tokens ``[n, prompt_len + max_answer_len]`` and a 0/1 mask of
        the positions whose *next* token is part of the answer (incl. ``<eos>``)."""
        prompts, answers = self.sample(n, gen)
        total = self.prompt_len + self.max_answer_len
        tokens = torch.full((n, total), PAD, dtype=torch.long)
        loss_mask = torch.zeros(n, total - 1)
        tokens[:, :self.prompt_len] = prompts
        for i, ans in enumerate(answers):
            resp = encode(ans) + [EOS]
            tokens[i, self.prompt_len:self.prompt_len + len(resp)] = torch.tensor(resp)
            loss_mask[i, self.prompt_len - 1:self.prompt_len - 1 + len(resp)] = 1
        return tokens, loss_mask


def make_task(cfg) -> AdditionTask:
    """From a :class:`~efa_ep.recipes.grpo.config.TaskConfig`."""
    return AdditionTask(cfg.num_digits, cfg.reverse_answer)
