"""Megatron-core on CPU (a reversible CPU mode) and a one-process world for the harness, tests and benchmarks."""

from __future__ import annotations

import os

import torch

from ...errors import EngineError
from ...handle import PatchHandle
from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# CPU mode
# --------------------------------------------------------------------------------------------------


#: The names 0.16.1's ``moe_utils`` binds only when transformer-engine (and Megatron's TE extension) import:
#: ``RouterGatingLinearFunction`` (every ``TopKRouter`` forward and backward, on any device) reads
#: ``te_general_gemm`` with no guard, so without transformer-engine the first router call raises
#: ``NameError``; the ``fused_*`` ones are read behind ``not HAVE_TE or ...`` (set too, as 0.19 does itself).
#: No other module on the local spec's path reads a transformer-engine name unguarded (the rest sit behind
#: ``HAVE_TE``, fp8 / fp4, CUDA graphs or the fusion flags moealign turns off).
TE_ONLY_MOE_UTILS_NAMES = ("te_general_gemm", "fused_topk_with_score_function",
                           "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                           "fused_permute_with_probs", "fused_sort_chunks_by_index",
                           "fused_sort_chunks_by_index_with_probs", "fused_unpermute")


class MegatronWithoutTE(PatchHandle):
    """Undo handle of :func:`enable_megatron_without_te` (scope ``"module"``)."""


def enable_megatron_without_te() -> MegatronWithoutTE:
    """Let Megatron-core's MoE router run where transformer-engine did not import, reversibly.

    Sets each of :data:`TE_ONLY_MOE_UTILS_NAMES` that ``megatron.core.transformer.moe.moe_utils`` lacks to None
    (its own ``is not None`` checks then take the plain ``torch.mm`` route), and turns ``HAVE_TE`` off in
    ``multi_latent_attention`` where its ``TELinear`` is no class (MLA on the local spec). Where the module has them
    (transformer-engine imported, or a Megatron-core that binds them itself) nothing is patched and
    ``patched`` is empty: users with transformer-engine keep its GEMM. Any device; the CPU mode nests it, and
    :func:`init_single_process` applies it on CUDA.
    """
    megatron_version()
    import megatron.core.transformer.moe.moe_utils as moe_utils

    import megatron.core.transformer.multi_latent_attention as mla

    missing = [name for name in TE_ONLY_MOE_UTILS_NAMES if name not in vars(moe_utils)]
    what = f"{len(missing)} transformer-engine names set to None" if missing else "nothing missing"
    # MLA: 0.16.1's multi_latent_attention sets HAVE_TE when Megatron's TE extension module imports, which it does
    # without transformer-engine (TELinear is then a MagicMock placeholder, not a class), then calls
    # isinstance(linear_proj, TELinear): TypeError when building MLASelfAttention on the local spec
    mla_te = bool(getattr(mla, "HAVE_TE", False)) and not isinstance(getattr(mla, "TELinear", None), type)
    if mla_te:
        what += "; multi_latent_attention.HAVE_TE off (its TELinear is no class)"
    handle = MegatronWithoutTE(f"Megatron-core without transformer-engine (moe_utils: {what})", "module")
    for name in missing:
        handle.set_attr(moe_utils, name, None)
    if mla_te:
        handle.set_attr(mla, "HAVE_TE", False)
    return handle


def _cpu_current_device() -> str:
    """``torch.cuda.current_device`` while a CPU mode is active: Megatron places its tensors on the CPU."""
    return "cpu"


def megatron_cpu_mode_active() -> bool:
    """Whether a :func:`enable_megatron_cpu` mode is active in this process (pinned or on a CPU machine)."""
    return torch.cuda.current_device is _cpu_current_device


class _CPUStream:
    """The stand-in for ``torch.cuda.Stream`` (and its events) in the CPU mode on a machine without CUDA: CPU
    kernels run in order, so waiting, recording and synchronising are no-ops. Megatron's all-to-all token
    dispatcher builds a device-to-host side stream (``torch.cuda.Stream()``) and records / waits on events around
    its split-size copies. A class, like the one it stands for (``torch.cuda.Stream | None`` annotations work)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> "_CPUStream":
        return self

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = _CPUStream()


def _cpu_current_stream(*args, **kwargs) -> _CPUStream:
    return _CPU_STREAM


class _CPUStreamContext:
    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc) -> None:
        return None


class _TorchOnCPU:
    """``torch`` as Megatron's pipeline schedules see it in the CPU mode: everything is torch's, but a tensor
    created with ``device="cuda"`` (0.16.1's schedules allocate their token counter so, unconditionally) is made on
    the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _split_sizes_on_cpu(original):
    """``moe_utils.maybe_move_tensor_to_cpu`` in the CPU mode: the all-to-all dispatcher asks for its split sizes
    ``as_numpy`` (``all_to_all_single`` takes a sequence of ints, not a tensor), and the original converts only
    tensors that were on CUDA."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _uneven_collectives_on_gloo(mappings):
    """Megatron's ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with uneven split sizes over a
    gloo group (the all-to-all dispatcher's all-gather / reduce-scatter over the TP group under sequence parallelism:
    each TP rank sends its own number of tokens): gloo's list collectives need equal sizes, so each piece is padded
    to the largest, exchanged, and cut back (an exact copy; the padding rows are dropped). Any other call is
    Megatron's own."""
    import torch.distributed as dist

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def uneven(group, sizes) -> bool:
        return sizes is not None and group is not None and group.size() > 1 and dist.get_backend(group) == "gloo"

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not uneven(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not uneven(group, input_split_sizes):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        width = max(sizes)
        stacked = input_.new_zeros((len(sizes), width, *input_.shape[1:]))
        for i, chunk in enumerate(input_.split(sizes)):
            stacked[i, :chunk.shape[0]] = chunk
        out = input_.new_empty((width, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, stacked.reshape(-1, *input_.shape[1:]), group=group)
        return out[:sizes[group.rank()]]

    return _gather_along_first_dim, _reduce_scatter_along_first_dim


class MegatronCPUMode(PatchHandle):
    """Undo handle of :func:`enable_megatron_cpu` (a :class:`~moealign.handle.PatchHandle`, scope ``"module"``)."""


def enable_megatron_cpu(*, pin_cpu: bool = False) -> MegatronCPUMode:
    """Let Megatron-core build and run models on CPU (gloo), reversibly.

    Patches, all undone by ``undo()``: ``torch.cuda.current_device`` returns ``"cpu"`` (Megatron moves
    router weights and rotary buffers to it); the tensor-parallel CUDA RNG tracker uses the CPU RNG;
    ``torch.cuda.get_rng_state`` / ``manual_seed`` map to the CPU ones; without CUDA, ``torch.cuda.Stream`` /
    ``current_stream`` / ``stream`` are no-op CPU streams (the all-to-all token dispatcher's device-to-host side
    stream and its events: CPU kernels run in order), ``torch.cuda.synchronize`` a no-op (the p2p pipeline
    communication calls it after ``batch_isend_irecv``), and the pipeline schedules' ``torch.zeros(...,
    device="cuda")`` token counter is made on the CPU, and the all-to-all dispatcher's split sizes become the
    int sequences ``all_to_all_single`` takes (its ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts CUDA
    tensors only), Megatron's first-dimension all-gather / reduce-scatter with uneven split sizes work over gloo (the
    all-to-all dispatcher under sequence parallelism: padded to the largest piece, cut back); :func:`enable_megatron_without_te`
    (transformer-engine is never installed on CPU machines).
    Where CUDA is available it raises :class:`~moealign.errors.EngineError` (a GPU machine's Megatron runs on
    the GPU) unless ``pin_cpu=True``: the caller pins Megatron to the CPU on purpose (``--device cpu``, tests
    whose claims are about CPU kernels). While the mode is active ``torch.cuda.current_device()`` is ``"cpu"``
    in the whole process: keep CUDA work out of its scope.
    """
    if torch.cuda.is_available() and not pin_cpu:
        raise EngineError("enable_megatron_cpu() refuses to run where CUDA is available; use the GPU, or pass "
                          "pin_cpu=True (init_single_process(device='cpu')) to pin Megatron to the CPU")
    megatron_version()
    import megatron.core.tensor_parallel.random as mrandom

    mode = MegatronCPUMode("Megatron-core CPU mode (torch.cuda RNG/device, tensor_parallel.random, moe_utils)",
                           "module")
    mode.set_attr(torch.cuda, "current_device", _cpu_current_device)
    mode.set_attr(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    mode.set_attr(torch.cuda, "manual_seed", lambda seed: None)
    if not torch.cuda.is_available():       # (pinned on a GPU machine, the real streams work on CPU tensors)
        mode.set_attr(torch.cuda, "Stream", _CPUStream)
        mode.set_attr(torch.cuda, "current_stream", _cpu_current_stream)
        mode.set_attr(torch.cuda, "stream", _CPUStreamContext)
        mode.set_attr(torch.cuda, "synchronize", lambda device=None: None)
    import megatron.core.pipeline_parallel.schedules as schedules

    mode.set_attr(schedules, "torch", _TorchOnCPU())
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    mode.set_attr(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_on_cpu(moe_utils.maybe_move_tensor_to_cpu))
    mode.set_attr(mrandom, "_get_cuda_rng_state",
                  lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    mode.set_attr(mrandom, "_set_cuda_rng_state",
                  lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    import megatron.core.tensor_parallel.mappings as mappings

    gather, scatter = _uneven_collectives_on_gloo(mappings)
    mode.set_attr(mappings, "_gather_along_first_dim", gather)
    mode.set_attr(mappings, "_reduce_scatter_along_first_dim", scatter)
    mode.add_handle(enable_megatron_without_te())
    if torch.cuda.is_available():
        # pinned on a GPU machine: Megatron's jit_fuser is torch.compile, and compiling asks CUDA for the current
        # device's properties through torch.cuda.current_device(), which is "cpu" here (TypeError). The mode's
        # functions run eagerly instead (torch._dynamo.config.disable for the mode's duration).
        from torch import _dynamo

        saved = _dynamo.config.disable
        _dynamo.config.disable = True
        mode.add_callback(lambda: setattr(_dynamo.config, "disable", saved), "torch._dynamo.config.disable")
    return mode


class MegatronWorld(PatchHandle):
    """Undo handle of :func:`init_single_process` (scope ``"process"``): ``undo()`` tears down only what it set
    up, in reverse (``parallel_state``, the process group, its rendezvous file, the CPU mode)."""

    def __init__(self, target: str = "one-process Megatron world", scope: str = "process"):
        super().__init__(target, scope)
        self.cpu_mode: MegatronCPUMode | None = None
        self.owns_process_group = False
        self.owns_parallel_state = False
        self.init_file: str | None = None

    def close(self) -> None:
        """Same as :meth:`undo` (:mod:`moealign.mismatch.engines` closes its world with it)."""
        self.undo()

    def _adopt_cpu_mode(self, mode: MegatronCPUMode) -> None:
        self.cpu_mode = mode

        def undo_cpu_mode() -> None:
            mode.undo()
            self.cpu_mode = None

        self.add_callback(undo_cpu_mode, mode.target)

    def _adopt_init_file(self, path: str) -> None:
        self.init_file = path

        def remove_init_file() -> None:
            if os.path.exists(path):
                os.unlink(path)

        self.add_callback(remove_init_file, f"rendezvous file {path}")

    def _adopt_process_group(self, backend: str) -> None:
        import torch.distributed as dist

        self.owns_process_group = True

        def destroy_process_group() -> None:
            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_process_group = False

        self.add_callback(destroy_process_group, f"torch.distributed process group ({backend}, world size 1)")

    def _adopt_parallel_state(self) -> None:
        from megatron.core import parallel_state

        self.owns_parallel_state = True

        def destroy_model_parallel() -> None:
            parallel_state.destroy_model_parallel()
            self.owns_parallel_state = False

        self.add_callback(destroy_model_parallel, "megatron parallel_state (TP = PP = CP = EP = 1)")


def init_single_process(seed: int = 1234, device: str = "auto") -> MegatronWorld:
    """A one-process Megatron world (TP = PP = CP = EP = 1) for the mismatch harness and benchmarks.

    ``device``: ``"auto"`` (default) is CUDA when available, else the CPU; ``"cpu"`` pins the CPU on any
    machine; ``"cuda"`` (or ``"cuda:N"``) needs CUDA. On CPU it enables :func:`enable_megatron_cpu` and a gloo
    process group; on CUDA, NCCL and :func:`enable_megatron_without_te` (a no-op where transformer-engine
    imported). An already initialised process group or ``parallel_state`` is used as it is (and left alone by
    ``undo()``).
    """
    import tempfile

    import torch.distributed as dist

    if device == "auto":
        on_cuda = torch.cuda.is_available()
    elif device == "cpu" or str(device).startswith("cuda"):
        on_cuda = str(device).startswith("cuda")
        if on_cuda and not torch.cuda.is_available():
            raise EngineError(f"init_single_process(device={device!r}): CUDA is not available on this machine")
    else:
        raise EngineError(f"init_single_process(device={device!r}): expected 'auto', 'cpu' or 'cuda'")
    megatron_version()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    backend = "nccl" if on_cuda else "gloo"
    world = MegatronWorld(f"one-process Megatron world ({'CUDA, nccl' if backend == 'nccl' else 'CPU mode, gloo'})")
    try:
        if not on_cuda:
            world._adopt_cpu_mode(enable_megatron_cpu(pin_cpu=True))
        else:
            world.add_handle(enable_megatron_without_te())
        if not dist.is_initialized():
            fd, init_file = tempfile.mkstemp(prefix="moealign-dist-")
            os.close(fd)
            os.unlink(init_file)
            world._adopt_init_file(init_file)
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
            world._adopt_process_group(backend)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            world._adopt_parallel_state()
        model_parallel_cuda_manual_seed(seed)
    except BaseException:
        world.undo()
        raise
    return world
