// Native kernels of the emulated wafer-scale device (lightning_sparse/wse/native.py builds
// and loads this file with ctypes; see its docstring).
//
// Tokens are the vector dimension: each kernel transposes a tile of T tokens of its token-major
// input into a feature-major buffer (row j = T contiguous tokens), so every kept weight costs T/L
// fused multiply-adds on contiguous vectors, and writes its output back token-major.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LS_SPMV_AVX512 1
#else
#define LS_SPMV_AVX512 0
#endif

// GCC/Clang vector extensions: one register = 64 bytes with AVX-512, else 32 (AVX2/NEON pairs).
#if defined(__AVX512F__)
#define LS_VECTOR_BYTES 64
#else
#define LS_VECTOR_BYTES 32
#endif

namespace {

template <typename S> struct VecOf;
template <> struct VecOf<float> {
  typedef float type __attribute__((vector_size(LS_VECTOR_BYTES)));
};
template <> struct VecOf<double> {
  typedef double type __attribute__((vector_size(LS_VECTOR_BYTES)));
};
template <typename S> using Vec = typename VecOf<S>::type;
template <typename S> constexpr int kLanes = LS_VECTOR_BYTES / sizeof(S);

template <typename S> inline Vec<S> load(const S* p) {
  Vec<S> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename S> inline void store(S* p, Vec<S> v) { std::memcpy(p, &v, sizeof v); }
// Every lane = x. Written x - 0 (exact for every x), which the compiler folds into one broadcast
// load; `Vec{} + x` (not an identity for x = -0) costs an add and a register broadcast on the FMA
// port per kept weight (benchmarks/README.md, "Figures behind the code").
template <typename S> inline Vec<S> splat(S x) { return x - Vec<S>{}; }
template <typename S> inline S horizontal_sum(Vec<S> v) {
  S s = 0;
  for (int l = 0; l < kLanes<S>; ++l) s += v[l];
  return s;
}

// out[0..3] += horizontal sums of a0..a3 (= with Store), sharing shuffles across the four (a
// transpose-reduce).
template <typename S, bool Store = false>
inline void reduce4(Vec<S> a0, Vec<S> a1, Vec<S> a2, Vec<S> a3, S* out) {
  const auto put = [out](int j, S sum) {
    if constexpr (Store) {
      out[j] = sum;
    } else {
      out[j] += sum;
    }
  };
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
  if constexpr (kLanes<S> == 16) {
    // Halves of (a0, a1) and of (a2, a3) added: 8 partial sums of each input.
    const Vec<S> s01 =
        __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15,
                                24, 25, 26, 27, 28, 29, 30, 31);
    const Vec<S> s23 =
        __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15,
                                24, 25, 26, 27, 28, 29, 30, 31);
    // 4 partial sums of each input, then pairs and neighbours within each group of 4 lanes.
    const Vec<S> s =
        __builtin_shufflevector(s01, s23, 0, 1, 2, 3, 8, 9, 10, 11,
                                16, 17, 18, 19, 24, 25, 26, 27) +
        __builtin_shufflevector(s01, s23, 4, 5, 6, 7, 12, 13, 14, 15,
                                20, 21, 22, 23, 28, 29, 30, 31);
    const Vec<S> t =
        s + __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const Vec<S> u =
        t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    put(0, u[0]); put(1, u[4]); put(2, u[8]); put(3, u[12]);
    return;
  } else if constexpr (kLanes<S> == 8) {
    const Vec<S> s01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const Vec<S> s23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const Vec<S> s = __builtin_shufflevector(s01, s23, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(s01, s23, 2, 3, 6, 7, 10, 11, 14, 15);
    const Vec<S> u = s + __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
    put(0, u[0]); put(1, u[2]); put(2, u[4]); put(3, u[6]);
    return;
  } else if constexpr (kLanes<S> == 4) {
    const Vec<S> s01 =
        __builtin_shufflevector(a0, a1, 0, 1, 4, 5) + __builtin_shufflevector(a0, a1, 2, 3, 6, 7);
    const Vec<S> s23 =
        __builtin_shufflevector(a2, a3, 0, 1, 4, 5) + __builtin_shufflevector(a2, a3, 2, 3, 6, 7);
    const Vec<S> s = __builtin_shufflevector(s01, s23, 0, 2, 4, 6) +
                     __builtin_shufflevector(s01, s23, 1, 3, 5, 7);
    put(0, s[0]); put(1, s[1]); put(2, s[2]); put(3, s[3]);
    return;
  }
#endif
  put(0, horizontal_sum<S>(a0)); put(1, horizontal_sum<S>(a1));
  put(2, horizontal_sum<S>(a2)); put(3, horizontal_sum<S>(a3));
}

struct Buffer {  // 64-byte aligned scratch memory, freed on scope exit
  void* ptr;
  explicit Buffer(size_t bytes)
      : ptr(std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64))) {}
  ~Buffer() { std::free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

constexpr int64_t kRowBlock = 16;  // output rows per work item (one cache line of floats)
constexpr int64_t kColBlock = 32;  // features per transpose work item
// The randomly accessed transposed tile (K features x T tokens) is sized to stay in a share of L2
// (more tokens per tile amortize each kept weight's index and value loads over more FMAs; a
// smaller tile stays closer to the core). The SpMM takes at most kSpmmVectors vectors of tokens
// (two beat four and eight on the 51M model's shapes, on the AMD EPYC and the Intel Xeon alike).
// SDDMM streams its gradient tile row by row, so only its X tile counts. Set at load time from
// this machine's cache sizes (`ls_set_tile_budgets`, `policy.tile_budgets`); these are the
// defaults (the rule's values for a 1 MB L2).
int64_t g_spmm_budget = 512 << 10;
int64_t g_sddmm_budget = 512 << 10;
constexpr int kSpmmVectors = 2;
constexpr int64_t kMinTokensPerThread = 32;

// One thread for small problems: a parallel region costs microseconds, and when the cores are
// oversubscribed a descheduled team member stalls the team for a whole time slice.
inline int threads_for(int64_t nnz, int64_t N, int64_t features, int threads) {
  const int64_t work = (nnz + features) * std::max<int64_t>(N, 1);
  return work < (int64_t{1} << 18) ? 1 : std::max(threads, 1);
}

// Largest vectors-per-tile (1, 2, 4 or 8) whose transposed tile of `features` rows fits the budget.
template <typename S>
int max_vectors(int64_t features, int64_t budget) {
  int nv = 8;
  const int64_t bytes_per_vector = static_cast<int64_t>(sizeof(S)) * features * kLanes<S>;
  while (nv > 1 && bytes_per_vector * nv > budget) nv /= 2;
  return nv;
}

// Smallest power of two vectors covering tn tokens, at most cap: a short last tile stays cheap.
template <typename S>
int vectors_for(int64_t tn, int cap) {
  int nv = 1;
  while (nv < cap && nv * kLanes<S> < tn) nv *= 2;
  return nv;
}

// Calls f(std::integral_constant<int, NV>) for the runtime nv in {1, 2, 4, 8}.
template <typename F>
inline auto with_vectors(int nv, F&& f) {
  switch (nv) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
#define LS_REGISTER_TRANSPOSE 1
// Lane e of the lo (HI=false) or hi output of one level of an L x L register transpose that swaps
// off-diagonal blocks of size B between rows i and i + B (indices into the concatenation a:b).
template <int L, int B, bool HI>
constexpr int transpose_index(int e) {
  return ((e / B) / 2 * 2 + (HI ? 1 : 0)) * B + e % B + ((e / B) % 2 ? L : 0);
}
template <typename S, int B, bool HI, size_t... I>
inline Vec<S> transpose_shuffle(Vec<S> a, Vec<S> b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, transpose_index<kLanes<S>, B, HI>(I)...);
}
// Transposes the L x L block held in r[0..L) (row i = r[i]) in registers.
template <typename S, int B = kLanes<S> / 2>
inline void transpose_block(Vec<S>* r) {
  constexpr int L = kLanes<S>;
  for (int g = 0; g < L; g += 2 * B) {
    for (int i = g; i < g + B; ++i) {
      constexpr auto lanes = std::make_index_sequence<L>{};
      const Vec<S> lo = transpose_shuffle<S, B, false>(r[i], r[i + B], lanes);
      const Vec<S> hi = transpose_shuffle<S, B, true>(r[i], r[i + B], lanes);
      r[i] = lo;
      r[i + B] = hi;
    }
  }
  if constexpr (B > 1) transpose_block<S, B / 2>(r);
}
#else
#define LS_REGISTER_TRANSPOSE 0
#endif

// dst[k * T + t] = src[(n0 + t) * ld + k] for k in [k0, k1), t < tn; zero-pads tokens tn..T-1 so
// the kernels always run full-width vectors. Full L x L blocks go through registers (about twice
// as fast as strided scalar copies). (An earlier register-transposed SpMM write-back lost to its
// 4 KiB-strided vector stores; the one in spmm_rows, 16 rows x L tokens per block, measured 2-9%
// faster than the scalar copy on 2026-11-27.)
template <typename S, int T>
inline void transpose_tile(const S* src, int64_t ld, int64_t n0, int64_t tn, int64_t k0, int64_t k1,
                           S* dst) {
  constexpr int L = kLanes<S>;
  for (int64_t kb = k0; kb < k1; kb += kColBlock) {
    const int64_t ke = std::min(kb + kColBlock, k1);
    int64_t t = 0;
#if LS_REGISTER_TRANSPOSE
    if (ke - kb == kColBlock) {
      for (; t + L <= tn; t += L) {
        for (int64_t k = kb; k < ke; k += L) {
          Vec<S> r[L];
          for (int i = 0; i < L; ++i) r[i] = load<S>(src + (n0 + t + i) * ld + k);
          transpose_block<S>(r);
          for (int i = 0; i < L; ++i) store<S>(dst + (k + i) * T + t, r[i]);
        }
      }
    }
#endif
    for (; t < tn; ++t) {
      const S* s = src + (n0 + t) * ld;
      for (int64_t k = kb; k < ke; ++k) dst[k * T + t] = s[k];
    }
    for (int64_t k = kb; k < ke; ++k)
      for (int64_t u = tn; u < T; ++u) dst[k * T + u] = S(0);
  }
}

// --- Y [N, M] = X [N, K] @ S^T (+ bias) for S [M, K] in CSR (crow, col, val) ---------------------

// Rows [i0, i1) of the output tile of tokens [n0, n0 + tn), from the transposed input tile xt.
template <typename S, typename I, int NV>
void spmm_rows(const int32_t* crow, const I* col, const S* val, const S* bias, const S* xt,
               int64_t i0, int64_t i1, int64_t n0, int64_t tn, int64_t M, S* Y) {
  constexpr int L = kLanes<S>;
  constexpr int T = NV * L;
  constexpr int U = NV >= 8 ? 1 : 8 / NV;  // accumulator sets: 8 independent FMA chains in flight
  alignas(64) S block[kRowBlock * T];
  for (int64_t ib = i0; ib < i1; ib += kRowBlock) {
    const int64_t ie = std::min(ib + kRowBlock, i1);
    for (int64_t i = ib; i < ie; ++i) {
      Vec<S> acc[U][NV];
      for (int u = 0; u < U; ++u)
        for (int v = 0; v < NV; ++v) acc[u][v] = Vec<S>{};
      int32_t k = crow[i];
      const int32_t end = crow[i + 1];
      for (; k + U <= end; k += U) {
        for (int u = 0; u < U; ++u) {
          const Vec<S> w = splat<S>(val[k + u]);
          const S* xr = xt + static_cast<int64_t>(col[k + u]) * T;
          for (int v = 0; v < NV; ++v) acc[u][v] += w * load<S>(xr + v * L);
        }
      }
      for (; k < end; ++k) {
        const Vec<S> w = splat<S>(val[k]);
        const S* xr = xt + static_cast<int64_t>(col[k]) * T;
        for (int v = 0; v < NV; ++v) acc[0][v] += w * load<S>(xr + v * L);
      }
      const Vec<S> b = splat<S>(bias != nullptr ? bias[i] : S(0));
      for (int v = 0; v < NV; ++v) {
        for (int u = 1; u < U; ++u) acc[0][v] += acc[u][v];
        store<S>(block + (i - ib) * T + v * L, acc[0][v] + b);
      }
    }
    // Back to token-major, one cache line per token. A full block goes through L x L register
    // transposes: the scalar copy cost 8% of the kernel at 90% sparsity and 15% at 95% (its
    // share grows as the rows' kept weights shrink).
    int64_t t = 0;
#if LS_REGISTER_TRANSPOSE
    if (ie - ib == kRowBlock) {
      for (; t + L <= tn; t += L) {
        for (int64_t r0 = 0; r0 < kRowBlock; r0 += L) {
          Vec<S> r[L];
          for (int j = 0; j < L; ++j) r[j] = load<S>(block + (r0 + j) * T + t);
          transpose_block<S>(r);  // r[j]: token t + j of rows ib + r0 ... ib + r0 + L - 1
          for (int j = 0; j < L; ++j) store<S>(Y + (n0 + t + j) * M + ib + r0, r[j]);
        }
      }
    }
#endif
    for (; t < tn; ++t) {
      S* yr = Y + (n0 + t) * M + ib;
      for (int64_t r = 0; r < ie - ib; ++r) yr[r] = block[r * T + t];
    }
  }
}

template <typename S, typename I>
void spmm(const int32_t* crow, const I* col, const S* val, const S* X, const S* bias,
          int64_t N, int64_t K, int64_t M, S* Y, int threads) {
  const int cap = std::min(kSpmmVectors, max_vectors<S>(K, g_spmm_budget));
  const int64_t T_cap = cap * kLanes<S>;
  threads = threads_for(crow[M], N, K + M, threads);
  if (threads == 1 || N >= threads * kMinTokensPerThread) {
    // Token-parallel: threads take tiles of tokens one at a time (each tile is independent, so
    // the result does not depend on who computes it), each into a private transposed buffer; a
    // thread the OS deschedules on a busy machine then simply takes fewer tiles.
    const int64_t tiles = (N + T_cap - 1) / T_cap;
#pragma omp parallel num_threads(threads)
    {
      Buffer xbuf(sizeof(S) * K * T_cap);
      S* xt = static_cast<S*>(xbuf.ptr);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t n0 = tile * T_cap;
        const int64_t tn = std::min(T_cap, N - n0);
        with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
          constexpr int T = decltype(nv)::value * kLanes<S>;
          transpose_tile<S, T>(X, K, n0, tn, 0, K, xt);
          spmm_rows<S, I, decltype(nv)::value>(crow, col, val, bias, xt, 0, M, n0, tn, M, Y);
        });
      }
    }
    return;
  }
  // Few tokens: threads share each tile and split its rows (two barriers per tile).
  Buffer xbuf(sizeof(S) * K * T_cap);
  S* xt = static_cast<S*>(xbuf.ptr);
#pragma omp parallel num_threads(threads)
  for (int64_t n0 = 0; n0 < N; n0 += T_cap) {
    const int64_t tn = std::min(T_cap, N - n0);
    with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
      constexpr int T = decltype(nv)::value * kLanes<S>;
#pragma omp for schedule(static)
      for (int64_t kb = 0; kb < K; kb += kColBlock)
        transpose_tile<S, T>(X, K, n0, tn, kb, std::min(kb + kColBlock, K), xt);
#pragma omp for schedule(dynamic, 1)
      for (int64_t ib = 0; ib < M; ib += kRowBlock)
        spmm_rows<S, I, decltype(nv)::value>(crow, col, val, bias, xt, ib, std::min(ib + kRowBlock, M),
                                          n0, tn, M, Y);
    });
  }
}

// --- X [N, K] = G [N, M] @ S for S [M, K] in CSR: the input gradient on the weight's own CSR ----
// Each kept weight (i, j) adds val * G[:, i] to X[:, j]. G's row i (T tokens) stays in registers
// while the row's kept weights scatter into the feature-major accumulator tile acc [K x T], so no
// transposed structure (CSR of S^T, 4-8 more bytes per kept weight) is needed. Within a row the
// columns are distinct: the unrolled group's loads and stores never alias. Each FMA costs a load
// and a store of the accumulator: a store-bound kernel, whose read-modify-writes go to L2 when
// the K x T tile does not fit L1. Column blocks keep them in L1: the accumulator of kb columns
// (`block_bytes` of L1) takes every row's kept weights in those columns, then the next block;
// columns ascend within a row, so a row's kept weights in block b start where block b - 1's
// ended, and a cursor per row (scratch, not stored) resumes it. Every accumulator element sums
// the same terms in the same order (rows ascending) either way: the two give identical bits, so
// which runs is a matter of time only (`kernel_variants.py` measures it per shape).

// acc[col[k] - c0] += val[k] * gt[i] for the kept weights of rows [0, M) in columns [c0, c1),
// from cursor[i] on; cursor[i] ends past them. With `last`, every remaining kept weight of a row
// is in the block (no column test).
template <typename S, typename I, int NV>
void spmm_t_rows(const int32_t* crow, const I* col, const S* val, const S* gt, int64_t M,
                 int64_t c0, int64_t c1, bool last, int32_t* cursor, S* acc) {
  constexpr int L = kLanes<S>;
  constexpr int T = NV * L;
  constexpr int U = 8;  // 8 independent read-modify-writes in flight (+3-8% over 4)
  S* base = acc - c0 * T;  // column j's accumulator row at base + j * T
  for (int64_t i = 0; i < M; ++i) {
    Vec<S> g[NV];
    for (int v = 0; v < NV; ++v) g[v] = load<S>(gt + i * T + v * L);
    int32_t k = cursor[i];
    const int32_t end = crow[i + 1];
    for (; k + U <= end && (last || col[k + U - 1] < c1); k += U) {
      S* a[U];
      Vec<S> w[U], x[U][NV];
      for (int u = 0; u < U; ++u) {
        a[u] = base + static_cast<int64_t>(col[k + u]) * T;
        w[u] = splat<S>(val[k + u]);
        for (int v = 0; v < NV; ++v) x[u][v] = load<S>(a[u] + v * L);
      }
      for (int u = 0; u < U; ++u)
        for (int v = 0; v < NV; ++v) store<S>(a[u] + v * L, x[u][v] + w[u] * g[v]);
    }
    for (; k < end && (last || col[k] < c1); ++k) {
      S* a = base + static_cast<int64_t>(col[k]) * T;
      const Vec<S> w = splat<S>(val[k]);
      for (int v = 0; v < NV; ++v) store<S>(a + v * L, load<S>(a + v * L) + w * g[v]);
    }
    cursor[i] = k;
  }
}

// dst[(n0 + t) * ld + k] = src[k * T + t] for k < K, t < tn: a feature-major tile back to
// token-major rows, L x L blocks through registers.
template <typename S, int T>
inline void untranspose_tile(const S* src, int64_t K, int64_t n0, int64_t tn, int64_t ld, S* dst) {
  constexpr int L = kLanes<S>;
  int64_t k = 0;
#if LS_REGISTER_TRANSPOSE
  for (; k + L <= K; k += L) {
    int64_t t = 0;
    for (; t + L <= tn; t += L) {
      Vec<S> r[L];
      for (int i = 0; i < L; ++i) r[i] = load<S>(src + (k + i) * T + t);
      transpose_block<S>(r);  // r[i]: token t + i of features k ... k + L - 1
      for (int i = 0; i < L; ++i) store<S>(dst + (n0 + t + i) * ld + k, r[i]);
    }
    for (; t < tn; ++t)
      for (int64_t f = k; f < k + L; ++f) dst[(n0 + t) * ld + f] = src[f * T + t];
  }
#endif
  for (int64_t t = 0; t < tn; ++t)
    for (int64_t f = k; f < K; ++f) dst[(n0 + t) * ld + f] = src[f * T + t];
}

// Threads take whole token tiles (private G and accumulator tiles), so every output element is
// summed over the rows in the same order whatever the thread count. `block_bytes` > 0 runs the
// accumulator by column blocks of that many bytes (at least kColBlock columns); 0, or a block
// that holds all K columns, runs it whole. Returns 1 if a buffer could not be allocated.
template <typename S, typename I>
int spmm_t(const int32_t* crow, const I* col, const S* val, const S* G, int64_t N, int64_t M,
           int64_t K, S* X, int threads, int64_t block_bytes) {
  const int cap = std::min(kSpmmVectors, max_vectors<S>(K, g_spmm_budget));
  const int64_t T_cap = cap * kLanes<S>;
  const int64_t tiles = (N + T_cap - 1) / T_cap;
  int64_t kb = K;
  if (block_bytes > 0) {
    const int64_t fit = block_bytes / static_cast<int64_t>(sizeof(S) * T_cap);
    kb = std::min(K, std::max(kColBlock, fit / kColBlock * kColBlock));
  }
  threads = static_cast<int>(std::min<int64_t>(threads_for(crow[M], N, K + M, threads), tiles));
  threads = std::max(threads, 1);
  // A G tile, an accumulator tile (kb columns) and the rows' cursors, in S-sized slots rounded
  // up to whole cache lines (each thread's tiles start 64-byte aligned).
  constexpr int64_t line = 64 / sizeof(S);
  const int64_t slots = (M + kb) * T_cap + (M * 4 + sizeof(S) - 1) / sizeof(S);
  const int64_t per_thread = (slots + line - 1) / line * line;
  Buffer buf(sizeof(S) * per_thread * threads);
  if (buf.ptr == nullptr) return 1;
#pragma omp parallel num_threads(threads)
  {
    S* gt = static_cast<S*>(buf.ptr) + per_thread * omp_get_thread_num();
    S* acc = gt + M * T_cap;
    int32_t* cursor = reinterpret_cast<int32_t*>(acc + kb * T_cap);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t n0 = tile * T_cap;
      const int64_t tn = std::min(T_cap, N - n0);
      with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
        constexpr int T = decltype(nv)::value * kLanes<S>;
        transpose_tile<S, T>(G, M, n0, tn, 0, M, gt);
        std::memcpy(cursor, crow, sizeof(int32_t) * M);
        for (int64_t c0 = 0; c0 < K; c0 += kb) {
          const int64_t c1 = std::min(c0 + kb, K);
          std::memset(acc, 0, sizeof(S) * (c1 - c0) * T);
          spmm_t_rows<S, I, decltype(nv)::value>(crow, col, val, gt, M, c0, c1, c1 == K, cursor,
                                                  acc);
          untranspose_tile<S, T>(acc, c1 - c0, n0, tn, K, X + c0);
        }
      });
    }
  }
  return 0;
}

// --- D [M, K] = (G^T @ X) at the kept positions of (crow, col), zero elsewhere ------------------

// vals[k] += dot over the tile's tokens of G column i and X column col[k], for rows [i0, i1)
// (= with Store: a range's first tile writes its partial sums, no zeroing pass before it; the
// kept values' partial sums are read and written once per tile, memory traffic that grows with
// the layer's kept count: benchmarks/README.md, "Figures behind the code").
template <typename S, typename I, int NV, bool Store = false>
void sddmm_rows(const int32_t* crow, const I* col, const S* gt, const S* xt, int64_t i0,
                int64_t i1, S* vals) {
  constexpr int L = kLanes<S>;
  constexpr int T = NV * L;
  for (int64_t i = i0; i < i1; ++i) {
    Vec<S> g[NV];
    for (int v = 0; v < NV; ++v) g[v] = load<S>(gt + i * T + v * L);
    int32_t k = crow[i];
    const int32_t end = crow[i + 1];
    // Four dot products at a time: four independent FMA chains sharing g, one shared reduction.
    for (; k + 4 <= end; k += 4) {
      const S* x0 = xt + static_cast<int64_t>(col[k]) * T;
      const S* x1 = xt + static_cast<int64_t>(col[k + 1]) * T;
      const S* x2 = xt + static_cast<int64_t>(col[k + 2]) * T;
      const S* x3 = xt + static_cast<int64_t>(col[k + 3]) * T;
      Vec<S> a0{}, a1{}, a2{}, a3{};
      for (int v = 0; v < NV; ++v) {
        a0 += g[v] * load<S>(x0 + v * L);
        a1 += g[v] * load<S>(x1 + v * L);
        a2 += g[v] * load<S>(x2 + v * L);
        a3 += g[v] * load<S>(x3 + v * L);
      }
      reduce4<S, Store>(a0, a1, a2, a3, vals + k);
    }
    for (; k < end; ++k) {
      const S* x0 = xt + static_cast<int64_t>(col[k]) * T;
      Vec<S> a0{};
      for (int v = 0; v < NV; ++v) a0 += g[v] * load<S>(x0 + v * L);
      if constexpr (Store) {
        vals[k] = horizontal_sum<S>(a0);
      } else {
        vals[k] += horizontal_sum<S>(a0);
      }
    }
  }
}

// D is dense [M, K] (zero at pruned positions) when `dense`, else the kept values [nnz] in CSR
// order (what a compact layer's value gradient is).
// SDDMM sums each kept weight's dot product over at most this many token ranges (whole tiles),
// each into its own partial buffer, then adds the partials in range order: the ranges depend on N
// only, so the result is the same whatever the thread count (threads take ranges dynamically; a
// descheduled thread just takes fewer).
constexpr int kTokenRanges = 4;

template <typename S, typename I>
int sddmm(const int32_t* crow, const I* col, const S* G, const S* X, int64_t N, int64_t K,
          int64_t M, S* D, bool dense, int threads) {
  const int cap = max_vectors<S>(K, g_sddmm_budget);
  const int64_t T_cap = cap * kLanes<S>;
  const int64_t nnz = crow[M];
  threads = threads_for(nnz, N, K + M, threads);
  const int64_t tiles = (N + T_cap - 1) / T_cap;
  const int ranges = static_cast<int>(std::min<int64_t>(kTokenRanges, std::max<int64_t>(tiles, 1)));
  // One range (few tokens) and several threads: they share each tile and split its rows instead.
  const bool by_rows = ranges == 1 && threads > 1;
  Buffer vbuf(sizeof(S) * nnz * ranges);
  Buffer gshared(by_rows ? sizeof(S) * M * T_cap : 0);
  Buffer xshared(by_rows ? sizeof(S) * K * T_cap : 0);
  if (!vbuf.ptr || !gshared.ptr || !xshared.ptr) return 1;
  S* partial = static_cast<S*>(vbuf.ptr);
#pragma omp parallel num_threads(threads)
  {
    if (!by_rows) {
      Buffer gbuf(sizeof(S) * M * T_cap), xbuf(sizeof(S) * K * T_cap);
      S* gt = static_cast<S*>(gbuf.ptr);
      S* xt = static_cast<S*>(xbuf.ptr);
#pragma omp for schedule(dynamic, 1)
      for (int p = 0; p < ranges; ++p) {
        S* vals = partial + nnz * p;
        const int64_t first = tiles * p / ranges, last = tiles * (p + 1) / ranges;
        if (first == last) std::memset(vals, 0, sizeof(S) * nnz);  // no tokens (N = 0)
        for (int64_t tile = first; tile < last; ++tile) {
          const int64_t n0 = tile * T_cap;
          const int64_t tn = std::min(T_cap, N - n0);
          with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
            constexpr int T = decltype(nv)::value * kLanes<S>;
            transpose_tile<S, T>(X, K, n0, tn, 0, K, xt);
            transpose_tile<S, T>(G, M, n0, tn, 0, M, gt);
            if (tile == first) {
              sddmm_rows<S, I, decltype(nv)::value, true>(crow, col, gt, xt, 0, M, vals);
            } else {
              sddmm_rows<S, I, decltype(nv)::value>(crow, col, gt, xt, 0, M, vals);
            }
          });
        }
      }
    } else {
      S* gt = static_cast<S*>(gshared.ptr);
      S* xt = static_cast<S*>(xshared.ptr);
#pragma omp for schedule(static)
      for (int64_t k = 0; k < nnz; ++k) partial[k] = S(0);
      for (int64_t n0 = 0; n0 < N; n0 += T_cap) {
        const int64_t tn = std::min(T_cap, N - n0);
        with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
          constexpr int T = decltype(nv)::value * kLanes<S>;
#pragma omp for schedule(static) nowait
          for (int64_t kb = 0; kb < K; kb += kColBlock)
            transpose_tile<S, T>(X, K, n0, tn, kb, std::min(kb + kColBlock, K), xt);
#pragma omp for schedule(static)
          for (int64_t mb = 0; mb < M; mb += kColBlock)
            transpose_tile<S, T>(G, M, n0, tn, mb, std::min(mb + kColBlock, M), gt);
#pragma omp for schedule(dynamic, 1)
          for (int64_t ib = 0; ib < M; ib += kRowBlock)
            sddmm_rows<S, I, decltype(nv)::value>(crow, col, gt, xt, ib, std::min(ib + kRowBlock, M),
                                               partial);
        });
      }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      S* row = D + i * K;
      if (dense) std::memset(row, 0, sizeof(S) * K);
      for (int32_t k = crow[i]; k < crow[i + 1]; ++k) {
        S sum = partial[k];
        for (int p = 1; p < ranges; ++p) sum += partial[nnz * p + k];
        if (dense) {
          row[col[k]] = sum;
        } else {
          D[k] = sum;
        }
      }
    }
  }
  return 0;
}

// --- CSR structure of a bool mask ---------------------------------------------------------------

// Bit k of the result is byte k of w, for bytes that are 0 or 1 (torch.bool): the multiply moves
// byte k's low bit to bit 56 + k without carries.
inline uint32_t byte_bits(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return static_cast<uint32_t>((w * 0x0102040810204080ULL) >> 56);
}

// Row pointers crow [M + 1] of the kept (nonzero) bytes of mask [M, K]; returns nnz.
// Masks below this many entries are built on one thread: a parallel region costs microseconds,
// and on a busy machine a descheduled team member stalls it for a whole time slice.
constexpr int64_t kParallelMaskMin = int64_t{1} << 18;
inline int mask_threads(int64_t M, int64_t K, int threads) {
  return M * K < kParallelMaskMin ? 1 : std::max(1, threads);
}
int64_t csr_count(const uint8_t* mask, int64_t M, int64_t K, int32_t* crow, int threads) {
  threads = mask_threads(M, K, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* row = mask + i * K;
    int32_t count = 0;
    for (int64_t j = 0; j < K; ++j) count += row[j];
    crow[i + 1] = count;
  }
  crow[0] = 0;
  for (int64_t i = 0; i < M; ++i) crow[i + 1] += crow[i];
  return crow[M];
}

// Given crow: the column of each kept entry in CSR order (ascending within a row), as I (uint16
// where K <= 65536, else int32). Rows are independent, so threads take them statically.
template <typename I>
void csr_cols(const uint8_t* mask, int64_t M, int64_t K, const int32_t* crow, I* col,
              int threads) {
  threads = mask_threads(M, K, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* row = mask + i * K;
    int32_t p = crow[i];
    int64_t j = 0;
    for (; j + 64 <= K; j += 64) {  // one unpredictable loop exit per 64 columns
      uint64_t bits = 0;
      for (int b = 0; b < 8; ++b)
        bits |= static_cast<uint64_t>(byte_bits(row + j + 8 * b)) << (8 * b);
      for (; bits != 0; bits &= bits - 1) col[p++] = static_cast<I>(j + __builtin_ctzll(bits));
    }
    for (; j < K; ++j)
      if (row[j]) col[p++] = static_cast<I>(j);
  }
}

// --- One token: y [M] = S x (+ bias), S [M, K] in CSR, memory-bound (GEMV) ----------------------
// The inference layout for batch-1 decode: column indices as uint16 when K <= 65536 (int32
// otherwise), values fp32 or bf16 (uint16 bit patterns, widened to fp32 exactly; accumulation in
// fp32). x [K] stays in L1/L2, so each kept weight costs its index and value bytes read from
// memory plus one lane of a hardware gather: 6 bytes (fp32) or 4 bytes (bf16) per kept weight
// against 4 per weight for a dense fp32 GEMV.
template <typename V> inline float widen(V v);
template <> inline float widen<float>(float v) { return v; }
template <> inline float widen<uint16_t>(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if LS_SPMV_AVX512
template <typename I> inline __m512i load_index16(const I* p, __mmask16 m);
template <> inline __m512i load_index16<uint16_t>(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
}
template <> inline __m512i load_index16<int32_t>(const int32_t* p, __mmask16 m) {
  return _mm512_maskz_loadu_epi32(m, p);
}
template <typename V> inline __m512 load_value16(const V* p, __mmask16 m);
template <> inline __m512 load_value16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <> inline __m512 load_value16<uint16_t>(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

template <typename I, typename V>
void spmv_rows(const int32_t* crow, const I* col, const V* val, const float* x, const float* bias,
               int64_t i0, int64_t i1, float* y) {
  for (int64_t i = i0; i < i1; ++i) {
    int32_t k = crow[i];
    const int32_t end = crow[i + 1];
#if LS_SPMV_AVX512
    // Two gathers in flight; full vectors unmasked, the row's tail under a lane mask.
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; k + 32 <= end; k += 32) {
      const __m512i c0 = load_index16<I>(col + k, 0xFFFF);
      const __m512i c1 = load_index16<I>(col + k + 16, 0xFFFF);
      a0 = _mm512_fmadd_ps(load_value16<V>(val + k, 0xFFFF), _mm512_i32gather_ps(c0, x, 4), a0);
      a1 = _mm512_fmadd_ps(load_value16<V>(val + k + 16, 0xFFFF),
                           _mm512_i32gather_ps(c1, x, 4), a1);
    }
    for (; k < end; k += 16) {
      const int left = end - k;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512i c = load_index16<I>(col + k, m);
      const __m512 xv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, c, x, 4);
      a0 = _mm512_fmadd_ps(load_value16<V>(val + k, m), xv, a0);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (; k + 4 <= end; k += 4) {
      s0 += widen<V>(val[k]) * x[col[k]];
      s1 += widen<V>(val[k + 1]) * x[col[k + 1]];
      s2 += widen<V>(val[k + 2]) * x[col[k + 2]];
      s3 += widen<V>(val[k + 3]) * x[col[k + 3]];
    }
    for (; k < end; ++k) s0 += widen<V>(val[k]) * x[col[k]];
    float sum = (s0 + s1) + (s2 + s3);
#endif
    y[i] = sum + (bias != nullptr ? bias[i] : 0.0f);
  }
}

// Rows split into one contiguous range per thread with equal shares of the kept weights (each
// row is summed by one thread in a fixed order: the result does not depend on the thread count
// beyond which rows a thread takes).
constexpr int64_t kParallelSpmvMin = int64_t{1} << 16;  // kept weights (~20 us of one thread)
template <typename I, typename V>
void spmv(const int32_t* crow, const I* col, const V* val, const float* x, const float* bias,
          int64_t M, float* y, int threads) {
  const int64_t nnz = crow[M];
  threads = nnz < kParallelSpmvMin ? 1 : std::max(threads, 1);
  if (threads == 1) {
    spmv_rows<I, V>(crow, col, val, x, bias, 0, M, y);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    const auto row_at = [&](int t) {
      if (t == team) return M;
      const int64_t target = nnz * t / team;
      return static_cast<int64_t>(std::lower_bound(crow, crow + M, target) - crow);
    };
    spmv_rows<I, V>(crow, col, val, x, bias, row_at(me), row_at(me + 1), y);
  }
}

}  // namespace

// --- Dense W [M, K] from kept values in CSR order: zeros elsewhere (a compact layer's weight) ---
template <typename S, typename I>
void scatter(const int32_t* crow, const I* col, const S* vals, int64_t M, int64_t K, S* W,
             int threads) {
  const int team = threads_for(M * K, 1, 0, threads);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t i = 0; i < M; ++i) {
    S* w = W + i * K;
    std::memset(w, 0, sizeof(S) * K);
    for (int32_t k = crow[i]; k < crow[i + 1]; ++k) w[col[k]] = vals[k];
  }
}

// --- Kept values of a dense W [M, K] in CSR order (rows) or in transposed-CSR order (columns) ---
template <typename S, typename I>
void gather(const int32_t* crow, const I* col, const S* W, int64_t M, int64_t K, S* out,
            int threads) {
  const int team = threads_for(crow[M], 1, M, threads);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t i = 0; i < M; ++i) {
    const S* w = W + i * K;
    for (int32_t k = crow[i]; k < crow[i + 1]; ++k) out[k] = w[col[k]];
  }
}
template <typename S, typename I>
void gather_t(const int32_t* t_crow, const I* t_col, const S* W, int64_t M, int64_t K,
              S* out, int threads) {
  const int team = threads_for(t_crow[K], 1, K, threads);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t j = 0; j < K; ++j)
    for (int32_t k = t_crow[j]; k < t_crow[j + 1]; ++k) out[k] = W[int64_t{t_col[k]} * K + j];
}
extern "C" {
void ls_set_tile_budgets(int64_t spmm_bytes, int64_t sddmm_bytes) {
  g_spmm_budget = spmm_bytes;
  g_sddmm_budget = sddmm_bytes;
}
int64_t ls_csr_count(const uint8_t* mask, int64_t M, int64_t K, int32_t* crow, int threads) {
  return csr_count(mask, M, K, crow, threads);
}
void ls_csr_cols_i32(const uint8_t* mask, int64_t M, int64_t K, const int32_t* crow, int32_t* col,
                     int threads) {
  csr_cols<int32_t>(mask, M, K, crow, col, threads);
}
void ls_csr_cols_u16(const uint8_t* mask, int64_t M, int64_t K, const int32_t* crow,
                     uint16_t* col, int threads) {
  csr_cols<uint16_t>(mask, M, K, crow, col, threads);
}
// The training kernels for values S (f32: float, f64: double) and column indices I (i32:
// int32_t, u16: uint16_t): ls_<kernel>_<values>_<indices>.
#define LS_TRAINING_KERNELS(SN, S, IN, I)                                                         \
  void ls_gather_##SN##_##IN(const int32_t* crow, const I* col, const S* W, int64_t M, int64_t K, \
                             S* out, int threads) {                                               \
    gather<S, I>(crow, col, W, M, K, out, threads);                                               \
  }                                                                                               \
  void ls_gather_t_##SN##_##IN(const int32_t* t_crow, const I* t_col, const S* W, int64_t M,     \
                               int64_t K, S* out, int threads) {                                  \
    gather_t<S, I>(t_crow, t_col, W, M, K, out, threads);                                         \
  }                                                                                               \
  void ls_scatter_##SN##_##IN(const int32_t* crow, const I* col, const S* vals, int64_t M,        \
                              int64_t K, S* W, int threads) {                                     \
    scatter<S, I>(crow, col, vals, M, K, W, threads);                                             \
  }                                                                                               \
  void ls_spmm_##SN##_##IN(const int32_t* crow, const I* col, const S* val, const S* X,           \
                           const S* bias, int64_t N, int64_t K, int64_t M, S* Y, int threads) {   \
    spmm<S, I>(crow, col, val, X, bias, N, K, M, Y, threads);                                     \
  }                                                                                               \
  int ls_spmm_t_##SN##_##IN(const int32_t* crow, const I* col, const S* val, const S* G,          \
                            int64_t N, int64_t M, int64_t K, S* X, int threads,                   \
                            int64_t block_bytes) {                                                \
    return spmm_t<S, I>(crow, col, val, G, N, M, K, X, threads, block_bytes);                     \
  }                                                                                               \
  int ls_sddmm_##SN##_##IN(const int32_t* crow, const I* col, const S* G, const S* X, int64_t N,  \
                           int64_t K, int64_t M, S* D, int threads) {                             \
    return sddmm<S, I>(crow, col, G, X, N, K, M, D, true, threads);                               \
  }                                                                                               \
  int ls_sddmm_values_##SN##_##IN(const int32_t* crow, const I* col, const S* G, const S* X,      \
                                  int64_t N, int64_t K, int64_t M, S* vals, int threads) {        \
    return sddmm<S, I>(crow, col, G, X, N, K, M, vals, false, threads);                           \
  }
LS_TRAINING_KERNELS(f32, float, i32, int32_t)
LS_TRAINING_KERNELS(f32, float, u16, uint16_t)
LS_TRAINING_KERNELS(f64, double, i32, int32_t)
LS_TRAINING_KERNELS(f64, double, u16, uint16_t)
#undef LS_TRAINING_KERNELS
void ls_spmv_f32_u16(const int32_t* crow, const uint16_t* col, const float* val, const float* x,
                     const float* bias, int64_t M, float* y, int threads) {
  spmv<uint16_t, float>(crow, col, val, x, bias, M, y, threads);
}
void ls_spmv_f32_i32(const int32_t* crow, const int32_t* col, const float* val, const float* x,
                     const float* bias, int64_t M, float* y, int threads) {
  spmv<int32_t, float>(crow, col, val, x, bias, M, y, threads);
}
void ls_spmv_bf16_u16(const int32_t* crow, const uint16_t* col, const uint16_t* val,
                      const float* x, const float* bias, int64_t M, float* y, int threads) {
  spmv<uint16_t, uint16_t>(crow, col, val, x, bias, M, y, threads);
}
void ls_spmv_bf16_i32(const int32_t* crow, const int32_t* col, const uint16_t* val,
                      const float* x, const float* bias, int64_t M, float* y, int threads) {
  spmv<int32_t, uint16_t>(crow, col, val, x, bias, M, y, threads);
}
}
