"""Run by tests/test_vllm_rollout.py in a child process: record a rollout of the embedded model at a TP size
(TP > 1: vLLM's multiprocessing workers, one CPU core per rank), optionally with the tree forward in every
worker (MOEALIGN_VLLM_PATCHES=tree, set by the caller), save it and print one JSON line.

Then the record is scored with its own routes forced in every worker (``score_with_routes``) and unforced; the
RESULT line carries both log-prob lists.

usage: python tests/vllm_record_tp.py OUT.safetensors TP
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    out, tp = sys.argv[1], int(sys.argv[2])
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record
    from moealign.record import SamplingParams

    options = {"tensor_parallel_size": tp}
    if tp > 1:
        options["distributed_executor_backend"] = "mp"
    llm = open_llm(str(embedded_model_path()), dtype="bf16", max_num_seqs=3, max_num_batched_tokens=32,
                   enable_prefix_caching=False, **options)
    prompts = [p[:n] for p, n in zip(default_prompts()[:4], (40, 90, 25, 60))]
    record = generate_with_record(llm, prompts, sampling=SamplingParams(temperature=0.9, top_p=0.9), max_new_tokens=10,
                                  seed=5)
    record.save(out)
    from moealign.patches.vllm.replay import score_with_routes

    forced = score_with_routes(llm, record)        # raises unless the experts that ran are the recorded ones
    native = score_with_routes(llm, record, force=False)
    death = None
    if tp > 1:
        # a worker killed by a signal (SIGILL, as an AMX kernel without permission does) is named by moealign
        import signal
        import time

        from moealign.errors import EngineError
        from moealign.patches.vllm.engine import naming_dead_workers

        worker = llm.llm_engine.model_executor.workers[1]
        os.kill(worker.proc.pid, signal.SIGILL)
        worker.proc.join(30)
        time.sleep(0.5)                             # vLLM's monitor thread shuts the executor down
        try:
            with naming_dead_workers(llm, "the test's rollout"):
                generate_with_record(llm, prompts[:1], sampling=SamplingParams(), max_new_tokens=2, seed=5)
            death = "no error"
        except EngineError as exc:
            death = str(exc)
        except Exception as exc:                    # noqa: BLE001 - reported to the test
            death = f"raw {type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps({"samples": len(record.samples), "rows": sum(s.routes.shape[0] for s in record.samples),
                                  "forced": [t.tolist() for t in forced], "native": [t.tolist() for t in native],
                                  "death": death}),
          flush=True)
    os._exit(0)                                     # the executor is dead: skip vLLM's shutdown handlers
