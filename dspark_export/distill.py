"""Brief distillation of a small draft model against the target (CPU).

Data: the target's own greedy answers to the project's distillation prompts
(``export/data/distill_prompts.jsonl``, written for this purpose; disjoint from the benchmark
prompts), rendered with the chat template. Loss: KL(p_target || p_draft) on the answer
positions, teacher-forced. Only the draft's decoder layers and final norm train; the shared
embeddings / LM head stay frozen. Progress goes to the ``progress`` callback.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROMPTS = Path(__file__).resolve().parent / "data" / "distill_prompts.jsonl"


def teacher_answers(teacher, tokenizer, max_new_tokens: int, progress,
                    target_engine: Path | None = None) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) for every distillation prompt: greedy answers of
    the target's FP32 engine when one is given (fast, and equal to the teacher's greedy
    output), else of the PyTorch teacher."""
    import torch

    pipe = None
    if target_engine is not None:
        import dspark_edge

        pipe = dspark_edge.load(target_engine, "fp32", verify_hashes=False)
    out = []
    records = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, rec in enumerate(records):
        ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        if pipe is not None:
            answer = list(pipe.generate(rec["messages"], max_new_tokens=max_new_tokens).token_ids)
        else:
            x = torch.tensor([ids])
            with torch.no_grad():
                gen = teacher.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
            answer = gen[0, len(ids):].tolist()
        out.append((ids + answer, len(ids)))
        if (i + 1) % 5 == 0 or i + 1 == len(records):
            progress(f"      teacher answers {i + 1}/{len(records)}")
    return out


def distill(student, teacher, tokenizer, minutes: float, progress, max_new_tokens: int = 96,
            batch: int = 4, lr: float = 3e-4, seed: int = 0, target_engine: Path | None = None,
            min_steps: int = 0) -> dict:
    """Train ``student`` in place for ``minutes`` (and at least ``min_steps`` steps, however
    long they take); returns a small report."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    data = teacher_answers(teacher, tokenizer, max_new_tokens, progress, target_engine)
    # Teacher distributions once, as log-probs on the answer positions.
    targets = []
    with torch.no_grad():
        for seq, plen in data:
            logits = teacher(torch.tensor([seq])).logits[0, plen - 1:-1]
            targets.append(F.log_softmax(logits.float(), dim=-1))
    for name, p in student.named_parameters():
        p.requires_grad = "layers." in name or name.endswith("model.norm.weight")
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    student.train()
    order = torch.randperm(len(data))
    deadline = time.perf_counter() + minutes * 60
    step, losses, pos = 0, [], 0
    while step < min_steps or time.perf_counter() < deadline:
        opt.zero_grad()
        total = 0.0
        for _ in range(batch):
            i = int(order[pos % len(order)])
            pos += 1
            seq, plen = data[i]
            logits = student(torch.tensor([seq])).logits[0, plen - 1:-1]
            loss = F.kl_div(F.log_softmax(logits, dim=-1), targets[i], log_target=True, reduction="batchmean")
            (loss / batch).backward()
            total += float(loss.detach()) / batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(total)
        if step % 10 == 0:
            left = max(0.0, deadline - time.perf_counter())
            progress(f"      distill step {step}: KL {sum(losses[-10:]) / 10:.3f} ({left / 60:.1f} min left)")
    student.eval()
    for p in student.parameters():
        p.requires_grad = True
    report = {"steps": step, "sequences": len(data), "first_kl": losses[0] if losses else None,
              "last_kl": sum(losses[-10:]) / len(losses[-10:]) if losses else None}
    log.info("distillation: %s", report)
    return report
