// kvgate's compiled CPU kernels (float32): the small per-layer operations of the executor's
// forward, each one pass over its data, registered as torch.ops.kvgate_cpu.*.
//
// Built once per machine by kvgate/kernels/cpu/__init__.py (torch.utils.cpp_extension, -O3
// -march=native -ffp-contract=off: no fused multiply-adds unless written as such, so an
// element-wise formula rounds exactly as the torch expression it replaces). The torch
// expressions they replace are the specification: TorchLayerOps in
// kvgate/executor/layer_ops.py (norms, SiLU, RoPE), write_kv_torch in
// kvgate/kernels/torch_ops.py, the decode and prefill paths of torch_attention.py;
// tests/kernels/test_kernels_cpu.py compares each kernel with them. Attention has AVX-512 forms
// (explicit multiply-adds, vectors summed as trees) for head dimensions 64 and 128 where the
// compiler targets AVX-512, and a portable form for every other case.
//
// Shapes (every pointer argument):
//   rms_norm        x [n, H], weight [H]                         -> [n, H]
//   add_rms_norm    x [n, H], residual [n, H], weight [H]        -> (residual + x [n, H], normed)
//   silu_and_mul    gate_up [n, 2 I] (gate | up)                 -> [n, I]
//   rotary_         qkv [n, heads, D] (rows contiguous), cos [n, D], sin_signed [n, D]: the first
//                   `rotated_heads` heads rotated in place
//   write_kv        key, value [n, Hkv, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
//                   (strided in dim 0); slots int64 [n] (negative: skipped)
//   paged_attention query [T, Hq, D]; key_cache, value_cache as above; block_tables int32 [R, W];
//                   query_start_loc int32 [R + 1]; seq_lens int32 [R]; rows int64 [m] (rows
//                   with at least one query); out [T, Hq, D]: the listed rows' tokens written;
//                   sliding_window, logit_softcap: optional (kvgate.kernels.paged_attention)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// Elements (or multiply-adds) a thread should get before a kernel splits its work: a parallel
// region costs a wake-up and a barrier, which on a busy machine waits for a descheduled thread.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

constexpr float kLog2e = 1.44269504088896341f;
// ln 2 split in two so that n * kLn2Hi is exact for |n| < 2^9 (Cody and Waite).
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;

// exp(x) to within 1.4 ulp for x in [-87.3, 88.7] (clamped outside: the smallest result is
// about 1e-38, not zero). A polynomial on the reduced argument with no call and no floor (which
// GCC does not vectorize without -fno-trapping-math): loops that use it are vectorized. The
// rounding adds and subtracts 1.5 * 2^23, which rounds to the nearest integer for |v| < 2^22.
// Minimax coefficients of the classic single-precision exp (Cephes expf).
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  const float n = (x * kLog2e + 12582912.0f) - 12582912.0f;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1) from exp_approx: within about 1e-7 of tanh absolutely (the
// error of exp near 1), in (-1, 1) everywhere (exp_approx's clamp keeps exp(2x) finite and
// non-zero), and vectorized like exp_approx.
inline float tanh_approx(float x) { return 1.0f - 2.0f / (exp_approx(2.0f * x) + 1.0f); }

// The optional parts of paged_attention's scores (kvgate.kernels.paged_attention): which
// positions the query at position p sees, and the soft-cap of each score.
struct ScoreRules {
  std::optional<int64_t> window;  // positions k with p - window < k <= p; none: 0 <= k <= p
  std::optional<float> cap;       // s -> cap * tanh(s / cap) before the softmax; none: s

  int64_t first_visible(int64_t p) const {
    return window ? std::max<int64_t>(0, p - *window + 1) : 0;
  }

  void cap_scores(float* s, int64_t n) const {
    if (!cap) return;
    const float c = *cap;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] = c * tanh_approx(s[i] / c);
  }
};

void check_float_rows(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.stride(dim - 1) == 1, name, "'s last dimension must be contiguous");
}

// One row: out = weight * (x * rsqrt(mean(x^2) + eps)). The sum of squares is accumulated in 16
// float lanes (a different order from torch's reduction: last-bit differences).
inline void norm_row(const float* x, const float* w, float* out, int64_t h, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, "x", 2);
  check_float_rows(weight, "weight", 1);
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.size(0) == h, "weight has ", weight.size(0), " elements, x rows ", h);
  at::Tensor out = at::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, op + r * h, h, eps);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float_rows(x, "x", 2);
  check_float_rows(residual, "residual", 2);
  check_float_rows(weight, "weight", 1);
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(residual.size(0) == n && residual.size(1) == h, "residual must be shaped like x");
  TORCH_CHECK(weight.size(0) == h, "weight has ", weight.size(0), " elements, x rows ", h);
  at::Tensor sum = at::empty({n, h}, x.options());
  at::Tensor out = at::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, n, grain_rows(2 * h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * h;
      const float* a = xp + r * xs;
      const float* b = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) s[i] = b[i] + a[i];
      norm_row(s, wp, op + r * h, h, eps);
    }
  });
  return {sum, out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "gate_up", 2);
  const int64_t n = gate_up.size(0), width = gate_up.size(1);
  TORCH_CHECK(width % 2 == 0, "gate_up's width must be even, got ", width);
  const int64_t half = width / 2;
  at::Tensor out = at::empty({n, half}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, n, grain_rows(4 * half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + half;
      float* o = op + r * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) o[i] = (g[i] / (1.0f + exp_approx(-g[i]))) * u[i];
    }
  });
  return out;
}

void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
             int64_t rotated_heads) {
  check_float_rows(qkv, "qkv", 3);
  check_float_rows(cos, "cos", 2);
  check_float_rows(sin_signed, "sin_signed", 2);
  const int64_t n = qkv.size(0), heads = qkv.size(1), d = qkv.size(2);
  TORCH_CHECK(qkv.stride(1) == d, "qkv's head vectors must be packed in each row");
  TORCH_CHECK(rotated_heads >= 0 && rotated_heads <= heads, "rotated_heads out of range");
  TORCH_CHECK(d % 2 == 0, "head_dim must be even, got ", d);
  TORCH_CHECK(cos.size(0) == n && cos.size(1) == d, "cos must be [n, head_dim]");
  TORCH_CHECK(sin_signed.size(0) == n && sin_signed.size(1) == d, "sin_signed must be [n, head_dim]");
  const int64_t half = d / 2;
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin_signed.stride(0);
  at::parallel_for(0, n, grain_rows(rotated_heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t head = 0; head < rotated_heads; ++head) {
        float* x = xp + t * xs + head * d;
        // x * cos + swap_halves(x) * sin_signed, both halves from the values before the write.
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] + b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

void check_cache(const at::Tensor& cache, const char* name, int64_t kv_heads, int64_t d) {
  check_float_rows(cache, name, 4);
  TORCH_CHECK(cache.size(2) == kv_heads && cache.size(3) == d, name,
              " must be [num_blocks, block_size, ", kv_heads, ", ", d, "]");
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slots) {
  check_float_rows(key, "key", 3);
  check_float_rows(value, "value", 3);
  const int64_t n = key.size(0), kv_heads = key.size(1), d = key.size(2);
  TORCH_CHECK(value.sizes() == key.sizes(), "value must be shaped like key");
  check_cache(key_cache, "key_cache", kv_heads, d);
  check_cache(value_cache, "value_cache", kv_heads, d);
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.strides() == key_cache.strides(),
              "value_cache must be laid out like key_cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == n &&
                  slots.is_contiguous(), "slots must be int64 [n], contiguous");
  const int64_t block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t cs0 = key_cache.stride(0), cs1 = key_cache.stride(1), cs2 = key_cache.stride(2);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0),
                vs1 = value.stride(1);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(sl[t] < num_slots, "slot ", sl[t], " of token ", t, " is past the cache");
  }
  at::parallel_for(0, n, grain_rows(2 * kv_heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sl[t];
      if (slot < 0) continue;
      const int64_t at = (slot / block_size) * cs0 + (slot % block_size) * cs1;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kc + at + h * cs2, kp + t * ks0 + h * ks1, d * sizeof(float));
        std::memcpy(vc + at + h * cs2, vp + t * vs0 + h * vs1, d * sizeof(float));
      }
    }
  });
}

// Positions ahead of the one being read whose K (or V) vectors are prefetched: a position's
// vectors for all KV heads are one contiguous run (kv_heads * head_dim floats), and blocks are
// scattered, so the hardware's stream prefetcher stops at each block's end; reading a few
// positions ahead keeps the next block's first lines in flight.
constexpr int64_t kPrefetchPositions = 4;

inline void prefetch_run(const float* at, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(at + i, 0, 0);
}

// One query token (a decode row, or one token of a prefill chunk), all its query heads over
// positions [first, len) (first > 0 under a sliding window: earlier positions are never read).
// Each position's K vectors (every KV head's, contiguous in the cache) are read once, scored
// against the query heads of each KV head's group; then the soft-cap (if any) and a softmax per
// query head; then V read the same way into the weighted sums.
// Per query head the arithmetic and its order are those of one head at a time (the dot product
// over the head dimension, the softmax over positions, the sum over positions in order).
// kD: the head dimension when known at compile time (fully unrolled dot products), else 0.
template <int64_t kD>
void attend_token(const float* q, int64_t q_head_stride, const float* kc, const float* vc,
                  int64_t cs0, int64_t cs1, int64_t cs2, const int32_t* table,
                  int64_t block_size, int64_t first, int64_t len, int64_t kv_heads,
                  int64_t group, int64_t head_dim, float scale, const ScoreRules& rules,
                  float* out, int64_t out_head_stride, std::vector<float>& scores,
                  std::vector<float>& scaled_q) {
  const int64_t d = kD ? kD : head_dim;
  const int64_t q_heads = kv_heads * group;
  const int64_t run = (kv_heads - 1) * cs2 + d;  // floats of one position, all KV heads
  const int64_t n = len - first;                 // scores[h * n + i]: position first + i
  scores.resize(q_heads * n);
  scaled_q.resize(q_heads * d);
  for (int64_t h = 0; h < q_heads; ++h) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) scaled_q[h * d + i] = q[h * q_head_stride + i] * scale;
  }
  auto position = [&](const float* cache, int64_t p) {
    return cache + table[p / block_size] * cs0 + (p % block_size) * cs1;
  };
  for (int64_t p = first; p < len; ++p) {
    if (p + kPrefetchPositions < len) prefetch_run(position(kc, p + kPrefetchPositions), run);
    const float* k = position(kc, p);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* kg = k + g * cs2;
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j;
        const float* qh = scaled_q.data() + h * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qh[i] * kg[i];
        scores[h * n + (p - first)] = dot;
      }
    }
  }
  for (int64_t h = 0; h < q_heads; ++h) {
    float* s = scores.data() + h * n;
    rules.cap_scores(s, n);
    float top = s[0];
#pragma omp simd reduction(max : top)
    for (int64_t i = 1; i < n; ++i) top = s[i] > top ? s[i] : top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_approx(s[i] - top);
      total += s[i];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
    float* o = out + h * out_head_stride;
    std::fill(o, o + d, 0.0f);
  }
  for (int64_t p = first; p < len; ++p) {
    if (p + kPrefetchPositions < len) prefetch_run(position(vc, p + kPrefetchPositions), run);
    const float* v = position(vc, p);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* vg = v + g * cs2;
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j;
        const float w = scores[h * n + (p - first)];
        float* o = out + h * out_head_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += w * vg[i];
      }
    }
  }
}

#if defined(__AVX512F__)
// exp_approx on 16 lanes: the same operations in the same order (bit for bit the same results
// for inputs that are not NaN).
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), magic), magic);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kLn2Hi))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kLn2Lo)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f}) {
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  }
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
                                 _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// s[0, n) <- softmax(s[0, n)), n >= 1: the maximum and the sum reduced as trees over 16 lanes
// (a short loop's cost is otherwise the lanes' serial reduction at its end).
inline void softmax_avx512(float* s, int64_t n) {
  const int64_t full = n / 16 * 16;
  const auto tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < full; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i));
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vtop));
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), vtop));
  _mm512_mask_storeu_ps(s + full, tail, e);
  total = _mm512_mask_add_ps(total, tail, total, e);
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t i = 0; i < full; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  _mm512_mask_storeu_ps(s + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), inv));
}

// Lane p of the result: the sum of the 16 lanes of v[p], for p = 0..15 (a transpose folded into
// the additions: 15 vector adds for 16 sums, where one horizontal sum at a time costs 16 scalar
// adds in a chain).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a, b, a, b) partial sums of v[2i], v[2i+1]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 vectors
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // lanes (0, 1): vectors 8i..8i+3, lanes (2, 3): 8i+4..8i+7
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    octets[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// attend_token for a head dimension of 16 * kC floats, on AVX-512, in the same order of memory
// reads (position by position, every KV head's vectors of a position together, a few positions
// prefetched ahead). A query head's dot product with a K vector is kC multiply-adds in vector
// lanes, kept until 16 positions are done and then summed 16 at a time by sum_lanes16; V is
// accumulated with multiply-adds. Fused multiply-adds and another summation order than
// attend_token: last-bit differences from it and from the torch path, within the tests'
// tolerances.
template <int64_t kC>
void attend_token_avx512(const float* q, int64_t q_head_stride, const float* kc,
                         const float* vc, int64_t cs0, int64_t cs1, int64_t cs2,
                         const int32_t* table, int64_t block_size, int64_t first, int64_t len,
                         int64_t kv_heads, int64_t group, float scale, const ScoreRules& rules,
                         float* out, int64_t out_head_stride, std::vector<float>& scores,
                         std::vector<float>& lanes) {
  constexpr int64_t d = 16 * kC;
  const int64_t q_heads = kv_heads * group;
  const int64_t run = (kv_heads - 1) * cs2 + d;
  const int64_t n = len - first;  // scores[h * padded + i]: position first + i
  const int64_t padded = (n + 15) / 16 * 16;
  scores.resize(q_heads * padded);
  lanes.resize(q_heads * 16 * 16);  // per query head, 16 positions' vectors of partial sums
  auto position = [&](const float* cache, int64_t p) {
    return cache + table[p / block_size] * cs0 + (p % block_size) * cs1;
  };
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t p0 = first; p0 < len; p0 += 16) {
    const int64_t count = std::min<int64_t>(16, len - p0);
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t p = p0 + i;
      if (i >= count) {  // past the row's end: sums of zeros, not read back
        for (int64_t h = 0; h < q_heads; ++h) {
          _mm512_storeu_ps(lanes.data() + (h * 16 + i) * 16, _mm512_setzero_ps());
        }
        continue;
      }
      if (p + kPrefetchPositions < len) prefetch_run(position(kc, p + kPrefetchPositions), run);
      const float* k = position(kc, p);
      for (int64_t g = 0; g < kv_heads; ++g) {
        __m512 kv[kC];
        for (int64_t c = 0; c < kC; ++c) kv[c] = _mm512_loadu_ps(k + g * cs2 + 16 * c);
        for (int64_t j = 0; j < group; ++j) {
          const int64_t h = g * group + j;
          const float* qh = q + h * q_head_stride;
          __m512 acc = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(qh), vscale), kv[0]);
          for (int64_t c = 1; c < kC; ++c) {
            acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(qh + 16 * c), vscale), kv[c], acc);
          }
          _mm512_storeu_ps(lanes.data() + (h * 16 + i) * 16, acc);
        }
      }
    }
    for (int64_t h = 0; h < q_heads; ++h) {
      __m512 v[16];
      for (int64_t i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(lanes.data() + (h * 16 + i) * 16);
      _mm512_storeu_ps(scores.data() + h * padded + (p0 - first), sum_lanes16(v));
    }
  }
  for (int64_t h = 0; h < q_heads; ++h) {
    rules.cap_scores(scores.data() + h * padded, n);
    softmax_avx512(scores.data() + h * padded, n);
    float* o = out + h * out_head_stride;
    for (int64_t c = 0; c < kC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_setzero_ps());
  }
  for (int64_t p = first; p < len; ++p) {
    if (p + kPrefetchPositions < len) prefetch_run(position(vc, p + kPrefetchPositions), run);
    const float* v = position(vc, p);
    for (int64_t g = 0; g < kv_heads; ++g) {
      __m512 vv[kC];
      for (int64_t c = 0; c < kC; ++c) vv[c] = _mm512_loadu_ps(v + g * cs2 + 16 * c);
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j;
        const __m512 w = _mm512_set1_ps(scores[h * padded + (p - first)]);
        float* o = out + h * out_head_stride;
        for (int64_t c = 0; c < kC; ++c) {
          _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(o + 16 * c)));
        }
      }
    }
  }
}

// A prefill chunk's query tokens, 16 at a time, for one KV head: the GEMM-shaped form of
// attend_token_avx512 for rows with many queries. The head's K vectors of the positions the
// tokens see are transposed once into 16-position panels (dimension-major), so that a tile of 16
// tokens is scored against 16 positions by multiply-adds of one panel row with each token's
// broadcast query element (no horizontal sums); soft-cap and softmax per token over the
// positions it sees; then the weighted sums of V, 16 tokens per V vector read. Token t of the
// row is at position first + t and sees [rules.first_visible(first + t), first + t]. Positions
// are held relative to lo, the first position the chunk's first token sees (offsets[i] and
// panel lane i: position lo + i), and a tile reads only from its first token's first visible
// position to its last token:
//
//   chunk's K panels    | lo ........................................... first + q_len)
//   tile t0 reads                | tile_lo ........ tile_seen)
//   token t sees                     | first_visible(p) .. p ]   (zero weight elsewhere)
//
// Positions outside what a tile reads are never loaded, so unwritten cache slots and blocks
// before the window (any bits) do not reach the output.
template <int64_t kC>
void attend_chunk_avx512(const float* qp, int64_t qs0, int64_t qs1, const float* kc,
                         const float* vc, const int64_t* offsets, int64_t cs2, int64_t first,
                         int64_t q_len, int64_t g, int64_t group, float scale,
                         const ScoreRules& rules, float* op, int64_t os0, int64_t os1,
                         std::vector<float>& panels, std::vector<float>& scores,
                         std::vector<float>& tile_q) {
  constexpr int64_t d = 16 * kC;
  const int64_t lo = rules.first_visible(first);
  const int64_t seen = first + q_len - lo;  // positions from lo the last token sees
  const int64_t chunks = (seen + 15) / 16;
  panels.assign(chunks * d * 16, 0.0f);  // panel c, dimension i, position lane: K[16 c + lane][i]
  for (int64_t p = 0; p < seen; ++p) {
    const float* k = kc + offsets[p] + g * cs2;
    float* panel = panels.data() + (p / 16) * d * 16 + p % 16;
    for (int64_t i = 0; i < d; ++i) panel[i * 16] = k[i];
  }
  const int64_t width = chunks * 16;
  scores.resize(16 * width);
  tile_q.resize(16 * d);
  for (int64_t t0 = 0; t0 < q_len; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, q_len - t0);
    const int64_t tile_lo = rules.first_visible(first + t0) - lo;  // the tile's first token's
    const int64_t tile_seen = first + t0 + count - lo;  // positions the tile's last token sees
    const int64_t tile_chunks = (tile_seen + 15) / 16;
    for (int64_t j = 0; j < group; ++j) {
      const int64_t h = g * group + j;
      for (int64_t t = 0; t < 16; ++t) {  // rows past the chunk's end repeat its last token
        const float* q = qp + (t0 + std::min(t, count - 1)) * qs0 + h * qs1;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) tile_q[t * d + i] = q[i] * scale;
      }
      for (int64_t c = tile_lo / 16; c < tile_chunks; ++c) {
        __m512 acc[16];
        for (int64_t t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        const float* panel = panels.data() + c * d * 16;
        for (int64_t i = 0; i < d; ++i) {
          const __m512 k = _mm512_loadu_ps(panel + i * 16);
          for (int64_t t = 0; t < 16; ++t) {
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(tile_q[t * d + i]), k, acc[t]);
          }
        }
        for (int64_t t = 0; t < 16; ++t) _mm512_storeu_ps(scores.data() + t * width + c * 16, acc[t]);
      }
      for (int64_t t = 0; t < count; ++t) {
        float* s = scores.data() + t * width;
        const int64_t p = first + t0 + t;
        const int64_t from = rules.first_visible(p) - lo, to = p + 1 - lo;
        rules.cap_scores(s + from, to - from);
        softmax_avx512(s + from, to - from);
        std::fill(s + tile_lo, s + from, 0.0f);  // positions this token does not see
        std::fill(s + to, s + tile_seen, 0.0f);
      }
      for (int64_t t = count; t < 16; ++t) {
        std::fill(scores.data() + t * width + tile_lo, scores.data() + t * width + tile_seen, 0.0f);
      }
      for (int64_t c = 0; c < kC; ++c) {
        __m512 acc[16];
        for (int64_t t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t p = tile_lo; p < tile_seen; ++p) {
          const __m512 v = _mm512_loadu_ps(vc + offsets[p] + g * cs2 + 16 * c);
          for (int64_t t = 0; t < 16; ++t) {
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(scores[t * width + p]), v, acc[t]);
          }
        }
        for (int64_t t = 0; t < count; ++t) {
          _mm512_storeu_ps(op + (t0 + t) * os0 + h * os1 + 16 * c, acc[t]);
        }
      }
    }
  }
}
#endif

// Paged attention for whole rows, read in place from the cache: every query token of each
// listed row attends to the row's positions up to its own (causal within a prefill chunk:
// token t of a row with q_len queries and seq_len positions, at p = seq_len - q_len + t, sees
// [0, p], or [max(0, p - sliding_window + 1), p] under a window: only those are read, so a long
// context under a small window costs the window).
// One task per query token: a decode row is one task, a prefill chunk of 128 tokens 128 tasks,
// each reading its visible K and V (from the core's caches after the first tokens). On AVX-512
// prefill chunks run tiled (attend_chunk_avx512) unless `per_token`: then every token runs
// attend_token's order of sums, so its output depends on its query and its visible K and V
// alone, never on how the scheduler cut its prompt into chunks (the batch-invariant mode).
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& rows, double softmax_scale, at::Tensor out,
                     bool per_token, std::optional<int64_t> sliding_window,
                     std::optional<double> logit_softcap) {
  check_float_rows(query, "query", 3);
  check_float_rows(out, "out", 3);
  TORCH_CHECK(out.sizes() == query.sizes(), "out must be shaped like query");
  const int64_t q_heads = query.size(1), d = query.size(2);
  const int64_t kv_heads = key_cache.size(2);
  check_cache(key_cache, "key_cache", kv_heads, d);
  check_cache(value_cache, "value_cache", kv_heads, d);
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.strides() == key_cache.strides(),
              "value_cache must be laid out like key_cache");
  TORCH_CHECK(q_heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata must be contiguous int32");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be int64 [m], contiguous");
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be >= 1");
  TORCH_CHECK(!logit_softcap || (std::isfinite(*logit_softcap) && *logit_softcap > 0.0),
              "logit_softcap must be finite and > 0");
  ScoreRules rules;
  rules.window = sliding_window;
  if (logit_softcap) rules.cap = static_cast<float>(*logit_softcap);
  const int64_t num_rows = seq_lens.size(0), width = block_tables.size(1);
  TORCH_CHECK(query_start_loc.size(0) == num_rows + 1, "query_start_loc must be [num_rows + 1]");
  const int64_t group = q_heads / kv_heads, block_size = key_cache.size(1);
  const int64_t m = rows.size(0), num_tokens = query.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  struct Task {
    int64_t token, row, first, len;  // the query token, its row, the positions it sees
  };
  std::vector<Task> tasks;
  std::vector<int64_t> chunk_rows;  // rows for attend_chunk_avx512
#if defined(__AVX512F__)
  const bool tiled = (d == 64 || d == 128) && !per_token;
#else
  const bool tiled = false;
#endif
  int64_t positions = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rp[i];
    TORCH_CHECK(r >= 0 && r < num_rows, "row ", r, " out of range");
    const int64_t begin = starts[r], q_len = starts[r + 1] - begin, len = lens[r];
    TORCH_CHECK(q_len >= 1 && begin >= 0 && begin + q_len <= num_tokens, "row ", r,
                " has no query tokens in range");
    TORCH_CHECK(len >= q_len && len <= width * block_size, "row ", r, " has ", len,
                " positions: fewer than its ", q_len, " queries, or more than its table holds");
    if (tiled && q_len > 1) {
      chunk_rows.push_back(r);
      continue;
    }
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t p = len - q_len + t, first = rules.first_visible(p);
      tasks.push_back({begin + t, r, first, p + 1});
      positions += p + 1 - first;
    }
  }
  const float* qp = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t cs0 = key_cache.stride(0), cs1 = key_cache.stride(1), cs2 = key_cache.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const auto scale = static_cast<float>(softmax_scale);
  const auto n = static_cast<int64_t>(tasks.size());
  // A task reads 2 * len * kv_heads * d floats of K and V.
  const int64_t task_floats = 2 * kv_heads * d * positions / std::max<int64_t>(1, n);
  auto* one = d == 64 ? attend_token<64> : d == 128 ? attend_token<128> : attend_token<0>;
  at::parallel_for(0, n, grain_rows(task_floats), [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scratch;  // scratch: scaled q, or attend_token_avx512's lanes
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const float* q = qp + task.token * qs0;
      float* o = op + task.token * os0;
      const int32_t* table = tables + task.row * width;
#if defined(__AVX512F__)
      if (d == 64 || d == 128) {
        (d == 64 ? attend_token_avx512<4> : attend_token_avx512<8>)(
            q, qs1, kc, vc, cs0, cs1, cs2, table, block_size, task.first, task.len, kv_heads,
            group, scale, rules, o, os1, scores, scratch);
        continue;
      }
#endif
      one(q, qs1, kc, vc, cs0, cs1, cs2, table, block_size, task.first, task.len, kv_heads, group,
          d, scale, rules, o, os1, scores, scratch);
    }
  });
#if defined(__AVX512F__)
  const auto chunk_tasks = static_cast<int64_t>(chunk_rows.size()) * kv_heads;
  at::parallel_for(0, chunk_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panels, scores, tile_q;
    std::vector<int64_t> offsets;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = chunk_rows[i / kv_heads], g = i % kv_heads;
      const int64_t first_token = starts[r], q_len = starts[r + 1] - first_token, len = lens[r];
      const int32_t* table = tables + r * width;
      // offsets[i]: position lo + i, from the first position the row's first query sees.
      const int64_t lo = rules.first_visible(len - q_len);
      offsets.resize(len - lo);
      for (int64_t p = lo; p < len; ++p) {
        offsets[p - lo] = table[p / block_size] * cs0 + (p % block_size) * cs1;
      }
      (d == 64 ? attend_chunk_avx512<4> : attend_chunk_avx512<8>)(
          qp + first_token * qs0, qs0, qs1, kc, vc, offsets.data(), cs2, len - q_len, q_len, g,
          group, scale, rules, op + first_token * os0, os0, os1, panels, scores, tile_q);
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY(kvgate_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin_signed, int rotated_heads) -> ()",
        &rotary_);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots) -> ()", &write_kv);
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor rows, "
        "float softmax_scale, Tensor(a!) out, bool per_token=False, int? sliding_window=None, "
        "float? logit_softcap=None) -> ()", &paged_attention);
}
