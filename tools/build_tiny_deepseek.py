"""Build moealign's second embedded model, ``embedded:tiny_deepseek``: a tiny DeepSeek-V3 (transformers'
``deepseek_v3`` architecture) trained briefly on the same corpus and tokenizer as ``embedded:tiny_moe``.

    python tools/build_tiny_deepseek.py                          # writes moealign/assets/tiny_deepseek/ (39 min measured on a shared 2-core machine)
    python tools/build_tiny_deepseek.py --quick --out /tmp/tds   # smoke test: a few steps

The architecture is DeepSeek-V3's, every feature that changes routing or what a refit must carry present, every size
tiny, except the two vLLM's CPU build fixes:

* MLA (multi-head latent attention): q LoRA rank 64 (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), kv LoRA rank
  **512** and decoupled RoPE head **64** (vLLM 0.32's CPU MLA decode kernel takes only head dim 576 = 512 + 64),
  nope head 32, value head 32, 4 heads, interleaved RoPE (``rope_interleave``, as DeepSeek's checkpoints);
* the first decoder layer dense (``first_k_dense_replace = 1``, MLP width 256), the other two MoE: 16 routed experts
  of width 32, top-4, and one shared expert (``n_shared_experts = 1``);
* DeepSeek-V3's router: sigmoid scores, an ``e_score_correction_bias`` added for selection only, grouped top-k
  (``n_group = 4`` groups of 4, ``topk_group = 2``), ``norm_topk_prob`` and ``routed_scaling_factor = 2.5``;
  ``config.json`` carries ``topk_method: "noaux_tc"`` and ``scoring_func: "sigmoid"`` as DeepSeek's own configs do
  (transformers' ``DeepseekV3Config`` does not write them, and vLLM then builds no ``e_score_correction_bias``);
* no multi-token-prediction layer (``num_nextn_predict_layers = 0``).

Training (a deterministic, brief run): the tokenizer, corpus and prompt set of ``tiny_moe`` (its ``tokenizer.json``
is copied, not retrained; the corpus is ``tools/build_tiny_moe.py``'s training files), AdamW for ``STEPS`` steps of
``BATCH`` windows. The routers start from a wider init (std ``ROUTER_INIT_STD``) so that the sigmoid scores are
spread, and the correction bias is updated as DeepSeek-V3's auxiliary-loss-free balancing does it
(``bias += BIAS_RATE * sign(mean load - load)`` per layer after every step, from the top-k the router chose): it ends
non-zero, and it decides routes. ``build_info.json`` records what matters for the tests: the fraction of (token,
layer) pairs whose expert set differs between a bf16 and an fp32 forward (route flips: must be > 0), the fraction
whose set changes when the bias is dropped, the held-out loss, and the weights' sha256.

Weights are stored in bfloat16 (the checkpoint stays a few MB; loading it in float32 is exact), the correction bias
in float32 (transformers keeps it in float32: ``_keep_in_fp32_modules_strict``).

Reproducibility: fixed seeds, deterministic algorithms, 2 torch threads, the tiny_moe corpus list; as for
``tiny_moe``, the corpus depends on the Python minor version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import build_tiny_moe as tiny_moe  # noqa: E402  (the corpus of the first embedded model)

TINY_MOE = ROOT / "moealign" / "assets" / "tiny_moe"
DEFAULT_OUT = ROOT / "moealign" / "assets" / "tiny_deepseek"

SEED = 0
STEPS = 200
BATCH = 8
SEQ_LEN = 128
ROUTER_INIT_STD = 0.1
BIAS_RATE = 1e-3         # DeepSeek-V3's gamma (aux-loss-free balancing), per step
EVAL_WINDOWS = 32
THREADS = 2
QUICK_STEPS = 3


def build_config(eos_id: int, pad_id: int):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=tiny_moe.VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        hidden_act="silu", max_position_embeddings=512, initializer_range=0.02, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True, attention_bias=False, attention_dropout=0.0, num_nextn_predict_layers=0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        topk_method="noaux_tc", scoring_func="sigmoid",    # DeepSeek's own config fields (vLLM reads them)
    )
    return config


def routers(model):
    return [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]


def init_routers(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for r in routers(model):
            r.weight.copy_(torch.randn(r.weight.shape, generator=gen) * ROUTER_INIT_STD)
            r.e_score_correction_bias.zero_()


def update_bias(model, hidden_by_router: dict) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each router's bias moves by BIAS_RATE towards equal load."""
    from moealign.families import get_family
    from moealign.routing_replay.gates import select_topk

    scoring = get_family("deepseek_v3").scoring(model.config)
    with torch.no_grad():
        for r in routers(model):
            h = hidden_by_router.get(id(r))
            if h is None:
                continue
            logits = F.linear(h.float(), r.weight.float())
            ids = select_topk(logits, r.top_k, scoring, expert_bias=r.e_score_correction_bias)[1]
            load = torch.bincount(ids.flatten(), minlength=r.num_experts).float()
            r.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)


def train(model, stream: torch.Tensor, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed + 1)
    opt = tiny_moe.make_optimizer(model)
    seen: dict = {}
    hooks = [r.register_forward_pre_hook(lambda m, args: seen.__setitem__(id(m), args[0].detach().reshape(
        -1, m.hidden_dim))) for r in routers(model)]
    model.train()
    losses = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = tiny_moe.lr_at(step, steps)      # 5% warmup, cosine to 0, peak 3e-3
        starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH,), generator=gen)
        ids = torch.stack([stream[s: s + SEQ_LEN] for s in starts.tolist()])
        seen.clear()
        out = model(input_ids=ids, use_cache=False)
        loss = tiny_moe.lm_loss(out.logits, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_bias(model, seen)
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}/{steps}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)
    for h in hooks:
        h.remove()
    model.eval()
    return losses


def route_sets(model, windows: torch.Tensor, dtype: torch.dtype, *, bias: bool = True) -> torch.Tensor:
    """[tokens, moe layers, k] sorted expert ids the routers choose in a ``dtype`` forward (routers as transformers
    runs them; ``bias=False``: the correction bias zeroed for the forward)."""
    import copy

    m = copy.deepcopy(model).to(dtype)
    saved = []
    if not bias:
        for r in routers(m):
            r.e_score_correction_bias.zero_()
    got = []
    hooks = [r.register_forward_hook(lambda mod, a, out: got.append(out[2].sort(-1).values)) for r in routers(m)]
    with torch.no_grad():
        m(input_ids=windows, use_cache=False)
    for h in hooks:
        h.remove()
    del saved
    return torch.stack(got, dim=1)


def measure(model, windows: torch.Tensor) -> dict:
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits.float()
        loss = tiny_moe.lm_loss(logits, windows).item()
        probs = logits[:, :-1].softmax(-1).reshape(-1, logits.shape[-1])
        kept = tiny_moe.top_p_set_size(probs, tiny_moe.TOP_P).float()
    fp32 = route_sets(model, windows, torch.float32)
    bf16 = route_sets(model, windows, torch.bfloat16)
    unbiased = route_sets(model, windows, torch.float32, bias=False)
    flips = (fp32 != bf16).any(-1).float()
    scores = []
    for r in routers(model):
        scores.append(r.e_score_correction_bias.abs().max().item())
    return {
        "heldout_loss": loss,
        "top_p": tiny_moe.TOP_P,
        "top_p_kept_median": kept.median().item(),
        "route_flip_rate_bf16_vs_fp32": flips.mean().item(),
        "route_flip_rate_bf16_vs_fp32_per_layer": flips.mean(0).tolist(),
        "route_change_rate_without_bias": (fp32 != unbiased).any(-1).float().mean().item(),
        "correction_bias_absmax_per_layer": scores,
        "eval_tokens": int(windows.numel()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    args = ap.parse_args(argv)
    steps = QUICK_STEPS if args.quick else args.steps

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    tok = Tokenizer.from_file(str(TINY_MOE / "tokenizer.json"))
    eos_id, pad_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>")
    train_files, heldout_files = tiny_moe.list_corpus(Path(sysconfig.get_paths()["stdlib"]))
    if args.quick:
        train_files = train_files[:tiny_moe.QUICK_TRAIN_FILES]
    stream = tiny_moe.encode_stream(tok, tiny_moe.read_texts(train_files), eos_id)
    held = tiny_moe.encode_stream(tok, tiny_moe.read_texts(heldout_files[:4]), eos_id)
    windows = torch.stack([held[i * SEQ_LEN: (i + 1) * SEQ_LEN] for i in range(EVAL_WINDOWS)])

    config = build_config(eos_id, pad_id)
    model = DeepseekV3ForCausalLM(config).float()
    init_routers(model, SEED)
    t0 = time.time()
    losses = train(model, stream, steps, SEED)
    train_s = time.time() - t0
    stats = measure(model, windows)
    print(json.dumps(stats, indent=1))

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for r in routers(model):            # stored as the checkpoint stores it: float32 bias, bf16 weights
        r.e_score_correction_bias.data = r.e_score_correction_bias.data.float()
    model.to(torch.bfloat16)
    for r in routers(model):
        r.e_score_correction_bias.data = r.e_score_correction_bias.data.float()
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0})
    cfg.pop("num_mtp_layers", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MOE / name, out / name)
    weights = out / "model.safetensors"
    info = {
        "description": "moealign embedded model tiny_deepseek: a tiny DeepSeek-V3 (MLA, shared expert, sigmoid "
                       "grouped router with correction bias) trained briefly on tiny_moe's corpus and tokenizer",
        "built_by": "tools/build_tiny_deepseek.py",
        "seed": SEED, "steps": steps, "batch": BATCH, "seq_len": SEQ_LEN, "router_init_std": ROUTER_INIT_STD,
        "bias_rate": BIAS_RATE, "threads": THREADS, "train_seconds": round(train_s, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": losses[-1], **stats,
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "weights_bytes": weights.stat().st_size,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"wrote {out} ({info['weights_bytes'] / 1e6:.1f} MB weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
