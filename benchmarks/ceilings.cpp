// The inner loops of the device's kernels alone, without their tiles' transposes, rows'
// overheads or reductions: what this core sustains for each access pattern
// (`bench_roofline.py --ceilings` builds this file with the kernels' flags and calls it).
//
// Per kept weight the kernels read a 16-bit column index and a value, then, for each of two
// vectors of tokens (the tile's width, kSpmmVectors), load the column's row of the transposed
// input tile and multiply-add it (the forward, gathering; the SDDMM's dot products read the same)
// or load, multiply-add and store the column's accumulator row (the input gradient, scattering).
// Rows here are 4096 kept weights long at random columns of a tile of `rows` x 2 vectors; the
// tile's size sets where it lives (L1, L2). Each probe returns GFLOP/s of one thread.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#define VB 64
#else
#define VB 32
#endif
typedef float V __attribute__((vector_size(VB)));
constexpr int L = VB / 4;
constexpr int NV = 2;
constexpr int T = NV * L;

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
// Every lane's sum, so the compiler keeps every lane's work.
inline float lanes(V v) {
  float s = 0;
  for (int l = 0; l < L; ++l) s += v[l];
  return s;
}

struct Operands {
  std::vector<uint16_t> col;
  std::vector<float> val;
  float* tile;
  Operands(int64_t rows, int64_t kept, unsigned seed) : col(kept), val(kept, 0.5f) {
    std::mt19937 g(seed);
    for (auto& c : col) c = static_cast<uint16_t>(g() % rows);
    tile = static_cast<float*>(std::aligned_alloc(64, rows * T * sizeof(float)));
    for (int64_t i = 0; i < rows * T; ++i) tile[i] = 1e-3f;
  }
  ~Operands() { std::free(tile); }
};

// FMAs on registers only: the core's peak.
__attribute__((noipa)) float fma_peak(int64_t n) {
  V acc[16];
  const V a = V{} + 0.999f, b = V{} + 1e-3f;
  for (int j = 0; j < 16; ++j) acc[j] = V{} + static_cast<float>(j);
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < 16; ++j) acc[j] = acc[j] * a + b;
  V s{};
  for (int j = 0; j < 16; ++j) s += acc[j];
  return lanes(s);
}

// One vector load per FMA, streaming through the tile in order (no index, no value): the
// least a kernel that loads its input vector per FMA needs.
__attribute__((noipa)) float stream(const Operands& o, int64_t rows, int reps) {
  V acc[8] = {};
  const V w = V{} + 0.5f;
  const int64_t n = rows * T;
  for (int r = 0; r < reps; ++r)
    for (int64_t k = 0; k + 8 * L <= n; k += 8 * L)
      for (int u = 0; u < 8; ++u) acc[u] += w * load(o.tile + k + u * L);
  V s{};
  for (auto& a : acc) s += a;
  return lanes(s);
}

// The forward's (and SDDMM's) pattern: per kept weight an index, a broadcast value and two
// vector loads of the tile's row, two FMAs into eight chains.
__attribute__((noipa)) float gather(const Operands& o, int reps) {
  V acc[4][NV] = {};
  const int64_t n = static_cast<int64_t>(o.col.size());
  for (int r = 0; r < reps; ++r)
    for (int64_t k = 0; k + 4 <= n; k += 4)
      for (int u = 0; u < 4; ++u) {
        const V w = o.val[k + u] - V{};
        const float* x = o.tile + static_cast<int64_t>(o.col[k + u]) * T;
        for (int v = 0; v < NV; ++v) acc[u][v] += w * load(x + v * L);
      }
  V s{};
  for (auto& a : acc)
    for (auto& v : a) s += v;
  return lanes(s);
}

// The input gradient's pattern: per kept weight an index, a broadcast value and, for two vectors,
// a load, an FMA and a store of the column's accumulator row; eight weights in flight.
__attribute__((noipa)) float scatter(Operands& o, int reps) {
  const V g0 = V{} + 1e-3f, g1 = V{} + 2e-3f;
  const int64_t n = static_cast<int64_t>(o.col.size());
  for (int r = 0; r < reps; ++r)
    for (int64_t k = 0; k + 8 <= n; k += 8) {
      float* a[8];
      V w[8], x[8][NV];
      for (int u = 0; u < 8; ++u) {
        a[u] = o.tile + static_cast<int64_t>(o.col[k + u]) * T;
        w[u] = o.val[k + u] - V{};
        for (int v = 0; v < NV; ++v) x[u][v] = load(a[u] + v * L);
      }
      for (int u = 0; u < 8; ++u) {
        store(a[u], x[u][0] + w[u] * g0);
        store(a[u] + L, x[u][1] + w[u] * g1);
      }
    }
  return o.tile[0];
}
}  // namespace

extern "C" {
// GFLOP/s of `threads` threads together (each its own operands) on probe `kind`: 0 FMA peak,
// 1 gather, 2 scatter, 3 stream, over a tile of `rows` rows (ignored by the peak).
double ls_ceiling(int kind, int64_t rows, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    Operands o(rows > 0 ? rows : 1, 4096, 7 + omp_get_thread_num());
    volatile float sink = 0;
    const int reps = 600;
    double best = 1e30;
    for (int round = 0; round < 7; ++round) {
      const double start = now();
      if (kind == 0) {
        sink = fma_peak(4096 * reps / 8);
      } else if (kind == 1) {
        sink = gather(o, reps);
      } else if (kind == 3) {
        sink = stream(o, rows, reps * 4096 / (rows * NV));
      } else {
        sink = scatter(o, reps);
      }
      best = std::min(best, now() - start);
    }
    (void)sink;
    double flops = kind == 0 ? 2.0 * L * 16 * (4096.0 * reps / 8) : 2.0 * T * 4096.0 * reps;
    if (kind == 3) flops = 2.0 * L * (rows * T / (8 * L) * 8) * (reps * 4096 / (rows * NV));
    total = flops / best / 1e9;
  }
  return total;
}
}
