// kvgate's compiled CPU kernels (float32): the small per-layer operations of the executor's
// forward, each one pass over its data, registered as torch.ops.kvgate_cpu.*.
//
// Built once per machine by kvgate/kernels/cpu/__init__.py (torch.utils.cpp_extension, -O3
// -march=native -ffp-contract=off: no fused multiply-adds, so an element-wise formula rounds
// exactly as the torch expression it replaces). The torch expressions they replace are the
// specification: TorchLayerOps in kvgate/gpu_executor/layer_ops.py (norms, SiLU, RoPE),
// write_kv_torch in kvgate/kernels/torch_ops.py, the decode path of torch_attention.py;
// tests/kernels/test_kernels_cpu.py compares each kernel with them.
//
// Shapes (every pointer argument):
//   rms_norm        x [n, H], weight [H]                         -> [n, H]
//   add_rms_norm    x [n, H], residual [n, H], weight [H]        -> (residual + x [n, H], normed)
//   silu_and_mul    gate_up [n, 2 I] (gate | up)                 -> [n, I]
//   rotary_         qkv [n, heads, D] (rows contiguous), cos [n, D], sin_signed [n, D]: the first
//                   `rotated_heads` heads rotated in place
//   write_kv        key, value [n, Hkv, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
//                   (strided in dim 0); slots int64 [n] (negative: skipped)
//   decode_attention query [T, Hq, D]; key_cache, value_cache as above; block_tables int32 [R, W];
//                   query_start_loc int32 [R + 1]; seq_lens int32 [R]; rows int64 [m] (decode
//                   rows: one query each); out [T, Hq, D]: row r's query token written

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// One decode row, one KV head: its `group` query heads over positions [0, len). Scores first
// (each K vector read once for the whole group), then softmax, then the weighted sum of V.
// kD: the head dimension when known at compile time (fully unrolled dot products), else 0.
template <int64_t kD>
void decode_one(const float* q, int64_t q_head_stride, const float* kc, const float* vc,
                int64_t cs0, int64_t cs1, const int32_t* table, int64_t block_size, int64_t len,
                int64_t group, int64_t head_dim, float scale, float* out, int64_t out_head_stride,
                std::vector<float>& scores, std::vector<float>& scaled_q) {
  const int64_t d = kD ? kD : head_dim;
  scores.resize(group * len);
  scaled_q.resize(group * d);
  for (int64_t j = 0; j < group; ++j) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) scaled_q[j * d + i] = q[j * q_head_stride + i] * scale;
  }
  for (int64_t p = 0; p < len; ++p) {
    const float* k = kc + table[p / block_size] * cs0 + (p % block_size) * cs1;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = scaled_q.data() + j * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qj[i] * k[i];
      scores[j * len + p] = dot;
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores.data() + j * len;
    float top = s[0];
#pragma omp simd reduction(max : top)
    for (int64_t p = 1; p < len; ++p) top = s[p] > top ? s[p] : top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      s[p] = exp_approx(s[p] - top);
      total += s[p];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t p = 0; p < len; ++p) s[p] *= inv;
    float* o = out + j * out_head_stride;
    std::fill(o, o + d, 0.0f);
  }
  for (int64_t p = 0; p < len; ++p) {
    const float* v = vc + table[p / block_size] * cs0 + (p % block_size) * cs1;
    for (int64_t j = 0; j < group; ++j) {
      const float w = scores[j * len + p];
      float* o = out + j * out_head_stride;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

void decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                      const at::Tensor& rows, double softmax_scale, at::Tensor out) {
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
  const int64_t num_rows = seq_lens.size(0), width = block_tables.size(1);
  const int64_t group = q_heads / kv_heads, block_size = key_cache.size(1);
  const int64_t m = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t positions = 0;
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < num_rows, "decode row ", rp[i], " out of range");
    TORCH_CHECK(lens[rp[i]] >= 1 && lens[rp[i]] <= width * block_size, "row ", rp[i],
                " has a length its block table cannot hold");
    positions += lens[rp[i]];
  }
  const float* qp = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t cs0 = key_cache.stride(0), cs1 = key_cache.stride(1), cs2 = key_cache.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const auto scale = static_cast<float>(softmax_scale);
  // A task (one row, one KV head) reads 2 * len * d floats of K and V.
  const int64_t task_floats = 2 * d * positions / std::max<int64_t>(1, m);
  at::parallel_for(0, m * kv_heads, grain_rows(task_floats), [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scaled_q;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = rp[task / kv_heads], g = task % kv_heads;
      const int64_t token = starts[r];
      auto* one = d == 64 ? decode_one<64> : d == 128 ? decode_one<128> : decode_one<0>;
      one(qp + token * qs0 + g * group * qs1, qs1, kc + g * cs2, vc + g * cs2, cs0, cs1,
          tables + r * width, block_size, lens[r], group, d, scale,
          op + token * os0 + g * group * os1, os1, scores, scaled_q);
    }
  });
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
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor rows, "
        "float softmax_scale, Tensor(a!) out) -> ()", &decode_attention);
}
