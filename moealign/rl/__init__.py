"""The RL loop under measurement: ``moealign rl-check`` and the refit library calls users' own loops use.

* :func:`refit` / :func:`verify_refit` (:mod:`moealign.rl.refit`): the trainer's weights into a running vLLM
  engine in place, and the proof that every worker now holds them (digests through vLLM's packing, a probe forward);
* :func:`certify_refit` (:mod:`moealign.rl.certify`): every check after any refit in one verdict (digests, derived
  buffers, the prefill and decode probes, the prefix cache, the engine awake);
* :func:`weight_manifest` / :class:`WeightManifest` (:mod:`moealign.rl.manifest`): the trainer's weights as
  per-tensor digests in a small file, so that ``verify_refit(llm, manifest)`` verifies an engine from another process;
* :func:`run_rl_check` (:mod:`moealign.rl.loop`): K steps of group-relative policy gradient, vLLM rolling out and
  Megatron-core training, every step measured (mismatch, router flips, correction, reward, refit, verification);
* :class:`RLCheckConfig` (:mod:`moealign.rl.config`): its options, checked before any engine starts.
"""

from .certify import CHECKS, RefitCertificate, certify_refit, prefix_cache_check, prime_prefix_cache
from .config import LEVERS, STEP_METRICS, RLCheckConfig
from .loop import run_rl_check
from .manifest import WeightManifest, weight_manifest
from .refit import Probe, RefitCheck, refit, trainer_tensors, verify_refit
from .reward import REWARD_NAME, balanced_brackets, group_advantages, rewards

__all__ = ["CHECKS", "RefitCertificate", "certify_refit", "prefix_cache_check", "prime_prefix_cache", "LEVERS", "RLCheckConfig", "STEP_METRICS", "run_rl_check", "Probe", "RefitCheck", "refit",
           "trainer_tensors", "verify_refit", "WeightManifest", "weight_manifest", "REWARD_NAME",
           "balanced_brackets", "group_advantages", "rewards"]
