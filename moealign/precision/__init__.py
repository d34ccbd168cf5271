"""Precision alignment: precision policies and audits, FP8 simulation, TP- and batch-invariant reductions.

Pure torch (``torch.distributed`` for the cross-rank parts); no engine imports. Submodules are imported
explicitly (nothing is imported eagerly here):

* :mod:`moealign.precision.policy` - named precision policies (fp32, bf16, fp16, fp16 with fp32 router and
  LM head, FP8 e4m3 per-tensor / per-block) and their transformers / Megatron / vLLM settings.
* :mod:`moealign.precision.audit` - ``audit(model, policy, inputs)``: parameter, buffer and computed dtypes.
* :mod:`moealign.precision.fp8` - simulated FP8 (casts with per-tensor / 128x128 block scales, fake-quant).
* :mod:`moealign.precision.loss_scale` - ``DynamicLossScaler`` for fp16 training.
* :mod:`moealign.precision.capability` - GPU compute capability (torch.cuda / NVML), ``supports(policy)``.
* :mod:`moealign.precision.tree` - TP-invariant tree reductions (leaf tree, tree all-reduce,
  row-parallel linear, vocab-parallel selected-token log-prob).
* :mod:`moealign.precision.batch_invariant` - batch-invariant matmul / mean / log_softmax / RMSNorm and
  ``batch_invariant_mode()``.
"""
