/*
 * stores.h - how the engine stores values apart from how a rule updates them (rules.h),
 * shared by the CPU kernels (step_cpu.c, tile_io.h, convert_cpu.c) and the CUDA kernels,
 * static inline for C11 and CUDA (PRECIS_HD): bf16 params' remainders (int16 halves and 8-bit corrections of a
 * master), stochastic rounding's keys and random numbers, and the moments' stored forms
 * (fp16 and fp8 codes in blocks of 128 with an fp32 scale each; docs/design.md
 * section 4).
 */
#ifndef PRECIS_STORES_H_
#define PRECIS_STORES_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "precis/precis.h"
#include "precis_convert.h"

/* ---- param remainders (docs/design.md section 4) ----------------------------- */

/* fp32 master bits hi:lo -> bf16 param = hi rounded to nearest (plus one when
 * lo, read as int16, is negative) and remainder = lo as int16. Exact both ways. */
static inline PRECIS_HD uint16_t precis_remainder_param(float master) {
  uint32_t u = precis_f32_bits(master);
  return (uint16_t)((u >> 16) + ((u >> 15) & 1u));
}

static inline PRECIS_HD int16_t precis_remainder_low(float master) {
  uint32_t lo = precis_f32_bits(master) & 0xFFFFu;
  return (int16_t)((int32_t)(lo ^ 0x8000u) - 0x8000); /* two's complement, no UB */
}

static inline PRECIS_HD float precis_remainder_master(uint16_t param, int16_t remainder) {
  uint32_t hi = (uint32_t)(uint16_t)(param - (remainder < 0 ? 1u : 0u));
  uint32_t lo = (uint32_t)(uint16_t)remainder;
  return precis_bits_f32((hi << 16) | lo);
}

/* 8-bit remainders (a 24-bit master: the bf16 param and one more byte of mantissa).
 * The fp32 master rounds to nearest even at bit 8 first (a NaN stays a quiet NaN,
 * never a carry into the sign); then the same split as above, one byte lower:
 * param = the 24-bit value's high half rounded to nearest, remainder = its low byte
 * as int8. Exact both ways for the 24-bit value. */
static inline PRECIS_HD uint32_t precis_master24_bits(float master) {
  uint32_t u = precis_f32_bits(master);
  uint32_t rounded = u + 0x7Fu + ((u >> 8) & 1u);
  return (master != master ? u | 0x00400000u : rounded) & 0xFFFFFF00u;
}

static inline PRECIS_HD uint16_t precis_remainder8_param(float master) {
  uint32_t u = precis_master24_bits(master);
  return (uint16_t)((u >> 16) + ((u >> 15) & 1u));
}

static inline PRECIS_HD int8_t precis_remainder8_low(float master) {
  uint32_t lo = (precis_master24_bits(master) >> 8) & 0xFFu;
  return (int8_t)((int32_t)(lo ^ 0x80u) - 0x80); /* two's complement, no UB */
}

static inline PRECIS_HD float precis_remainder8_master(uint16_t param, int8_t remainder) {
  uint32_t hi = (uint32_t)(uint16_t)(param - (remainder < 0 ? 1u : 0u));
  uint32_t lo = (uint32_t)(uint8_t)remainder;
  return precis_bits_f32((hi << 16) | (lo << 8));
}

/* ---- stochastic rounding fp32 -> bf16 ----------------------------------- */

/* A counter-based generator: the random number of an element depends only on
 * what the element is, never on how a call, thread or chunk reaches it: (seed,
 * the stream of its param, step, its index in the whole, unsharded param). So a
 * param stepped whole, in pieces (CPU offload), as an FSDP2 shard at any world
 * size, or as a slice with its global offset gets the same bits (docs/design.md
 * section 4). precis_sr_key mixes the seed, the stream and the step (host or
 * device, once per tensor); precis_sr_rand16 hashes in the low 32 bits of the
 * element's index with 32-bit integer ops only, which vectorize. The index's
 * high bits are in no key: elements 2^32 apart in one param share their random
 * numbers, which biases nothing (each rounding is unbiased on its own) and lets
 * a piece start anywhere, a 2^32 boundary inside a tile included. */
typedef struct precis_sr_key {
  uint32_t k0, k1;
} precis_sr_key_t;

static inline PRECIS_HD uint64_t precis_mix64(uint64_t x) { /* splitmix64 finalizer */
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

static inline PRECIS_HD uint32_t precis_hash32(uint32_t x) { /* "lowbias32", a bijection */
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

static inline PRECIS_HD precis_sr_key_t precis_sr_key(uint64_t seed, uint64_t stream,
                                                      int64_t step) {
  precis_sr_key_t k;
  uint64_t h = precis_mix64(seed + 0x9E3779B97F4A7C15ull);
  h = precis_mix64(h ^ stream);
  h = precis_mix64(h ^ (uint64_t)step);
  k.k0 = (uint32_t)h;
  k.k1 = (uint32_t)(h >> 32);
  return k;
}

/* Uniform in [0, 65535] for element index (low 32 bits) i. */
static inline PRECIS_HD uint32_t precis_sr_rand16(precis_sr_key_t k, uint32_t i) {
  return precis_hash32(precis_hash32(i + k.k0) ^ k.k1) >> 16;
}

/* Add the random 16 bits below the kept ones and truncate: rounds up with
 * probability (dropped bits) / 2^16, so E[result] = x within a binade. Inf
 * stays inf; NaN gets round-to-nearest's code (its sign and top payload bits,
 * quiet), never a carry into the sign bit. Written as precis_f32_to_bf16_rn's
 * select: one compare and one select per vector, where the round-to-nearest
 * path computed in full cost a vector loop five more operations. */
static inline PRECIS_HD uint16_t precis_f32_to_bf16_sr(float x, uint32_t rand16) {
  uint32_t u = precis_f32_bits(x);
  uint32_t r = x != x ? u | 0x00400000u : u + rand16;
  return (uint16_t)(r >> 16);
}

/* ---- unbiased moment stores (docs/design.md section 4) ------------------- */

/* A moment whose format cannot hold one step's change is stored with stochastic
 * rounding, so that its expected value is AdamW's: v always (its decay by
 * 1 - beta2 per step is below half a bf16 / fp16 / fp8 spacing, and rounding to
 * nearest would keep v from decaying), m in fp8 (m8's neighbours are 1.6-3.1%
 * apart, and a step, 10% of the gap to g, is below half of that wherever g is
 * within 8-16% of m: rounding to nearest would drop it). Adam's bf16 and fp16 m
 * round to nearest (the step moves m by 10% of the gap to g, many spacings), and so
 * do AMSGrad's max (a max, not an average) and precis_moment_encode (one store).
 * The one-state rules' momentum (rule not Adam) rounds stochastically in every
 * dtype but fp32: Lion's moves by 1% of the gap to g (beta2 0.99), Muon's by 5%,
 * SGD's settles at g / (1 - momentum), and on a steady gradient rounding to nearest
 * left bf16 momentum 0.785x (Lion), 0.950x (Muon), 0.976x (SGD) of fp32's
 * (bench/momentum_fidelity.py, docs/design.md section 4). */
static inline PRECIS_HD int precis_moment_store_sr(int dtype, int second, int rule) {
  if (dtype == PRECIS_DTYPE_FP32) return 0;
  return rule != PRECIS_RULE_ADAM || second || dtype == PRECIS_DTYPE_FP8_E4M3;
}

/* The moments' random stream, apart from the params' (precis_sr_key). */
enum { PRECIS_STREAM_MOMENTS = 1 };

/* The moments' key of the param of stream `stream`. The step is not in it
 * (precis_moment_rand adds it): its slot holds -PRECIS_STREAM_MOMENTS, which no
 * step (>= 1) takes, so it differs from the params' keys for every stream,
 * whatever its bits. */
static inline PRECIS_HD precis_sr_key_t precis_moment_key(uint64_t seed, uint64_t stream) {
  return precis_sr_key(seed, stream, -(int64_t)PRECIS_STREAM_MOMENTS);
}

#define PRECIS_WEYL32 0x9E3779B9u /* 2^32 / golden ratio */

/* The one hash of element i (low 32 bits of its index) per step, which feeds
 * both moments' roundings: m takes its low 16 bits, v its high 16 (one hash per
 * moment was most of an fp8 step's arithmetic). The hash is a bijection of i, so
 * over 2^32 elements every pair of halves comes once: the halves are independent
 * and uniform, and m's rounding is uncorrelated with v's (docs/design.md
 * section 4). */
static inline PRECIS_HD uint32_t precis_moment_hash(precis_sr_key_t k, uint32_t i) {
  return precis_hash32(i + k.k0) ^ k.k1;
}

/* The r (uniform in [0, 2^32)) of moment `second` (0: m, 1: v) at step: its 16
 * bits of the element's hash on top, plus step * 2^32/golden ratio (a Weyl
 * sequence). At every step the top 16 bits are uniform across elements and the
 * low 16 a constant of the step, so a rounding that drops more than 16 bits is
 * biased by at most 2^-16 of a spacing (m8 and v8 drop 18), and not at all
 * over the steps; bf16 and fp16 drop 16 and 13. Over
 * one element's steps r is evenly spread rather than independent, so the
 * rounding errors of successive stores partly cancel instead of adding up like a
 * random walk: the spread of fp8 sqrt(v) around AdamW's shrinks by a fifth
 * (docs/design.md section 4). */
static inline PRECIS_HD uint32_t precis_moment_rand(uint32_t hash, int second, int64_t step) {
  uint32_t half = second ? hash & 0xFFFF0000u : hash << 16;
  return half + (uint32_t)step * PRECIS_WEYL32;
}

/* ---- unsigned minifloat codes ------------------------------------------- */

/* code = e << mb | mantissa with exponent bias `bias`; e = 0 is subnormal
 * (mantissa * 2^(1 - bias - mb)); no inf, no NaN. Used for the magnitudes of
 * fp16 and fp8 E4M3 and for the fp8 moments' own codes (below). */
static inline PRECIS_HD float precis_ufloat_to_f32(uint32_t code, int mb, int bias) {
  float sub = (float)(int32_t)(code & ((1u << mb) - 1u)) *
              precis_bits_f32((uint32_t)(127 + 1 - bias - mb) << 23);
  uint32_t normal = (code << (23 - mb)) + ((uint32_t)(127 - bias) << 23);
  /* A mask, not a select: gcc vectorizes this form in every loop it is inlined
   * into (a ternary kept bench/adam_reference_loop.c's fp8 loop scalar, 2.5x slower),
   * and the int32 conversion is AVX2's (no unsigned one before AVX-512). */
  uint32_t is_sub = 0u - (uint32_t)((code >> mb) == 0);
  return precis_bits_f32((precis_f32_bits(sub) & is_sub) | (normal & ~is_sub));
}

/* a >= 0 -> code rounded to nearest even, saturating at max_code (so do inf
 * and NaN: a NaN moment shows through its block's NaN scale). */
static inline PRECIS_HD uint32_t precis_f32_to_ufloat_rn(float a, int mb, int bias,
                                                          uint32_t max_code) {
  const int drop = 23 - mb;
  uint32_t u = precis_f32_bits(a);
  uint32_t normal =
      (u - ((uint32_t)(127 - bias) << 23) + ((1u << (drop - 1)) - 1u) + ((u >> drop) & 1u)) >> drop;
  /* subnormal: adding 2^(24 - bias - mb), whose ulp is the subnormal step, makes
   * the FPU round to nearest even */
  float magic = precis_bits_f32((uint32_t)(127 + 24 - bias - mb) << 23);
  uint32_t sub = precis_f32_bits(a + magic) - precis_f32_bits(magic);
  uint32_t is_sub = 0u - (uint32_t)(u < ((uint32_t)(128 - bias) << 23)); /* a mask: see above */
  uint32_t code = (sub & is_sub) | (normal & ~is_sub);
  return code > max_code ? max_code : code;
}

/* a >= 0 -> code rounded up with probability (a - lo) / (hi - lo) for r
 * uniform in [0, 2^32): E[decoded code] = a below max_code, which saturates
 * (so do inf and NaN). a is written in fixed point with `drop` bits below the
 * code's last place, r's top `drop` bits are added, and the fraction is
 * truncated: integer ops only, which vectorize. Normals are their bits less the
 * bias; subnormals the bits that adding the smallest normal 2^(1 - bias) gains
 * (its ulp is 2^-drop of a subnormal step, so the FPU rounds a onto that grid:
 * a bias of at most 2^-(drop + 1) of a step, far below precis_moment_rand's
 * 2^-16). */
static inline PRECIS_HD uint32_t precis_f32_to_ufloat_sr(float a, uint32_t r, int mb, int bias,
                                                          uint32_t max_code) {
  const int drop = 23 - mb;
  const uint32_t min_normal = (uint32_t)(128 - bias) << 23;
  uint32_t u = precis_f32_bits(a);
  uint32_t normal = u - ((uint32_t)(127 - bias) << 23);
  uint32_t sub = precis_f32_bits(a + precis_bits_f32(min_normal)) - min_normal;
  uint32_t below = 0u - (uint32_t)(u < min_normal); /* a mask: see precis_ufloat_to_f32 */
  uint32_t fixed = (sub & below) | (normal & ~below);
  uint32_t code = (fixed + (r >> (32 - drop))) >> drop;
  return code > max_code ? max_code : code;
}

/* ---- block-scaled moments (fp16, fp8) ----------------------------------- */

#define PRECIS_FP16_MAX 65504.0f

/* fp8 second moments are stored as sqrt(v) / s in a code of their own, "v8":
 * unsigned E3M5 (v is never negative: E4M3's sign bit would be wasted), bias 1,
 * so 5 mantissa bits (neighbours 1.6-3.1% apart, against E4M3's 6-12%) over
 * 7 binades (126 down to 1) plus 31 subnormal steps of 2^-5. With stochastic
 * rounding E4M3 left sqrt(v) 0.79-1.20x of AdamW's (p10-p90), v8 0.91-1.09x
 * (docs/design.md section 4). */
#define PRECIS_V8_MBITS 5
#define PRECIS_V8_BIAS 1
#define PRECIS_V8_MAX 126.0f
#define PRECIS_V8_MAX_CODE 0xFFu

static inline PRECIS_HD float precis_v8_to_f32(uint8_t code) {
  return precis_ufloat_to_f32(code, PRECIS_V8_MBITS, PRECIS_V8_BIAS);
}

/* fp8 first moments are stored as m / s in "m8": signed E2M5 (a sign bit and
 * v8's magnitudes less its top binade), bias 1, max 7.875, subnormals, no inf
 * or NaN codes. Its 5 mantissa bits (neighbours 1.6-3.1% apart) cut E4M3's
 * median relative error on real gradients from 5.6% to 1.68%; its 3 binades
 * plus subnormals (2^-5 of s) cover what a 128-element block of m spans
 * (docs/design.md section 4). */
#define PRECIS_M8_MBITS 5
#define PRECIS_M8_BIAS 1
#define PRECIS_M8_MAX 7.875f
#define PRECIS_M8_MAX_CODE 0x7Fu /* of the magnitude */

static inline PRECIS_HD float precis_m8_to_f32(uint8_t code) {
  float a = precis_ufloat_to_f32(code & 0x7Fu, PRECIS_M8_MBITS, PRECIS_M8_BIAS);
  return precis_bits_f32(precis_f32_bits(a) | ((uint32_t)(code & 0x80u) << 24));
}

/* m8's code of q = m / s, by its magnitude's code mag (rounded either way): the
 * sign of q on top, so -0 stays -0; a NaN q takes the largest magnitude (the
 * moment shows through its block's NaN scale). */
static inline PRECIS_HD uint8_t precis_m8_code(float q, uint32_t mag) {
  uint32_t u = precis_f32_bits(q);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint8_t)PRECIS_M8_MAX_CODE
                                         : (uint8_t)(((u >> 24) & 0x80u) | mag);
}

/* Stored bits of dtype -> fp32; for a moment, before its block scale: fp8 is
 * m8 (m) or v8 (second). The CUDA kernels' one conversion on load. */
static inline PRECIS_HD float precis_moment_code_f32(int dtype, int second, uint32_t bits) {
  switch (dtype) {
    case PRECIS_DTYPE_FP32: return precis_bits_f32(bits);
    case PRECIS_DTYPE_FP16: return precis_f16_to_f32((uint16_t)bits);
    case PRECIS_DTYPE_BF16: return precis_bf16_to_f32((uint16_t)bits);
    default:
      return second ? precis_v8_to_f32((uint8_t)bits) : precis_m8_to_f32((uint8_t)bits);
  }
}

/* Largest finite value of a scaled moment's code. */
static inline PRECIS_HD float precis_moment_max(int is_fp8, int second) {
  return is_fp8 ? (second ? PRECIS_V8_MAX : PRECIS_M8_MAX) : PRECIS_FP16_MAX;
}

/* Blocks whose amax is below this are stored as zeros with s = 0, so that
 * max_representable / amax below stays finite. Only a first moment can be that
 * small: a non-zero fp32 v is >= 2^-149, so sqrt(v) >= 2^-74.5. */
#define PRECIS_MOMENT_AMAX_MIN 7.88860905221011805e-31f /* 2^-100 */

/* s = amax / max_representable; amax is max |m| or max sqrt(v) of the block.
 * An all-zero block gives s = 0; a NaN amax gives a NaN s (the state is lost,
 * and says so rather than turning into zeros). */
static inline PRECIS_HD float precis_block_scale(float amax, int is_fp8, int second) {
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? amax / precis_moment_max(is_fp8, second) : 0.0f;
}

/* What quantizing multiplies by: max_representable / amax (one division per
 * block instead of one per element), or 0 for a zero block, whose values are
 * all 0 (or below 2^-100) and must come out as 0, never 0 * inf = NaN. */
static inline PRECIS_HD float precis_block_multiplier(float amax, int is_fp8, int second) {
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? precis_moment_max(is_fp8, second) / amax : 0.0f;
}

/* For the second moment (x = sqrt(v) >= 0) a positive value never becomes
 * zero: it rounds up to the smallest subnormal code, so m / (sqrt(v) + eps)
 * stays bounded. q is the value before rounding, code its rounding. */
static inline PRECIS_HD uint16_t precis_moment_keep_f16(uint16_t code, float q, int second) {
  return ((second != 0) & (q > 0.0f) & (code == 0)) ? (uint16_t)1 : code; /* &: vectorizes */
}

static inline PRECIS_HD uint8_t precis_moment_keep_fp8(uint8_t code, float q, int second) {
  return ((second != 0) & (q > 0.0f) & (code == 0)) ? (uint8_t)1 : code; /* &: vectorizes */
}

/* Quantize one value to nearest: x * multiplier (~ x / s), rounded to nearest
 * even; fp8 m to m8, fp8 v to v8. */
static inline PRECIS_HD uint16_t precis_moment_q_f16(float x, float multiplier, int second) {
  float q = x * multiplier;
  return precis_moment_keep_f16(precis_f32_to_f16_rn(q), q, second);
}

static inline PRECIS_HD uint8_t precis_moment_q_fp8(float x, float multiplier, int second) {
  float q = x * multiplier;
  /* v8 takes |q|: sqrt(v) may be -0 */
  float a = precis_bits_f32(precis_f32_bits(q) & 0x7FFFFFFFu);
  uint8_t code = second ? (uint8_t)precis_f32_to_ufloat_rn(a, PRECIS_V8_MBITS, PRECIS_V8_BIAS,
                                                           PRECIS_V8_MAX_CODE)
                        : precis_m8_code(q, precis_f32_to_ufloat_rn(a, PRECIS_M8_MBITS,
                                                                    PRECIS_M8_BIAS,
                                                                    PRECIS_M8_MAX_CODE));
  return precis_moment_keep_fp8(code, q, second);
}

/* The same with stochastic rounding (precis_f32_to_ufloat_sr on the magnitude;
 * r from precis_moment_rand). NaN takes the round-to-nearest code. */
static inline PRECIS_HD uint16_t precis_moment_sr_f16(float x, float multiplier, int second,
                                                      uint32_t r) {
  float q = x * multiplier;
  uint32_t u = precis_f32_bits(q);
  uint32_t mag = precis_f32_to_ufloat_sr(precis_bits_f32(u & 0x7FFFFFFFu), r, 10, 15, 0x7BFFu);
  uint16_t code = (u & 0x7FFFFFFFu) > 0x7F800000u ? precis_f32_to_f16_rn(q)
                                                   : (uint16_t)(((u >> 16) & 0x8000u) | mag);
  return precis_moment_keep_f16(code, q, second);
}

static inline PRECIS_HD uint8_t precis_moment_sr_fp8(float x, float multiplier, int second,
                                                     uint32_t r) {
  float q = x * multiplier;
  float a = precis_bits_f32(precis_f32_bits(q) & 0x7FFFFFFFu);
  uint8_t code = second ? (uint8_t)precis_f32_to_ufloat_sr(a, r, PRECIS_V8_MBITS, PRECIS_V8_BIAS,
                                                           PRECIS_V8_MAX_CODE)
                        : precis_m8_code(q, precis_f32_to_ufloat_sr(a, r, PRECIS_M8_MBITS,
                                                                    PRECIS_M8_BIAS,
                                                                    PRECIS_M8_MAX_CODE));
  return precis_moment_keep_fp8(code, q, second);
}

/* Dequantize: m = q * s; v = (q * s)^2 for the second moment. */
static inline PRECIS_HD float precis_moment_dq(float q, float scale, int second) {
  float x = q * scale;
  return second ? x * x : x;
}

#endif /* PRECIS_STORES_H_ */
