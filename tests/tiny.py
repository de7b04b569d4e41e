"""A tiny random Llama config for tests that need a model but not a good one, greedy answers and
logits of a runner without an engine around it, transformers' own, and a saved model's answers
through an Engine against transformers'."""

from pathlib import Path

import torch
from transformers import LlamaConfig

from mashbox import Engine, SamplingParams
from mashbox.engine.load.checkpoint import Checkpoint
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence


def tiny_config(vocab_size: int, **overrides: object) -> LlamaConfig:
    return LlamaConfig(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "initializer_range": 0.3, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, **overrides,
    })


def greedy(runner: ModelRunner, prompts: list[list[int]], new: int = 12) -> list[list[int]]:
    """Greedy answers (the runner has 4 slots of 512). The steps are given times in which a prompt
    token costs 1-4 decode rows, so that beside decoding rows prompts are cut mid-chunk where the
    runner allows it."""
    scheduler = Scheduler(num_slots=4, ctx=512, chunk_tokens=32, step_tokens=64, busy_tokens=64,
                          cut_anywhere=runner.cut_anywhere)
    seqs = [Sequence(str(i), p, SamplingParams(), new) for i, p in enumerate(prompts)]
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_work:
        plan = scheduler.schedule()
        cost = 1 + len(scheduler.running) % 4
        scheduler.update(plan, runner.run(plan), 0.001 * (plan.decode_rows + cost * plan.prompt_tokens))
    return [s.output_ids for s in seqs]


def last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The runner's logits after ``prompt`` (at most 512 tokens, all in one step)."""
    scheduler = Scheduler(num_slots=4, ctx=512, chunk_tokens=512, step_tokens=512, busy_tokens=512)
    scheduler.add(Sequence("0", prompt, SamplingParams(), 1))
    batch = runner._batch(scheduler.schedule())
    with torch.inference_mode():
        return runner._logits(runner.forward(batch).index_select(0, batch.sample_rows))[0]


def random_norms(model) -> None:
    """Set a Gemma model's norm weights at random: transformers starts them at 0, a weight of 1 + 0,
    which would hide a norm read without its shift."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)


def plain_runner(model) -> ModelRunner:
    """A runner of a transformers model's own tensors, in the exact float form (4 slots of 512)."""
    return ModelRunner(Checkpoint.from_model(model), num_slots=4, ctx=512, form="plain")


def logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits after ``prompt`` (ids)."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


def generate(model, prompt: list[int], n: int = 12) -> list[int]:
    """transformers' greedy answer of ``n`` tokens to ``prompt`` (ids)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def answers_as_transformers(folder: Path, model, tokenizer, prompts: list[str], n: int = 10,
                            save: bool = True) -> None:
    """``model`` and ``tokenizer`` saved in ``folder`` (``save=False``: the model is there already): an
    Engine on it answers each prompt greedily with transformers' text."""
    if save:
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with Engine(str(folder), dtype="float32", ctx=256, slots=2, quiet=True) as engine:
        for prompt in prompts:
            expected = tokenizer.decode(generate(model, tokenizer.encode(prompt), n), skip_special_tokens=True)
            assert engine.complete(prompt=prompt, max_tokens=n, temperature=0).choices[0].text == expected


def scripted(path: Path, source: Path, template: str, chain: list[str], special: bool = False,
             think_tokens: bool = True) -> Path:
    """A 2-layer Llama saved at ``path``, with the tokenizer of the model at ``source``, whose next token
    depends only on the last one: each token of ``chain`` (one token each; ``<think>`` and ``</think>`` are
    added to the vocabulary where ``think_tokens``, as special tokens where ``special``) is followed by the next, every other token
    by ``<|im_end|>``. Its answers are known to the token, whatever the prompt before its last token."""
    from transformers import AddedToken, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source)
    if think_tokens:  # else the tags are written in pieces (``</``, ``think``, ``>``)
        tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.chat_template = template
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in chain]
    assert all(len(i) == 1 for i in ids), [(t, i) for t, i in zip(chain, ids) if len(i) != 1]
    follows = dict(zip((i[0] for i in ids), (i[0] for i in ids[1:])))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = LlamaForCausalLM(tiny_config(len(tokenizer), tie_word_embeddings=False, eos_token_id=end)).eval()
    hidden = model.config.hidden_size
    known = sorted({*follows, *follows.values()})
    assert len(known) < hidden
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # the layers add nothing
                p.zero_()
        model.model.embed_tokens.weight[:] = torch.eye(hidden)[hidden - 1]  # any other token: the last unit
        head = model.lm_head.weight
        head.zero_()
        head[end, hidden - 1] = 50.0
        for unit, token in enumerate(known):
            model.model.embed_tokens.weight[token] = torch.eye(hidden)[unit]
            head[follows.get(token, end), unit] = 50.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
