"""moealign's one native CPU extension: the fused leaf-tree kernel of :mod:`moealign.precision._tree_kernel` and the
layout-digest kernel of the refit verification (:func:`moealign.patches.vllm.refit.span_lanes`), in one C++ source
built on first use with ``torch.utils.cpp_extension.load_inline`` (one build, cached per machine and torch version).

Each kernel computes exactly what its torch path computes (the tree kernel: one IEEE float32 operation at a time in
the torch trees' order, contraction off; the digest kernel: wrapping 64-bit integer sums and products, exact in any
order), so the bits are the same with or without it (``tests/test_canonical_ops.py``, ``tests/test_weight_manifest.py``
compare them with ``torch.equal``). Where the extension cannot be built (no compiler, no ninja, no headers) every
caller runs its torch path; ``MOEALIGN_TREE_KERNEL=0`` / ``MOEALIGN_DIGEST_KERNEL=0`` turn one kernel off.

The digest kernel (``layout_lanes``) reads a ``[L, Mo, Mi, n]`` view through its strides (element sizes 1, 2, 4, 8
bytes): row ``m = mo * Mi + mi`` of tensor ``l``, columns ``c``; the bytes of each row, shifted by ``off`` bytes, are
little-endian 8-byte words ``w[q]``, and tensor ``l``'s lanes are ``sum_m rowkey[m] * sum_q w[q] * colkey[q]`` mod
2^64. A strided view (vLLM's CPU-prepacked experts in logical order) is read where it lies, no copy; work is shared
out over torch's intra-op threads (one parallel region per call; sums mod 2^64 do not depend on the split).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

__all__ = ["extension", "kernel_enabled"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// ---------------------------------------------------------------------------------------------------------------
// the leaf tree of moealign.precision.tree.tree_linear (float32 nodes)
// ---------------------------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------------------------
// the layout digest of moealign.patches.vllm.refit.span_lanes (wrapping uint64 arithmetic: exact in any order)
// ---------------------------------------------------------------------------------------------------------------

typedef uint64_t u64;

// the digest's loops, compiled twice: for x86-64-v4 (AVX-512: 64-bit vector multiplies) and the baseline, chosen
// when the extension loads (integer arithmetic: both give the same bits)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOEALIGN_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define MOEALIGN_CLONES
#endif

// columns [lo, hi) of the n columns whose bytes fall in word q (element size S, the row's bytes shifted by off)
template <int S>
static inline void word_columns(int64_t q, int64_t off, int64_t n, int64_t* lo, int64_t* hi) {
  *lo = q == 0 ? 0 : (8 * q - off) / S;
  *hi = std::min<int64_t>(n, (8 * q + 8 - off) / S);
}

// G rows (row g at p + g * smi elements, smi == 1 where UNIT; columns at stride sn) into acc[2 g], acc[2 g + 1];
// k0 / k1: the two lanes' column keys
template <typename T, int G, bool UNIT>
MOEALIGN_CLONES static void rows_strided(const T* p, int64_t smi, int64_t n, int64_t sn, int64_t off, const u64* k0,
                                         const u64* k1, int64_t Q, u64* acc) {
  constexpr int S = sizeof(T), PER = 8 / S;
  u64 a0[G], a1[G];
  for (int g = 0; g < G; ++g) { a0[g] = 0; a1[g] = 0; }
  const int64_t whole = off == 0 ? n / PER : 0;                 // words of PER whole columns from column 0 on
  for (int64_t q = 0; q < whole; ++q) {
    u64 w[G];
    for (int g = 0; g < G; ++g) w[g] = 0;
    for (int j = 0; j < PER; ++j) {
      const T* e = p + (q * PER + j) * sn;
      for (int g = 0; g < G; ++g) w[g] |= (u64)e[UNIT ? g : g * smi] << (8 * S * j);
    }
    const u64 c0 = k0[q], c1 = k1[q];
    for (int g = 0; g < G; ++g) { a0[g] += w[g] * c0; a1[g] += w[g] * c1; }
  }
  for (int64_t q = whole; q < Q; ++q) {
    int64_t lo, hi;
    word_columns<S>(q, off, n, &lo, &hi);
    u64 w[G];
    for (int g = 0; g < G; ++g) w[g] = 0;
    for (int64_t c = lo; c < hi; ++c) {
      const int sh = (int)(((off + c * S) & 7) * 8);
      const T* e = p + c * sn;
      for (int g = 0; g < G; ++g) w[g] |= (u64)e[UNIT ? g : g * smi] << sh;
    }
    const u64 c0 = k0[q], c1 = k1[q];
    for (int g = 0; g < G; ++g) { a0[g] += w[g] * c0; a1[g] += w[g] * c1; }
  }
  for (int g = 0; g < G; ++g) { acc[2 * g] = a0[g]; acc[2 * g + 1] = a1[g]; }
}

// the row's byte b as word q's byte (b - 8 q + off): 0 outside the row
static inline u64 partial_word(const unsigned char* p, int64_t nbytes, int64_t off, int64_t q) {
  u64 w = 0;
  for (int b = 0; b < 8; ++b) {
    const int64_t at = 8 * q + b - off;
    if (at >= 0 && at < nbytes) w |= (u64)p[at] << (8 * b);
  }
  return w;
}

// one row whose columns are contiguous: its bytes read as words where they lie, eight words at a time (the partial
// first / last words assembled byte by byte)
MOEALIGN_CLONES static void row_contiguous(const unsigned char* p, int64_t nbytes, int64_t off, const u64* k0,
                                           const u64* k1, int64_t Q, u64* acc) {
  constexpr int V = 8;
  const int64_t lo = off > 0 ? 1 : 0;
  const int64_t hi = std::max<int64_t>(lo, (off + nbytes) / 8);   // words [lo, hi) lie wholly in the row
  u64 s0 = 0, s1 = 0;
  for (int64_t q = 0; q < lo; ++q) { const u64 w = partial_word(p, nbytes, off, q); s0 += w * k0[q]; s1 += w * k1[q]; }
  u64 a0[V], a1[V];
  for (int v = 0; v < V; ++v) { a0[v] = 0; a1[v] = 0; }
  const unsigned char* base = p + 8 * lo - off;
  int64_t q = lo;
  for (; q + V <= hi; q += V) {
    u64 w[V];
    std::memcpy(w, base + 8 * (q - lo), 8 * V);
    for (int v = 0; v < V; ++v) { a0[v] += w[v] * k0[q + v]; a1[v] += w[v] * k1[q + v]; }
  }
  for (; q < hi; ++q) { u64 w; std::memcpy(&w, base + 8 * (q - lo), 8); s0 += w * k0[q]; s1 += w * k1[q]; }
  for (q = hi; q < Q; ++q) { const u64 w = partial_word(p, nbytes, off, q); s0 += w * k0[q]; s1 += w * k1[q]; }
  for (int v = 0; v < V; ++v) { s0 += a0[v]; s1 += a1[v]; }
  acc[0] = s0; acc[1] = s1;
}

template <typename T>
static void digest_typed(const torch::Tensor& x, int64_t off, const u64* k0, const u64* k1, int64_t Q, const u64* rk,
                         u64* part, int64_t tasks, int64_t groups) {
  constexpr int G = 16;
  const int64_t Mo = x.size(1), Mi = x.size(2), n = x.size(3);
  const int64_t sl = x.stride(0), smo = x.stride(1), smi = x.stride(2), sn = x.stride(3);
  const T* base = reinterpret_cast<const T*>(x.data_ptr());
  const bool contiguous_rows = sn == 1 || n <= 1;
  const int64_t row_bytes = n * (int64_t)sizeof(T);
  const int64_t grain = std::max<int64_t>(
      1, (int64_t)(1 << 18) / std::max<int64_t>(1, std::min<int64_t>(G, Mi) * row_bytes));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    u64 acc[2 * G];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t gi = t % groups, lm = t / groups, mo = lm % Mo, l = lm / Mo;
      const int64_t mi0 = gi * G, count = std::min<int64_t>(G, Mi - mi0);
      const T* p = base + l * sl + mo * smo + mi0 * smi;
      if (contiguous_rows) {
        for (int64_t g = 0; g < count; ++g)
          row_contiguous(reinterpret_cast<const unsigned char*>(p + g * smi), row_bytes, off, k0, k1, Q, acc + 2 * g);
      } else if (count == G && smi == 1) {
        rows_strided<T, G, true>(p, smi, n, sn, off, k0, k1, Q, acc);
      } else if (count == G) {
        rows_strided<T, G, false>(p, smi, n, sn, off, k0, k1, Q, acc);
      } else {
        for (int64_t g = 0; g < count; ++g)
          rows_strided<T, 1, false>(p + g * smi, smi, n, sn, off, k0, k1, Q, acc + 2 * g);
      }
      u64 s0 = 0, s1 = 0;
      const u64* r = rk + 2 * (mo * Mi + mi0);
      for (int64_t g = 0; g < count; ++g) { s0 += acc[2 * g] * r[2 * g]; s1 += acc[2 * g + 1] * r[2 * g + 1]; }
      part[2 * t] = s0; part[2 * t + 1] = s1;
    }
  });
}

// x [L, Mo, Mi, n] (any strides), colkeys [Q, 2] int64, rowkeys [Mo * Mi, 2] int64 -> [L, 2] int64 lanes
torch::Tensor layout_lanes(torch::Tensor x, torch::Tensor colkeys, torch::Tensor rowkeys, int64_t off) {
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu(), "x must be a [L, Mo, Mi, n] CPU tensor");
  TORCH_CHECK(colkeys.dtype() == torch::kInt64 && rowkeys.dtype() == torch::kInt64, "int64 keys");
  const int64_t L = x.size(0), Mo = x.size(1), Mi = x.size(2), n = x.size(3);
  const int64_t S = x.element_size();
  TORCH_CHECK(S == 1 || S == 2 || S == 4 || S == 8, "element size 1, 2, 4 or 8 bytes");
  TORCH_CHECK(off >= 0 && off < 8 && off % S == 0, "off: 0 .. 7, a multiple of the element size");
  colkeys = colkeys.contiguous(); rowkeys = rowkeys.contiguous();
  const int64_t Q = colkeys.size(0);
  TORCH_CHECK(colkeys.dim() == 2 && colkeys.size(1) == 2 && Q == (off + n * S + 7) / 8, "colkeys: [words, 2]");
  TORCH_CHECK(rowkeys.dim() == 2 && rowkeys.size(1) == 2 && rowkeys.size(0) == Mo * Mi, "rowkeys: [rows, 2]");
  auto out = torch::zeros({L, 2}, torch::kInt64);
  const int64_t groups = (Mi + 15) / 16, tasks = L * Mo * groups;
  if (tasks == 0 || Q == 0) return out;
  auto part = torch::empty({tasks, 2}, torch::kInt64);
  auto lanes = colkeys.t().contiguous();                          // [2, Q]: each lane's keys contiguous
  const u64* k0 = reinterpret_cast<const u64*>(lanes.data_ptr<int64_t>());
  const u64* k1 = k0 + Q;
  const u64* rk = reinterpret_cast<const u64*>(rowkeys.data_ptr<int64_t>());
  u64* pp = reinterpret_cast<u64*>(part.data_ptr<int64_t>());
  if (S == 1) digest_typed<uint8_t>(x, off, k0, k1, Q, rk, pp, tasks, groups);
  else if (S == 2) digest_typed<uint16_t>(x, off, k0, k1, Q, rk, pp, tasks, groups);
  else if (S == 4) digest_typed<uint32_t>(x, off, k0, k1, Q, rk, pp, tasks, groups);
  else digest_typed<uint64_t>(x, off, k0, k1, Q, rk, pp, tasks, groups);
  u64* op = reinterpret_cast<u64*>(out.data_ptr<int64_t>());
  const int64_t per = tasks / L;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t t = l * per; t < (l + 1) * per; ++t) { op[2 * l] += pp[2 * t]; op[2 * l + 1] += pp[2 * t + 1]; }
  return out;
}
"""

_SWITCHES = {"tree": "MOEALIGN_TREE_KERNEL", "digest": "MOEALIGN_DIGEST_KERNEL"}
_LOCK = threading.Lock()
_STATE: dict = {}


def kernel_enabled(kernel: str) -> bool:
    """Whether ``kernel`` (``"tree"`` / ``"digest"``) is switched on (its variable is not ``"0"``)."""
    return os.environ.get(_SWITCHES[kernel], "1") != "0"


def extension(kernel: str):
    """The compiled extension (``leaf_tree_linear``, ``layout_lanes``) when ``kernel`` is switched on and the
    extension builds here; None otherwise (the caller runs its torch path)."""
    if not kernel_enabled(kernel):
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
                        name=f"moealign_native_v3_{tag}", cpp_sources=[_SOURCE],
                        functions=["leaf_tree_linear", "layout_lanes"],
                        extra_cflags=["-O3", "-ffp-contract=off", "-fno-fast-math"], verbose=False)
            except Exception as exc:  # noqa: BLE001 - no compiler / ninja / headers: the torch paths run instead
                warnings.warn(f"moealign: its native CPU kernels could not be built ({type(exc).__name__}); the torch "
                              "paths run (the same bits, slower)", stacklevel=2)
                _STATE["module"] = None
        return _STATE["module"]
