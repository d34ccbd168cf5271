"""Where the last vLLM -> Megatron gap comes from: every op of the embedded model, one at a time, fp32.

vLLM (its CPU build, in this process) prefills one token sequence with forward hooks on every module; Megatron-core
(the mismatch test's training engine) runs the same tokens. Two columns per op:

* **cumulative**: max |vLLM - Megatron| of the op's output in the two full forwards (differences compound);
* **local**: Megatron's module run on *vLLM's* input of that op, against vLLM's output: what this op alone adds.
  A local 0 means the two engines compute that op bit for bit the same.

    python tools/probe_vllm_megatron_gap.py                    # stock vLLM
    MOEALIGN_VLLM_PATCHES=tree python tools/probe_vllm_megatron_gap.py   # vLLM under moealign's tree forward
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def _hook_all(model, store: dict) -> list:
    import torch

    def make(name):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor):
                return
            if name in store and out.shape[0] <= store[name][1].shape[0]:
                return   # keep the call with the most rows (the prefill; all prompt positions of the logits)
            store[name] = (tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs),
                           out.detach().clone(), tuple(o.detach().clone() for o in output if isinstance(o, torch.Tensor))
                           if isinstance(output, tuple) else ())
        return hook

    return [module.register_forward_hook(make(name)) for name, module in model.named_modules()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="sequence length (default 48)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--aligned", action="store_true",
                    help="both engines under moealign's canonical forward (MOEALIGN_VLLM_PATCHES=canonical)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args(argv)
    if args.aligned:
        os.environ["MOEALIGN_VLLM_PATCHES"] = "canonical"

    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine
    from moealign.patches.vllm.engine import open_llm

    from _timing import write_json

    path = str(embedded_model_path())
    llm = open_llm(path, dtype=args.dtype, max_num_seqs=2, enable_prefix_caching=False)
    ids = llm.get_tokenizer()("".join(default_prompts()[:4]))["input_ids"][:args.tokens]
    T = len(ids)
    vllm_store: dict = {}
    llm.apply_model(lambda model: len(_hook_all(model, vllm_store)))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                 use_tqdm=False)

    engine = MegatronTrainEngine(path, args.dtype)
    model = engine.model
    if args.aligned:
        from moealign.model_config import read_model_config
        from moealign.patches.megatron.canonical import apply_canonical_forward

        cfg = read_model_config(path)
        apply_canonical_forward(model, rope_base=cfg["rope_parameters"]["rope_theta"],
                                max_positions=cfg["max_position_embeddings"])
    mg_store: dict = {}
    hooks = _hook_all(model, mg_store)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(T)[None], mask)
    for hook in hooks:
        hook.remove()

    def diff(a, b) -> float:
        a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
        n = min(a.shape[0], b.shape[0])     # vLLM's logits: the prompt positions that have a next token
        return float((a[:n] - b[:n]).abs().max())

    V, M = vllm_store, mg_store
    col = lambda t: t.reshape(T, 1, -1)  # noqa: E731  (Megatron's [s, b, h])
    rows = [("embedding", diff(V["model.embed_tokens"][1], M["embedding"][1]), None)]
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            v, m = f"model.layers.{i}", f"decoder.layers.{i}"
            # vLLM's RMSNorm adds the residual itself (inputs (x, residual) -> (normed, x + residual))
            norm_in = V[v + ".input_layernorm"][0]
            x = norm_in[0] + norm_in[1] if len(norm_in) > 1 and isinstance(norm_in[1], torch.Tensor) else norm_in[0]
            rows.append((f"layer {i} input RMSNorm", diff(V[v + ".input_layernorm"][1], M[m + ".input_layernorm"][1]),
                         diff(layer.input_layernorm(col(x)), V[v + ".input_layernorm"][1])))
            attn = layer.self_attention(col(V[v + ".input_layernorm"][1]), attention_mask=mask,
                                        rotary_pos_emb=model.rotary_pos_emb(T))[0]
            rows.append((f"layer {i} attention block (QKV, RoPE, core, out proj)",
                         diff(V[v + ".self_attn"][1], M[m + ".self_attention"][1]), diff(attn, V[v + ".self_attn"][1])))
            rows.append((f"layer {i}   out proj alone", diff(V[v + ".self_attn.o_proj"][1],
                                                               M[m + ".self_attention.linear_proj"][1]),
                         diff(layer.self_attention.linear_proj(col(V[v + ".self_attn.o_proj"][0][0]))[0],
                              V[v + ".self_attn.o_proj"][1])))
            norm_in = V[v + ".post_attention_layernorm"][0]
            x = norm_in[0] + norm_in[1]
            rows.append((f"layer {i} post-attention RMSNorm", diff(V[v + ".post_attention_layernorm"][1],
                                                                  M[m + ".pre_mlp_layernorm"][1]),
                         diff(layer.pre_mlp_layernorm(col(x)), V[v + ".post_attention_layernorm"][1])))
            out = layer.mlp(col(V[v + ".mlp"][0][0]))
            out = out[0] if isinstance(out, tuple) else out
            rows.append((f"layer {i} MoE block (router, experts, combine)", diff(V[v + ".mlp"][1], M[m + ".mlp"][1]),
                         diff(out, V[v + ".mlp"][1])))
        norm_in = V["model.norm"][0]
        x = norm_in[0] + norm_in[1]
        rows.append(("final RMSNorm", diff(V["model.norm"][1], M["decoder.final_layernorm"][1]),
                     diff(model.decoder.final_layernorm(col(x)), V["model.norm"][1])))
        rows.append(("LM head", diff(V["logits_processor"][1], logits.reshape(T, -1)),
                     diff(model.output_layer(col(V["model.norm"][1]))[0], V["logits_processor"][1])))
    tree = os.environ.get("MOEALIGN_VLLM_PATCHES", "") or "stock"
    print(f"vLLM ({tree}) vs Megatron-core{' (canonical)' if args.aligned else ''}, {args.dtype}, {T} tokens: "
          f"max |diff| per op")
    print(f"{'op':<52} {'cumulative':>11} {'local':>10}")
    for name, cum, local in rows:
        print(f"{name:<52} {cum:>11.3g} {'-' if local is None else format(local, '.3g'):>10}")
    if args.json:
        write_json(args.json, {"vllm_patches": tree, "tokens": T,
                               "rows": [{"op": n, "cumulative": c, "local": lo} for n, c, lo in rows]})
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
