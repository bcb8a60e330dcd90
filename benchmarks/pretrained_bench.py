"""Starting from a pretrained LLM (issue #45's benchmark): load seconds and peak host memory per rank at world 1
and 2, the profiler's conversations/s on LLaVA-format records, and generation with the KV cache against full
recompute (`generation_bench.generation_figures`).

    .venv/bin/python benchmarks/pretrained_bench.py [--quick] --out pretrained.json

The LLM is Qwen2-0.5B's shape (896 wide, 24 layers, 14/2 heads, vocabulary 151,936; `--quick`: 4 layers),
random weights written by transformers with a small BPE tokenizer trained here (no hub). A rank's peak is its
process's maximum RSS after building the replica, beside its RSS before (the fixed overhead: torch, the
runtime); the target is a per-rank peak of at most 0.6 x the model's bytes at world 2, plus that overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation_bench import generation_figures
from omni_core.common.plan import ParallelPlan
from omni_core.data.profile import profile_dataset
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import preimport, run_ranks
from omni_core.runtime.replica import build_replica

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the", "a", "red", "blue", "green", "box", "circle", "square", "image", "shows",
    "is", "on", "of", "left", "right", "top", "small", "large", "what", "colour",
]
CONVERSATIONS = 2000


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_llm(folder: Path, quick: bool) -> int:
    """Qwen2-0.5B-shaped random weights and a ChatML tokenizer in `folder`; the weights' bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(0)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator((_sentence(rng, 12) for _ in range(2000)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=4 if quick else 24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_recipe(root: Path, llm: Path, data: Path | None = None) -> Recipe:
    fields: dict = {"seq_len": 1024}
    if data is not None:
        fields.update(source="jsonl", path=str(data), format="conversation", media_root=str(data.parent),
                      profile_decode=False)
    return Recipe.model_validate({
        "experiment": {"name": "pretrained-bench", "output_dir": str(root / "out"), "seed": 3},
        "data": fields,
        "model": {"flavor": "debug", "pretrained": {"llm": str(llm)}},
        "train": {"steps": 1, "ckpt_every": 0},
    })


def _load_rank(rank: int, world: int, root: str, llm: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    start = time.perf_counter()
    replica = build_replica(bench_recipe(Path(root), Path(llm)), ParallelPlan.parse(f"dp{world}"), info,
                            torch.float32)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if replica.meshes is not None:
        replica.meshes.release()
    return {"load_s": seconds, "rss_before_mb": before, "peak_rss_mb": peak}


def load_figures(root: Path, llm: Path, model_bytes: int) -> dict:
    out: dict = {"model_mb": model_bytes / 2**20}
    for world in (1, 2):
        ranks = run_ranks(_load_rank, world, str(root), str(llm), timeout_s=900)
        out[f"world{world}"] = ranks
        overhead = max(r["rss_before_mb"] for r in ranks)
        out[f"world{world}_peak_over_model"] = max(r["peak_rss_mb"] - overhead for r in ranks) / out["model_mb"]
    return out


def write_conversations(folder: Path, count: int) -> Path:
    """LLaVA-format records, text only (the profiler's tokenization and packing are what is timed)."""
    rng = random.Random(1)
    records = [
        {"id": f"c{i}", "conversations": [
            {"from": "human", "value": _sentence(rng, rng.randint(6, 30)) + "?"},
            {"from": "gpt", "value": _sentence(rng, rng.randint(4, 60)) + "."},
            {"from": "human", "value": _sentence(rng, rng.randint(4, 20)) + "?"},
            {"from": "gpt", "value": _sentence(rng, rng.randint(4, 40)) + "."}]}
        for i in range(count)
    ]
    path = folder / "conversations.json"
    path.write_text(json.dumps(records))
    return path


def profile_figures(root: Path, llm: Path, count: int) -> dict:
    data = write_conversations(root, count)
    start = time.perf_counter()
    profile, _ = profile_dataset(bench_recipe(root, llm, data), root / "profile", draw=False)
    seconds = time.perf_counter() - start
    return {"conversations": profile.total_samples, "profile_s": seconds,
            "conversations_per_s": profile.total_samples / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    preimport()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_bytes = write_llm(root / "llm", args.quick)
        report = {
            "quick": args.quick,
            "load_average": os.getloadavg(),
            "load": load_figures(root, root / "llm", model_bytes),
            "profiler": profile_figures(root, root / "llm", 300 if args.quick else CONVERSATIONS),
            "generation": generation_figures(args.quick, torch.device("cpu")),
        }
    report["load_average_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
