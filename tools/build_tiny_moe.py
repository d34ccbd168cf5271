"""Build moealign's embedded default model: a tiny Qwen3-MoE trained on the Python standard library.

The mismatch test and the examples need a mixture-of-experts checkpoint that loads with plain
transformers, fits in the package (about 9 MB of fp32 safetensors), and behaves like a real model
where it matters: routers that prefer some experts over others, and next-token distributions whose
top-p sets are small. Random weights give near-uniform routers and near-uniform sampling sets, so they
prove nothing about routing replay or sampling-mask replay. This script trains one briefly on CPU.

    python tools/build_tiny_moe.py                          # writes moealign/assets/tiny_moe/ (~4-6 min, 2 cores)
    python tools/build_tiny_moe.py --quick --out /tmp/tiny  # smoke test: small corpus, a few steps

What it does, in order:

1. Corpus: the top-level ``*.py`` files of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), sorted by name. Every 8th file (index % 8 == 4) is held out;
   the rest is the training set. Each file is parsed and written back with ``ast.unparse`` after its
   docstrings are removed, so the text is code only (no docstrings, no comments, canonical layout):
   prose is where a model this small stays near uniform, and a model trained on raw source keeps
   top-p sets of 100+ tokens. The corpus therefore depends on the Python minor version (its stdlib and
   its ``ast.unparse``): the shipped model was built with the version recorded in ``build_info.json``;
   rebuilding on another Python gives a model of the same shape with similar statistics, but other
   weights.
2. Tokenizer: byte-level BPE with the ``tokenizers`` library, vocabulary 2048, special tokens
   ``<|endoftext|>`` (id 0; bos, eos) and ``<|pad|>`` (id 1), trained on the training files only.
3. Model: ``Qwen3MoeForCausalLM`` with 4 layers, 16 experts, top-4 (normalised), hidden 128, 4 query
   heads and 2 key/value heads of 32, experts of width 64, untied embeddings.
4. Training: AdamW (lr 3e-3, 5% linear warmup, then cosine to 0), 1500 steps of 16 random windows of 128
   tokens from the concatenated training files (about 4 epochs), cross-entropy plus 0.01 x a per-layer
   load-balancing loss on the router logits (``output_router_logits=True``) so that every expert is used.
5. Measurement on held-out windows: loss, next-token entropy at temperature 1, top-p 0.9 set size,
   router entropy / log(16), top-1 router probability, expert load per layer. Printed and written to
   ``build_info.json`` with the versions, the seed, the step count and the sha256 of the weights.
6. ``prompts.json``: 64 prompts of 32 tokens, each the start of a function definition in a held-out
   file, spread evenly over all such definitions.

Reproducibility: fixed seeds, ``torch.use_deterministic_algorithms(True)``, 2 torch threads, a fixed
file list. With the same Python, torch and transformers versions on the same kind of CPU, the weights'
sha256 is the same from run to run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
from pathlib import Path

# The tokenizers library's thread pool keeps spinning after encode_batch and then competes with torch's
# two threads (the first training steps run 10x slower). Its results do not depend on it.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "moealign" / "assets" / "tiny_moe"

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]  # ids 0 and 1
HELDOUT_EVERY, HELDOUT_AT = 8, 4  # file i is held out when i % 8 == 4
SEQ_LEN = 128
BATCH = 16
DEFAULT_STEPS = 1500
PEAK_LR = 3e-3
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.0
WEIGHT_DECAY = 0.1
AUX_LOSS_COEF = 0.01
EVAL_WINDOWS = 64
N_PROMPTS = 64
PROMPT_TOKENS = 32
TOP_P = 0.9
THREADS = 2

# Quick mode (the smoke test): a corpus subset and a handful of steps.
QUICK_TRAIN_FILES = 12
QUICK_STEPS = 4
QUICK_EVAL_WINDOWS = 8


# ----------------------------------------------------------------------------------------------------
# Corpus and tokenizer


def list_corpus(stdlib_dir: Path) -> tuple[list[Path], list[Path]]:
    """The fixed file list: top-level stdlib modules sorted by name, split into (train, held out)."""
    files = sorted((p for p in stdlib_dir.glob("*.py") if p.is_file()), key=lambda p: p.name)
    if len(files) < 2 * HELDOUT_EVERY:
        raise RuntimeError(f"only {len(files)} .py files in {stdlib_dir}; is this a full Python install?")
    train = [p for i, p in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_AT]
    heldout = [p for i, p in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_AT]
    return train, heldout


def strip_docstrings(source: str) -> str:
    """The module's code without docstrings or comments, in ast.unparse's canonical layout.

    Prose (docstrings, comments) is where a model this small stays near uniform: it is what keeps the
    top-p sets of a model trained on raw source large. Code alone is what a code model is confident on.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def read_texts(files: list[Path]) -> list[str]:
    return [strip_docstrings(p.read_text(encoding="utf-8", errors="replace")) for p in files]


def corpus_fingerprint(files: list[Path], texts: list[str]) -> str:
    h = hashlib.sha256()
    for p, t in zip(files, texts):
        h.update(p.name.encode() + b"\0" + t.encode("utf-8") + b"\0")
    return h.hexdigest()


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (GPT-2 style pre-tokenisation, no prefix space, no added bos)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return tok


def wrap_tokenizer(tok):
    """The transformers view of the tokenizer, so that AutoTokenizer.from_pretrained works."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token=None,
        pad_token="<|pad|>",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """All documents concatenated, each followed by <|endoftext|>, as one 1-D LongTensor."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------
# Model


def build_config(eos_id: int, pad_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,  # dense MLP width; unused since every layer is sparse
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=512,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        output_router_logits=False,  # training asks for them per call; inference does not pay for the aux loss
        router_aux_loss_coef=AUX_LOSS_COEF,
        mlp_only_layers=[],
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def lr_at(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay from PEAK_LR to FINAL_LR_FRACTION * PEAK_LR."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return PEAK_LR * (FINAL_LR_FRACTION + (1.0 - FINAL_LR_FRACTION) * cosine)


def make_optimizer(model) -> torch.optim.AdamW:
    """Weight decay on matrices (and expert tensors), none on norm gains."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, T] window (predicting positions 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer balancing loss, computed per layer and averaged over layers:
    E * sum_e f_e * P_e, with f_e the fraction of top-k slots that go to expert e and P_e its mean
    router probability. 1.0 when balanced, up to E when one expert takes everything.

    transformers' own aux_loss sums the counts of all layers before taking the product, so one layer's
    imbalance can hide behind another's (a layer can keep a dead expert); here each layer pays for its own."""
    per_layer = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        n_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        slot_fraction = F.one_hot(chosen, n_experts).float().sum(dim=(0, 1)) / (chosen.numel())
        per_layer.append(n_experts * (slot_fraction * probs.mean(dim=0)).sum())
    return torch.stack(per_layer).mean()


def train(model, stream: torch.Tensor, steps: int, seed: int, log_every: int) -> list[float]:
    """Returns the per-step language-model loss (without the balancing term)."""
    gen = torch.Generator().manual_seed(seed + 1)
    opt = make_optimizer(model)
    coef = model.config.router_aux_loss_coef
    n_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    model.train()
    losses: list[float] = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH,), generator=gen)
        ids = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        loss = lm_loss(out.logits, ids)
        balance = load_balancing_loss(out.router_logits, top_k)
        opt.zero_grad(set_to_none=True)
        (loss + coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(
                f"step {step:5d}/{steps}  lr {lr_at(step, steps):.2e}  loss {loss.item():.4f}  "
                f"balance {balance.item():.3f} (1 = balanced, {n_experts} = collapsed)  "
                f"{time.time() - t0:6.1f}s",
                flush=True,
            )
    return losses


# ----------------------------------------------------------------------------------------------------
# Measurement


def eval_windows(stream: torch.Tensor, n: int) -> torch.Tensor:
    """n windows of SEQ_LEN tokens at evenly spaced, fixed offsets of the held-out stream."""
    if len(stream) < SEQ_LEN + 1:
        raise RuntimeError("held-out stream shorter than one window")
    starts = torch.linspace(0, len(stream) - SEQ_LEN - 1, n).long()
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])


def top_p_set_size(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Number of tokens nucleus sampling keeps: the smallest prefix of the sorted distribution whose
    mass reaches top_p (a token is kept when the mass strictly before it is below top_p)."""
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return (mass_before < top_p).sum(dim=-1)


@torch.no_grad()
def measure(model, windows: torch.Tensor, chunk: int = 16) -> dict:
    model.eval()
    n_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    n_layers = model.config.num_hidden_layers
    losses, entropies, kept = [], [], []
    router_entropy = [[] for _ in range(n_layers)]
    router_top1 = [[] for _ in range(n_layers)]
    load = torch.zeros(n_layers, n_experts)
    for i in range(0, len(windows), chunk):
        ids = windows[i : i + chunk]
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        losses.append(lm_loss(out.logits, ids).item() * ids[:, 1:].numel())
        logp = out.logits.float().log_softmax(dim=-1).reshape(-1, out.logits.shape[-1])
        p = logp.exp()
        entropies.append(-(p * logp).sum(-1))
        kept.append(top_p_set_size(p, TOP_P).float())
        for layer, logits in enumerate(out.router_logits):
            r_logp = logits.float().log_softmax(dim=-1)
            r_p = r_logp.exp()
            router_entropy[layer].append(-(r_p * r_logp).sum(-1))
            router_top1[layer].append(r_p.max(dim=-1).values)
            chosen = r_p.topk(top_k, dim=-1).indices.reshape(-1)
            load[layer] += torch.bincount(chosen, minlength=n_experts).float()
    n_pred = windows[:, 1:].numel()
    load_frac = load / load.sum(dim=-1, keepdim=True)
    router_entropy_ratio = [torch.cat(v).mean().item() / math.log(n_experts) for v in router_entropy]
    router_top1_mean = [torch.cat(v).mean().item() for v in router_top1]
    return {
        "heldout_loss": sum(losses) / n_pred,
        "next_token_entropy_nats": torch.cat(entropies).mean().item(),
        "top_p": TOP_P,
        "top_p_kept_mean": torch.cat(kept).mean().item(),
        "top_p_kept_median": torch.cat(kept).median().item(),
        "router_entropy_over_logE_per_layer": router_entropy_ratio,
        "router_entropy_over_logE_mean": sum(router_entropy_ratio) / n_layers,
        "router_top1_prob_per_layer": router_top1_mean,
        "router_top1_prob_mean": sum(router_top1_mean) / n_layers,
        "expert_load_fraction_min_per_layer": load_frac.min(dim=-1).values.tolist(),
        "expert_load_fraction_max_per_layer": load_frac.max(dim=-1).values.tolist(),
        "expert_load_fraction_uniform": 1.0 / n_experts,
        "eval_positions": int(len(windows) * SEQ_LEN),
    }


# ----------------------------------------------------------------------------------------------------
# Prompts


DEF_LINE = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+[A-Za-z_]", re.MULTILINE)


def make_prompts(tok, texts: list[str], n: int, n_tokens: int) -> list[str]:
    """The first n_tokens tokens from each function definition in the held-out files (starting at
    ``def``, indentation dropped), then n of them evenly spread over all candidates, in file order.
    A candidate is kept only when its text re-tokenises to exactly the same n_tokens ids."""
    candidates: list[str] = []
    seen: set[str] = set()
    for text in texts:
        for m in DEF_LINE.finditer(text):
            start = m.start() + len(m.group(0)) - len(m.group(0).lstrip(" \t"))
            ids = tok.encode(text[start : start + 20 * n_tokens]).ids[:n_tokens]
            if len(ids) < n_tokens:
                continue
            prompt = tok.decode(ids)
            if prompt in seen or tok.encode(prompt).ids != ids:
                continue
            seen.add(prompt)
            candidates.append(prompt)
    if len(candidates) < n:
        raise RuntimeError(f"only {len(candidates)} prompt candidates in the held-out files, need {n}")
    return [candidates[i * len(candidates) // n] for i in range(n)]


# ----------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS}, quick {QUICK_STEPS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke test: corpus subset, a few steps")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if steps < 1:
        ap.error("--steps must be >= 1")

    t_start = time.time()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    import tokenizers
    import transformers
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    # 1. corpus
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = list_corpus(stdlib_dir)
    if args.quick:
        train_files = train_files[:QUICK_TRAIN_FILES]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    print(f"python {platform.python_version()}  stdlib {stdlib_dir}")
    print(f"corpus: {len(train_files)} training files, {len(heldout_files)} held-out files")

    # 2. tokenizer
    tok = train_tokenizer(train_texts)
    eos_id, pad_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>")
    train_stream = encode_stream(tok, train_texts, eos_id)
    heldout_stream = encode_stream(tok, heldout_texts, eos_id)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_stream)} training, {len(heldout_stream)} held-out tokens")

    # 3. model (eager experts: a plain loop over experts, deterministic on CPU)
    config = build_config(eos_id, pad_id)
    model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="eager", dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")

    # 4. training
    losses = train(model, train_stream, steps, args.seed, log_every=max(1, min(50, steps // 10)))
    tail = losses[-min(50, len(losses)) :]
    final_train_loss = sum(tail) / len(tail)

    # 5. measurement
    windows = eval_windows(heldout_stream, QUICK_EVAL_WINDOWS if args.quick else EVAL_WINDOWS)
    stats = measure(model, windows)

    # 6. prompts, then save
    prompts = make_prompts(tok, heldout_texts, N_PROMPTS, PROMPT_TOKENS)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    wrap_tokenizer(tok).save_pretrained(out)
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    weights_sha = sha256_file(out / "model.safetensors")

    info = {
        "description": "moealign embedded default model: tiny Qwen3-MoE trained on the Python stdlib source",
        "built_by": "tools/build_tiny_moe.py" + (" --quick" if args.quick else ""),
        "seed": args.seed,
        "steps": steps,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "peak_lr": PEAK_LR,
        "router_aux_loss_coef": AUX_LOSS_COEF,
        "threads": THREADS,
        "parameters": n_params,
        "final_train_loss": final_train_loss,
        **stats,
        "corpus": {
            "source": "top-level *.py of sysconfig.get_paths()['stdlib'], sorted by name, docstrings "
            "stripped and ast.unparse'd; "
            f"file i held out when i % {HELDOUT_EVERY} == {HELDOUT_AT}; depends on the Python minor version",
            "python": platform.python_version(),
            "train_files": len(train_files),
            "heldout_files": [p.name for p in heldout_files],
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
            "sha256": corpus_fingerprint(train_files + heldout_files, train_texts + heldout_texts),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "weights_sha256": weights_sha,
        "build_seconds": round(time.time() - t_start, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

    log_e = math.log(config.num_experts)
    print()
    print(f"final train loss          {final_train_loss:.4f}")
    print(f"held-out loss             {stats['heldout_loss']:.4f}")
    print(f"next-token entropy (T=1)  {stats['next_token_entropy_nats']:.3f} nats")
    print(f"top-p {TOP_P} kept set       mean {stats['top_p_kept_mean']:.1f}, median {stats['top_p_kept_median']:.0f} tokens")
    print("router entropy / log E    " + "  ".join(f"{v:.3f}" for v in stats["router_entropy_over_logE_per_layer"])
          + f"   (log E = {log_e:.3f})")
    print("router top-1 prob         " + "  ".join(f"{v:.3f}" for v in stats["router_top1_prob_per_layer"]))
    print("expert load min / max     " + "  ".join(
        f"{lo:.3f}/{hi:.3f}" for lo, hi in zip(stats["expert_load_fraction_min_per_layer"],
                                              stats["expert_load_fraction_max_per_layer"]))
          + f"   (uniform {1 / config.num_experts:.4f})")
    print(f"versions                  torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}")
    print(f"saved to {out}  ({info['build_seconds']} s)")
    print(f"weights sha256 {weights_sha}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
