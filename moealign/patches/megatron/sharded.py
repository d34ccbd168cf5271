"""A sharded Megatron-core trainer: one process per rank, Megatron's own parallelism, routing replay on every rank.

::

    from moealign.patches.megatron.sharded import ShardedMegatronTrainer

    with ShardedMegatronTrainer(model_path, tp=2, ep=2, pp=1, dispatcher="alltoall") as trainer:
        fwd = trainer.forward(record, range(len(record)), replay=True)
        fwd.logprobs        # per sample, the log-prob of each response token (fp32, full vocabulary)
        fwd.flips           # router flips of the experts every router used against the record's
        fwd.ranks           # per rank: its coordinates, its layers, what its replay verifier checked
        loss = my_loss(leaf := fwd.logits.clone().requires_grad_())         # any loss of the logits
        loss.backward()
        step = trainer.train_step(record, range(len(record)), leaf.grad, replay=True, lr=2e-3, max_grad_norm=1.0)

The driver (this process) validates the layout (:func:`~moealign.patches.megatron.checkpoint.check_parallel_layout`,
a :class:`~moealign.errors.ConfigError` before any process starts) and starts ``world = tp * pp * dp`` rank processes
(``torch.multiprocessing``, spawn; gloo on CPU, NCCL on CUDA). Each rank initialises Megatron's
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
expert_model_parallel_size=ep)``, builds the ``GPTModel`` of its pipeline stage and loads only its own shards of the
checkpoint (:func:`~moealign.patches.megatron.checkpoint.build_megatron_stage`: its layers, its experts, its
tensor-parallel slices, read tensor by tensor from the safetensors files). A forward runs Megatron's own schedule
(``get_forward_backward_func()``, ``forward_only=True``: the p2p pipeline schedule when PP > 1) over micro-batches;
every exchange of tensors between ranks is Megatron's (tensor-parallel all-reduces and gathers, the MoE token
dispatcher's all-to-all or all-gather, the pipeline's send / recv). The driver talks to the ranks through one pipe
each, for commands and results only.

Tensor parallelism is sequence parallelism, as Megatron trains MoE with TP: at TP > 1 every rank's model is built with
``sequence_parallel=True`` (the local spec's norms are
:class:`~moealign.patches.megatron.checkpoint.SequenceParallelTorchNorm`, which marks their weights), so TP rank r's
norms, routers and MoE layers see the r-th of TP equal chunks of the sequence (``[s / TP, b, h]``), each expert sees
every token once (the dispatcher gathers the TP ranks' distinct tokens), the output layer gathers the sequence and the
vocabulary (every last-stage TP rank holds ``[b, s, V]``), and after a backward the weights marked
``sequence_parallel`` (norms, routers, MLA's whole kv down projection: :mod:`~moealign.patches.megatron.mla`) have
their gradients summed over the TP group.

Data: the samples are split over the data-parallel ranks in order, each rank's share into micro-batches of
``micro_batch_size`` rows, all padded (right) to the longest sample of the call, so every micro-batch has the same
``[micro_batch_size, T]`` shape (the pipeline's p2p buffers and the all-gather dispatcher need it), T a multiple of TP
(sequence parallelism: one more masked, unrouted column where needed); slots left over are filled with copies of a real
sample whose results are dropped.

Replay: each rank drives Megatron's ``RouterReplay`` through :class:`~moealign.patches.megatron.RouterReplayDriver`
for its own routers (bound by global ``layer_number``: a pipeline stage holds a subset), one ``set_routes`` per
micro-batch in the schedule's own order (under sequence parallelism each TP rank's routers get its chunk's rows), with
the per-forward token check and the dispatcher verifier; after the schedule ``check(calls=micro-batches)`` runs on
every rank. A failure names the rank and its coordinates. The routes the routers used come from every TP rank's
chunk (:meth:`~moealign.patches.megatron.capture.MegatronRouteCapture.last_forward_rows`) and the driver puts them back
in sequence order.

Training (:meth:`ShardedMegatronTrainer.train_step`, what ``rl-check`` runs): the caller's loss is a function of
the logits :meth:`~ShardedMegatronTrainer.forward` returned; given G = dLoss/dlogits, every rank runs the schedule
again with ``forward_only=False`` and, on the last stage, the surrogate ``sum(logits * G)`` (replay as in the forward);
then the gradients are summed over the data-parallel (expert-data-parallel) groups (and, for the weights Megatron
marks ``sequence_parallel``, over the TP group), the global norm is Megatron's, the clip is ``clip_grad_norm_``'s and
each rank's ``torch.optim.Adam`` steps its own parameters.

Failures: a rank that raises answers with its error (the driver raises the same :mod:`moealign.errors` class
naming the rank); a rank that dies is named with its exit (:func:`moealign.exits.child_failure`) and the others are
stopped (terminate, join, kill); no answer within ``timeout_s`` is an :class:`~moealign.errors.EngineTimeoutError`
naming the silent ranks (also stopped). Ranks exit when the driver's process goes away.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from typing import Sequence

import torch

from ... import errors as _errors_module
from ...errors import ConfigError, EngineError, EngineTimeoutError, MoealignWarning, ReplayError
from .checkpoint import ParallelLayout, check_parallel_layout

__all__ = ["DISPATCHERS", "FAULTS", "TRAIN_FAULTS", "TIMERS", "HFPiece", "HFTensorPlan", "ShardedForward",
           "ShardedMegatronTrainer", "ShardedTrainStep", "precision_fields", "process_memory"]

#: Megatron's MoE token dispatchers the sharded trainer runs (``moe_token_dispatcher_type``).
DISPATCHERS = ("alltoall", "allgather")
#: Negative controls of :meth:`ShardedMegatronTrainer.forward` (``fault=``): what each rank does to its replay rows.
FAULTS = ("shift", "swap")
#: Negative controls of :meth:`ShardedMegatronTrainer.train_step` (``fault=(name, rank)``): ``"no-grad"`` withholds
#: the loss's gradient from that rank (its surrogate's gradient zeros), ``"skip-step"`` skips its optimizer step,
#: ``"expert-grad-x-tp"`` multiplies its expert parameters' gradients by TP before they are reduced (what TP without
#: sequence parallelism did: each expert saw TP copies of every token).
TRAIN_FAULTS = ("no-grad", "skip-step", "expert-grad-x-tp")
#: The per-rank timers of a forward (seconds summed over the rank's micro-batches; each rank's
#: ``ranks[i]["timings"]``): moealign's own replay work, in CPU time of the rank's thread (``time.thread_time``: what
#: the rank spent, not how long it waited for a core when ranks share them), ``set_routes`` (the micro-batch's ReplayBatch built and
#: handed to the stage's routers), ``token_check`` (the driver's forward pre-hook: every router row's token),
#: ``verifier`` (the routing maps the dispatchers received, compared with the routes set), ``check`` (the counters
#: read after the schedule, one host sync); and ``forward``, the rank's whole schedule in wall-clock time (Megatron's
#: forward, the exchanges and waits between ranks, and the four above) and ``forward_cpu``, the same in the rank
#: thread's CPU time. On CUDA the host's share of asynchronous work.
TIMERS = ("set_routes", "token_check", "verifier", "check", "forward", "forward_cpu")


@dataclass
class ShardedForward:
    """One sharded forward over ``record.samples[indices]``, in record order (the fields of
    :class:`moealign.mismatch.engines.TrainForward`, plus what the ranks report).

    ``logits`` ``[n_response_tokens, V]`` float32 (the full vocabulary, gathered by Megatron's output layer),
    ``tokens`` ``[n_response_tokens]``, ``routes`` ``[n_route_rows, n_layers, k]`` int64: the experts every router
    used on each recorded route row (rows as in the record), layers from every pipeline stage. ``logprobs``: per
    sample the log-prob of each response token (``log_softmax`` over the vocabulary). ``flips``: router flips of
    ``routes`` against the record's (:func:`~moealign.routing_replay.flips.route_flip_metrics`). ``ranks``: per rank
    its coordinates, MoE layers, micro-batches, (replay) its verifier's counts and its ``timings`` (:data:`TIMERS`)."""

    logits: torch.Tensor
    tokens: torch.Tensor
    routes: torch.Tensor
    logprobs: list[torch.Tensor]
    flips: object
    ranks: list[dict] = field(default_factory=list)


@dataclass
class ShardedTrainStep:
    """One optimizer step of the sharded trainer (:meth:`ShardedMegatronTrainer.train_step`): ``logits``
    ``[n_response_tokens, V]`` float32 of the training pass (before the update, in record order: equal to
    :meth:`~ShardedMegatronTrainer.forward`'s bit for bit, the gradient was taken at them), ``grad_norm`` the global
    gradient norm before clipping (every rank's, agreed), ``ranks`` each rank's report (replay counts, timings)."""

    logits: torch.Tensor
    grad_norm: float
    ranks: list[dict] = field(default_factory=list)


@dataclass
class _Batches:
    batch: object
    n: int
    mbs: int
    num_mb: int
    rows: list
    per_dp: list
    command: dict
    resp_counts: list


@dataclass(frozen=True)
class HFPiece:
    """One rank's piece of a transformers tensor in a weight plan: ``rank``, its mapping group ``gid`` and index ``j``
    in it (:class:`~moealign.patches.megatron.checkpoint.HFShardGroups`), ``offsets`` and ``shape`` in the full
    tensor."""

    rank: int
    gid: int
    j: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class HFTensorPlan:
    """A transformers tensor of a sharded trainer (:meth:`ShardedMegatronTrainer.hf_plan`): ``full_shape``, ``dtype``
    (a torch dtype name) and the owned ``pieces`` that tile it."""

    name: str
    full_shape: tuple[int, ...]
    dtype: str
    pieces: list[HFPiece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.full_shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


# --------------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------------


def precision_fields(precision, *, engine: str = "the sharded Megatron trainer",
                     hint: str = "") -> tuple[str, dict]:
    """``(policy name, Megatron config fields)`` of the precision policy ``precision`` (a name or a policy) for
    Megatron's local (transformer-engine-free) spec, or :class:`~moealign.errors.ConfigError` naming why ``engine``
    cannot express it (an fp32 router / LM head in an fp16 model, FP8: Megatron's FP8 needs transformer-engine
    layers), ``hint`` appended. Pure: no Megatron import (the commands check it before any process starts); the
    one check both Megatron trainers (this one and :class:`moealign.mismatch.engines.MegatronTrainEngine`) make."""
    from ...precision.policy import (PrecisionPolicy, UnknownPolicyError, get_policy, megatron_gaps,
                                     to_megatron_config_fields)

    if isinstance(precision, PrecisionPolicy):
        policy = precision
    else:
        try:
            policy = get_policy(precision)
        except UnknownPolicyError as exc:
            raise ConfigError(f"unknown precision policy {precision!r}") from exc
    gaps = megatron_gaps(policy)
    if gaps:
        raise ConfigError(f"{engine} cannot express precision policy {policy.name!r}: {'; '.join(gaps)}{hint}")
    try:
        fields = to_megatron_config_fields(policy, te_available=False)
    except EngineError as exc:
        raise ConfigError(f"{engine} cannot run precision policy {policy.name!r}: Megatron's FP8 needs "
                          f"transformer-engine layers (the local spec has none){hint}") from exc
    return policy.name, dict(fields)


class ShardedMegatronTrainer:
    """The Megatron-core trainer of the mismatch test, sharded: ``tp`` x ``ep`` x ``pp`` (``dp`` data-parallel copies;
    default the smallest world Megatron accepts, ``dp = ep``), one process per rank (module docstring).

    ``dispatcher``: ``"alltoall"`` or ``"allgather"`` (Megatron's ``moe_token_dispatcher_type``). ``precision``: a
    :mod:`moealign.precision.policy` name Megatron's local spec can express. ``device``: ``"cpu"`` (gloo, the CPU
    mode) or ``"cuda"`` (NCCL, one GPU per rank). ``micro_batch_size``: rows per micro-batch (default: each
    data-parallel rank's samples over ``pp`` micro-batches). ``timeout_s``: the most a start or a command may take
    (also the process group's timeout). ``threads``: torch threads per rank.

    In the shape of :class:`moealign.mismatch.engines.TrainEngine`: ``name``, ``version``, ``dtype``, ``precision``,
    :meth:`meta`, :meth:`forward`, :meth:`close`; ``layout`` (:class:`ParallelLayout`, ``layout.as_dict()`` is the
    report's ``train.parallel``). A context manager (closes on exit).
    """

    name = "megatron"

    def __init__(self, model_path, *, tp: int = 1, ep: int = 1, pp: int = 1, dp: int | None = None,
                 dispatcher: str = "alltoall", precision: str = "fp32", device: str = "cpu",
                 micro_batch_size: int | None = None, timeout_s: float = 300.0, threads: int = 1, seed: int = 1234,
                 aligned: bool = False, aligned_skip=(), tp_reduce: str = "tree"):
        from ...model_config import ConfigView, read_model_config

        self._procs: list = []
        self._conns: list = []
        self._tmpdir: str | None = None
        self.closed = False
        if dispatcher not in DISPATCHERS:
            raise ConfigError(f"unknown MoE token dispatcher {dispatcher!r}; choose one of {list(DISPATCHERS)}")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"the sharded Megatron trainer runs on 'cpu' (gloo) or 'cuda' (NCCL), not {device!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}")
        if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                             or micro_batch_size < 1):
            raise ConfigError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        if not isinstance(aligned, bool):
            raise ConfigError(f"aligned must be a bool, got {aligned!r}")
        canonical_ops = None
        if aligned:
            from ...precision.canonical import OPS
            from .canonical import TP_REDUCTIONS

            unknown = sorted(set(aligned_skip) - set(OPS))
            if unknown:
                raise ConfigError(f"aligned_skip: unknown canonical ops {unknown}; the canonical ops are {list(OPS)}")
            if tp_reduce not in TP_REDUCTIONS:
                raise ConfigError(f"tp_reduce must be one of {list(TP_REDUCTIONS)}, got {tp_reduce!r}")
            canonical_ops = [op for op in OPS if op not in aligned_skip]
        elif aligned_skip:
            raise ConfigError("aligned_skip leaves canonical ops stock: it needs aligned=True")
        self.aligned = aligned
        self.canonical_ops = canonical_ops
        self.precision, fields = precision_fields(precision)
        self.dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            fields["params_dtype"], str(fields["params_dtype"]).replace("torch.", ""))
        self.model_path = str(model_path)
        config = read_model_config(self.model_path)
        self._config = config
        self.layout: ParallelLayout = check_parallel_layout(config, tp=tp, ep=ep, pp=pp, dp=dp)
        if aligned:
            from ...precision.canonical import check_canonical_model, check_canonical_tp

            check_canonical_model(config)
            check_canonical_tp(config, self.layout.tp, "tp")
        world = self.layout.world
        if device == "cuda":
            if not torch.cuda.is_available() or torch.cuda.device_count() < world:
                raise ConfigError(f"{self.layout} needs {world} CUDA devices, this machine has "
                                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        elif world > (os.cpu_count() or 1):
            warnings.warn(f"{self.layout}: {world} rank processes on {os.cpu_count()} CPU cores; it will be slow",
                          MoealignWarning, stacklevel=2)
        view = ConfigView(**config)
        #: Megatron's sequence parallelism, on whenever TP > 1 (module docstring: what it changes)
        self.sequence_parallel = self.layout.tp > 1
        self.top_k = int(view.num_experts_per_tok)
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.dispatcher = dispatcher
        self.timeout_s = float(timeout_s)
        self.pad_token_id = int(config.get("pad_token_id") or 0) if isinstance(config.get("pad_token_id"), int) else 0
        self._meta = None
        self.version = ""
        self.ranks: list[dict] = []
        spec = dict(model_path=self.model_path, config=config, tp=self.layout.tp, ep=self.layout.ep,
                    pp=self.layout.pp, world=world, dispatcher=dispatcher, fields=fields, device=device,
                    timeout_s=self.timeout_s, threads=threads, seed=seed, parent=os.getpid(),
                    canonical_ops=canonical_ops, tp_reduce=tp_reduce,
                    sequence_parallel=self.sequence_parallel)
        self._start(spec)

    # ---------------------------------------------------------------------------------------------- processes

    def _start(self, spec: dict) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="moealign-sharded-")
        spec["init_file"] = os.path.join(self._tmpdir, "rendezvous")
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        try:
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(spec["threads"])
            for rank in range(spec["world"]):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(rank, spec, child), daemon=True,
                                   name=f"moealign-megatron-rank{rank}")
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        except BaseException:
            self._stop()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            self.ranks = self._gather("start")
        except BaseException:
            self._stop()
            raise
        self.version = self.ranks[0]["version"]

    def _what(self, rank: int) -> str:
        info = self.ranks[rank] if rank < len(self.ranks) else None
        if info is None:
            return f"rank {rank}"
        return (f"rank {rank} (tp {info['tp_rank']}, pp {info['pp_rank']}, dp {info['dp_rank']}, ep "
                f"{info['ep_rank']})")

    def _stop(self) -> None:
        """Terminate and join every rank process (kill the ones that outlive the grace), close the pipes."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        self.closed = True

    def _gather(self, what: str, ranks: Sequence[int] | None = None) -> list:
        """Every rank's answer to the last command (in rank order); a dead, silent or failing rank raises.
        ``ranks``: only these ranks were sent a command (the others are not waited for)."""
        from ...exits import child_failure

        expected = list(range(len(self._procs))) if ranks is None else sorted(ranks)
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + self.timeout_s
        grace_end = None
        while len(answers) < len(expected):
            pending = [r for r in expected if r not in answers]
            now = time.monotonic()
            limit = deadline if grace_end is None else min(deadline, grace_end)
            if now >= limit:
                break
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            wait_connections(waitables, timeout=min(1.0, limit - now))
            for r in pending:
                conn, proc = self._conns[r], self._procs[r]
                try:
                    if conn.poll():
                        answers[r] = conn.recv()
                        if answers[r][0] == "error" and grace_end is None:
                            grace_end = time.monotonic() + 10.0    # the others may wait in a collective
                        continue
                except (EOFError, OSError):
                    pass
                if not proc.is_alive():
                    proc.join(1.0)
                    message = child_failure(f"{self._what(r)} of {self.layout}", proc.exitcode)
                    others = [x for x in range(len(self._procs)) if x != r]
                    self._stop()
                    raise EngineError(f"the sharded Megatron trainer's {message} during {what}; the other ranks "
                                      f"{others} were stopped")
        errors = sorted(((r, a) for r, a in answers.items() if a[0] == "error"), key=lambda x: x[0])
        silent = [r for r in expected if r not in answers]
        if errors:
            r, (_, cls_name, message) = errors[0]
            cls = getattr(_errors_module, cls_name, None)
            if not (isinstance(cls, type) and issubclass(cls, _errors_module.MoealignError)):
                cls = EngineError
            also = [x for x, _ in errors[1:]]
            text = f"{self._what(r)} of {self.layout} failed during {what}: {message}"
            if also:
                text += f" (ranks {also} failed too)"
            if silent:
                self._stop()
                text += f"; ranks {silent} did not answer and were stopped"
            raise cls(text)
        if silent:
            self._stop()
            raise EngineTimeoutError(f"the sharded Megatron trainer's ranks {silent} of {self.layout} did not answer "
                                     f"{what} within {self.timeout_s:.0f} s; every rank was stopped")
        return [answers[r][1] for r in expected]

    def _command(self, what: str, payloads) -> list:
        """Send ``payloads`` (one per rank, or ``{rank: payload}`` for some ranks) and gather the answers of those
        ranks (:meth:`_gather`)."""
        if self.closed:
            raise EngineError("this ShardedMegatronTrainer was closed (or its world was stopped after a failure); "
                              "start a new one")
        items = payloads if isinstance(payloads, dict) else dict(enumerate(payloads))
        for r, payload in items.items():
            try:
                self._conns[r].send(payload)
            except (BrokenPipeError, OSError):
                pass                              # _gather names the dead rank
        return self._gather(what, sorted(items))

    # ---------------------------------------------------------------------------------------------- the API

    def meta(self):
        """The :class:`~moealign.record.RecordMeta` of the checkpoint (config fingerprint, router weights read from
        the safetensors files)."""
        if self._meta is None:
            from ...families import get_family
            from ...model_config import ConfigView, moe_layers
            from ...record import RecordMeta
            from ...model_config import checkpoint_fingerprint
            from ...record.meta import router_samples, router_signature
            from .checkpoint import open_hf_checkpoint

            view = ConfigView(**self._config)
            layers = moe_layers(self._config)
            ckpt = open_hf_checkpoint(self.model_path, view)
            try:
                weights = [ckpt.get(f"model.layers.{i}.mlp.gate.weight").float() for i in layers]
            finally:
                ckpt.close()
            self._meta = RecordMeta(
                engine="megatron", engine_version=str(self.version), model_fingerprint=checkpoint_fingerprint(
                    self.model_path), num_layers=int(view.num_hidden_layers), moe_layers=layers,
                num_experts=int(get_family(view.model_type).num_experts(view)), top_k=self.top_k,
                vocab_size=int(view.vocab_size), dtype="float32", router_signature=router_signature(weights),
                router_samples=router_samples(weights), model_name=self.model_path)
        return self._meta

    def _plan(self, n: int) -> tuple[int, int]:
        """(micro-batch size, micro-batches per data-parallel rank) for ``n`` samples."""
        dp = self.layout.dp
        per_dp = math.ceil(n / dp)
        mbs = self.micro_batch_size or math.ceil(per_dp / min(self.layout.pp, per_dp))
        return mbs, math.ceil(per_dp / mbs)

    def _batches(self, record, indices: Sequence[int], replay: bool) -> "_Batches":
        """``record.samples[indices]`` padded and split into each data-parallel rank's micro-batches (module
        docstring: filler slots repeat the last sample)."""
        from ...record import RolloutRecord

        indices = [int(i) for i in indices]
        if not indices:
            raise ConfigError("forward needs at least one sample index")
        samples = [record.samples[i] for i in indices]
        sub = RolloutRecord(record.meta, samples, validate=False)
        if replay and not sub.has_routes:
            raise ReplayError("replay=True needs a record with routes")
        batch = sub.to_padded("right", self.pad_token_id)
        n, T = batch.input_ids.shape
        mbs, num_mb = self._plan(n)
        dp = self.layout.dp
        slots = dp * num_mb * mbs
        rows = list(range(n)) + [n - 1] * (slots - n)            # filler slots repeat the last sample
        routes = batch.routes if (batch.routes is not None and replay) else None
        tensors = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       response_mask=batch.response_mask, route_mask=batch.route_mask, routes=routes)
        extra = (-T) % self.layout.tp if self.sequence_parallel else 0
        if extra:       # sequence parallelism splits T over the TP ranks: more (masked, unrouted) padding columns
            fill = dict(input_ids=self.pad_token_id)
            tensors = {k: None if v is None else torch.cat([v, v.new_full((v.shape[0], extra, *v.shape[2:]),
                                                                          fill.get(k, 0))], dim=1)
                       for k, v in tensors.items()}
            T += extra
        per_dp = []
        for d in range(dp):
            mbs_list = []
            for m in range(num_mb):
                sel = torch.tensor(rows[(d * num_mb + m) * mbs:(d * num_mb + m + 1) * mbs])
                mbs_list.append({k: None if v is None else v[sel] for k, v in tensors.items()})
            per_dp.append(mbs_list)
        command = dict(moe_layers=tuple(batch.moe_layers), seq_length=T, micro_batch_size=mbs, num_mb=num_mb,
                       replay=bool(replay))
        return _Batches(batch=batch, n=n, mbs=mbs, num_mb=num_mb, rows=rows, per_dp=per_dp, command=command,
                        resp_counts=batch.response_mask.sum(1).tolist())

    def _assemble(self, b: "_Batches", answers: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, tokens, routes)`` in record order from the ranks' answers: logits from the last stage's TP
        rank 0, routes from every stage's TP ranks (under sequence parallelism each TP rank's routers saw its own
        chunk of the sequence: its rows go back to their places, each routed row from exactly one rank)."""
        batch, n, mbs, num_mb, rows = b.batch, b.n, b.mbs, b.num_mb, b.rows
        resp_counts = b.resp_counts
        route_counts = batch.route_mask.sum(1).tolist()
        slot_logits: dict[int, torch.Tensor] = {}
        slot_routes: dict[int, dict[int, torch.Tensor]] = {}
        pieces: dict[tuple[int, int, int], list] = {}           # (dp, micro-batch, stage) -> the TP ranks' rows
        for info, answer in zip(self.ranks, answers):
            d = info["dp_rank"]
            for m, out in enumerate(answer["micro_batches"]):
                base = (d * num_mb + m) * mbs
                sel = rows[base:base + mbs]
                if out.get("logits") is not None and info["tp_rank"] == 0:
                    parts = out["logits"].split([resp_counts[s] for s in sel])
                    for j, part in enumerate(parts):
                        if base + j < n:
                            slot_logits[base + j] = part
                if out.get("routes") is not None:
                    pieces.setdefault((d, m, info["pp_rank"]), []).append((out["route_rows"], out["routes"]))
        for (d, m, stage), parts in pieces.items():
            mask = b.per_dp[d][m]["route_mask"].reshape(-1)
            L, k = parts[0][1].shape[1:]
            table = torch.full((mask.numel(), L, k), -1, dtype=torch.int64)
            count = torch.zeros(mask.numel(), dtype=torch.int64)
            for where, ids in parts:
                table[where] = ids
                count[where] += 1
            if bool((count[mask] != 1).any()) or bool((count[~mask] != 0).any()):
                raise EngineError(f"the sharded trainer's TP ranks of stage {stage} returned routes for "
                                  f"{int((count[mask] > 0).sum())} of the {int(mask.sum())} routed rows of "
                                  f"micro-batch {m} (data-parallel rank {d}), some more than once")
            base = (d * num_mb + m) * mbs
            sel = rows[base:base + mbs]
            for j, part in enumerate(table[mask].split([route_counts[s] for s in sel])):
                if base + j < n:
                    slot_routes.setdefault(base + j, {})[stage] = part
        missing = [i for i in range(n) if i not in slot_logits or len(slot_routes.get(i, {})) != self.layout.pp]
        if missing:
            raise EngineError(f"the sharded trainer's ranks returned no results for samples {missing[:8]}")
        logits = torch.cat([slot_logits[i] for i in range(n)])
        routes_used = torch.cat([torch.cat([slot_routes[i][s] for s in range(self.layout.pp)], dim=1)
                                 for i in range(n)])
        bi, p = batch.response_mask.nonzero(as_tuple=True)
        return logits, batch.input_ids[bi, p], routes_used

    def forward(self, record, indices: Sequence[int], *, replay: bool, fault: str | None = None) -> ShardedForward:
        """The logits at the response positions of ``record.samples[indices]``, the experts each router used, the
        log-probs per sample and the router flips against the record (:class:`ShardedForward`), through Megatron's
        schedule on every rank. ``replay=True``: every router replays its tokens' recorded experts, checked per
        token on every rank (a failure raises :class:`~moealign.errors.ReplayError` naming the rank).

        ``fault`` (negative controls, replay only): ``"shift"`` hands every router the rows of the token before
        (routes and their tokens moved one position along the sequence), ``"swap"`` the rows of the next sample of
        its micro-batch; each rank's token check must name it."""
        from ...routing_replay.flips import route_flip_metrics

        if fault is not None and (fault not in FAULTS or not replay):
            raise ConfigError(f"fault must be one of {list(FAULTS)} and needs replay=True, got fault={fault!r}, "
                              f"replay={replay}")
        b = self._batches(record, indices, replay)
        command = dict(b.command, fault=fault)
        answers = self._command("forward", [("forward", dict(command, micro_batches=b.per_dp[info["dp_rank"]]))
                                            for info in self.ranks])
        logits, tokens, routes_used = self._assemble(b, answers)
        batch = b.batch
        if self.canonical_ops is not None and "log_softmax" in self.canonical_ops:
            from ...precision.canonical import c_log_softmax

            full = c_log_softmax(logits, -1)
        else:
            full = torch.log_softmax(logits, dim=-1)
        logprobs = full.gather(-1, tokens[:, None].to(logits.device))[:, 0]
        per_sample = list(logprobs.split(b.resp_counts))
        flips = None
        if batch.routes is not None:
            recorded = batch.routes[batch.route_mask].to(torch.int64)
            flips = route_flip_metrics(routes_used, recorded)
        reports = [dict(info, **answer["report"]) for info, answer in zip(self.ranks, answers)]
        return ShardedForward(logits=logits, tokens=tokens, routes=routes_used, logprobs=per_sample, flips=flips,
                              ranks=reports)

    def train_step(self, record, indices: Sequence[int], grad_logits: torch.Tensor, *, replay: bool, lr: float,
                   max_grad_norm: float, fault: tuple[str, int] | None = None) -> ShardedTrainStep:
        """One optimizer step of every rank, given ``grad_logits`` = dLoss/dlogits ``[n_response_tokens, V]`` (the
        gradient of the caller's loss with respect to the logits :meth:`forward` returned for the same samples, in
        the same order): Megatron's schedule with ``forward_only=False`` on every rank, the last stage's loss the
        surrogate ``sum(logits * grad_logits)`` over its micro-batches' response positions (its gradient with
        respect to the logits is exactly ``grad_logits``; each data-parallel rank gets its samples' rows, filler
        slots zeros, each TP rank its own ``V / TP`` columns of it, never the whole vocabulary: the surrogate covers the
        rank's slice of the gathered logits and the output layer's gather hands each rank its slice in the backward;
        each rank's report states the columns it received, ``grad_columns``), routing
        replay as in :meth:`forward` (``set_routes`` per micro-batch, the per-token check and the verifier on every
        rank). Then on every rank: gradients summed over its data-parallel group (expert parameters, Megatron's
        ``allreduce=False``, over the expert-data-parallel group), the global gradient norm as Megatron's
        optimizer computes it (the squares of the rank's non-duplicate gradients, tensor-parallel duplicates and
        shared copies counted once, summed over the model-parallel group for dense parameters and the
        expert-tensor-model-pipeline group for expert ones), the gradients clipped to ``max_grad_norm`` with
        ``torch.nn.utils.clip_grad_norm_``'s coefficient, and ``torch.optim.Adam(lr=lr)`` (created at the first step,
        its state kept) over the rank's own parameters. Returns the pass's logits (for the caller's check that they
        are the logits the gradient was taken at) and the norm (:class:`ShardedTrainStep`).

        Each rank's report also holds ``grad_squares``: per Megatron parameter name, the sum of the squares of its
        reduced gradient before the clip, where the rank's copy is not a tensor-parallel duplicate (in a TP-only world
        the sum over the ranks is each parameter's whole squared gradient norm: what a test compares per tensor).

        ``fault`` (negative controls): ``("no-grad", rank)``: that rank's surrogate gradient is withheld (zeros);
        ``("skip-step", rank)``: that rank skips its optimizer step; ``("expert-grad-x-tp", rank)``: that rank's
        expert gradients are multiplied by TP before the reductions (TP without sequence parallelism's error)."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ConfigError(f"lr must be a finite number >= 0, got {lr!r}")
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or \
                not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
        if fault is not None and (not isinstance(fault, tuple) or len(fault) != 2 or fault[0] not in TRAIN_FAULTS
                                  or fault[1] not in range(len(self.ranks))):
            raise ConfigError(f"fault must be (one of {list(TRAIN_FAULTS)}, a rank below {len(self.ranks)}), "
                              f"got {fault!r}")
        b = self._batches(record, indices, replay)
        vocab = int(self._config["vocab_size"])
        total = sum(b.resp_counts)
        if not isinstance(grad_logits, torch.Tensor) or tuple(grad_logits.shape) != (total, vocab) or \
                grad_logits.dtype != torch.float32:
            raise ConfigError(f"grad_logits must be a float32 tensor [{total}, {vocab}] (the response tokens' logits "
                              f"of these samples), got {getattr(grad_logits, 'dtype', type(grad_logits).__name__)} "
                              f"{tuple(getattr(grad_logits, 'shape', ()))}")
        if not bool(torch.isfinite(grad_logits).all()):
            raise ConfigError("grad_logits holds NaN or Inf values: the loss's gradient is not finite")
        grad_logits = grad_logits.detach().to("cpu")
        per_sample = list(grad_logits.split(b.resp_counts))
        width = vocab // self.layout.tp                             # checked at the start: TP divides the vocabulary
        payloads = []
        for info in self.ranks:
            grads = None
            if info["last_stage"]:                  # only the last stage computes the surrogate
                d, grads = info["dp_rank"], []
                cols = slice(info["tp_rank"] * width, (info["tp_rank"] + 1) * width)   # its vocabulary slice only
                for m in range(b.num_mb):
                    base = (d * b.num_mb + m) * b.mbs
                    parts = [per_sample[s][:, cols] if base + j < b.n else per_sample[s].new_zeros(
                        per_sample[s].shape[0], width) for j, s in enumerate(b.rows[base:base + b.mbs])]
                    grads.append(torch.cat(parts))
            rank_fault = fault[0] if fault is not None and fault[1] == info["rank"] else None
            payloads.append(("train", dict(b.command, fault=None, micro_batches=b.per_dp[info["dp_rank"]],
                                           grads=grads, lr=float(lr), max_grad_norm=float(max_grad_norm),
                                           train_fault=rank_fault)))
        answers = self._command("the training step", payloads)
        logits, _, _ = self._assemble(b, answers)
        norms = {a["grad_norm"] for a in answers}
        if len(norms) != 1:
            raise EngineError(f"the sharded trainer's ranks disagree on the global gradient norm: "
                              f"{[a['grad_norm'] for a in answers]}")
        reports = [dict(info, **answer["report"]) for info, answer in zip(self.ranks, answers)]
        return ShardedTrainStep(logits=logits, grad_norm=norms.pop(), ranks=reports)

    def set_dispatcher(self, dispatcher: str) -> None:
        """Rebuild every rank's model with MoE token dispatcher ``dispatcher`` (``"alltoall"`` / ``"allgather"``) in
        the same world (the checkpoint's shards are read again)."""
        if dispatcher not in DISPATCHERS:
            raise ConfigError(f"unknown MoE token dispatcher {dispatcher!r}; choose one of {list(DISPATCHERS)}")
        self._command("the dispatcher rebuild", [("dispatcher", dispatcher)] * len(self._conns))
        self.dispatcher = dispatcher

    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order."""
        return [proc.pid for proc in self._procs]

    def hf_shards(self) -> list[list]:
        """Per rank, its own tensors in transformers names
        (:func:`~moealign.patches.megatron.checkpoint.iter_hf_shards_from_megatron`: ``(name, tensor, offsets,
        full_shape)``), all copied to this process at once (small models, tests; a refit streams them instead:
        :meth:`hf_tensors`)."""
        return self._command("hf_shards", [("hf_shards", None)] * len(self._conns))

    @property
    def hf_config(self) -> dict:
        """The checkpoint's transformers config (``config.json``, as :func:`moealign.model_config.read_model_config`
        reads it)."""
        return dict(self._config)

    def hf_plan(self) -> dict[str, "HFTensorPlan"]:
        """Which rank sends which piece of every transformers tensor, in stream order (``{name: HFTensorPlan}``):
        every rank states its pieces (names, offsets, shapes; nothing converted but to the meta device), each piece
        is owned by the first rank holding it (the others hold data-parallel copies: replicated tensors, a tied
        embedding's copy on the last stage), and the owned pieces must tile each full tensor exactly
        (:class:`~moealign.errors.EngineError` naming the tensor otherwise)."""
        metas = self._command("the weight plan", [("hf_meta", None)] * len(self._conns))
        plan: dict[str, HFTensorPlan] = {}
        owned: set = set()
        for rank, pieces in enumerate(metas):
            for gid, j, name, offsets, shape, full, dtype in pieces:
                entry = plan.setdefault(name, HFTensorPlan(name, tuple(full), dtype))
                if entry.full_shape != tuple(full) or entry.dtype != dtype:
                    raise EngineError(f"the sharded trainer's {self._what(rank)} holds {name!r} as {dtype} of "
                                      f"{tuple(full)}, another rank as {entry.dtype} of {entry.full_shape}")
                key = (name, tuple(offsets), tuple(shape))
                if key in owned:
                    continue
                owned.add(key)
                entry.pieces.append(HFPiece(rank, gid, j, tuple(offsets), tuple(shape)))
        for entry in plan.values():
            covered = sum(math.prod(p.shape) for p in entry.pieces)
            inside = all(len(p.offsets) == len(entry.full_shape) and all(
                0 <= o and o + n <= f for o, n, f in zip(p.offsets, p.shape, entry.full_shape)) for p in entry.pieces)
            if covered != math.prod(entry.full_shape) or not inside:
                raise EngineError(f"the sharded trainer's ranks hold {covered} of the {math.prod(entry.full_shape)} "
                                  f"elements of {entry.name!r} {entry.full_shape} (pieces "
                                  f"{[(p.rank, p.offsets, p.shape) for p in entry.pieces][:6]})")
        if not plan:
            raise EngineError("the sharded trainer's ranks hold no tensors")
        return plan

    def hf_tensors(self, *, chunk_bytes: int, meta: bool = False):
        """``(transformers name, full tensor)`` of the trainer's weights, streamed from the ranks in bounded chunks
        (what :func:`moealign.rl.refit` feeds a vLLM engine). The plan (:meth:`hf_plan`) is read when this is called;
        the tensors then come chunk by chunk as the returned iterator is read: for whole tensors of about
        ``chunk_bytes`` together (the refit's chunking rule: tensors until ``chunk_bytes`` is crossed) this process
        allocates one shared-memory buffer per tensor and sends the buffers to the ranks that own their pieces; each
        rank converts only the mapping groups those pieces come from and copies each piece into its place (its
        tensor-parallel slice, its expert rows), so the tensors are joined where they are written and nothing is
        copied again here. The next chunk is asked for only when the consumer has taken every tensor of this one: a
        rank holds its shard + the group it converts, this process one chunk. ``meta=True``: meta-device tensors of
        the full shapes, nothing sent."""
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
        plan = self.hf_plan()
        if meta:
            return ((e.name, torch.empty(e.full_shape, dtype=getattr(torch, e.dtype), device="meta"))
                    for e in plan.values())
        return self._stream_hf(list(plan.values()), chunk_bytes)

    def _stream_hf(self, entries: list["HFTensorPlan"], chunk_bytes: int):
        i = 0
        while i < len(entries):
            _release_freed_memory()                   # the chunk the consumer has taken and dropped
            chunk, size = [], 0
            while i < len(entries):
                chunk.append(entries[i])
                size += entries[i].nbytes
                i += 1
                if size >= chunk_bytes:                       # the refit's own chunking rule (same boundaries)
                    break
            # one shared-memory buffer per tensor of the chunk; each rank writes its pieces into place
            buffers = [_shared_empty(e.full_shape, getattr(torch, e.dtype)) for e in chunk]
            writes: dict[int, list] = {}
            for k, entry in enumerate(chunk):
                for piece in entry.pieces:
                    writes.setdefault(piece.rank, []).append((piece.gid, piece.j, k, piece.offsets, piece.shape))
            self._command("the weight stream", {r: ("hf_write", (buffers, w)) for r, w in writes.items()})
            for k, entry in enumerate(chunk):
                tensor, buffers[k] = buffers[k], None
                yield entry.name, tensor

    def map_hf_shards(self, fn, *args, what: str = "a function over the weights", converted: bool = True) -> list:
        """``fn(pieces, *args)`` on every rank, once per mapping group, over the pieces that rank owns (:meth:`hf_plan`:
        each element of every transformers tensor exactly once over the world), converted one group at a time on the
        rank; ``pieces``: a list of :class:`~moealign.patches.megatron.checkpoint.HFShard` on the rank's device.
        ``fn`` must be picklable (a module-level function: it is sent to the rank processes) and return something small
        (digests, flags). Returns every result, rank by rank, group by group. What the weight manifest (each rank
        digests its own pieces) and the refit's value check (before any weight moves) run on the ranks; ``what`` names
        the command in a failure. ``converted=False``: ``fn`` gets each such group unconverted instead, ``[(Megatron
        name, transformers names, tensor)]`` as the rank holds it (no copy, any device: enough to check values)."""
        plan = self.hf_plan()
        owned: dict[int, list] = {r: [] for r in range(len(self._conns))}
        for entry in plan.values():
            for piece in entry.pieces:
                owned[piece.rank].append((piece.gid, piece.j))
        answers = self._command(what, {r: ("hf_map", (fn, args, ids, bool(converted))) for r, ids in owned.items()
                                       if ids})
        return [result for answer in answers for result in answer]

    def load_checkpoint(self, model_path) -> None:
        """Every rank reads its own shards of the checkpoint at ``model_path`` into its model, in place (a trainer
        resuming from a checkpoint; the record's meta is read from it afterwards). Refused
        (:class:`~moealign.errors.ConfigError`, before any rank reads) when its ``config.json`` differs from this
        trainer's in any field but the dtype and the names of the files' writers."""
        from ...model_config import read_model_config

        config = read_model_config(str(model_path))
        ignored = {"torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures"}
        differ = sorted(k for k in set(config) | set(self._config) if k not in ignored
                        and config.get(k, "<absent>") != self._config.get(k, "<absent>"))
        if differ:
            raise ConfigError(f"load_checkpoint: {model_path} is another model than this trainer's (config fields "
                              f"{differ[:6]} differ)")
        self._command("the checkpoint load", [("load", str(model_path))] * len(self._conns))
        self.model_path = str(model_path)
        self._meta = None

    def peak_rss(self, *, reset: bool = False) -> list[dict]:
        """Per rank ``{"rss": bytes now, "peak": the most since the last reset}`` (Linux's ``VmRSS`` / ``VmHWM``;
        ``reset=True`` then starts a new peak from the current size: ``/proc/self/clear_refs``; :func:`process_memory`,
        which reads the driver's own). Where ``/proc`` has neither, the values are ``None``."""
        return self._command("the memory reading", [("memory", bool(reset))] * len(self._conns))

    def close(self) -> None:
        """Stop every rank (a clean shutdown first, then terminate); calling it again does nothing."""
        if self.closed:
            return
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 20.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._stop()

    def __enter__(self) -> "ShardedMegatronTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed and self._procs:
                self._stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# --------------------------------------------------------------------------------------------------
# the rank process
# --------------------------------------------------------------------------------------------------


def _rank_main(rank: int, spec: dict, conn) -> None:
    """One rank: set up the world and the model, then answer commands until "close" (or the driver is gone)."""
    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")            # Megatron's fallback / deprecation chatter, once per rank
    state = None
    code = 0
    try:
        state = _RankState(rank, spec)
        conn.send(("ok", state.info))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != spec["parent"]:
                    break                         # the driver is gone: leave, do not linger as an orphan
                continue
            cmd, payload = conn.recv()
            if cmd == "close":
                break
            try:
                result = state.run(cmd, payload)
                payload = None                    # a weight stream's buffers: not kept until the next command
                conn.send(("ok", result))
                result = None
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver, named
                payload = None
                conn.send(("error", type(exc).__name__, _one_line(exc)))
    except Exception as exc:  # noqa: BLE001
        code = 1
        try:
            conn.send(("error", type(exc).__name__, _one_line(exc)))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if state is not None:
            state.teardown()
    os._exit(code)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if not isinstance(exc, _errors_module.MoealignError):
        frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
        ours = [f for f in frames if "megatron" in f.filename or "moealign" in f.filename]
        frame = (ours or frames or [None])[-1]
        where = f" (at {'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno})" if frame else ""
        text = f"{type(exc).__name__}: {text}{where}"
    return text


class _RankState:
    """One rank's world, model and replay driver."""

    def __init__(self, rank: int, spec: dict):
        from datetime import timedelta

        import torch.distributed as dist

        from ...model_config import ConfigView
        from .version import megatron_version
        from .world import enable_megatron_cpu, enable_megatron_without_te

        self.rank, self.spec = rank, spec
        self._cached = self._groups_source = None
        self.mode = None
        self.dist_ready = self.ps_ready = False
        self.driver = None
        self.canonical = None
        self.optimizer = None
        version = megatron_version()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if spec["device"] == "cpu":
            self.mode = enable_megatron_cpu(pin_cpu=True)
            backend, self.device = "gloo", torch.device("cpu")
        else:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.mode = enable_megatron_without_te()
            backend, self.device = "nccl", torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, init_method=f"file://{spec['init_file']}", rank=rank,
                                world_size=spec["world"], timeout=timedelta(seconds=spec["timeout_s"]))
        self.dist_ready = True
        ps.initialize_model_parallel(tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"],
                                     expert_model_parallel_size=spec["ep"])
        self.ps_ready = True
        model_parallel_cuda_manual_seed(spec["seed"])
        self.hf_config = ConfigView(**spec["config"])
        self.build(spec["dispatcher"])
        self.info = dict(rank=rank, version=str(version), tp_rank=ps.get_tensor_model_parallel_rank(),
                         pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                         ep_rank=ps.get_expert_model_parallel_rank(), moe_layers=list(self.driver.moe_layers),
                         first_stage=ps.is_pipeline_first_stage(), last_stage=ps.is_pipeline_last_stage(),
                         local_experts=int(self.model.config.num_moe_experts) // spec["ep"])

    def build(self, dispatcher: str) -> None:
        """(Re)build this rank's model with MoE token dispatcher ``dispatcher`` and its replay driver; a previous
        model's driver is undone and its ``RouterReplay`` instances leave Megatron's global list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from .checkpoint import build_megatron_stage
        from .replay import RouterReplayDriver

        if self.driver is not None:
            old = {id(r.router_replay) for _, r in self.driver.routers}
            self.driver.undo()
            self.driver = None
            registry = RouterReplay.global_router_replay_instances
            registry[:] = [inst for inst in registry if id(inst) not in old]
            self.model = None
        if self.canonical is not None:
            self.canonical.undo()
            self.canonical = None
        spec = self.spec
        self.model = build_megatron_stage(self.hf_config, spec["model_path"], parallel_output=False,
                                          cpu=spec["device"] == "cpu", moe_token_dispatcher_type=dispatcher,
                                          sequence_parallel=bool(spec["sequence_parallel"]), **spec["fields"])
        self.model.to(self.device).eval()
        self.optimizer = None                           # a rebuilt model: a new optimizer at the next step
        if spec.get("canonical_ops") is not None:       # before the replay driver, as the single-rank engine does
            from .canonical import apply_canonical_forward_from_hf

            self.canonical = apply_canonical_forward_from_hf(self.model, self.hf_config, ops=spec["canonical_ops"],
                                                             tp_reduce=spec["tp_reduce"])
        self.driver = RouterReplayDriver(self.model, aux_loss="own")
        self.dispatcher = dispatcher
        self._time_replay_work()

    def _time_replay_work(self) -> None:
        """The timers of :data:`TIMERS` around the driver's token check (a forward pre-hook before and one after
        the driver's) and its verifier (``observe``, an instance attribute over the verifier's method)."""
        self.timers = dict.fromkeys(TIMERS, 0.0)
        start = [0.0]

        def begin(module, args, kwargs):
            start[0] = _cpu_clock()

        def end(module, args, kwargs):
            self.timers["token_check"] += _cpu_clock() - start[0]

        self.model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True)
        self.model.register_forward_pre_hook(end, with_kwargs=True)
        verifier = self.driver.verifier
        if verifier is not None:
            observe = verifier.observe

            def timed_observe(*args, **kwargs):
                t0 = _cpu_clock()
                try:
                    return observe(*args, **kwargs)
                finally:
                    self.timers["verifier"] += _cpu_clock() - t0

            verifier.observe = timed_observe

    def run(self, cmd: str, payload):
        if cmd != "hf_write":
            self._cached = None          # a converted group is kept only between the chunks of a weight stream
        if cmd == "forward":
            return self.forward(payload)
        if cmd == "train":
            return self.forward(payload, train=True)
        if cmd == "dispatcher":
            self.build(payload)
            return self.dispatcher
        if cmd == "hf_shards":
            from .checkpoint import iter_hf_shards_from_megatron

            return [(s.name, s.tensor.detach().to("cpu").clone(), s.offsets, s.full_shape)
                    for s in iter_hf_shards_from_megatron(self.model, self.hf_config)]
        if cmd == "hf_meta":
            source = self._hf_groups(meta=True)
            return [(gid, j, p.name, tuple(p.offsets), tuple(p.tensor.shape), tuple(p.full_shape),
                     str(p.tensor.dtype).replace("torch.", ""))
                    for gid in range(len(source)) for j, p in enumerate(source.group(gid))]
        if cmd == "hf_write":
            _release_freed_memory()               # the previous chunk's groups, freed: back to the OS
            buffers, writes = payload
            for gid, j, k, offsets, shape in writes:     # each piece into its place in the driver's shared buffer
                target = buffers[k]
                place = target[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
                # a layer's experts: each expert's (slice of its) weight straight into its row of the buffer, never
                # the rank's experts stacked into one converted copy first
                parts = self._groups().expert_parts(gid, j)
                if parts is not None:
                    got, dtype = (len(parts), *parts[0].shape), parts[0].dtype
                else:
                    piece = self._piece(gid, j)
                    got, dtype = tuple(piece.tensor.shape), piece.tensor.dtype
                if tuple(got) != tuple(shape) or dtype != target.dtype:
                    name = self._groups().names(gid)
                    raise EngineError(f"{name} at {list(offsets)} is {tuple(got)} {dtype} on this rank; the plan "
                                      f"said {tuple(shape)} {target.dtype}")
                if parts is None:
                    place.copy_(piece.tensor)
                else:
                    for e, part in enumerate(parts):
                        place[e].copy_(part)
            return None
        if cmd == "hf_map":
            fn, args, ids, converted = payload
            by_group: dict[int, list[int]] = {}
            for gid, j in ids:
                by_group.setdefault(gid, []).append(j)
            if not converted:
                source = self._groups()
                return [fn(source.megatron_tensors(gid), *args) for gid in by_group]
            try:
                results = []
                for gid, js in by_group.items():
                    results.append(fn([self._piece(gid, j) for j in js], *args))
                    self._cached = None
                    _release_freed_memory()
                return results
            finally:
                self._cached = None
        if cmd == "load":
            from .checkpoint import load_hf_into_megatron

            self._cached = None
            load_hf_into_megatron(self.model, payload, self.hf_config)
            return None
        if cmd == "memory":
            return process_memory(payload)
        raise EngineError(f"unknown command {cmd!r}")

    def _hf_groups(self, meta: bool = False):
        from .checkpoint import HFShardGroups

        return HFShardGroups(self.model, self.hf_config, meta=meta)

    def _groups(self):
        """This rank's :class:`~moealign.patches.megatron.checkpoint.HFShardGroups` (built once per model)."""
        if self._groups_source is None or self._groups_source[0] is not self.model:
            self._groups_source = (self.model, self._hf_groups())
        return self._groups_source[1]

    def _piece(self, gid: int, j: int):
        """Piece ``j`` of mapping group ``gid`` (on the rank's device), the group converted once (the last group
        converted is kept until another is asked for: a group's pieces are asked for together or in a row)."""
        cached = self._cached
        if cached is None or cached[0] != gid:
            groups = self._groups()
            self._cached = None                                   # the previous group goes before the next comes
            cached = self._cached = (gid, groups.group(gid))
        return cached[1][j]

    def _replay_batch(self, mb: dict, moe_layers, fault: str | None):
        from ...routing_replay.protocol import ReplayBatch
        from ...routing_replay.routes import expand_routes

        ids, attn, routes, route_mask = mb["input_ids"], mb["attention_mask"], mb["routes"], mb["route_mask"]
        if fault == "shift":        # every row handed the route (and token) of the position before it
            ids, attn, routes, route_mask = (x.roll(1, dims=1) for x in (ids, attn, routes, route_mask))
        elif fault == "swap":       # every row handed the rows of the next sample of the micro-batch
            ids, attn, routes, route_mask = (x.roll(1, dims=0) for x in (ids, attn, routes, route_mask))
        return ReplayBatch.padded(expand_routes(routes), input_ids=ids, attention_mask=attn,
                                  moe_layers=moe_layers, route_mask=route_mask, allow_degenerate=True)

    def forward(self, cmd: dict, *, train: bool = False) -> dict:
        """Megatron's schedule over this rank's micro-batches: forward only (``train=False``), or forward and
        backward with the surrogate loss of :meth:`ShardedMegatronTrainer.train_step` on the last stage
        (``cmd["grads"]``: per micro-batch, dLoss/dlogits of its response positions)."""
        import contextlib

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from .capture import capture_routes

        micro_batches = cmd["micro_batches"]
        replay, fault = cmd["replay"], cmd["fault"]
        T = cmd["seq_length"]
        dev = self.device
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        outputs = [dict() for _ in micro_batches]
        data = iter(enumerate(micro_batches))
        driver = self.driver
        tp0 = self.info["tp_rank"] == 0
        # under sequence parallelism each TP rank's routers see its own chunk of the sequence: every TP rank
        # reports its rows (with their record rows), else TP rank 0 reports all of them
        sp_size, sp_rank = (self.spec["tp"], self.info["tp_rank"]) if self.model.config.sequence_parallel else (1, 0)
        captured = []
        grads = cmd.get("grads") if train else None
        grad_columns: list[int] = []                # the widths of the loss gradients this rank received (reported)
        if train and self.info["last_stage"] and (grads is None or len(grads) != len(micro_batches)):
            raise EngineError(f"the training step sent {0 if grads is None else len(grads)} gradients for "
                              f"{len(micro_batches)} micro-batches to a last-stage rank")

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            ids = mb["input_ids"].to(dev)
            attn = mb["attention_mask"]
            pos = (attn.cumsum(-1) - 1).clamp(min=0).to(dev)
            mask = (causal[None, None] | (attn == 0)[:, None, None, :]).to(dev)
            if replay:
                t0 = _cpu_clock()
                driver.set_routes(self._replay_batch(mb, cmd["moe_layers"], fault))
                timers["set_routes"] += _cpu_clock() - t0
                with driver.forward():
                    out = model(ids, pos, mask)
            else:
                out = model(ids, pos, mask)
            captured.append((index, capture.last_forward_rows(sp_size=sp_size, sp_rank=sp_rank)
                             if tp0 or sp_size > 1 else None, mb["route_mask"]))
            capture.clear()

            def loss_func(output, non_loss_data=False):
                # last stage: logits [b, s, V]; position p - 1 scores the token at p
                b, p = mb["response_mask"].nonzero(as_tuple=True)
                picked = output[b.to(dev), (p - 1).to(dev)].float()
                if tp0:
                    outputs[index]["logits"] = picked.detach().cpu()
                if not train:
                    return output.new_zeros(())
                # the surrogate over this TP rank's vocabulary slice: d(sum(picked[:, slice] * G_slice)) / d(picked)
                # is G_slice in the slice and 0 elsewhere; the output layer's gather hands each rank its own slice in
                # the backward, G_slice exactly (the driver sends each rank its V / TP columns, never the vocabulary)
                g = grads[index].to(dev)
                if cmd.get("train_fault") == "no-grad":
                    g = torch.zeros_like(g)
                lo = self.info["tp_rank"] * g.shape[1]
                loss = (picked[:, lo:lo + g.shape[1]] * g).sum()
                grad_columns.append(int(g.shape[1]))
                return loss, torch.ones((), dtype=torch.int), {}

            return out, loss_func

        report = {}
        timers = self.timers
        for name in timers:
            timers[name] = 0.0
        config = self.model.config
        per_token = config.calculate_per_token_loss
        if train:
            config.calculate_per_token_loss = True      # the schedule adds no 1 / num_microbatches to the surrogate
            for param in self.model.parameters():
                param.requires_grad_(True)
                param.grad = None
        try:
            t_schedule, c_schedule = time.perf_counter(), _cpu_clock()
            with (contextlib.nullcontext() if train else torch.no_grad()), \
                    capture_routes(self.model, routers=self.driver.routers) as capture:
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=data, model=[self.model],
                    num_microbatches=cmd["num_mb"], seq_length=T, micro_batch_size=cmd["micro_batch_size"],
                    forward_only=not train, collect_non_loss_data=not train)
            timers["forward"], timers["forward_cpu"] = time.perf_counter() - t_schedule, _cpu_clock() - c_schedule
            if replay:
                t0 = _cpu_clock()
                driver.check(calls=cmd["num_mb"])
                rep = driver.verify_report()
                timers["check"] = _cpu_clock() - t0
                report = dict(replayed_calls=rep.calls, verified_rows=rep.rows, replayed_rows=rep.replayed_rows,
                              mismatched_rows=rep.mismatched_rows, unrouted_rows=rep.unrouted_rows)
        finally:
            config.calculate_per_token_loss = per_token
            driver.clear()
            driver.reset_counters()
        for index, local, route_mask in captured:
            if local is not None:
                where, used = local
                keep = route_mask.reshape(-1)[where]
                outputs[index]["routes"] = used[keep.to(used.device)].cpu()
                outputs[index]["route_rows"] = where[keep]
        answer = dict(micro_batches=outputs, report=dict(report, micro_batches=len(micro_batches),
                                                         timings=dict(timers)))
        if train:
            answer["grad_norm"], squares = self._step(cmd)
            answer["report"]["grad_columns"] = max(grad_columns, default=0)     # 0: not a last-stage rank
            answer["report"]["grad_squares"] = squares
        return answer

    def _step(self, cmd: dict) -> tuple[float, dict]:
        """After the backward: gradients reduced over the data-parallel ranks, the global norm, the clip, Adam (see
        :meth:`ShardedMegatronTrainer.train_step`). Returns the norm before clipping and the rank's
        ``grad_squares``."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        model, config = self.model, self.model.config
        named = list(model.named_parameters())
        params = [p for _, p in named]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        # what Megatron's finalize_model_grads adds up across ranks besides the data-parallel reduction: the
        # replicated parameters whose gradient each tensor-parallel rank holds only a part of (the q / k layernorms
        # over its own heads; under sequence parallelism, on at TP > 1, those marked sequence_parallel: every norm
        # and router weight, each TP rank's over its own sequence chunk), summed over the TP group; a word embedding
        # shared with the output layer across pipeline stages, summed over the embedding group. The experts need
        # nothing here: under sequence parallelism the dispatcher hands each expert every token once
        tp_group = ps.get_tensor_model_parallel_group()
        tp = dist.get_world_size(tp_group)
        if cmd.get("train_fault") == "expert-grad-x-tp":
            # the negative control: what TP without sequence parallelism did (each expert ran on TP copies of every
            # token: its gradient TP times the loss's), on this rank's expert parameters
            for name, param in named:
                if ".mlp.experts." in name:
                    param.grad.mul_(tp)
        if tp > 1:
            for name, param in named:
                if (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)) or \
                        (config.sequence_parallel and getattr(param, "sequence_parallel", False)):
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tp_group)
        if getattr(model, "share_embeddings_and_output_weights", False) and ps.get_pipeline_model_parallel_world_size() > 1 \
                and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
            shared = model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, op=dist.ReduceOp.SUM, group=ps.get_embedding_group())
        dense_group, expert_group = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
        for param in params:                    # Megatron's DDP: expert parameters carry allreduce=False
            group = dense_group if getattr(param, "allreduce", True) else expert_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        # the norm as Megatron's (chained) optimizer computes it: per group the sum of the squares of the rank's
        # non-duplicate gradients, summed over the group's model-parallel ranks; the groups' squares added
        squares = []
        for expert, group in ((False, ps.get_model_parallel_group()),
                              (True, ps.get_expert_tensor_model_pipeline_parallel_group())):
            grads = [p.grad.float() for p in params if getattr(p, "allreduce", True) != expert
                     and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) \
                if grads else torch.zeros((), device=self.device)
            square = (local ** 2).reshape(1)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(square, op=dist.ReduceOp.SUM, group=group)
            squares.append(square[0])
        total = torch.sqrt(squares[0] + squares[1])
        # per parameter, the squares of the rank's reduced gradient where it is not a TP duplicate (one host read)
        counted = [(name, p) for name, p in named if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        sums = torch.stack([p.grad.float().square().sum() for _, p in counted]).tolist() if counted else []
        squares_by_name = {name: value for (name, _), value in zip(counted, sums)}
        # torch.nn.utils.clip_grad_norm_'s coefficient (the single-process trainer's clip), applied on every rank
        coef = torch.clamp(cmd["max_grad_norm"] / (total + 1e-6), max=1.0)
        for param in params:
            param.grad.mul_(coef)
        if self.optimizer is None:
            self.optimizer = torch.optim.Adam(params, lr=cmd["lr"])
        elif self.optimizer.param_groups[0]["lr"] != cmd["lr"]:
            raise ConfigError(f"lr {cmd['lr']} differs from this trainer's optimizer's {self.optimizer.param_groups[0]['lr']}")
        if cmd.get("train_fault") != "skip-step":
            self.optimizer.step()
        for param in params:
            param.grad = None
        return float(total), squares_by_name

    def teardown(self) -> None:
        with _suppress():
            if self.driver is not None:
                self.driver.undo()
        with _suppress():
            if self.canonical is not None:
                self.canonical.undo()
        if self.ps_ready:
            from megatron.core import parallel_state as ps

            with _suppress():
                ps.destroy_model_parallel()
        if self.dist_ready:
            import torch.distributed as dist

            with _suppress():
                dist.destroy_process_group()
        if self.mode is not None:
            with _suppress():
                self.mode.undo()


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory (sent through a pipe, the receiving process maps the same pages;
    allocated there directly, not copied in as ``share_memory_`` would)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def _release_freed_memory() -> None:
    """Hand the pages of freed memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing): without it the
    groups a rank converts for a weight stream, freed one after another, stay in the allocator's free lists and the
    rank's resident set grows towards a second copy of its shard (measured before this was added: 431 MB above the
    start for a 433 MB shard streamed in 64 MiB chunks)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def process_memory(reset: bool = False) -> dict:
    """This process's resident set now and its peak (``VmRSS`` / ``VmHWM``, bytes); ``reset``: freed memory handed
    back to the OS first (so that the size read is what is in use), then a new peak from there."""
    values = {"rss": None, "peak": None}
    if reset:
        _release_freed_memory()
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values["rss" if key == "VmRSS" else "peak"] = int(rest.split()[0]) * 1024
        if reset:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
    except OSError:
        pass
    return values


def _cpu_clock() -> float:
    """CPU seconds of this thread (the rank's own replay work, not its waits for a core)."""
    return time.thread_time()


def _suppress():
    import contextlib

    return contextlib.suppress(Exception)
