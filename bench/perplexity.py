"""Perplexity of a GGUF through mashbox's kernels beside llama.cpp's `llama-perplexity` on the same file
and the same text, computed the same way.

    .venv/bin/python bench/perplexity.py [--model ID-or-.gguf] [--llama-perplexity PATH] [--chunks 20] [--kv-dtype q8_0]

The text is the docstrings of a fixed list of standard-library modules (bench/quality.py's: English
prose every Python has). Both cut its tokens into chunks of 512 (the first token of each made BOS
where the model's vocabulary adds one), run each chunk from an empty cache and score the next-token
log-likelihood of its second half, as `llama-perplexity -c 512` does. mashbox runs the engine's
own forward (the kernels a request uses, prompt chunks of 256) on the GGUF's blocks. Prints both
perplexities and their ratio; llama.cpp's tokens are used for both where its tokenizer is found.
``--kv-dtype q8_0`` keeps both KV caches in q8_0 (llama.cpp's ``-ctk/-ctv q8_0``).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quality import text  # noqa: E402

from mashbox import SamplingParams  # noqa: E402
from mashbox.engine.load.catalog import resolve  # noqa: E402
from mashbox.engine.load.loader import load  # noqa: E402
from mashbox.engine.model.form import decide  # noqa: E402
from mashbox.engine.model.runner import ModelRunner  # noqa: E402
from mashbox.engine.sched.scheduler import Scheduler  # noqa: E402
from mashbox.engine.sched.sequence import Sequence  # noqa: E402

CTX = 512
DEFAULT_LLAMA = Path("/tmp/llama-peer/build/bin/llama-perplexity")


def chunk_nll(runner: ModelRunner, ids: list[int]) -> tuple[float, int]:
    """(summed NLL, count) of the second half of one chunk's next tokens, from an empty slot."""
    scheduler = Scheduler(1, len(ids) + 1, 256)
    seq = Sequence("ppl", ids, SamplingParams(), 1)
    scheduler.add(seq)
    logits = []
    with torch.inference_mode():
        while seq.in_prefill or seq.num_computed == 0:
            plan = scheduler.schedule()
            hidden = runner.forward(runner._batch(plan))
            logits.append(runner._logits(hidden).float())
            scheduler.update(plan, [0] if plan.work[0].sample else [])
    runner.kv.keys.zero_()
    runner.kv.values.zero_()
    logits = torch.cat(logits)[: len(ids) - 1]
    first = CTX // 2
    targets = torch.tensor(ids[first + 1 :])
    nll = torch.nn.functional.cross_entropy(logits[first:], targets, reduction="sum").item()
    return nll, targets.shape[0]


def mashbox_perplexity(model: str, tokens: list[int], chunks: int, bos: int | None, kv: str) -> float:
    form = decide(torch.device("cpu"), None, batch_invariant=True, kv_dtype=kv)
    loaded = load(model, dtype=form.dtype)
    runner = ModelRunner(loaded.checkpoint, 1, CTX + 1, form)
    nll, count = 0.0, 0
    for c in range(chunks):
        ids = tokens[c * CTX : (c + 1) * CTX]
        if bos is not None:
            ids = [bos, *ids[1:]]
        n, k = chunk_nll(runner, ids)
        nll, count = nll + n, count + k
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf: Path, text_file: Path, chunks: int, threads: int, kv: str) -> float:
    out = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(CTX), "--chunks", str(chunks),
                          "-t", str(threads), "-b", str(CTX), "--no-warmup", "-ctk", kv, "-ctv", kv]
                         + (["--no-repack"] if _amx() else []),
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no estimate:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def _amx() -> bool:
    return "amx" in Path("/proc/cpuinfo").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--llama-perplexity", type=Path, default=DEFAULT_LLAMA)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtype", choices=["f16", "q8_0"], default="f16")
    args = parser.parse_args()
    source = resolve(args.model)
    loaded = load(args.model)
    tokenizer = loaded.tokenizer
    body = text()
    tokens = tokenizer.encode(body, add_special_tokens=False)
    chunks = min(args.chunks, len(tokens) // CTX)
    bos = tokenizer.bos_token_id if tokenizer.encode("a")[:1] == [tokenizer.bos_token_id] else None
    ours = mashbox_perplexity(args.model, tokens, chunks, bos, args.kv_dtype)
    print(f"{source.path.name}: {chunks} chunks of {CTX} tokens, KV cache {args.kv_dtype}")
    print(f"mashbox perplexity: {ours:.4f}")
    if args.llama_perplexity.exists():
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(body)
            f.flush()
            theirs = llama_perplexity(args.llama_perplexity, source.path, Path(f.name), chunks, args.threads,
                                      args.kv_dtype)
        print(f"llama-perplexity: {theirs:.4f}; mashbox / llama.cpp {ours / theirs:.4f}")


if __name__ == "__main__":
    main()
