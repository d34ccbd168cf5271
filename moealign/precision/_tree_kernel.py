"""A fused CPU kernel for the leaf tree of :func:`moealign.precision.tree.tree_linear` (float32 nodes).

It computes exactly the torch implementation's arithmetic, one IEEE float32 operation at a time in the same order
(each product, then the canonical tree within each leaf, then over the leaves), compiled with floating-point
contraction off and no fast-math, so the bits are the torch path's (``tests/test_canonical_ops.py`` compares them
with ``torch.equal``); outputs are independent, so the threads that share them out change nothing. Built on first
use with ``torch.utils.cpp_extension.load_inline`` (cached per machine); when it cannot be built (no compiler, no
ninja) or ``MOEALIGN_TREE_KERNEL=0``, the torch path runs instead (the same bits, slower).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

__all__ = ["tree_kernel", "leaf_tree_linear"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

// the canonical tree over v[0..n) (destroys v): a left-to-right chain over the odd part of n, then adjacent pairs
static inline void tree_lanes(float* v, int n, int lanes) {
  int c = n; while (c % 2 == 0) c /= 2;
  int g = n / c;
  for (int i = 0; i < g; ++i) {
    float* dst = v + (size_t)i * lanes;
    const float* a0 = v + (size_t)(i * c) * lanes;
    for (int t = 0; t < lanes; ++t) dst[t] = a0[t];
    for (int j = 1; j < c; ++j) {
      const float* aj = v + (size_t)(i * c + j) * lanes;
      for (int t = 0; t < lanes; ++t) dst[t] = dst[t] + aj[t];
    }
  }
  while (g > 1) {
    for (int i = 0; i < g / 2; ++i) {
      float* dst = v + (size_t)i * lanes;
      const float* a = v + (size_t)(2 * i) * lanes;
      const float* b = v + (size_t)(2 * i + 1) * lanes;
      for (int t = 0; t < lanes; ++t) dst[t] = a[t] + b[t];
    }
    g /= 2;
  }
}

// out[m, n] = tree over K of x[m, k] * wt[idx[m], k, n] (idx empty: wt is [K, N] for every row; wt is the
// weight transposed, so the lanes (outputs n) read contiguous memory)
torch::Tensor leaf_tree_linear(torch::Tensor x, torch::Tensor wt, torch::Tensor idx, int64_t leaf) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && wt.dtype() == torch::kFloat32, "float32 only");
  x = x.contiguous(); wt = wt.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const bool gathered = idx.numel() > 0;
  const int64_t N = gathered ? wt.size(2) : wt.size(1);
  TORCH_CHECK(K % leaf == 0, "K must be a multiple of the leaf width");
  const int64_t leaves = K / leaf;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  const int64_t* ip = gathered ? idx.contiguous().data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  constexpr int LANES = 16;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf((size_t)leaf * LANES), roots((size_t)leaves * LANES);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * K;
      const float* wm = wp + (gathered ? ip[m] * N * K : 0);
      for (int64_t n0 = 0; n0 < N; n0 += LANES) {
        const int lanes = (int)std::min<int64_t>(LANES, N - n0);
        for (int64_t l = 0; l < leaves; ++l) {
          for (int j = 0; j < leaf; ++j) {
            const float xv = xr[l * leaf + j];
            float* dst = buf.data() + (size_t)j * lanes;
            const float* wk = wm + (l * leaf + j) * N + n0;
            for (int t = 0; t < lanes; ++t) dst[t] = xv * wk[t];
          }
          tree_lanes(buf.data(), (int)leaf, lanes);
          for (int t = 0; t < lanes; ++t) roots[(size_t)l * lanes + t] = buf[t];
        }
        tree_lanes(roots.data(), (int)leaves, lanes);
        for (int t = 0; t < lanes; ++t) op[m * N + n0 + t] = roots[t];
      }
    }
  });
  return out;
}
"""

_LOCK = threading.Lock()
_STATE: dict = {}


def tree_kernel():
    """The compiled extension module, or None (not buildable here, or disabled by ``MOEALIGN_TREE_KERNEL=0``)."""
    if os.environ.get("MOEALIGN_TREE_KERNEL", "1") == "0":
        return None
    with _LOCK:
        if "module" not in _STATE:
            try:
                from torch.utils.cpp_extension import load_inline

                # one build per torch version: the cache is keyed by the name, and a build for another torch's ABI
                # must not be loaded
                tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _STATE["module"] = load_inline(
                        name=f"moealign_leaf_tree_v2_{tag}", cpp_sources=[_SOURCE], functions=["leaf_tree_linear"],
                        extra_cflags=["-O3", "-ffp-contract=off", "-fno-fast-math"], verbose=False)
            except Exception as exc:  # noqa: BLE001 - no compiler / ninja / headers: the torch path runs instead
                warnings.warn(f"moealign: the fused tree kernel could not be built ({type(exc).__name__}); the torch "
                              "path runs (the same bits, slower)", stacklevel=2)
                _STATE["module"] = None
        return _STATE["module"]


def leaf_tree_linear(x: torch.Tensor, w: torch.Tensor, leaf_width: int, idx: torch.Tensor | None = None):
    """The fused kernel's ``[M, N]`` float32 roots, or None where it does not apply (not CPU float32, not built)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
        return None
    module = tree_kernel()
    if module is None:
        return None
    empty = torch.empty(0, dtype=torch.int64)
    wt = w.transpose(-1, -2).contiguous()            # [K, N] / [E, K, N]: the lanes read contiguous weights
    return module.leaf_tree_linear(x, wt, empty if idx is None else idx.to(torch.int64), int(leaf_width))
