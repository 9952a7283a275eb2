// Quantized matrix products on CPU: y = x @ W.T with W kept in its GGUF block format (Q8_0,
// Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), registered as torch.ops.kvgate_quant.*.
//
// Built once per machine by kvgate/kernels/cpu/quant.py (-O3 -march=native -ffp-contract=off).
// The specification is kvgate/kernels/torch_quant.py: every row of x is quantized per block to
// int8 (32 values, or 256 for the K-quants), each block's products are summed exactly in
// integers, and one float32 term per block is added up in block order, every product and sum
// rounded on its own (no fused multiply-add). The integer sums are exact whatever the
// instructions, so the output is the reference's bit for bit, at every row count and thread
// count (tests/kernels/test_kernels_quant.py).
//
// Instructions (chosen at build time by the compiler's target, reported by isa()):
//   avx512-vnni / avx-vnni  u8 x s8 dot products of four (vpdpbusd) on 256-bit vectors
//   avx2                    vpmaddubsw (u8 x s8 pairs to int16) then vpmaddwd (to int32)
//   scalar                  the same integers in plain loops
// No product here can saturate vpmaddubsw's int16: unsigned weights are at most 63 (Q6_K's six
// bits) or 128 (|Q8_0|, the sign moved to the activation), activations at most 127 in size.
//
// Tiling: threads split the rows of W (at::parallel_for, torch's intra-op threads); a thread
// decodes one row's scales once, then runs it against x eight rows at a time (AVX2: the eight
// rows' values transposed in groups of four, each weight group broadcast, so an int32 lane
// holds one row's block sum), then four rows at a time (four int32 partial-sum vectors
// reduced by one tree of horizontal adds), and the last n % 4 rows of x
// against four rows of W at a time (the same: four vectors, one tree; four independent float
// sums), the rows of W left over one by one. No padding rows are computed: batch-1 decode is
// all lone rows.
//
// Shapes:
//   matmul     x [n, k] float32 (rows contiguous); data [rows, k / block * bytes] uint8;
//              format: the QuantFormat's index (Q8_0 0, Q4_0 1, Q4_1 2, Q4_K 3, Q5_K 4, Q6_K 5)
//              -> [n, rows] float32
//   isa        () -> the instruction set above, as a string

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

enum class Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

constexpr int64_t kTile = 4;  // rows of x per tile
constexpr int kWTile = 4;     // rows of W per tile of a lone row of x
constexpr int64_t kTile8 = 8; // rows of x per tile of transposed activations
// Tiles of eight rows that share one unpacking of a row of W's blocks (blocks of 32): 2 was the
// fastest of 1, 2, 4 and 8 at 32 and 128 rows (8 spills registers).
constexpr int64_t kTiles8 = 2;

struct Layout {
  int64_t values;
  int64_t bytes;
};

Layout layout_of(Format f) {
  switch (f) {
    case Format::Q8_0: return {32, 34};
    case Format::Q4_0: return {32, 18};
    case Format::Q4_1: return {32, 20};
    case Format::Q4_K: return {256, 144};
    case Format::Q5_K: return {256, 176};
    case Format::Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unknown quantization format");
}

bool is_k_quant(Format f) { return f == Format::Q4_K || f == Format::Q5_K || f == Format::Q6_K; }

inline float half_at(const uint8_t* p) {  // exact either way: every fp16 is a float32
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__) && defined(__AVX2__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// ---------------------------------------------------------------------------- activations

// x quantized per block (torch_quant.quantize_activations), laid out for tiles of four rows:
// per-block numbers block-major ([block][row]) so a tile's four are one load.
struct Activations {
  int64_t rows_padded, k, block;
  std::vector<int8_t> q;       // [rows_padded][k]
  std::vector<float> d;        // [k / block][rows_padded]
  std::vector<int32_t> sum32;  // [k / 32][rows_padded]: sum of q per 32
  std::vector<float> sa;       // [k / 32][rows_padded]: d * sum32 (blocks of 32 only)
  std::vector<int16_t> rsum16; // [rows_padded][k / 16]: sum of q per 16, row-major
  std::vector<int16_t> rsum32; // [rows_padded][k / 32]
  std::vector<int32_t> sum16;  // [k / 16][rows_padded]: sum of q per 16 (tiles of eight rows)
  // The first n / 8 * 8 rows as tiles of eight rows with their values in groups of four, the
  // eight rows' groups side by side ([tile][k / 4][row][4]), so one 32-byte load is a group of
  // four values of eight rows.
  std::vector<int8_t> qt;
};

Activations quantize_rows(const float* x, int64_t xs, int64_t n, int64_t k, int64_t block,
                          bool tiles8 = true) {
  Activations a;
  a.rows_padded = (n + kTile - 1) / kTile * kTile;
  a.k = k;
  a.block = block;
  const int64_t np = a.rows_padded, nb = k / block;
  a.q.assign(np * k, 0);
  a.d.assign(nb * np, 0.0f);
  a.sum32.assign(k / 32 * np, 0);
  a.sa.assign(k / 32 * np, 0.0f);
  a.rsum16.assign(np * (k / 16), 0);
  a.rsum32.assign(np * (k / 32), 0);
  a.sum16.assign(k / 16 * np, 0);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * xs;
      int8_t* q = a.q.data() + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        float amax = 0.0f;
        for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(row[b * block + i]));
        const float d = amax / 127.0f;
        const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t i = 0; i < block; ++i) {
          const float v = std::nearbyint(row[b * block + i] * inverse);
          q[b * block + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
        }
        a.d[b * np + r] = d;
      }
      for (int64_t g = 0; g < k / 16; ++g) {
        int32_t s = 0;
        for (int64_t i = 0; i < 16; ++i) s += q[g * 16 + i];
        a.rsum16[r * (k / 16) + g] = static_cast<int16_t>(s);
        a.sum16[g * np + r] = s;
      }
      for (int64_t g = 0; g < k / 32; ++g) {
        const int32_t s = a.rsum16[r * (k / 16) + 2 * g] + a.rsum16[r * (k / 16) + 2 * g + 1];
        a.rsum32[r * (k / 32) + g] = static_cast<int16_t>(s);
        a.sum32[g * np + r] = s;
        if (block == 32) a.sa[g * np + r] = a.d[g * np + r] * static_cast<float>(s);
      }
    }
  });
  const int64_t tiled8 = tiles8 ? n / kTile8 * kTile8 : 0;
  a.qt.resize(tiled8 * k);
  for (int64_t r = 0; r < tiled8; ++r) {
    const int8_t* q = a.q.data() + r * k;
    int8_t* tile = a.qt.data() + (r / kTile8) * kTile8 * k + (r % kTile8) * 4;
    for (int64_t g = 0; g < k / 4; ++g) std::memcpy(tile + g * kTile8 * 4, q + g * 4, 4);
  }
  return a;
}

// ------------------------------------------------------------------ one row of W, decoded

// The per-block numbers of one row of W, decoded once per row (fp16 -> float, 6-bit scales).
struct RowScales {
  std::vector<float> d, m;        // per block: d (Q8_0/Q4_0/Q4_1/K), m (Q4_1) or dmin (Q4_K/Q5_K)
  std::vector<int16_t> sc, mins;  // K-quants: per block 8 (Q4_K/Q5_K) or 16 (Q6_K) scales; mins 8
};

void decode_row(Format f, const uint8_t* row, int64_t nb, int64_t bytes, RowScales& s) {
  s.d.resize(nb);
  s.m.resize(nb);
  s.sc.resize(nb * 16);
  s.mins.resize(nb * 8);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    if (f == Format::Q6_K) {
      s.d[b] = half_at(blk + 208);
      for (int j = 0; j < 16; ++j) s.sc[b * 16 + j] = static_cast<int8_t>(blk[192 + j]);
      continue;
    }
    s.d[b] = half_at(blk);
    if (f == Format::Q4_1 || f == Format::Q4_K || f == Format::Q5_K) s.m[b] = half_at(blk + 2);
    if (f == Format::Q4_K || f == Format::Q5_K) {
      const uint8_t* p = blk + 4;  // quant_formats.k_scales_mins
      for (int j = 0; j < 4; ++j) {
        s.sc[b * 16 + j] = p[j] & 63;
        s.mins[b * 8 + j] = p[j + 4] & 63;
        s.sc[b * 16 + j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        s.mins[b * 8 + j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
      }
    }
  }
}

// -------------------------------------------------------- integer sums of one block, 4 rows

#if defined(__AVX2__)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIsa = "avx512-vnni";
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#define KVGATE_QUANT_VNNI 1
#elif defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#define KVGATE_QUANT_VNNI 1
#else
constexpr const char* kIsa = "avx2";
// Eight int32 lanes, lane i = sum of u * s over bytes 4i..4i+3.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

// Sum of each sub-block's products times its scale, in eight int32 lanes. A 32-value vector
// is one sub-block (one scale) or, in Q6_K, two of 16 (values 0-15 in the low 128 bits).
#if defined(KVGATE_QUANT_VNNI)
inline __m256i scale_vector(int16_t low, int16_t high) {
  return _mm256_set_m128i(_mm_set1_epi32(high), _mm_set1_epi32(low));
}
inline __m256i scaled_dot(__m256i u, __m256i s, __m256i scale) {
  return _mm256_mullo_epi32(dot_u8s8(u, s), scale);
}
#else
inline __m256i scale_vector(int16_t low, int16_t high) {
  return _mm256_set_m128i(_mm_set1_epi16(high), _mm_set1_epi16(low));
}
inline __m256i scaled_dot(__m256i u, __m256i s, __m256i scale) {  // pairs times the scale
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
}
#endif

// [sum(a), sum(b), sum(c), sum(d)] of four vectors of eight int32.
inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

inline __m128i hsum4_128(__m128i a, __m128i b, __m128i c, __m128i d) {
  return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q4_0/Q4_1: 16 bytes -> 32 values 0..15, values 0-15 in the low half, 16-31 in the high.
inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_set_m128i(high, low);
}

// The lane sums of T vectors into out[0..T): four by a tree of horizontal adds, or one.
template <int T>
inline void hsum_store(const __m256i* v, int32_t* out) {
  if constexpr (T == 4) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), hsum4(v[0], v[1], v[2], v[3]));
  } else {
    static_assert(T == 1, "tiles of four rows or one");
    const __m128i s =
        _mm_add_epi32(_mm256_castsi256_si128(v[0]), _mm256_extracti128_si256(v[0], 1));
    const __m128i s2 = _mm_hadd_epi32(s, s);
    out[0] = _mm_cvtsi128_si32(_mm_hadd_epi32(s2, s2));
  }
}

template <int T>
inline void hsum_store_128(const __m128i* v, int32_t* out) {
  if constexpr (T == 4) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), hsum4_128(v[0], v[1], v[2], v[3]));
  } else {
    const __m128i s2 = _mm_hadd_epi32(v[0], v[0]);
    out[0] = _mm_cvtsi128_si32(_mm_hadd_epi32(s2, s2));
  }
}

// Blocks of 32 (Q8_0, Q4_0, Q4_1): isum[t] = sum (qw - offset) qa for rows m0..m0+T-1.
template <int T>
inline void block32_ints(Format f, const uint8_t* blk, const Activations& a, int64_t m0,
                         int64_t b, int32_t* isum) {
  const int64_t k = a.k;
  const int8_t* q0 = a.q.data() + m0 * k + b * 32;
  __m256i p[T];
  if (f == Format::Q8_0) {
    const __m256i w = load32(blk + 2);
    const __m256i wu = _mm256_sign_epi8(w, w);
    for (int t = 0; t < T; ++t) p[t] = dot_u8s8(wu, _mm256_sign_epi8(load32(q0 + t * k), w));
  } else {
    const __m256i w = unpack_q4(blk + (f == Format::Q4_0 ? 2 : 4));
    for (int t = 0; t < T; ++t) p[t] = dot_u8s8(w, load32(q0 + t * k));
  }
  hsum_store<T>(p, isum);
  if (f == Format::Q4_0) {  // sum (q - 8) qa = sum q qa - 8 sum qa
    for (int t = 0; t < T; ++t) isum[t] -= a.sum32[b * a.rows_padded + m0 + t] * 8;
  }
}

// Chunk c (0..3) of a Q4_K/Q5_K super-block: its 64 values as 32 low nibbles and 32 high ones,
// the fifth bit (Q5_K) put in place.
inline void k45_chunk(Format f, const uint8_t* blk, int c, __m256i& low, __m256i& high) {
  const __m256i packed = load32(blk + (f == Format::Q4_K ? 16 : 48) + 32 * c);
  low = low_nibbles(packed);
  high = high_nibbles(packed);
  if (f == Format::Q5_K) {  // the fifth bit: bit 2c (low) and 2c + 1 (high) of qh
    const __m256i qh = load32(blk + 16);
    const __m256i bit_low = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
    const __m256i bit_high = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
    const __m256i sixteen = _mm256_set1_epi8(16);
    low = _mm256_or_si256(low, _mm256_and_si256(
        _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_low), bit_low), sixteen));
    high = _mm256_or_si256(high, _mm256_and_si256(
        _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_high), bit_high), sixteen));
  }
}

// Q4_K / Q5_K super-block: isum[t] = sum_j sc_j sum q qa, imin[t] = sum_j m_j sum qa.
template <int T>
inline void k45_ints(Format f, const uint8_t* blk, const int16_t* sc, const int16_t* mins,
                     const Activations& a, int64_t m0, int64_t b, int32_t* isum, int32_t* imin) {
  const int64_t k = a.k;
  const int8_t* q0 = a.q.data() + m0 * k + b * 256;
  __m256i acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    __m256i low, high;
    k45_chunk(f, blk, c, low, high);
    const __m256i sc_low = scale_vector(sc[2 * c], sc[2 * c]);
    const __m256i sc_high = scale_vector(sc[2 * c + 1], sc[2 * c + 1]);
    for (int t = 0; t < T; ++t) {
      const int8_t* q = q0 + t * k + 64 * c;
      acc[t] = _mm256_add_epi32(acc[t], scaled_dot(low, load32(q), sc_low));
      acc[t] = _mm256_add_epi32(acc[t], scaled_dot(high, load32(q + 32), sc_high));
    }
  }
  hsum_store<T>(acc, isum);
  const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins));
  __m128i mp[T];
  for (int t = 0; t < T; ++t) {
    const int16_t* s = a.rsum32.data() + (m0 + t) * (k / 32) + b * 8;
    mp[t] = _mm_madd_epi16(m, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  hsum_store_128<T>(mp, imin);
}

// Bits s and s + 1 of every byte moved to bits 4 and 5 (Q6_K's high bits).
inline __m256i q6_high(__m256i qh, int s) {
  const __m256i moved = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}

// Half h (0, 1) of a Q6_K super-block: four groups of 32 values 0..63.
inline void q6k_groups(const uint8_t* blk, int h, __m256i* groups) {
  const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
  const __m256i qh = load32(blk + 128 + 32 * h);
  groups[0] = _mm256_or_si256(low_nibbles(ql0), q6_high(qh, 0));
  groups[1] = _mm256_or_si256(low_nibbles(ql1), q6_high(qh, 2));
  groups[2] = _mm256_or_si256(high_nibbles(ql0), q6_high(qh, 4));
  groups[3] = _mm256_or_si256(high_nibbles(ql1), q6_high(qh, 6));
}

// Q6_K super-block: isum[t] = sum_j sc_j sum (q - 32) qa.
template <int T>
inline void q6k_ints(const uint8_t* blk, const int16_t* sc, const Activations& a, int64_t m0,
                     int64_t b, int32_t* isum) {
  const int64_t k = a.k;
  const int8_t* q0 = a.q.data() + m0 * k + b * 256;
  __m256i acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    __m256i groups[4];
    q6k_groups(blk, h, groups);
    for (int g = 0; g < 4; ++g) {
      const int j = 8 * h + 2 * g;  // the group's two 16-value sub-blocks: j, j + 1
      const __m256i scale = scale_vector(sc[j], sc[j + 1]);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = q0 + t * k + 128 * h + 32 * g;
        acc[t] = _mm256_add_epi32(acc[t], scaled_dot(groups[g], load32(q), scale));
      }
    }
  }
  hsum_store<T>(acc, isum);
  const __m256i scales = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc));
  __m256i cp[T];
  for (int t = 0; t < T; ++t) {
    const int16_t* s = a.rsum16.data() + (m0 + t) * (k / 16) + b * 16;
    cp[t] = _mm256_madd_epi16(scales, load32(s));
  }
  int32_t correction[T];  // sum_j sc_j sum qa
  hsum_store<T>(cp, correction);
  for (int t = 0; t < T; ++t) isum[t] -= correction[t] * 32;
}

// -------------------------------------------------- one row of W against 8 rows of x
// A block's weights are broadcast four at a time against the same four values of eight rows
// of x (the transposed tile, Activations::qt), so each of eight int32 lanes ends up holding one
// row's whole block sum: no horizontal sums, and the float steps of eight rows are the eight
// lanes of one 256-bit operation each (the same expression per row as tile_product: the same
// bits).

#if defined(KVGATE_QUANT_VNNI)
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
}
#endif

// The block's 32 weights as bytes (Q4: 0..15 in value order; Q8_0: signed), for broadcasts.
inline void block32_bytes(Format f, const uint8_t* blk, uint8_t* out) {
  if (f == Format::Q8_0) {
    std::memcpy(out, blk + 2, 32);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        unpack_q4(blk + (f == Format::Q4_0 ? 2 : 4)));
  }
}

// sum over the 4 * GROUPS unsigned values w[0 .. 4 GROUPS) of w * x for each of the tile's eight
// rows (xg: the tile's groups of four for those values).
template <int GROUPS>
inline __m256i dot_tile8(const uint8_t* w, const int8_t* xg) {
  __m256i isum = _mm256_setzero_si256();
  for (int g = 0; g < GROUPS; ++g) {
    int32_t four;
    std::memcpy(&four, w + 4 * g, 4);
    isum = dot_acc(isum, _mm256_set1_epi32(four), load32(xg + g * 4 * kTile8));
  }
  return isum;
}

inline __m256i load_i32x8(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// K-quants against a tile of eight rows, one format per instantiation (blocks of 32 take
// tiles8_block32 below, which shares a block's unpacking between tiles).
template <Format f>
void tile8_format(const uint8_t* row, int64_t bytes, const Activations& a, const RowScales& s,
                  int64_t nb, int64_t m0, float* out) {
  static_assert(f == Format::Q4_K || f == Format::Q5_K || f == Format::Q6_K);
  const int64_t np = a.rows_padded;
  const int8_t* tile = a.qt.data() + m0 * a.k;
  alignas(32) uint8_t w[256];
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const int8_t* xb = tile + b * 256 * kTile8;
    const __m256 dda = _mm256_mul_ps(_mm256_set1_ps(s.d[b]), _mm256_loadu_ps(&a.d[b * np + m0]));
    __m256i isum = _mm256_setzero_si256();
    if constexpr (f == Format::Q6_K) {  // sum_j sc_j (sum q qa - 32 sum qa), sub-blocks of 16
      for (int h = 0; h < 2; ++h) {
        __m256i groups[4];
        q6k_groups(blk, h, groups);
        for (int g = 0; g < 4; ++g)
          _mm256_store_si256(reinterpret_cast<__m256i*>(w + 128 * h + 32 * g), groups[g]);
      }
      const int16_t* sc = &s.sc[b * 16];
      for (int j = 0; j < 16; ++j) {
        const __m256i dot = _mm256_sub_epi32(
            dot_tile8<4>(w + 16 * j, xb + 16 * j * kTile8),
            _mm256_slli_epi32(load_i32x8(&a.sum16[(b * 16 + j) * np + m0]), 5));
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot, _mm256_set1_epi32(sc[j])));
      }
      acc = _mm256_add_ps(acc, _mm256_mul_ps(dda, _mm256_cvtepi32_ps(isum)));
      continue;
    } else {
    // Q4_K / Q5_K: sum_j sc_j sum q qa and sum_j m_j sum qa, sub-blocks of 32
    for (int c = 0; c < 4; ++c) {
      __m256i low, high;
      k45_chunk(f, blk, c, low, high);
      _mm256_store_si256(reinterpret_cast<__m256i*>(w + 64 * c), low);
      _mm256_store_si256(reinterpret_cast<__m256i*>(w + 64 * c + 32), high);
    }
    const int16_t* sc = &s.sc[b * 16];
    const int16_t* mins = &s.mins[b * 8];
    __m256i imin = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i dot = dot_tile8<8>(w + 32 * j, xb + 32 * j * kTile8);
      isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot, _mm256_set1_epi32(sc[j])));
      imin = _mm256_add_epi32(imin, _mm256_mullo_epi32(load_i32x8(&a.sum32[(b * 8 + j) * np + m0]),
                                                       _mm256_set1_epi32(mins[j])));
    }
    const __m256 dmin = _mm256_mul_ps(_mm256_set1_ps(s.m[b]), _mm256_loadu_ps(&a.d[b * np + m0]));
    acc = _mm256_add_ps(acc, _mm256_sub_ps(_mm256_mul_ps(dda, _mm256_cvtepi32_ps(isum)),
                                           _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(imin))));
    }
  }
  _mm256_storeu_ps(out, acc);
}

// Blocks of 32: TT tiles of eight rows (rows m0 .. m0 + 8 TT) at once, each block's weights
// unpacked and broadcast once for all of them. out: [TT][8].
template <Format f, int TT>
void tiles8_block32(const uint8_t* row, int64_t bytes, const Activations& a, const RowScales& s,
                    int64_t nb, int64_t m0, float* out) {
  const int64_t np = a.rows_padded;
  const int64_t k = a.k;
  const int8_t* tiles = a.qt.data() + m0 * k;  // tile t at tiles + t * 8 k
  alignas(32) uint8_t w[32];
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    block32_bytes(f, row + b * bytes, w);
    __m256i wg[8], wu[8];
    for (int g = 0; g < 8; ++g) {
      int32_t four;
      std::memcpy(&four, w + 4 * g, 4);
      wg[g] = _mm256_set1_epi32(four);
      if constexpr (f == Format::Q8_0) wu[g] = _mm256_sign_epi8(wg[g], wg[g]);
    }
    const __m256 d = _mm256_set1_ps(s.d[b]);
    for (int t = 0; t < TT; ++t) {
      const int64_t m = m0 + t * kTile8;
      const int8_t* xb = tiles + t * kTile8 * k + b * 32 * kTile8;
      __m256i isum = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i x = load32(xb + g * 4 * kTile8);
        if constexpr (f == Format::Q8_0) {
          isum = dot_acc(isum, wu[g], _mm256_sign_epi8(x, wg[g]));
        } else {
          isum = dot_acc(isum, wg[g], x);
        }
      }
      if constexpr (f == Format::Q4_0)  // sum (q - 8) qa
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(load_i32x8(&a.sum32[b * np + m]), 3));
      const __m256 dda = _mm256_mul_ps(d, _mm256_loadu_ps(&a.d[b * np + m]));
      const __m256 term = _mm256_mul_ps(dda, _mm256_cvtepi32_ps(isum));
      if constexpr (f == Format::Q4_1) {
        const __m256 sa = _mm256_loadu_ps(&a.sa[b * np + m]);
        acc[t] = _mm256_add_ps(acc[t], _mm256_add_ps(term, _mm256_mul_ps(_mm256_set1_ps(s.m[b]), sa)));
      } else {
        acc[t] = _mm256_add_ps(acc[t], term);
      }
    }
  }
  for (int t = 0; t < TT; ++t) _mm256_storeu_ps(out + t * kTile8, acc[t]);
}

// Rows m0 .. m0 + 8 count of x (count tiles of eight) against one row of W. out: [count][8].
void tiles8_product(Format f, const uint8_t* row, int64_t bytes, const Activations& a,
                    const RowScales& s, int64_t nb, int64_t m0, int64_t count, float* out);

void tile8_product(Format f, const uint8_t* row, int64_t bytes, const Activations& a,
                   const RowScales& s, int64_t nb, int64_t m0, float* out) {
  switch (f) {
    case Format::Q4_K: return tile8_format<Format::Q4_K>(row, bytes, a, s, nb, m0, out);
    case Format::Q5_K: return tile8_format<Format::Q5_K>(row, bytes, a, s, nb, m0, out);
    case Format::Q6_K: return tile8_format<Format::Q6_K>(row, bytes, a, s, nb, m0, out);
    default: TORCH_CHECK(false, "blocks of 32 take tiles8_block32");
  }
}

template <Format f>
void tiles8_block32_any(const uint8_t* row, int64_t bytes, const Activations& a,
                        const RowScales& s, int64_t nb, int64_t m0, int64_t count, float* out) {
  int64_t t = 0;
  for (; t + kTiles8 <= count; t += kTiles8)
    tiles8_block32<f, kTiles8>(row, bytes, a, s, nb, m0 + t * kTile8, out + t * kTile8);
  for (; t < count; ++t)
    tiles8_block32<f, 1>(row, bytes, a, s, nb, m0 + t * kTile8, out + t * kTile8);
}

void tiles8_product(Format f, const uint8_t* row, int64_t bytes, const Activations& a,
                    const RowScales& s, int64_t nb, int64_t m0, int64_t count, float* out) {
  switch (f) {
    case Format::Q8_0: return tiles8_block32_any<Format::Q8_0>(row, bytes, a, s, nb, m0, count, out);
    case Format::Q4_0: return tiles8_block32_any<Format::Q4_0>(row, bytes, a, s, nb, m0, count, out);
    case Format::Q4_1: return tiles8_block32_any<Format::Q4_1>(row, bytes, a, s, nb, m0, count, out);
    default:
      for (int64_t t = 0; t < count; ++t)
        tile8_product(f, row, bytes, a, s, nb, m0 + t * kTile8, out + t * kTile8);
  }
}

constexpr bool kHasTile8 = true;


// ------------------------------------------- integer sums of one block, 4 rows of W, 1 of x
// Rows j = 0..3 of W (block b at rows[j] + off) against row m of x: the same integers as the
// one-row functions above (integer sums are exact in any order), with one reduction tree
// (hsum4) for the four instead of one per row: what a lone decode row runs.

inline __m128i block32_ints_w4(Format f, const uint8_t* const* rows, int64_t off,
                               const Activations& a, int64_t m, int64_t b) {
  const __m256i x = load32(a.q.data() + m * a.k + b * 32);
  __m256i p[4];
  for (int j = 0; j < 4; ++j) {
    const uint8_t* blk = rows[j] + off;
    if (f == Format::Q8_0) {
      const __m256i w = load32(blk + 2);
      p[j] = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    } else {
      p[j] = dot_u8s8(unpack_q4(blk + (f == Format::Q4_0 ? 2 : 4)), x);
    }
  }
  const __m128i isum = hsum4(p[0], p[1], p[2], p[3]);
  if (f != Format::Q4_0) return isum;
  return _mm_sub_epi32(isum, _mm_set1_epi32(a.sum32[b * a.rows_padded + m] * 8));
}

inline __m128i k45_ints_w4(Format f, const uint8_t* const* rows, int64_t off,
                           const RowScales* s, const Activations& a, int64_t m, int64_t b,
                           __m128i& imin) {
  const int8_t* q = a.q.data() + m * a.k + b * 256;
  __m256i acc[4];
  for (int j = 0; j < 4; ++j) {
    const uint8_t* blk = rows[j] + off;
    const int16_t* sc = &s[j].sc[b * 16];
    acc[j] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i low, high;
      k45_chunk(f, blk, c, low, high);
      acc[j] = _mm256_add_epi32(
          acc[j], scaled_dot(low, load32(q + 64 * c), scale_vector(sc[2 * c], sc[2 * c])));
      acc[j] = _mm256_add_epi32(acc[j], scaled_dot(high, load32(q + 64 * c + 32),
                                                   scale_vector(sc[2 * c + 1], sc[2 * c + 1])));
    }
  }
  const __m128i r = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(a.rsum32.data() + m * (a.k / 32) + b * 8));
  __m128i mp[4];
  for (int j = 0; j < 4; ++j) {
    const __m128i mins = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&s[j].mins[b * 8]));
    mp[j] = _mm_madd_epi16(mins, r);
  }
  imin = hsum4_128(mp[0], mp[1], mp[2], mp[3]);
  return hsum4(acc[0], acc[1], acc[2], acc[3]);
}

inline __m128i q6k_ints_w4(const uint8_t* const* rows, int64_t off, const RowScales* s,
                           const Activations& a, int64_t m, int64_t b) {
  const int8_t* q = a.q.data() + m * a.k + b * 256;
  __m256i acc[4], cp[4];
  const __m256i r = load32(a.rsum16.data() + m * (a.k / 16) + b * 16);
  for (int j = 0; j < 4; ++j) {
    const uint8_t* blk = rows[j] + off;
    const int16_t* sc = &s[j].sc[b * 16];
    acc[j] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      __m256i groups[4];
      q6k_groups(blk, h, groups);
      for (int g = 0; g < 4; ++g) {
        const int i = 8 * h + 2 * g;
        acc[j] = _mm256_add_epi32(acc[j], scaled_dot(groups[g], load32(q + 128 * h + 32 * g),
                                                     scale_vector(sc[i], sc[i + 1])));
      }
    }
    cp[j] = _mm256_madd_epi16(load32(sc), r);
  }
  const __m128i correction = hsum4(cp[0], cp[1], cp[2], cp[3]);  // sum_j sc_j sum qa
  return _mm_sub_epi32(hsum4(acc[0], acc[1], acc[2], acc[3]),
                       _mm_mullo_epi32(correction, _mm_set1_epi32(32)));
}

#else  // scalar: the same integers

constexpr const char* kIsa = "scalar";

inline int32_t q4_value(const uint8_t* qs, int i) {
  return i < 16 ? (qs[i] & 0x0F) : (qs[i - 16] >> 4);
}

template <int T>
inline void block32_ints(Format f, const uint8_t* blk, const Activations& a, int64_t m0,
                         int64_t b, int32_t* isum) {
  for (int t = 0; t < T; ++t) {
    const int8_t* q = a.q.data() + (m0 + t) * a.k + b * 32;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      int32_t w;
      if (f == Format::Q8_0) w = static_cast<int8_t>(blk[2 + i]);
      else if (f == Format::Q4_0) w = q4_value(blk + 2, i) - 8;
      else w = q4_value(blk + 4, i);
      s += w * q[i];
    }
    isum[t] = s;
  }
}

// Value i (0..255) of a K-quant super-block, before any offset.
inline int32_t k_value(Format f, const uint8_t* blk, int i) {
  const int c = i / 64, r = i % 64, l = r % 32;
  if (f == Format::Q6_K) {
    const int h = i / 128, g = (i % 128) / 32;
    const uint8_t ql = blk[64 * h + (g % 2) * 32 + l];
    const int32_t low = g < 2 ? (ql & 0x0F) : (ql >> 4);
    return low | (((blk[128 + 32 * h + l] >> (2 * g)) & 3) << 4);
  }
  const uint8_t* qs = blk + (f == Format::Q4_K ? 16 : 48);
  int32_t v = r < 32 ? (qs[32 * c + l] & 0x0F) : (qs[32 * c + l] >> 4);
  if (f == Format::Q5_K) v |= ((blk[16 + l] >> (2 * c + (r < 32 ? 0 : 1))) & 1) << 4;
  return v;
}

template <int T>
inline void k45_ints(Format f, const uint8_t* blk, const int16_t* sc, const int16_t* mins,
                     const Activations& a, int64_t m0, int64_t b, int32_t* isum, int32_t* imin) {
  for (int t = 0; t < T; ++t) {
    const int8_t* q = a.q.data() + (m0 + t) * a.k + b * 256;
    int32_t s = 0, m = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t dot = 0, sum = 0;
      for (int i = 32 * j; i < 32 * j + 32; ++i) {
        dot += k_value(f, blk, i) * q[i];
        sum += q[i];
      }
      s += sc[j] * dot;
      m += mins[j] * sum;
    }
    isum[t] = s;
    imin[t] = m;
  }
}

template <int T>
inline void q6k_ints(const uint8_t* blk, const int16_t* sc, const Activations& a, int64_t m0,
                     int64_t b, int32_t* isum) {
  for (int t = 0; t < T; ++t) {
    const int8_t* q = a.q.data() + (m0 + t) * a.k + b * 256;
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t dot = 0;
      for (int i = 16 * j; i < 16 * j + 16; ++i) dot += (k_value(Format::Q6_K, blk, i) - 32) * q[i];
      s += sc[j] * dot;
    }
    isum[t] = s;
  }
}

inline void block32_ints_w4(Format f, const uint8_t* const* rows, int64_t off,
                            const Activations& a, int64_t m, int64_t b, int32_t* isum) {
  for (int j = 0; j < 4; ++j) block32_ints<1>(f, rows[j] + off, a, m, b, &isum[j]);
}

constexpr bool kHasTile8 = false;  // no transposed tiles: four-row tiles only
void tiles8_product(Format, const uint8_t*, int64_t, const Activations&, const RowScales&,
                    int64_t, int64_t, int64_t, float*) {}

inline void k45_ints_w4(Format f, const uint8_t* const* rows, int64_t off, const RowScales* s,
                        const Activations& a, int64_t m, int64_t b, int32_t* isum,
                        int32_t* imin) {
  for (int j = 0; j < 4; ++j)
    k45_ints<1>(f, rows[j] + off, &s[j].sc[b * 16], &s[j].mins[b * 8], a, m, b, &isum[j],
                &imin[j]);
}

inline void q6k_ints_w4(const uint8_t* const* rows, int64_t off, const RowScales* s,
                        const Activations& a, int64_t m, int64_t b, int32_t* isum) {
  for (int j = 0; j < 4; ++j) q6k_ints<1>(rows[j] + off, &s[j].sc[b * 16], a, m, b, &isum[j]);
}

#endif

// ------------------------------------------------------------------------------ the product

// One row of W (scales decoded in s) against rows m0..m0+T-1 of x: acc[t] (torch_quant's float
// steps, in block order; the same expression per row whatever T, so the same bits).
template <int T>
void tile_product(Format f, const uint8_t* row, int64_t bytes, const Activations& a,
                  const RowScales& s, int64_t nb, int64_t m0, float* acc) {
  const int64_t np = a.rows_padded;
  alignas(16) int32_t isum[T], imin[T];
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float* da = &a.d[b * np + m0];
    switch (f) {
      case Format::Q8_0:
      case Format::Q4_0:
        block32_ints<T>(f, blk, a, m0, b, isum);
        for (int t = 0; t < T; ++t)
          acc[t] = acc[t] + (s.d[b] * da[t]) * static_cast<float>(isum[t]);
        break;
      case Format::Q4_1: {
        block32_ints<T>(f, blk, a, m0, b, isum);
        const float* sa = &a.sa[b * np + m0];
        for (int t = 0; t < T; ++t)
          acc[t] = acc[t] + ((s.d[b] * da[t]) * static_cast<float>(isum[t]) + s.m[b] * sa[t]);
        break;
      }
      case Format::Q4_K:
      case Format::Q5_K:
        k45_ints<T>(f, blk, &s.sc[b * 16], &s.mins[b * 8], a, m0, b, isum, imin);
        for (int t = 0; t < T; ++t)
          acc[t] = acc[t] + ((s.d[b] * da[t]) * static_cast<float>(isum[t]) -
                             (s.m[b] * da[t]) * static_cast<float>(imin[t]));
        break;
      case Format::Q6_K:
        q6k_ints<T>(blk, &s.sc[b * 16], a, m0, b, isum);
        for (int t = 0; t < T; ++t)
          acc[t] = acc[t] + (s.d[b] * da[t]) * static_cast<float>(isum[t]);
        break;
    }
  }
}

// Rows rows[0..3] of W (scales decoded in s[0..3]) against row m of x: acc[j] for row j, the
// same expression per row, in block order, as tile_product gives it (so the same bits): with
// AVX2 the four rows' float steps are the four lanes of one 128-bit operation each.
#if defined(__AVX2__)
void wtile_product(Format f, const uint8_t* const* rows, int64_t bytes, const Activations& a,
                   const RowScales* s, int64_t nb, int64_t m, float* out) {
  const int64_t np = a.rows_padded;
  thread_local std::vector<float> d4, m4;  // [block][row of W]: the rows' scales side by side
  d4.resize(nb * kWTile);
  m4.resize(nb * kWTile);
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < kWTile; ++j) {
      d4[b * kWTile + j] = s[j].d[b];
      m4[b * kWTile + j] = s[j].m[b];
    }
  }
  __m128 acc = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t off = b * bytes;
    const __m128 d = _mm_loadu_ps(&d4[b * kWTile]);
    const __m128 da = _mm_set1_ps(a.d[b * np + m]);
    switch (f) {
      case Format::Q8_0:
      case Format::Q4_0: {
        const __m128 isum = _mm_cvtepi32_ps(block32_ints_w4(f, rows, off, a, m, b));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, da), isum));
        break;
      }
      case Format::Q4_1: {
        const __m128 isum = _mm_cvtepi32_ps(block32_ints_w4(f, rows, off, a, m, b));
        const __m128 min_term = _mm_mul_ps(_mm_loadu_ps(&m4[b * kWTile]),
                                           _mm_set1_ps(a.sa[b * np + m]));
        acc = _mm_add_ps(acc, _mm_add_ps(_mm_mul_ps(_mm_mul_ps(d, da), isum), min_term));
        break;
      }
      case Format::Q4_K:
      case Format::Q5_K: {
        __m128i imin_ints;
        const __m128 isum = _mm_cvtepi32_ps(k45_ints_w4(f, rows, off, s, a, m, b, imin_ints));
        const __m128 dmin = _mm_mul_ps(_mm_loadu_ps(&m4[b * kWTile]), da);
        acc = _mm_add_ps(acc, _mm_sub_ps(_mm_mul_ps(_mm_mul_ps(d, da), isum),
                                         _mm_mul_ps(dmin, _mm_cvtepi32_ps(imin_ints))));
        break;
      }
      case Format::Q6_K: {
        const __m128 isum = _mm_cvtepi32_ps(q6k_ints_w4(rows, off, s, a, m, b));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, da), isum));
        break;
      }
    }
  }
  _mm_storeu_ps(out, acc);
}
#else
void wtile_product(Format f, const uint8_t* const* rows, int64_t bytes, const Activations& a,
                   const RowScales* s, int64_t nb, int64_t m, float* acc) {
  const int64_t np = a.rows_padded;
  int32_t isum[kWTile], imin[kWTile];
  for (int j = 0; j < kWTile; ++j) acc[j] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t off = b * bytes;
    const float da = a.d[b * np + m];
    switch (f) {
      case Format::Q8_0:
      case Format::Q4_0:
        block32_ints_w4(f, rows, off, a, m, b, isum);
        for (int j = 0; j < kWTile; ++j)
          acc[j] = acc[j] + (s[j].d[b] * da) * static_cast<float>(isum[j]);
        break;
      case Format::Q4_1: {
        block32_ints_w4(f, rows, off, a, m, b, isum);
        const float sa = a.sa[b * np + m];
        for (int j = 0; j < kWTile; ++j)
          acc[j] = acc[j] + ((s[j].d[b] * da) * static_cast<float>(isum[j]) + s[j].m[b] * sa);
        break;
      }
      case Format::Q4_K:
      case Format::Q5_K:
        k45_ints_w4(f, rows, off, s, a, m, b, isum, imin);
        for (int j = 0; j < kWTile; ++j)
          acc[j] = acc[j] + ((s[j].d[b] * da) * static_cast<float>(isum[j]) -
                             (s[j].m[b] * da) * static_cast<float>(imin[j]));
        break;
      case Format::Q6_K:
        q6k_ints_w4(rows, off, s, a, m, b, isum);
        for (int j = 0; j < kWTile; ++j)
          acc[j] = acc[j] + (s[j].d[b] * da) * static_cast<float>(isum[j]);
        break;
    }
  }
}
#endif

// Rows [begin, end) of W against x into out. The rows of x in tiles of eight (blocks of 32, with
// AVX2) and then of four (one row of W at a time) while four remain; the last n % 4 rows of x (a lone decode row: all of it) against four
// rows of W at a time, then the rows of W left over one by one. No padding rows are computed.
void rows_product(Format f, const uint8_t* w, int64_t row_bytes, int64_t bytes,
                  const Activations& a, float* out, int64_t n, int64_t rows, int64_t begin,
                  int64_t end) {
  const int64_t nb = a.k / layout_of(f).values;
  const int64_t tiled8 = kHasTile8 ? static_cast<int64_t>(a.qt.size()) / a.k : 0;
  const int64_t tiled = tiled8 + (n - tiled8) / kTile * kTile;
  RowScales s[kWTile];
  for (int64_t r = begin; tiled > 0 && r < end; ++r) {
    const uint8_t* row = w + r * row_bytes;
    decode_row(f, row, nb, bytes, s[0]);
    for (int64_t m0 = 0; m0 < tiled8; m0 += kTiles8 * kTile8) {
      const int64_t count = std::min(kTiles8, (tiled8 - m0) / kTile8);
      alignas(32) float acc[kTiles8 * kTile8];
      tiles8_product(f, row, bytes, a, s[0], nb, m0, count, acc);
      for (int64_t t = 0; t < count * kTile8; ++t) out[(m0 + t) * rows + r] = acc[t];
    }
    for (int64_t m0 = tiled8; m0 < tiled; m0 += kTile) {
      float acc[kTile];
      tile_product<kTile>(f, row, bytes, a, s[0], nb, m0, acc);
      for (int t = 0; t < kTile; ++t) out[(m0 + t) * rows + r] = acc[t];
    }
  }
  if (tiled == n) return;
  int64_t r = begin;
  for (; r + kWTile <= end; r += kWTile) {
    const uint8_t* four[kWTile];
    for (int j = 0; j < kWTile; ++j) {
      four[j] = w + (r + j) * row_bytes;
      decode_row(f, four[j], nb, bytes, s[j]);
    }
    for (int64_t m = tiled; m < n; ++m) {
      float acc[kWTile];
      wtile_product(f, four, bytes, a, s, nb, m, acc);
      for (int j = 0; j < kWTile; ++j) out[m * rows + r + j] = acc[j];
    }
  }
  for (; r < end; ++r) {
    const uint8_t* row = w + r * row_bytes;
    decode_row(f, row, nb, bytes, s[0]);
    for (int64_t m = tiled; m < n; ++m) {
      float acc[1];
      tile_product<1>(f, row, bytes, a, s[0], nb, m, acc);
      out[m * rows + r] = acc[0];
    }
  }
}

// The arguments of both products checked; the format and its block bytes, and a row's bytes.
struct Checked {
  Format f;
  int64_t bytes, row_bytes;
};

Checked check_arguments(const at::Tensor& x, const at::Tensor& data, int64_t format,
                        int64_t cols) {
  TORCH_CHECK(format >= 0 && format <= 5, "format must be 0..5, got ", format);
  const Format f = static_cast<Format>(format);
  const Layout lay = layout_of(f);
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "x and data must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be 2-D float32");
  TORCH_CHECK(x.size(1) == cols && x.stride(1) == 1, "x must be [n, ", cols, "], rows contiguous");
  TORCH_CHECK(cols % lay.values == 0, "cols must be a multiple of ", lay.values);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "data must be contiguous 2-D uint8");
  const int64_t bytes = lay.bytes, row_bytes = cols / lay.values * bytes;
  TORCH_CHECK(data.size(1) == row_bytes, "data rows must be ", row_bytes, " bytes");
  return {f, bytes, row_bytes};
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& data, int64_t format, int64_t cols) {
  const auto [f, bytes, row_bytes] = check_arguments(x, data, format, cols);
  const int64_t n = x.size(0), rows = data.size(0);
  at::Tensor out = at::empty({n, rows}, x.options());
  if (n == 0 || rows == 0) return out;
  const Activations acts =
      quantize_rows(x.data_ptr<float>(), x.stride(0), n, cols, is_k_quant(f) ? 256 : 32);
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  // About 64k multiply-adds per task: enough to amortize a task, small enough to share.
  const int64_t grain = std::max<int64_t>(1, 65536 / (cols * ((n + kTile - 1) / kTile * kTile)));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    rows_product(f, w, row_bytes, bytes, acts, o, n, rows, begin, end);
  });
  return out;
}


// --------------------------------------------------- W repacked in groups of eight rows
// A group of eight rows of W, block by block (the same bytes as the eight rows' blocks,
// reordered; quant.py's repack_rows8 and ROWS8_FIELDS are the specification of the layout).
// Blocks of 32:
//   d[8] fp16, then (Q4_1) m[8] fp16, then the quants in groups of four values, the eight rows'
//   groups side by side: Q4_0/Q4_1 [chunk c 0..3][row][4 packed bytes] (low nibbles: values
//   4c..4c+3, high: 16+4c..16+4c+3); Q8_0 [group g 0..7][row][4 values].
// x's four values of a group are broadcast against the eight rows at once: each int32 lane ends
// with one row's block sum (no horizontal sums), and the float steps of eight rows are the
// lanes of one operation (per row the same expression as tile_product: the same bits).

#if defined(__AVX2__) && defined(__F16C__)
template <Format f, int TX>
void rows8_tile(const uint8_t* group, int64_t nb, const Activations& a, int64_t m0, float* out) {
  constexpr int64_t bytes = f == Format::Q8_0 ? 34 : (f == Format::Q4_0 ? 18 : 20);
  constexpr int64_t quants = f == Format::Q4_1 ? 32 : 16;  // the quants' offset in a block group
  const int64_t np = a.rows_padded;
  __m256 acc[TX];
  for (int t = 0; t < TX; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bg = group + b * 8 * bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg)));
    __m256i wv[8], wu[8];
    if constexpr (f == Format::Q8_0) {
      for (int g = 0; g < 8; ++g) {
        wv[g] = load32(bg + quants + 32 * g);
        wu[g] = _mm256_sign_epi8(wv[g], wv[g]);
      }
    } else {
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(bg + quants + 32 * c);
        wv[c] = _mm256_and_si256(v, mask);
        wv[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
    }
    for (int t = 0; t < TX; ++t) {
      const int64_t m = m0 + t;
      const int8_t* xq = a.q.data() + m * a.k + b * 32;
      __m256i isum = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        int32_t four;
        std::memcpy(&four, xq + 4 * g, 4);
        const __m256i x = _mm256_set1_epi32(four);
        if constexpr (f == Format::Q8_0) {
          isum = dot_acc(isum, wu[g], _mm256_sign_epi8(x, wv[g]));
        } else {
          isum = dot_acc(isum, wv[g], x);
        }
      }
      if constexpr (f == Format::Q4_0)  // sum (q - 8) qa
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(a.sum32[b * np + m] * 8));
      const __m256 term = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.d[b * np + m])),
                                        _mm256_cvtepi32_ps(isum));
      if constexpr (f == Format::Q4_1) {
        const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + 16)));
        acc[t] = _mm256_add_ps(acc[t], _mm256_add_ps(term, _mm256_mul_ps(mins, _mm256_set1_ps(a.sa[b * np + m]))));
      } else {
        acc[t] = _mm256_add_ps(acc[t], term);
      }
    }
  }
  for (int t = 0; t < TX; ++t) _mm256_storeu_ps(out + t * 8, acc[t]);
}

// Q4_K / Q5_K in groups of eight rows (quant.py's ROWS8_FIELDS): per super-block d[8], dmin[8]
// (fp16), the 12 scale bytes [12][row], (Q5_K) qh [8][row][4], qs [32][row][4]. Each row's 6-bit
// scales and mins are decoded in its lane; the chunk c, group i word of qs holds values
// 64c + 4i .. + 3 (low nibbles) and 64c + 32 + 4i .. + 3 (high nibbles), as stored.
template <Format f, int TX>
void rows8_tile_k45(const uint8_t* group, int64_t nb, const Activations& a, int64_t m0,
                    float* out) {
  constexpr int64_t bytes = f == Format::Q4_K ? 144 : 176;
  constexpr int64_t qs_at = f == Format::Q4_K ? 128 : 384;
  const int64_t np = a.rows_padded;
  const __m256i nibble = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
  __m256 acc[TX];
  for (int t = 0; t < TX; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bg = group + b * 8 * bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + 16)));
    __m256i p[12];  // scale byte i of each row, one per lane
    for (int i = 0; i < 12; ++i)
      p[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bg + 32 + 8 * i)));
    __m256i sc[8], mn[8];  // quant_formats.k_scales_mins, per lane
    for (int j = 0; j < 4; ++j) {
      sc[j] = _mm256_and_si256(p[j], six);
      mn[j] = _mm256_and_si256(p[j + 4], six);
      sc[j + 4] = _mm256_or_si256(_mm256_and_si256(p[j + 8], four),
                                  _mm256_slli_epi32(_mm256_srli_epi32(p[j], 6), 4));
      mn[j + 4] = _mm256_or_si256(_mm256_srli_epi32(p[j + 8], 4),
                                  _mm256_slli_epi32(_mm256_srli_epi32(p[j + 4], 6), 4));
    }
    __m256i isum[TX], imin[TX];
    for (int t = 0; t < TX; ++t) {
      isum[t] = _mm256_setzero_si256();
      imin[t] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        imin[t] = _mm256_add_epi32(imin[t], _mm256_mullo_epi32(
            mn[j], _mm256_set1_epi32(a.sum32[(b * 8 + j) * np + m0 + t])));
    }
    for (int c = 0; c < 4; ++c) {
      __m256i lo[TX], hi[TX];
      for (int t = 0; t < TX; ++t) lo[t] = hi[t] = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m256i v = load32(bg + qs_at + (8 * c + i) * 32);
        __m256i low = _mm256_and_si256(v, nibble);
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        if constexpr (f == Format::Q5_K) {  // the fifth bit: bit 2c (low) and 2c + 1 (high)
          const __m256i h = load32(bg + 128 + i * 32);
          low = _mm256_or_si256(low, _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4));
          high = _mm256_or_si256(high, _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4));
        }
        for (int t = 0; t < TX; ++t) {
          const int8_t* xq = a.q.data() + (m0 + t) * a.k + b * 256 + 64 * c + 4 * i;
          int32_t xl, xh;
          std::memcpy(&xl, xq, 4);
          std::memcpy(&xh, xq + 32, 4);
          lo[t] = dot_acc(lo[t], low, _mm256_set1_epi32(xl));
          hi[t] = dot_acc(hi[t], high, _mm256_set1_epi32(xh));
        }
      }
      for (int t = 0; t < TX; ++t) {
        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(lo[t], sc[2 * c]));
        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(hi[t], sc[2 * c + 1]));
      }
    }
    for (int t = 0; t < TX; ++t) {
      const __m256 da = _mm256_set1_ps(a.d[b * np + m0 + t]);
      acc[t] = _mm256_add_ps(acc[t], _mm256_sub_ps(
          _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[t])),
          _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(imin[t]))));
    }
  }
  for (int t = 0; t < TX; ++t) _mm256_storeu_ps(out + t * 8, acc[t]);
}

// Q6_K in groups of eight rows: ql [32][row][4], qh [16][row][4], scales [16][row] (int8), d[8]
// (fp16). Word l4 of half h: ql word 16h + l4 holds (low / high nibbles) values of groups 0 / 2,
// ql word 16h + 8 + l4 those of groups 1 / 3, qh word 8h + l4 their two high bits (bits 2g, 2g+1),
// for values 128h + 32g + 4 l4 .. + 3, as stored.
template <int TX>
void rows8_tile_q6k(const uint8_t* group, int64_t nb, const Activations& a, int64_t m0,
                    float* out) {
  constexpr int64_t bytes = 210;
  const int64_t np = a.rows_padded;
  const __m256i nibble = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  __m256 acc[TX];
  for (int t = 0; t < TX; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bg = group + b * 8 * bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + 1664)));
    __m256i isum[TX];
    for (int t = 0; t < TX; ++t) isum[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int half = 0; half < 2; ++half) {  // words l4 0-3, then 4-7: sub-blocks 8h + 2g + half
        __m256i dots[TX][4];
        for (int t = 0; t < TX; ++t)
          for (int g = 0; g < 4; ++g) dots[t][g] = _mm256_setzero_si256();
        for (int l4 = 4 * half; l4 < 4 * half + 4; ++l4) {
          const __m256i A = load32(bg + (16 * h + l4) * 32);
          const __m256i B = load32(bg + (16 * h + 8 + l4) * 32);
          const __m256i H = load32(bg + 1024 + (8 * h + l4) * 32);
          const __m256i q[4] = {
              _mm256_or_si256(_mm256_and_si256(A, nibble),
                              _mm256_slli_epi16(_mm256_and_si256(H, three), 4)),
              _mm256_or_si256(_mm256_and_si256(B, nibble),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), three), 4)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), nibble),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), three), 4)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), nibble),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), three), 4)),
          };
          for (int t = 0; t < TX; ++t) {
            const int8_t* xq = a.q.data() + (m0 + t) * a.k + b * 256 + 128 * h + 4 * l4;
            for (int g = 0; g < 4; ++g) {
              int32_t four;
              std::memcpy(&four, xq + 32 * g, 4);
              dots[t][g] = dot_acc(dots[t][g], q[g], _mm256_set1_epi32(four));
            }
          }
        }
        for (int g = 0; g < 4; ++g) {
          const int j = 8 * h + 2 * g + half;
          const __m256i sc = _mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bg + 1536 + 8 * j)));
          for (int t = 0; t < TX; ++t) {  // sc_j (sum q qa - 32 sum qa)
            const __m256i corr = _mm256_set1_epi32(32 * a.sum16[(b * 16 + j) * np + m0 + t]);
            isum[t] = _mm256_add_epi32(
                isum[t], _mm256_mullo_epi32(sc, _mm256_sub_epi32(dots[t][g], corr)));
          }
        }
      }
    }
    for (int t = 0; t < TX; ++t) {
      const __m256 da = _mm256_set1_ps(a.d[b * np + m0 + t]);
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[t])));
    }
  }
  for (int t = 0; t < TX; ++t) _mm256_storeu_ps(out + t * 8, acc[t]);
}

constexpr int kRows8X = 4;  // rows of x per pass over a group of W (its unpacked blocks reused)

template <Format f, int TX>
void rows8_any(const uint8_t* group, int64_t nb, const Activations& a, int64_t m0, float* out) {
  if constexpr (f == Format::Q4_K || f == Format::Q5_K) {
    rows8_tile_k45<f, TX>(group, nb, a, m0, out);
  } else if constexpr (f == Format::Q6_K) {
    rows8_tile_q6k<TX>(group, nb, a, m0, out);
  } else {
    rows8_tile<f, TX>(group, nb, a, m0, out);
  }
}

template <Format f>
void rows8_groups(const uint8_t* w, int64_t row_bytes, const Activations& a, float* out,
                  int64_t n, int64_t rows, int64_t gbegin, int64_t gend) {
  const int64_t nb = a.k / layout_of(f).values;
  for (int64_t G = gbegin; G < gend; ++G) {
    const uint8_t* group = w + G * 8 * row_bytes;
    alignas(32) float acc[kRows8X * 8];
    int64_t m0 = 0;
    for (; m0 + kRows8X <= n; m0 += kRows8X) {
      rows8_any<f, kRows8X>(group, nb, a, m0, acc);
      for (int t = 0; t < kRows8X; ++t)
        for (int j = 0; j < 8; ++j) out[(m0 + t) * rows + G * 8 + j] = acc[t * 8 + j];
    }
    for (; m0 < n; ++m0) {
      rows8_any<f, 1>(group, nb, a, m0, acc);
      for (int j = 0; j < 8; ++j) out[m0 * rows + G * 8 + j] = acc[j];
    }
  }
}

void rows8_product(Format f, const uint8_t* w, int64_t row_bytes, const Activations& a,
                   float* out, int64_t n, int64_t rows, int64_t gbegin, int64_t gend) {
  switch (f) {
    case Format::Q8_0: return rows8_groups<Format::Q8_0>(w, row_bytes, a, out, n, rows, gbegin, gend);
    case Format::Q4_0: return rows8_groups<Format::Q4_0>(w, row_bytes, a, out, n, rows, gbegin, gend);
    case Format::Q4_1: return rows8_groups<Format::Q4_1>(w, row_bytes, a, out, n, rows, gbegin, gend);
    case Format::Q4_K: return rows8_groups<Format::Q4_K>(w, row_bytes, a, out, n, rows, gbegin, gend);
    case Format::Q5_K: return rows8_groups<Format::Q5_K>(w, row_bytes, a, out, n, rows, gbegin, gend);
    case Format::Q6_K: return rows8_groups<Format::Q6_K>(w, row_bytes, a, out, n, rows, gbegin, gend);
  }
}
constexpr bool kHasRows8 = true;
#else
void rows8_product(Format, const uint8_t*, int64_t, const Activations&, float*, int64_t, int64_t,
                   int64_t, int64_t) {}
constexpr bool kHasRows8 = false;
#endif

// x [n, cols] @ W.T with W's first rows / 8 * 8 rows repacked in groups of eight (above) and
// the rows left over as stored.
at::Tensor matmul_rows8(const at::Tensor& x, const at::Tensor& data, int64_t format,
                        int64_t cols) {
  TORCH_CHECK(kHasRows8, "the rows8 layout needs AVX2 and F16C (this build: ", kIsa, ")");
  const auto [f, bytes, row_bytes] = check_arguments(x, data, format, cols);
  const int64_t n = x.size(0), rows = data.size(0), groups = rows / 8;
  at::Tensor out = at::empty({n, rows}, x.options());
  if (n == 0 || rows == 0) return out;
  // No transposed tiles: the rows8 groups broadcast x, and the rows left over (fewer than
  // eight) run a row at a time.
  const Activations acts =
      quantize_rows(x.data_ptr<float>(), x.stride(0), n, cols, is_k_quant(f) ? 256 : 32, false);
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / (cols * 8 * ((n + 3) / 4 * 4)));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    rows8_product(f, w, row_bytes, acts, o, n, rows, begin, end);
  });
  if (groups * 8 < rows) rows_product(f, w, row_bytes, bytes, acts, o, n, rows, groups * 8, rows);
  return out;
}

// ================================================ float activations: W dequantized in the dot
//
// y = x @ W.T with x as it is (float32): the dequantized matrix's product within float32
// summation error (the order is this kernel's own), the weights never held whole as floats.
// dequantize gives the float32 values of quant_formats.dequantize bit for bit (the same
// products of fp16 scales and small integers, each rounded on its own).
// matmul_float is the product for few rows of x (decode) or, at any count, the batch-invariant
// mode's: threads split W's rows; each group of 32 values is dequantized in registers (16 or 8
// float lanes) once per row of W and multiplied into the rows of x four at a time (one W row)
// or into one row (four W rows) by fused multiply-adds (the same operations for a row whatever
// its tile, so a row's output never depends on its batch). For many rows,
// kvgate/kernels/cpu/quant.py dequantizes W a chunk of rows at a time (dequantize below, the
// same registers stored) and multiplies by oneDNN's GEMM.

// One block's values, scalar: the reference for the vector path below (and the path without
// AVX2). s: the row's decoded scales (decode_row), b: the block's index.
void dequantize_block_scalar(Format f, const uint8_t* blk, const RowScales& s, int64_t b,
                             float* out) {
  const float d = s.d[b];
  switch (f) {
    case Format::Q8_0:
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
      return;
    case Format::Q4_0:
    case Format::Q4_1: {
      const uint8_t* qs = blk + (f == Format::Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        const int low = qs[i] & 0x0F, high = qs[i] >> 4;
        if (f == Format::Q4_0) {
          out[i] = d * static_cast<float>(low - 8);
          out[i + 16] = d * static_cast<float>(high - 8);
        } else {
          out[i] = d * static_cast<float>(low) + s.m[b];
          out[i + 16] = d * static_cast<float>(high) + s.m[b];
        }
      }
      return;
    }
    case Format::Q4_K:
    case Format::Q5_K: {
      const uint8_t* qs = blk + (f == Format::Q4_K ? 16 : 48);
      const uint8_t* qh = blk + 16;
      for (int c = 0; c < 4; ++c) {
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * c + half;
          const float scale = d * static_cast<float>(s.sc[b * 16 + j]);
          const float offset = s.m[b] * static_cast<float>(s.mins[b * 8 + j]);
          for (int i = 0; i < 32; ++i) {
            int q = half == 0 ? (qs[32 * c + i] & 0x0F) : (qs[32 * c + i] >> 4);
            if (f == Format::Q5_K) q |= ((qh[i] >> j) & 1) << 4;
            out[64 * c + 32 * half + i] = scale * static_cast<float>(q) - offset;
          }
        }
      }
      return;
    }
    case Format::Q6_K:
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk + 64 * h;
        const uint8_t* qh = blk + 128 + 32 * h;
        for (int g = 0; g < 4; ++g) {
          for (int i = 0; i < 32; ++i) {
            const int nibble = g < 2 ? (ql[32 * g + i] & 0x0F) : (ql[32 * (g - 2) + i] >> 4);
            const int q = nibble | (((qh[i] >> (2 * g)) & 3) << 4);
            const int j = 8 * h + 2 * g + i / 16;
            const float scale = d * static_cast<float>(s.sc[b * 16 + j]);
            out[128 * h + 32 * g + i] = scale * static_cast<float>(q - 32);
          }
        }
      }
      return;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kFloatVector = true;

// 32 bytes (unsigned, or signed for Q8_0) as four vectors of eight floats, in order.
template <bool kSigned>
inline void bytes_to_floats(__m256i v, __m256* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
  for (int h = 0; h < 2; ++h) {
    for (int e = 0; e < 2; ++e) {
      const __m128i eight = e == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
      const __m256i ints = kSigned ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      out[2 * h + e] = _mm256_cvtepi32_ps(ints);
    }
  }
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// Every format as groups of 32 values, each value scale q + offset (the scale of values 0-15
// and of 16-31 differ in Q6_K only; the offset is zero but in Q4_1, Q4_K and Q5_K). Block b's
// groups: fn(q, first, lo, hi, offset), q the group's integers as 32 signed bytes (every
// format's fit: -32..63), first its first value in the block.
template <Format f, typename Fn>
inline void block_groups(const uint8_t* blk, const RowScales& s, int64_t b, Fn&& fn) {
  const float d = s.d[b];
  if constexpr (f == Format::Q8_0) {
    fn(load32(blk + 2), 0, d, d, 0.0f);
  } else if constexpr (f == Format::Q4_0) {
    fn(_mm256_sub_epi8(unpack_q4(blk + 2), _mm256_set1_epi8(8)), 0, d, d, 0.0f);
  } else if constexpr (f == Format::Q4_1) {
    fn(unpack_q4(blk + 4), 0, d, d, s.m[b]);
  } else if constexpr (f == Format::Q4_K || f == Format::Q5_K) {
    for (int c = 0; c < 4; ++c) {
      __m256i halves[2];
      k45_chunk(f, blk, c, halves[0], halves[1]);
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        const float scale = d * static_cast<float>(s.sc[b * 16 + j]);
        fn(halves[half], 64 * c + 32 * half, scale, scale,
           -(s.m[b] * static_cast<float>(s.mins[b * 8 + j])));
      }
    }
  } else {
    for (int h = 0; h < 2; ++h) {
      __m256i groups[4];
      q6k_groups(blk, h, groups);
      for (int g = 0; g < 4; ++g) {
        const int j = 8 * h + 2 * g;
        fn(_mm256_sub_epi8(groups[g], _mm256_set1_epi8(32)), 128 * h + 32 * g,
           d * static_cast<float>(s.sc[b * 16 + j]), d * static_cast<float>(s.sc[b * 16 + j + 1]),
           0.0f);
      }
    }
  }
}

// A group's 32 values as quant_formats.dequantize computes them: scale q (+ offset where the
// format has one), each step rounded on its own; as kGroupVectors vectors of floats.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using FloatVector = __m512;
inline FloatVector vector_zero() { return _mm512_setzero_ps(); }
inline float vector_sum(FloatVector v) { return _mm512_reduce_add_ps(v); }
inline FloatVector vector_load(const float* p) { return _mm512_loadu_ps(p); }
inline void vector_store(float* p, FloatVector v) { _mm512_storeu_ps(p, v); }
inline FloatVector vector_fma(FloatVector a, FloatVector b, FloatVector c) {
  return _mm512_fmadd_ps(a, b, c);
}
template <bool kOffset>
inline void group_values(__m256i q, float lo, float hi, float offset, FloatVector* v) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int h = 0; h < 2; ++h) {
    v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(halves[h])),
                         _mm512_set1_ps(h == 0 ? lo : hi));
    if constexpr (kOffset) v[h] = _mm512_add_ps(v[h], _mm512_set1_ps(offset));
  }
}
#else
constexpr int kLanes = 8;
using FloatVector = __m256;
inline FloatVector vector_zero() { return _mm256_setzero_ps(); }
inline float vector_sum(FloatVector v) { return hsum_ps(v); }
inline FloatVector vector_load(const float* p) { return _mm256_loadu_ps(p); }
inline void vector_store(float* p, FloatVector v) { _mm256_storeu_ps(p, v); }
inline FloatVector vector_fma(FloatVector a, FloatVector b, FloatVector c) {
  return _mm256_fmadd_ps(a, b, c);
}
template <bool kOffset>
inline void group_values(__m256i q, float lo, float hi, float offset, FloatVector* v) {
  bytes_to_floats<true>(q, v);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_mul_ps(v[i], _mm256_set1_ps(i < 2 ? lo : hi));
    if constexpr (kOffset) v[i] = _mm256_add_ps(v[i], _mm256_set1_ps(offset));
  }
}
#endif
constexpr int kGroupVectors = 32 / kLanes;

template <Format f>
constexpr bool has_offset() {
  return f == Format::Q4_1 || f == Format::Q4_K || f == Format::Q5_K;
}

// R rows of W (from ``w``, scales decoded in s[0..R)) against T rows of x: out[t * os + r].
// Each group is dequantized once per row of W and multiplied into the T rows of x by fused
// multiply-adds, one accumulator per pair of rows: the same operations for a row of x whatever
// T is, so its output never depends on its batch.
template <Format f, int R, int T>
void fused_tile(const uint8_t* w, int64_t row_bytes, const RowScales* s, const float* x,
                int64_t k, float* out, int64_t os) {
  constexpr Layout lay = f == Format::Q8_0   ? Layout{32, 34}
                         : f == Format::Q4_0 ? Layout{32, 18}
                         : f == Format::Q4_1 ? Layout{32, 20}
                         : f == Format::Q4_K ? Layout{256, 144}
                         : f == Format::Q5_K ? Layout{256, 176}
                                             : Layout{256, 210};
  const int64_t nb = k / lay.values;
  FloatVector total[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) total[r][t] = vector_zero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      block_groups<f>(w + r * row_bytes + b * lay.bytes, s[r], b,
                      [&](__m256i q, int64_t first, float lo, float hi, float offset) {
        FloatVector v[kGroupVectors];
        group_values<has_offset<f>()>(q, lo, hi, offset, v);
        const float* xp = x + b * lay.values + first;
        for (int t = 0; t < T; ++t)
          for (int i = 0; i < kGroupVectors; ++i)
            total[r][t] = vector_fma(v[i], vector_load(xp + t * k + i * kLanes), total[r][t]);
      });
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * os + r] = vector_sum(total[r][t]);
}

template <Format f>
void dequantize_groups(const uint8_t* blk, const RowScales& s, int64_t b, float* out) {
  block_groups<f>(blk, s, b, [&](__m256i q, int64_t first, float lo, float hi, float offset) {
    FloatVector v[kGroupVectors];
    group_values<has_offset<f>()>(q, lo, hi, offset, v);
    for (int i = 0; i < kGroupVectors; ++i) vector_store(out + first + i * kLanes, v[i]);
  });
}

void dequantize_block(Format f, const uint8_t* blk, const RowScales& s, int64_t b, float* out) {
  switch (f) {
    case Format::Q8_0: return dequantize_groups<Format::Q8_0>(blk, s, b, out);
    case Format::Q4_0: return dequantize_groups<Format::Q4_0>(blk, s, b, out);
    case Format::Q4_1: return dequantize_groups<Format::Q4_1>(blk, s, b, out);
    case Format::Q4_K: return dequantize_groups<Format::Q4_K>(blk, s, b, out);
    case Format::Q5_K: return dequantize_groups<Format::Q5_K>(blk, s, b, out);
    case Format::Q6_K: return dequantize_groups<Format::Q6_K>(blk, s, b, out);
  }
}

// Rows [r0, r0 + R) of W against all n rows of x, scales decoded once per row.
template <Format f, int R>
void fused_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t n, int64_t k,
                float* out, int64_t rows, int64_t r0, RowScales* s) {
  constexpr int64_t values = f == Format::Q8_0 || f == Format::Q4_0 || f == Format::Q4_1 ? 32 : 256;
  const Layout lay = layout_of(f);
  for (int r = 0; r < R; ++r) decode_row(f, w + (r0 + r) * row_bytes, k / values, lay.bytes, s[r]);
  const uint8_t* wr = w + r0 * row_bytes;
  int64_t m = 0;
  if constexpr (R == 4) {  // a lone row of x: four rows of W, four independent sums
    for (; m < n; ++m)
      fused_tile<f, 4, 1>(wr, row_bytes, s, x + m * k, k, out + m * rows + r0, rows);
  } else {
    for (; m + 4 <= n; m += 4)
      fused_tile<f, R, 4>(wr, row_bytes, s, x + m * k, k, out + m * rows + r0, rows);
    for (; m < n; ++m)
      fused_tile<f, R, 1>(wr, row_bytes, s, x + m * k, k, out + m * rows + r0, rows);
  }
}

template <Format f>
void fused_product(const uint8_t* w, int64_t row_bytes, const float* x, int64_t n, int64_t k, float* out, int64_t rows, int64_t begin, int64_t end) {
  RowScales s[4];
  int64_t r = begin;
  if (n == 1) {
    for (; r + 4 <= end; r += 4) fused_rows<f, 4>(w, row_bytes, x, n, k, out, rows, r, s);
  }
  for (; r < end; ++r) fused_rows<f, 1>(w, row_bytes, x, n, k, out, rows, r, s);
}

void fused_any(Format f, const uint8_t* w, int64_t row_bytes, const float* x, int64_t n, int64_t k, float* out, int64_t rows, int64_t begin, int64_t end) {
  switch (f) {
    case Format::Q8_0: return fused_product<Format::Q8_0>(w, row_bytes, x, n, k, out, rows, begin, end);
    case Format::Q4_0: return fused_product<Format::Q4_0>(w, row_bytes, x, n, k, out, rows, begin, end);
    case Format::Q4_1: return fused_product<Format::Q4_1>(w, row_bytes, x, n, k, out, rows, begin, end);
    case Format::Q4_K: return fused_product<Format::Q4_K>(w, row_bytes, x, n, k, out, rows, begin, end);
    case Format::Q5_K: return fused_product<Format::Q5_K>(w, row_bytes, x, n, k, out, rows, begin, end);
    case Format::Q6_K: return fused_product<Format::Q6_K>(w, row_bytes, x, n, k, out, rows, begin, end);
  }
}
#else
constexpr bool kFloatVector = false;

void dequantize_block(Format f, const uint8_t* blk, const RowScales& s, int64_t b, float* out) {
  dequantize_block_scalar(f, blk, s, b, out);
}
#endif

// Row r of W (``row``, its blocks as stored) dequantized into out[0..k).
void dequantize_row(Format f, const uint8_t* row, int64_t k, bool vector, RowScales& s,
                    float* out) {
  const Layout lay = layout_of(f);
  const int64_t nb = k / lay.values;
  decode_row(f, row, nb, lay.bytes, s);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * lay.bytes;
    if (vector) {
      dequantize_block(f, blk, s, b, out + b * lay.values);
    } else {
      dequantize_block_scalar(f, blk, s, b, out + b * lay.values);
    }
  }
}

at::Tensor matmul_float(const at::Tensor& x_in, const at::Tensor& data, int64_t format,
                        int64_t cols) {
  const at::Tensor x = x_in.contiguous();
  const auto [f, bytes, row_bytes] = check_arguments(x, data, format, cols);
  (void)bytes;
  const int64_t n = x.size(0), rows = data.size(0), k = cols;
  at::Tensor out = at::empty({n, rows}, x.options());
  if (n == 0 || rows == 0) return out;
  const uint8_t* w = data.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // About 64k multiply-adds per task, as matmul's.
  const int64_t grain = std::max<int64_t>(4, 65536 / (k * n));
#if defined(__AVX2__) && defined(__FMA__)
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    fused_any(f, w, row_bytes, xp, n, k, o, rows, begin, end);
  });
#else
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> values(k);  // a row of W, dequantized
    RowScales s;
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row(f, w + r * row_bytes, k, false, s, values.data());
      for (int64_t m = 0; m < n; ++m) {
        float sum = 0.0f;
        for (int64_t i = 0; i < k; ++i) sum += values[i] * xp[m * k + i];
        o[m * rows + r] = sum;
      }
    }
  });
#endif
  return out;
}

// The float32 values of W (the dequantize-in-the-dot's own, for tests): vector or scalar path.
at::Tensor dequantize(const at::Tensor& data, int64_t format, int64_t cols, bool vector) {
  const at::Tensor x = at::empty({0, cols}, data.options().dtype(at::kFloat));
  const auto [f, bytes, row_bytes] = check_arguments(x, data, format, cols);
  (void)bytes;
  const int64_t rows = data.size(0);
  at::Tensor out = at::empty({rows, cols}, x.options());
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowScales s;
    for (int64_t r = begin; r < end; ++r)
      dequantize_row(f, w + r * row_bytes, cols, vector && kFloatVector, s, o + r * cols);
  });
  return out;
}

std::string isa() { return kIsa; }
bool has_rows8() { return kHasRows8; }

}  // namespace

TORCH_LIBRARY(kvgate_quant, m) {
  m.def("matmul(Tensor x, Tensor data, int format, int cols) -> Tensor", &matmul);
  m.def("matmul_rows8(Tensor x, Tensor data, int format, int cols) -> Tensor", &matmul_rows8);
  m.def("matmul_float(Tensor x, Tensor data, int format, int cols) -> Tensor", &matmul_float);
  m.def("dequantize(Tensor data, int format, int cols, bool vector) -> Tensor", &dequantize);
  m.def("isa() -> str", &isa);
  m.def("has_rows8() -> bool", &has_rows8);
}
