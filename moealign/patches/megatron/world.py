"""Megatron-core on CPU (a reversible CPU mode) and a one-process world for the harness, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import EngineError
from .._handle import AttributePatches
from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# CPU mode
# --------------------------------------------------------------------------------------------------


class MegatronCPUMode(AttributePatches):
    """Undo handle of :func:`enable_megatron_cpu` (also a context manager)."""


def enable_megatron_cpu() -> MegatronCPUMode:
    """Let Megatron-core build and run models on CPU (gloo), reversibly.

    Patches, all undone by ``undo()``: ``torch.cuda.current_device`` returns ``"cpu"`` (Megatron moves
    router weights and rotary buffers to it); the tensor-parallel CUDA RNG tracker uses the CPU RNG;
    ``torch.cuda.get_rng_state`` / ``manual_seed`` map to the CPU ones; 0.16.1's ``moe_utils`` gets the
    names it only defines when transformer-engine imports (set to None, as 0.19 does itself).
    Raises RuntimeError when CUDA is available: the CPU mode is never active on a GPU machine.
    """
    if torch.cuda.is_available():
        raise EngineError("enable_megatron_cpu() refuses to run where CUDA is available; use the GPU")
    megatron_version()
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    mode = MegatronCPUMode()
    mode._set(torch.cuda, "current_device", lambda: "cpu")
    mode._set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    mode._set(torch.cuda, "manual_seed", lambda seed: None)
    mode._set(mrandom, "_get_cuda_rng_state",
              lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    mode._set(mrandom, "_set_cuda_rng_state",
              lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
                 "fused_moe_aux_loss"):
        if not hasattr(moe_utils, name):
            mode._set(moe_utils, name, None)
    return mode


@dataclass
class MegatronWorld:
    """Undo handle of :func:`init_single_process`: tears down only what it set up."""

    cpu_mode: MegatronCPUMode | None = None
    owns_process_group: bool = False
    owns_parallel_state: bool = False
    init_file: str | None = None

    def close(self) -> None:
        import os

        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.owns_parallel_state:
            parallel_state.destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False
        if self.init_file and os.path.exists(self.init_file):
            os.unlink(self.init_file)
        if self.cpu_mode is not None:
            self.cpu_mode.undo()
            self.cpu_mode = None

    def __enter__(self) -> "MegatronWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_single_process(seed: int = 1234) -> MegatronWorld:
    """A one-process Megatron world (TP = PP = CP = EP = 1) for the mismatch harness and benchmarks.

    On CPU it enables :func:`enable_megatron_cpu` and a gloo process group; on CUDA, NCCL. An already
    initialised process group or ``parallel_state`` is used as it is (and left alone by ``close()``).
    """
    import tempfile

    import torch.distributed as dist

    megatron_version()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = MegatronWorld()
    try:
        if not torch.cuda.is_available():
            world.cpu_mode = enable_megatron_cpu()
        if not dist.is_initialized():
            fd, world.init_file = tempfile.mkstemp(prefix="moealign-dist-")
            import os

            os.close(fd)
            os.unlink(world.init_file)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"file://{world.init_file}", rank=0, world_size=1)
            world.owns_process_group = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            world.owns_parallel_state = True
        model_parallel_cuda_manual_seed(seed)
    except BaseException:
        world.close()
        raise
    return world
