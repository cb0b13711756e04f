"""Train the built-in model on the synthetic two-stage corpus (:mod:`kvhandoff.builtin.corpus`).

Called once by :mod:`kvhandoff.model` when the model is generated; deterministic for a
given seed, thread count and torch build (the cached result is what every engine loads,
so P and D always share the same weights). The loss covers only what the model is asked
to produce (the thinking span, its end, the semantic id, EOS): the history is the
user's input and carries no rule.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from kvhandoff.builtin.corpus import SID_TOKENS, Example, make_example, semantic_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    seed: int
    steps: int = 700
    batch_size: int = 24
    lr: float = 3e-3
    warmup_steps: int = 40
    max_items: int = 48
    #: Every ``long_every``-th batch has long histories, so positions up to a few hundred
    #: tokens are seen in training (the harness hands off ~700-token parents).
    long_every: int = 8
    long_max_items: int = 300


class Encoder:
    """Token ids of corpus pieces, as the router and the engines will see them."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        ids = tokenizer.convert_tokens_to_ids
        self.think_end, self.sid_begin, self.sid_end = ids(["</think>", "<|sid_begin|>",
                                                            "<|sid_end|>"])
        self.eos = tokenizer.eos_token_id
        self.newline = tokenizer.encode("\n", add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def example(self, ex: Example, sid: list[str]) -> tuple[list[int], int]:
        """(token ids, index of the first target token) of one corpus line."""
        prompt = self.encode(ex.prompt)
        target = self.encode(" " + ex.thinking)
        if ex.ends_by_eos:
            target += [self.eos]
        else:
            target += [self.think_end, *self.newline, self.sid_begin,
                       *self.tok.convert_tokens_to_ids(sid), self.sid_end, self.eos]
        return prompt + target, len(prompt)


def _batch(enc: Encoder, rng: random.Random, size: int, max_items: int):
    import torch


    rows = []
    for _ in range(size):
        ex = make_example(rng, max_items=max_items)
        rows.append(enc.example(ex, semantic_id(ex.history)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((size, width), enc.eos, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for r, (ids, start) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, start : len(ids)] = torch.tensor(ids[start:])
    return input_ids, labels


def train(model_dir: str, cfg: TrainConfig) -> dict[str, float]:
    """Train the randomly initialised model in ``model_dir`` in place (safetensors)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = Encoder(tok)
    for t in SID_TOKENS:
        assert len(enc.encode(t)) == 1, f"semantic-id token {t} is not one token"
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01,
                            betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup_steps)
                                   / (cfg.steps - cfg.warmup_steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(cfg.seed)
    t0, loss_ema = time.perf_counter(), None
    for step in range(cfg.steps):
        long = cfg.long_every and step % cfg.long_every == cfg.long_every - 1
        input_ids, labels = _batch(enc, rng, cfg.batch_size // 4 if long else cfg.batch_size,
                                   cfg.long_max_items if long else cfg.max_items)
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if step % 100 == 0 or step == cfg.steps - 1:
            logger.info("train step %d/%d loss %.3f (%.0fs)", step, cfg.steps, loss_ema,
                        time.perf_counter() - t0)
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"loss": float(loss_ema or 0.0), "seconds": time.perf_counter() - t0}
