/*
 * adam_reference_loop.c - the "hardware limit" of bench/adam_cpu.py.
 *
 * Plain C loops that do torch 2.13's fp32 AdamW arithmetic (torch.optim.adam.
 * _single_tensor_adam with decoupled weight decay; the fused CPU kernel does the
 * same operations in the same order):
 *
 *   param.mul_(1 - lr * wd)
 *   exp_avg.lerp_(grad, 1 - beta1)                  one FMA: m + w * (g - m) when
 *                                                   w < 0.5, else g + (w - 1) * (g - m)
 *   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
 *   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
 *   param.addcdiv_(exp_avg, denom, value=-step_size)
 *
 * with IEEE sqrtf; where m or v is stored in fewer bits than fp32 (every row but fp32)
 * the denominator is precis_adam_param's one-division form, fma(sqrt, 1 /
 * bias_correction2_sqrt, eps), as the kernels take it. (torch's for-loop takes MKL's
 * vmsSqrt on x86, which precis takes
 * too by default, for torch's bits; bench/adam_cpu.py also times precis with IEEE
 * sqrt, PRECIS_CPU_SQRT=ieee, which is this loop's arithmetic exactly.)
 *
 * over arrays of the dtypes a precis policy keeps, so each loop reads and writes
 * exactly the bytes per parameter that policy must move:
 *
 *   fp32              p, g, m, v fp32                  read 16, write 12 = 28
 *   bf16 default      g bf16, master fp32, m, v bf16;  read 10, write 10 = 20
 *                     bf16 param written (RNE)
 *   bf16 checked      bf16 default that first reads the bf16 param and takes it
 *                     as the master where it is not the master's rounding (a write
 *                     behind the optimizer's back seen in the loop itself: the least
 *                     a step that sees loads can add)   read 12, write 10 = 22
 *   bf16 tile records bf16 default with one 64-bit record per tile of 4,096
 *                     elements (a sixth buffer, uint64, ceil(numel / 4096)
 *                     entries, tile j = elements [4096 j, 4096 (j + 1)) of its
 *                     tensor): per tile, fingerprint the bf16 params as found
 *                     (8 KiB, left in L1), compare with the tile's record, run the
 *                     plain update where they match and the checked one where not,
 *                     then store the fingerprint of the tile as written: writes
 *                     behind the optimizer's back seen a tile at a time
 *                                          read 12 + 1/512, write 10 + 1/512 = 22.004
 *   bf16 remainders   g, param bf16, int16 remainder,  read 10, write 8  = 18
 *                     m, v bf16 (master = param:remainder)
 *   bf16 fp8 moments  g bf16, master fp32, m, v fp8    read 8 + scales, write 8 + scales
 *                     (m in precis's signed E2M5 "m8", v as sqrt(v) in its
 *                     unsigned E3M5 "v8"),
 *                     one fp32 scale per 128 elements (m: max |m| / 7.875,
 *                     v: max sqrt(v) / 126), bf16 param written         = 16.125
 *   fp8 + remainders  the same with the param read and written and an int16
 *                     remainder instead of the fp32 master              = 14.125
 *   fp8 + 8-bit rem.  ... and a one-byte remainder (a 24-bit master)    = 12.125
 *
 * and precis's moment stores: v in bf16, fp16 and v8, and m in m8, rounded
 * stochastically with precis's own draw and encoder (csrc/stores.h's
 * precis_moment_hash, precis_moment_rand: one hash per element and step for both
 * moments, a fixed key here, step from the consts; precis_f32_to_ufloat_sr); bf16
 * and fp16 m, param and fp32 round to nearest or are exact.
 *
 * ref_streams_step runs the same streams with one integer op per element in place
 * of the arithmetic: a plain loop's time for a policy's bytes alone. ref_arith_step
 * runs the arithmetic alone: the same loop over data that stay in L1. ref_rule_step
 * (the end of the file) runs the one-state rules' loops: SGD, Lion, Muon's momentum
 * and its apply, for bench/rules_cpu.py.
 *
 * Nothing else: no argument checks, no finite checks (NaN and inf are not kept). The
 * work of all tensors of a step is one OpenMP parallel region: the tensors' 128-
 * element blocks are split evenly over omp_get_max_threads() threads (set by the
 * caller with ref_set_num_threads, the same count torch and precis use), each
 * thread runs over its contiguous run of blocks, tensor by tensor (bf16 tile records:
 * each thread's ends moved up to a tile boundary of their tensor, thread_blocks).
 *
 * Built at run time by bench/adam_cpu.py with
 *   gcc -std=c11 -O3 -march=native -fopenmp -fno-math-errno -fPIC -shared
 *       -I csrc -I csrc/include
 * (-fno-math-errno only lets sqrtf vectorize; -std=c11 keeps GCC from fusing a*b+c
 * anywhere but the explicit fmaf calls, as in torch's kernels).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "stores.h" /* the moments' random numbers, minifloat codecs and rounding; the rest is here */
#include "fingerprint.h" /* pr_fp_words, pr_fp_tail, pr_fp_length: the tile records' sums */

#define BLOCK 128 /* fp8 scale block, as PRECIS_SCALE_BLOCK */
#define AMAX_MIN 7.88860905221011805e-31f /* 2^-100: smaller blocks are stored as zeros */

enum {
  REF_FP32 = 0,
  REF_BF16 = 1,
  REF_BF16_REMAINDERS = 2,
  REF_BF16_FP8 = 3,
  REF_BF16_FP8_REMAINDERS = 4,
  REF_BF16_FP16 = 5,
  REF_BF16_FP8_REMAINDERS8 = 6,
  REF_BF16_CHECKED = 7, /* REF_BF16 seeing loads; no streams loop of its own */
  REF_BF16_TILE_RECORDS = 8, /* REF_BF16 seeing loads a tile at a time; no streams loop */
  REF_COUNT = 9
};
#define TILE 4096 /* REF_BF16_TILE_RECORDS: elements per record */
#define TILE_BLOCKS (TILE / BLOCK)
#define FP16_MAX 65504.0f

/* Per-step constants, each rounded to float once from torch's Python floats. */
typedef struct ref_consts {
  float decay;         /* 1 - lr * wd */
  float lerp_coef;     /* w = 1 - beta1, or w - 1 when lerp_from_g */
  int32_t lerp_from_g; /* |w| >= 0.5 */
  float beta2, one_minus_beta2;
  float bias2_sqrt;    /* (1 - beta2^step) ** 0.5 */
  float inv_bias2_sqrt; /* 1 / bias2_sqrt in float, set by the loop (ref_inverse) */
  float neg_step_size; /* -(lr / (1 - beta1^step)) */
  float eps;
  uint32_t step;       /* the step's number, for the moments' random numbers */
} ref_consts_t;

void ref_set_num_threads(int n) { omp_set_num_threads(n); }
int ref_get_max_threads(void) { return omp_get_max_threads(); }

/* ---- dtype conversions (bits only, so the loops vectorize) --------------- */

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
  uint32_t u = f32_bits(f);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The minifloat codecs are stores.h's (precis_ufloat_to_f32, _rn, _sr, and m8 / v8
 * on them): the kernel's own, in the mask form gcc vectorizes here too (a ternary's
 * float add kept the stochastic stores scalar under -ftrapping-math, 2026-11-26). */

/* fp16 moments: m signed, to nearest; sqrt(v) stochastically, never 0 when positive. */
static inline uint16_t m_to_f16_rn(float x, float mul) {
  uint32_t u = f32_bits(x * mul);
  return (uint16_t)(((u >> 16) & 0x8000u) |
                    precis_f32_to_ufloat_rn(bits_f32(u & 0x7FFFFFFFu), 10, 15, 0x7BFFu));
}

static inline uint16_t sqrt_v_to_f16_sr(float x, float mul, uint32_t r) {
  float q = x * mul;
  uint32_t code = precis_f32_to_ufloat_sr(bits_f32(f32_bits(q) & 0x7FFFFFFFu), r, 10, 15, 0x7BFFu);
  return (uint16_t)((q > 0.0f) & (code == 0) ? 1u : code);
}

static inline float f16_to_f32(uint16_t h) { /* finite codes only: moments never hold inf */
  return bits_f32(f32_bits(precis_ufloat_to_f32(h & 0x7FFFu, 10, 15)) |
                  ((uint32_t)(h & 0x8000u) << 16));
}

/* The moments' fp8 codes, stochastically rounded: x * mul (~ x / block scale);
 * m signed in m8; v as sqrt(v) in v8, never 0 when positive. */
static inline uint8_t m_to_fp8_sr(float x, float mul, uint32_t r) {
  uint32_t u = f32_bits(x * mul);
  uint32_t mag = precis_f32_to_ufloat_sr(bits_f32(u & 0x7FFFFFFFu), r, 5, 1, 0x7Fu);
  return (uint8_t)(((u >> 24) & 0x80u) | mag);
}

static inline uint8_t sqrt_v_to_v8_sr(float x, float mul, uint32_t r) {
  float q = x * mul;
  /* |q|: sqrt(v) may be -0 */
  uint32_t code = precis_f32_to_ufloat_sr(bits_f32(f32_bits(q) & 0x7FFFFFFFu), r, 5, 1, 0xFFu);
  return (uint8_t)((q > 0.0f) & (code == 0) ? 1u : code); /* &, not &&: vectorizes */
}

/* ---- the moments' random numbers (precis_moment_hash, _rand) --------------- */

static const precis_sr_key_t MOMENT_KEY = {0x243F6A88u, 0x85A308D3u};

/* bf16 v: add 16 random bits below the kept ones and truncate. */
static inline uint16_t v_to_bf16_sr(const ref_consts_t* c, float v, int64_t i) {
  uint32_t r = precis_moment_rand(precis_moment_hash(MOMENT_KEY, (uint32_t)i), 1, c->step);
  return (uint16_t)((f32_bits(v) + (r >> 16)) >> 16);
}

/* ---- torch's AdamW element update ------------------------------------------ */

/* Updates p, m, v in place; returns sqrt(new v) (the fp8 loop needs it). torch_form:
 * torch's denominator (fp32 moments); else precis_adam_param's one division, as the
 * kernels take it for moments stored in fewer bits. */
static inline float adamw(const ref_consts_t* c, int torch_form, float g, float* p, float* m,
                          float* v) {
  float pp = *p * c->decay;                                /* param.mul_ */
  float mm = fmaf(c->lerp_coef, g - *m, c->lerp_from_g ? g : *m); /* exp_avg.lerp_ */
  float vv = fmaf(c->one_minus_beta2 * g, g, *v * c->beta2); /* mul_ + addcmul_ */
  float sq = sqrtf(vv);
  float denom = torch_form ? sq / c->bias2_sqrt + c->eps  /* sqrt / bc2_sqrt + eps */
                           : fmaf(sq, c->inv_bias2_sqrt, c->eps);
  *p = pp + (c->neg_step_size * mm) / denom;               /* addcdiv_ */
  *m = mm;
  *v = vv;
  return sq;
}

/* The step's constants with inv_bias2_sqrt made as precis_step_consts_make makes it. */
static ref_consts_t ref_inverse(const ref_consts_t* consts) {
  ref_consts_t c = *consts;
  c.inv_bias2_sqrt = 1.0f / c.bias2_sqrt;
  return c;
}

/* ---- one contiguous run [lo, hi) of one tensor, per policy ----------------- */

static void run_fp32(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  float* restrict p = (float*)t[0];
  const float* restrict g = (const float*)t[1];
  float* restrict m = (float*)t[2];
  float* restrict v = (float*)t[3];
  for (int64_t i = lo; i < hi; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    (void)adamw(c, 1, g[i], &pi, &mi, &vi);
    p[i] = pi; m[i] = mi; v[i] = vi;
  }
}

/* The master of element i: fp32 (rem 0), param:remainder (rem 1: int16; rem 2:
 * 8-bit, a 24-bit master), with stores.h's splits, as the kernels store them. */
static inline float load_master(const void* master, const uint16_t* param, int rem, int64_t i) {
  if (rem == 1) return precis_remainder_master(param[i], ((const int16_t*)master)[i]);
  if (rem == 2) return precis_remainder8_master(param[i], ((const int8_t*)master)[i]);
  return ((const float*)master)[i];
}

static inline void store_master(void* master, uint16_t* param, int rem, int64_t i, float p) {
  if (rem == 1) {
    param[i] = precis_remainder_param(p);
    ((int16_t*)master)[i] = precis_remainder_low(p);
  } else if (rem == 2) {
    param[i] = precis_remainder8_param(p);
    ((int8_t*)master)[i] = precis_remainder8_low(p);
  } else {
    ((float*)master)[i] = p;
    param[i] = f32_to_bf16(p);
  }
}

/* bf16 moments; master fp32 (t: param bf16 written, grad bf16, master, m, v) or
 * param:remainder (rem = 1; t: param read and written, grad, remainder int16, m, v).
 * checked (fp32 master only): the param is read too, and taken as the master where it
 * is not the master's rounding. rem and checked are constants after inlining. */
static inline __attribute__((always_inline)) void run_bf16_moments(const ref_consts_t* c,
                                                                   void* const* t, int64_t lo,
                                                                   int64_t hi, int rem,
                                                                   int checked) {
  uint16_t* restrict param = (uint16_t*)t[0];
  const uint16_t* restrict g = (const uint16_t*)t[1];
  void* restrict master = t[2];
  uint16_t* restrict m = (uint16_t*)t[3];
  uint16_t* restrict v = (uint16_t*)t[4];
  for (int64_t i = lo; i < hi; ++i) {
    float pi = load_master(master, param, rem, i), mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
    if (checked && param[i] != f32_to_bf16(pi)) pi = bf16_to_f32(param[i]);
    (void)adamw(c, 0, bf16_to_f32(g[i]), &pi, &mi, &vi);
    store_master(master, param, rem, i, pi);
    m[i] = f32_to_bf16(mi);
    v[i] = v_to_bf16_sr(c, vi, i);
  }
}

static void run_bf16(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  run_bf16_moments(c, t, lo, hi, 0, 0);
}

static void run_bf16_checked(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  run_bf16_moments(c, t, lo, hi, 0, 1);
}

static void run_bf16_remainders(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  run_bf16_moments(c, t, lo, hi, 1, 0);
}

/* The record of the tile [t0, t1) of a bf16 tensor (t0 a multiple of TILE; t1 the next
 * one or the tensor's end): precis_fingerprint's terms of the tile's words, with word
 * indices counted from the tensor's start (fingerprint.h's pr_fp_words over words
 * [t0 / 4, t1 / 4), two adds a word), plus, where the tensor's bytes end mid-word (t1 %
 * 4 != 0, only at its end), the zero-padded last word's term (pr_fp_tail less the
 * length's term; 0 otherwise). So a tensor's records sum to precis_fingerprint of its
 * bytes less pr_fp_length(2 numel): a tile's record is that sum over the prefix up to
 * t1 less the one up to t0 (ref_fingerprint, the check's). */
static inline uint64_t tile_record(const uint16_t* param, int64_t t0, int64_t t1) {
  const unsigned char* buf = (const unsigned char*)param;
  return pr_fp_words(buf, t0 / 4, t1 / 4) + (pr_fp_tail(buf, 2 * t1) - pr_fp_length(2 * t1));
}

/* REF_BF16_TILE_RECORDS's AdamW loop over [lo, hi) (lo a multiple of TILE, hi one or the
 * tensor's end: the thread split's, thread_blocks with tiles): per tile, the params'
 * record as found against the stored one (t[5]); equal, the plain update (REF_BF16's
 * loop), else the element-by-element checked one (REF_BF16_CHECKED's); then the record
 * of the params as written, read back from L1. */
static void run_bf16_tiles(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  const uint16_t* param = (const uint16_t*)t[0];
  uint64_t* records = (uint64_t*)t[5];
  for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
    int64_t t1 = t0 + TILE < hi ? t0 + TILE : hi;
    if (tile_record(param, t0, t1) == records[t0 / TILE]) {
      run_bf16_moments(c, t, t0, t1, 0, 0);
    } else {
      run_bf16_moments(c, t, t0, t1, 0, 1);
    }
    records[t0 / TILE] = tile_record(param, t0, t1);
  }
}

/* precis_fingerprint of one range of bytes less its length's term (fingerprint.h): a
 * sum of terms over the range's words, so a piece's share is a difference of two
 * prefixes'. The checks' expected tile records (bench/adam_cpu.py, rules_cpu.py). */
uint64_t ref_fingerprint(const void* buf, int64_t nbytes) {
  const unsigned char* b = (const unsigned char*)buf;
  return pr_fp_words(b, 0, nbytes / 8) + (pr_fp_tail(b, nbytes) - pr_fp_length(nbytes));
}

/* One scale block [b0, b0 + n) of a tensor with scaled moments (fp8: 1 byte,
 * else fp16): decode m, v, update, new block scales from max |m| and max
 * sqrt(v), encode. The master is fp32 or param:remainder (rem). fp8 and rem are
 * constants after inlining. t: param bf16, grad bf16, master fp32 or remainder
 * int16, m, v, m scales, v scales. */
static inline __attribute__((always_inline)) void scaled_block(const ref_consts_t* c,
                                                               void* const* t, int64_t b0,
                                                               int64_t n, int fp8, int rem) {
  const int esz = fp8 ? 1 : 2;
  uint16_t* restrict param = (uint16_t*)t[0] + b0;
  const uint16_t* restrict g = (const uint16_t*)t[1] + b0;
  void* restrict master = (char*)t[2] + b0 * (rem == 2 ? 1 : rem ? 2 : 4);
  void* restrict mq = (char*)t[3] + b0 * esz;
  void* restrict vq = (char*)t[4] + b0 * esz;
  float* restrict ms = (float*)t[5] + b0 / BLOCK;
  float* restrict vs = (float*)t[6] + b0 / BLOCK;
  const float m_max = fp8 ? PRECIS_M8_MAX : FP16_MAX, v_max = fp8 ? PRECIS_V8_MAX : FP16_MAX;
  float sm = *ms, sv = *vs;
  float mf[BLOCK], sq[BLOCK];
  /* max |x| as the integer max of the bits without sign: vectorizes (fmaxf does not) */
  uint32_t amax_m_bits = 0, amax_v_bits = 0;
  for (int64_t j = 0; j < n; ++j) {
    float pi = load_master(master, param, rem, j);
    float mi = (fp8 ? precis_m8_to_f32(((uint8_t*)mq)[j]) : f16_to_f32(((uint16_t*)mq)[j])) * sm;
    float x = (fp8 ? precis_v8_to_f32(((uint8_t*)vq)[j]) : f16_to_f32(((uint16_t*)vq)[j])) * sv;
    float vi = x * x;
    float s = adamw(c, 0, bf16_to_f32(g[j]), &pi, &mi, &vi);
    store_master(master, param, rem, j, pi);
    mf[j] = mi;
    sq[j] = s;
    uint32_t am = f32_bits(mi) & 0x7FFFFFFFu, av = f32_bits(s) & 0x7FFFFFFFu;
    amax_m_bits = am > amax_m_bits ? am : amax_m_bits;
    amax_v_bits = av > amax_v_bits ? av : amax_v_bits;
  }
  float amax_m = bits_f32(amax_m_bits), amax_v = bits_f32(amax_v_bits);
  float mul_m = amax_m < AMAX_MIN ? 0.0f : m_max / amax_m;
  float mul_v = amax_v < AMAX_MIN ? 0.0f : v_max / amax_v;
  *ms = amax_m < AMAX_MIN ? 0.0f : amax_m / m_max;
  *vs = amax_v < AMAX_MIN ? 0.0f : amax_v / v_max;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t i = (uint32_t)(b0 + j);
    uint32_t h = precis_moment_hash(MOMENT_KEY, i);
    uint32_t rv = precis_moment_rand(h, 1, c->step);
    if (fp8) {
      ((uint8_t*)mq)[j] = m_to_fp8_sr(mf[j], mul_m, precis_moment_rand(h, 0, c->step));
      ((uint8_t*)vq)[j] = sqrt_v_to_v8_sr(sq[j], mul_v, rv);
    } else {
      ((uint16_t*)mq)[j] = m_to_f16_rn(mf[j], mul_m);
      ((uint16_t*)vq)[j] = sqrt_v_to_f16_sr(sq[j], mul_v, rv);
    }
  }
}

/* lo is a multiple of BLOCK; full blocks get a constant trip count. */
static inline __attribute__((always_inline)) void run_scaled(const ref_consts_t* c,
                                                             void* const* t, int64_t lo,
                                                             int64_t hi, int fp8, int rem) {
  int64_t b0 = lo;
  for (; b0 + BLOCK <= hi; b0 += BLOCK) scaled_block(c, t, b0, BLOCK, fp8, rem);
  if (b0 < hi) scaled_block(c, t, b0, hi - b0, fp8, rem);
}

static void run_bf16_fp8(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  run_scaled(c, t, lo, hi, 1, 0);
}

static void run_bf16_fp8_remainders(const ref_consts_t* c, void* const* t, int64_t lo,
                                    int64_t hi) {
  run_scaled(c, t, lo, hi, 1, 1);
}

static void run_bf16_fp8_remainders8(const ref_consts_t* c, void* const* t, int64_t lo,
                                     int64_t hi) {
  run_scaled(c, t, lo, hi, 1, 2);
}

static void run_bf16_fp16(const ref_consts_t* c, void* const* t, int64_t lo, int64_t hi) {
  run_scaled(c, t, lo, hi, 0, 0);
}

/* ---- the same streams without the arithmetic ------------------------------
 *
 * Each buffer read and written as its policy's loop does (a write-only param
 * stays write-only, plain stores), with one integer op per element instead of the
 * Adam update: the time a plain loop needs for a policy's streams alone. mask is 0
 * at run time, so every buffer but the write-only param keeps its values (later
 * steps see no garbage), but the compiler cannot drop a load or a store. */

static void streams_fp32(void* const* t, int64_t lo, int64_t hi, uint32_t mask) {
  uint32_t* restrict p = (uint32_t*)t[0];
  const uint32_t* restrict g = (const uint32_t*)t[1];
  uint32_t* restrict m = (uint32_t*)t[2];
  uint32_t* restrict v = (uint32_t*)t[3];
  for (int64_t i = lo; i < hi; ++i) {
    uint32_t x = g[i] & mask;
    p[i] ^= x; m[i] ^= x; v[i] ^= x;
  }
}

/* The bf16-param policies: master fp32 (param write-only) or a remainder (rem:
 * param read and written), moments of esz bytes, and with scaled = 1 one scale
 * per block of each moment in t[5], t[6]. Constants after inlining. */
static inline __attribute__((always_inline)) void streams_bf16(void* const* t, int64_t lo,
                                                               int64_t hi, uint32_t mask, int rem,
                                                               int esz, int scaled) {
  uint16_t* restrict param = (uint16_t*)t[0];
  const uint16_t* restrict g = (const uint16_t*)t[1];
  void* restrict master = t[2];
  void* restrict m = t[3];
  void* restrict v = t[4];
  for (int64_t i = lo; i < hi; ++i) {
    uint32_t x = g[i] & mask;
    if (rem == 2) {
      param[i] ^= (uint16_t)x; ((uint8_t*)master)[i] ^= (uint8_t)x;
    } else if (rem) {
      param[i] ^= (uint16_t)x; ((uint16_t*)master)[i] ^= (uint16_t)x;
    } else {
      ((uint32_t*)master)[i] ^= x;
      param[i] = (uint16_t)(((uint32_t*)master)[i] >> 16);
    }
    if (esz == 1) {
      ((uint8_t*)m)[i] ^= (uint8_t)x; ((uint8_t*)v)[i] ^= (uint8_t)x;
    } else {
      ((uint16_t*)m)[i] ^= (uint16_t)x; ((uint16_t*)v)[i] ^= (uint16_t)x;
    }
  }
  if (scaled) {
    uint32_t* restrict ms = (uint32_t*)t[5];
    uint32_t* restrict vs = (uint32_t*)t[6];
    for (int64_t b = lo / BLOCK; b < (hi + BLOCK - 1) / BLOCK; ++b) {
      ms[b] ^= mask; vs[b] ^= mask;
    }
  }
}

/* ---- the step over all tensors ---------------------------------------------
 *
 * ntensors tensors; numel[k] elements in tensor k; block_start[k] = blocks of the
 * tensors before k (ntensors + 1 entries). ptrs holds nbuf * ntensors pointers,
 * buffer-major: ptrs[b * ntensors + k] is buffer b of tensor k, in the order the
 * run_* function of the policy reads them. streams: the streams_* loops instead
 * (mask 0). */

/* Elements [lo, hi) of one tensor (buffers t) with the policy's loop. */
static inline void run_policy(int policy, int streams, const ref_consts_t* c, void* const* t,
                              int64_t lo, int64_t hi, uint32_t mask) {
  switch (policy * 2 + streams) {
    case REF_FP32 * 2: run_fp32(c, t, lo, hi); break;
    case REF_BF16 * 2: run_bf16(c, t, lo, hi); break;
    case REF_BF16_REMAINDERS * 2: run_bf16_remainders(c, t, lo, hi); break;
    case REF_BF16_FP8 * 2: run_bf16_fp8(c, t, lo, hi); break;
    case REF_BF16_FP8_REMAINDERS * 2: run_bf16_fp8_remainders(c, t, lo, hi); break;
    case REF_BF16_FP16 * 2: run_bf16_fp16(c, t, lo, hi); break;
    case REF_BF16_FP8_REMAINDERS8 * 2: run_bf16_fp8_remainders8(c, t, lo, hi); break;
    case REF_BF16_CHECKED * 2: run_bf16_checked(c, t, lo, hi); break;
    case REF_BF16_TILE_RECORDS * 2: run_bf16_tiles(c, t, lo, hi); break;
    case REF_FP32 * 2 + 1: streams_fp32(t, lo, hi, mask); break;
    case REF_BF16 * 2 + 1: streams_bf16(t, lo, hi, mask, 0, 2, 0); break;
    case REF_BF16_REMAINDERS * 2 + 1: streams_bf16(t, lo, hi, mask, 1, 2, 0); break;
    case REF_BF16_FP8 * 2 + 1: streams_bf16(t, lo, hi, mask, 0, 1, 1); break;
    case REF_BF16_FP8_REMAINDERS * 2 + 1: streams_bf16(t, lo, hi, mask, 1, 1, 1); break;
    case REF_BF16_FP8_REMAINDERS8 * 2 + 1: streams_bf16(t, lo, hi, mask, 2, 1, 1); break;
    default: streams_bf16(t, lo, hi, mask, 0, 2, 1); break;
  }
}

/* The first tensor with blocks after block b (ntensors if none). */
static int64_t tensor_of_block(int64_t ntensors, const int64_t* block_start, int64_t b) {
  int64_t lo_k = 0, hi_k = ntensors;
  while (lo_k < hi_k) {
    int64_t mid = (lo_k + hi_k) / 2;
    if (block_start[mid + 1] <= b) lo_k = mid + 1; else hi_k = mid;
  }
  return lo_k;
}

/* Block b moved up to the next tile boundary of its tensor (tiles start at each
 * tensor's element 0, TILE_BLOCKS blocks each), or to the tensor's end: monotone, and
 * 0 and block_start[ntensors] stay, so the threads' rounded shares still cover every
 * block once. */
static int64_t tile_bound(int64_t ntensors, const int64_t* block_start, int64_t b) {
  int64_t k = tensor_of_block(ntensors, block_start, b);
  if (k == ntensors) return b;
  int64_t up = block_start[k] + (b - block_start[k] + TILE_BLOCKS - 1) / TILE_BLOCKS * TILE_BLOCKS;
  return up < block_start[k + 1] ? up : block_start[k + 1];
}

/* The calling OpenMP thread's share of the blocks, [*b_lo, *b_hi) of all
 * block_start[ntensors] (tensor k holds [block_start[k], block_start[k + 1])), and the
 * first tensor with blocks at or after *b_lo. tiles (REF_BF16_TILE_RECORDS): both ends
 * moved up to a tile boundary of their tensor (tile_bound), so that each thread's runs
 * are whole tiles (a tensor's last one may be short) and no tile is split between
 * threads; a thread's share then differs from the even split by under a tile at each
 * end. */
static int64_t thread_blocks(int64_t ntensors, const int64_t* block_start, int tiles,
                             int64_t* b_lo, int64_t* b_hi) {
  int64_t nblocks = block_start[ntensors];
  int nt = omp_get_num_threads(), id = omp_get_thread_num();
  *b_lo = nblocks * id / nt;
  *b_hi = nblocks * (id + 1) / nt;
  if (tiles) {
    *b_lo = tile_bound(ntensors, block_start, *b_lo);
    *b_hi = tile_bound(ntensors, block_start, *b_hi);
  }
  return tensor_of_block(ntensors, block_start, *b_lo);
}

/* Tensor k's elements [*lo, *hi) within the blocks [b_lo, b_hi). */
static void tensor_share(int64_t k, const int64_t* numel, const int64_t* block_start,
                         int64_t b_lo, int64_t b_hi, int64_t* lo, int64_t* hi) {
  int64_t first = b_lo > block_start[k] ? b_lo - block_start[k] : 0;
  int64_t last = (b_hi < block_start[k + 1] ? b_hi : block_start[k + 1]) - block_start[k];
  *lo = first * BLOCK;
  *hi = last * BLOCK < numel[k] ? last * BLOCK : numel[k];
}

static int ref_run(int policy, int streams, int64_t ntensors, const int64_t* numel,
                   const int64_t* block_start, void* const* ptrs, int nbuf,
                   const ref_consts_t* consts, uint32_t mask) {
  if (policy < REF_FP32 || policy >= REF_COUNT || nbuf > 8) return -1;
  if (streams && (policy == REF_BF16_CHECKED || policy == REF_BF16_TILE_RECORDS)) {
    return -1; /* no streams loop of its own */
  }
  ref_consts_t c = ref_inverse(consts);
#pragma omp parallel
  {
    int64_t b_lo, b_hi, lo, hi;
    for (int64_t k = thread_blocks(ntensors, block_start, policy == REF_BF16_TILE_RECORDS,
                                   &b_lo, &b_hi);
         k < ntensors && block_start[k] < b_hi; ++k) {
      tensor_share(k, numel, block_start, b_lo, b_hi, &lo, &hi);
      void* t[8];
      for (int b = 0; b < nbuf; ++b) t[b] = ptrs[(int64_t)b * ntensors + k];
      run_policy(policy, streams, &c, t, lo, hi, mask);
    }
  }
  return 0;
}

int ref_adamw_step(int policy, int64_t ntensors, const int64_t* numel, const int64_t* block_start,
                   void* const* ptrs, int nbuf, const ref_consts_t* consts) {
  return ref_run(policy, 0, ntensors, numel, block_start, ptrs, nbuf, consts, 0);
}

int ref_streams_step(int policy, int64_t ntensors, const int64_t* numel,
                     const int64_t* block_start, void* const* ptrs, int nbuf, uint32_t mask) {
  const ref_consts_t unused = {0};
  return ref_run(policy, 1, ntensors, numel, block_start, ptrs, nbuf, &unused, mask);
}

/* ---- the arithmetic alone ----------------------------------------------------
 *
 * The policy's loop over numel elements whose data sit in L1: each thread runs it
 * over its own tile of `tile` elements (a multiple of BLOCK; thread i's is
 * [i * tile, (i + 1) * tile) of one buffer set, ptrs[b] = buffer b) again and
 * again until the threads have done numel elements together. No memory traffic
 * beyond L1: the time of the loop's instructions, which no kernel doing the same
 * arithmetic can beat however fast the memory. */
int ref_arith_step(int policy, int64_t numel, int64_t tile, void* const* ptrs, int nbuf,
                   const ref_consts_t* consts) {
  if (policy < REF_FP32 || policy >= REF_COUNT || nbuf > 8 || tile <= 0 || tile % BLOCK ||
      policy == REF_BF16_TILE_RECORDS) { /* (its records: tiles of tensors, not of L1) */
    return -1;
  }
  ref_consts_t c = ref_inverse(consts);
#pragma omp parallel
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t reps = (numel + tile * nt - 1) / (tile * nt);
    for (int64_t r = 0; r < reps; ++r) run_policy(policy, 0, &c, ptrs, id * tile, (id + 1) * tile, 0);
  }
  return 0;
}

/* ---- the one-state rules (bench/rules_cpu.py) -------------------------------
 *
 * The hardware limit of precis's SGD, Lion and Muon steps: torch's arithmetic for
 * each rule (as csrc/rules.h's precis_sgd_update, precis_lion_update and
 * precis_muon_momentum do it, FMA for FMA, written out here) over arrays of the
 * dtypes a policy keeps, the momentum m its one state:
 *
 *   REF_RULE_SGD    torch.optim.SGD: g += wd * p; m = g at step 1, else
 *                   m = (1 - dampening) * g + momentum * m; d = m, or g + momentum * m
 *                   (Nesterov); p = p * decay - lr * d
 *   REF_RULE_LION   u = (1 - beta1) * g + beta1 * m; p = p * decay - lr * sign(u);
 *                   m = (1 - beta2) * g + beta2 * m
 *   REF_RULE_MUON   torch.optim.Muon's momentum: m = m.lerp(g, 1 - momentum); the
 *                   direction (m, or g.lerp(m, momentum) with Nesterov) written in
 *                   bf16, to nearest (what Newton-Schulz starts from); no param
 *   REF_RULE_APPLY  Muon's apply: p = p * decay - lr * u, u the bf16 update (SGD
 *                   without momentum, decoupled decay); no m
 *
 * over the storage kinds (the REF_* policies above, their param and master
 * stores the same):
 *
 *   REF_FP32                  p, g, m fp32 (Muon: the direction bf16)
 *   REF_BF16                  g, m bf16, master fp32, bf16 param written (RNE);
 *                             m rounded stochastically from m's half of the
 *                             element's hash, as precis stores a one-state rule's
 *                             bf16 momentum (precis_moment_store_sr)
 *   REF_BF16_CHECKED          REF_BF16 that first reads the bf16 param and takes
 *                             it as the master where it is not the master's
 *                             rounding (a write behind the optimizer's back seen
 *                             in the loop itself, element by element: the least a
 *                             step that sees loads can add)
 *   REF_BF16_TILE_RECORDS     REF_BF16 with one uint64 record per tile of 4,096
 *                             elements (slot 6): a tile whose bf16 params'
 *                             fingerprint as found is its record gets the plain
 *                             update, another the checked one; then the record of the
 *                             tile as written (run_bf16_tiles' scheme; SGD and Lion
 *                             only)
 *   REF_BF16_FP8_REMAINDERS8  g bf16, param bf16 read and written with a one-byte
 *                             remainder (a 24-bit master), m in m8 with one fp32
 *                             scale per 128 elements (max |m| / 7.875), rounded
 *                             stochastically from m's half of the element's hash
 *
 * ptrs per tensor, in this order: param, grad, master (fp32 or the remainder),
 * m, m scales, out (Muon's direction), tile records: buffers a rule or kind does not
 * read may be NULL. Thread split, tensors and blocks as ref_adamw_step. */

enum { REF_RULE_SGD = 0, REF_RULE_LION = 1, REF_RULE_MUON = 2, REF_RULE_APPLY = 3,
       REF_RULE_COUNT = 4 };
enum { RULE_NBUF = 7 };

typedef struct ref_rule_consts {
  float wd;                   /* SGD's L2 term (0 when decoupled) */
  float momentum;             /* SGD */
  float one_minus_dampening;  /* SGD */
  float beta1, one_minus_beta1, beta2, one_minus_beta2; /* Lion */
  float lerp_coef;            /* Muon: w = 1 - momentum, or w - 1 when lerp_from_g */
  float out_lerp_coef;        /* Muon Nesterov: momentum, or momentum - 1 (from m) */
  float decay;                /* 1 - lr * wd (decoupled), else 1 */
  float neg_lr;               /* -lr */
  int32_t lerp_from_g, out_lerp_from_m, nesterov, first_step;
  uint32_t step;              /* the moments' random numbers */
} ref_rule_consts_t;

static inline float sign_f(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }

/* bf16 m of element i: add m's 16 random bits below the kept ones and truncate. */
static inline uint16_t m_to_bf16_sr(uint32_t step, float m, int64_t i) {
  uint32_t r = precis_moment_rand(precis_moment_hash(MOMENT_KEY, (uint32_t)i), 0, step);
  return (uint16_t)((f32_bits(m) + (r >> 16)) >> 16);
}

/* One element's update of rule (a constant after inlining) from g, *p, *m; returns
 * Muon's direction. Loop-invariant flags (first step, Nesterov, the lerps' end
 * points) are the callers': each runs a loop per case. */
static inline __attribute__((always_inline)) float rule_update(const ref_rule_consts_t* c,
                                                               int rule, int first, int nest,
                                                               int from_g, int from_m, float g,
                                                               float* p, float* m) {
  switch (rule) {
    case REF_RULE_SGD: {
      g = fmaf(c->wd, *p, g);
      float mm = first ? g : fmaf(c->one_minus_dampening, g, *m * c->momentum);
      float d = nest ? fmaf(c->momentum, mm, g) : mm;
      *p = fmaf(c->neg_lr, d, *p * c->decay);
      *m = mm;
      return 0.0f;
    }
    case REF_RULE_LION: {
      float u = fmaf(c->one_minus_beta1, g, c->beta1 * *m);
      *p = fmaf(c->neg_lr, sign_f(u), *p * c->decay);
      *m = fmaf(c->one_minus_beta2, g, c->beta2 * *m);
      return 0.0f;
    }
    case REF_RULE_MUON: {
      float mm = fmaf(c->lerp_coef, g - *m, from_g ? g : *m);
      *m = mm;
      return nest ? fmaf(c->out_lerp_coef, mm - g, from_m ? mm : g) : mm;
    }
    default: /* REF_RULE_APPLY */
      *p = fmaf(c->neg_lr, g, *p * c->decay);
      return 0.0f;
  }
}

/* Elements [lo, hi) of one tensor: fp32 (kind REF_FP32) or bf16 with an fp32 master
 * (REF_BF16; checked: REF_BF16_CHECKED); flags as rule_update, all constants after
 * inlining. */
static inline __attribute__((always_inline)) void rule_plain(const ref_rule_consts_t* c,
                                                             void* const* t, int64_t lo,
                                                             int64_t hi, int rule, int bf16,
                                                             int checked, int first, int nest,
                                                             int from_g, int from_m) {
  const int has_p = rule != REF_RULE_MUON, has_m = rule != REF_RULE_APPLY;
  float* restrict pf = (float*)t[bf16 ? 2 : 0]; /* the master */
  uint16_t* restrict pb = (uint16_t*)t[0];     /* the bf16 param */
  const void* restrict g = t[1];
  void* restrict m = t[3];
  uint16_t* restrict out = (uint16_t*)t[5];
  for (int64_t i = lo; i < hi; ++i) {
    /* Muon's apply reads the bf16 update whatever the param */
    float gi = (bf16 || rule == REF_RULE_APPLY) ? bf16_to_f32(((const uint16_t*)g)[i])
                                                : ((const float*)g)[i];
    float pi = has_p ? pf[i] : 0.0f;
    if (checked && has_p && pb[i] != f32_to_bf16(pi)) pi = bf16_to_f32(pb[i]);
    float mi = has_m ? (bf16 ? bf16_to_f32(((uint16_t*)m)[i]) : ((float*)m)[i]) : 0.0f;
    float d = rule_update(c, rule, first, nest, from_g, from_m, gi, &pi, &mi);
    if (has_p) {
      pf[i] = pi;
      if (bf16) pb[i] = f32_to_bf16(pi);
    }
    if (has_m) {
      if (bf16) ((uint16_t*)m)[i] = m_to_bf16_sr(c->step, mi, i); else ((float*)m)[i] = mi;
    }
    if (rule == REF_RULE_MUON) out[i] = f32_to_bf16(d);
  }
}

/* REF_BF16_TILE_RECORDS's loop over [lo, hi) (tile boundaries, as run_bf16_tiles'):
 * per tile, rule_plain's bf16 loop, plain where the params' record as found is the
 * stored one (t[6]) and checked where not, then the record of the tile as written. */
static inline __attribute__((always_inline)) void rule_tiles(const ref_rule_consts_t* c,
                                                             void* const* t, int64_t lo,
                                                             int64_t hi, int rule, int first,
                                                             int nest, int from_g, int from_m) {
  const uint16_t* param = (const uint16_t*)t[0];
  uint64_t* records = (uint64_t*)t[6];
  for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
    int64_t t1 = t0 + TILE < hi ? t0 + TILE : hi;
    if (tile_record(param, t0, t1) == records[t0 / TILE]) {
      rule_plain(c, t, t0, t1, rule, 1, 0, first, nest, from_g, from_m);
    } else {
      rule_plain(c, t, t0, t1, rule, 1, 1, first, nest, from_g, from_m);
    }
    records[t0 / TILE] = tile_record(param, t0, t1);
  }
}

/* One scale block [b0, b0 + n) of the fp8-momentum, 8-bit-remainder kind: decode m
 * with its scale, update, store the master, then the block's new scale from max |m|
 * and m's codes, rounded stochastically. */
static inline __attribute__((always_inline)) void rule_fp8_block(const ref_rule_consts_t* c,
                                                                 void* const* t, int64_t b0,
                                                                 int64_t n, int rule,
                                                                 int first, int nest,
                                                                 int from_g, int from_m) {
  const int has_p = rule != REF_RULE_MUON, has_m = rule != REF_RULE_APPLY;
  uint16_t* restrict param = (uint16_t*)t[0] + (has_p ? b0 : 0);
  const uint16_t* restrict g = (const uint16_t*)t[1] + b0;
  int8_t* restrict rem = (int8_t*)t[2] + (has_p ? b0 : 0);
  uint8_t* restrict mq = (uint8_t*)t[3] + (has_m ? b0 : 0);
  float* restrict ms = (float*)t[4] + (has_m ? b0 / BLOCK : 0);
  uint16_t* restrict out = (uint16_t*)t[5] + (rule == REF_RULE_MUON ? b0 : 0);
  float sm = has_m ? *ms : 0.0f;
  float mf[BLOCK];
  uint32_t amax_bits = 0;
  for (int64_t j = 0; j < n; ++j) {
    float pi = has_p ? precis_remainder8_master(param[j], rem[j]) : 0.0f;
    float mi = has_m ? precis_m8_to_f32(mq[j]) * sm : 0.0f;
    float d = rule_update(c, rule, first, nest, from_g, from_m, bf16_to_f32(g[j]), &pi, &mi);
    if (has_p) {
      param[j] = precis_remainder8_param(pi);
      rem[j] = precis_remainder8_low(pi);
    }
    if (rule == REF_RULE_MUON) out[j] = f32_to_bf16(d);
    mf[j] = mi;
    uint32_t am = f32_bits(mi) & 0x7FFFFFFFu;
    amax_bits = am > amax_bits ? am : amax_bits;
  }
  if (!has_m) return;
  float amax = bits_f32(amax_bits);
  float mul = amax < AMAX_MIN ? 0.0f : PRECIS_M8_MAX / amax;
  *ms = amax < AMAX_MIN ? 0.0f : amax / PRECIS_M8_MAX;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t h = precis_moment_hash(MOMENT_KEY, (uint32_t)(b0 + j));
    mq[j] = m_to_fp8_sr(mf[j], mul, precis_moment_rand(h, 0, c->step));
  }
}

static inline __attribute__((always_inline)) void rule_fp8(const ref_rule_consts_t* c,
                                                           void* const* t, int64_t lo,
                                                           int64_t hi, int rule, int first,
                                                           int nest, int from_g, int from_m) {
  int64_t b0 = lo;
  for (; b0 + BLOCK <= hi; b0 += BLOCK) {
    rule_fp8_block(c, t, b0, BLOCK, rule, first, nest, from_g, from_m);
  }
  if (b0 < hi) rule_fp8_block(c, t, b0, hi - b0, rule, first, nest, from_g, from_m);
}

/* rule x kind with every flag a constant: the cases bench/rules_cpu.py runs (SGD:
 * first step or not, Nesterov or not; Muon: Nesterov with both lerps from m, as at
 * momentum 0.95, or plain). Returns -1 for another case. */
#define RULE_KINDS(R, F, N, FG, FM)                                             \
  switch (kind) {                                                               \
    case REF_FP32: rule_plain(c, t, lo, hi, R, 0, 0, F, N, FG, FM); return 0;   \
    case REF_BF16: rule_plain(c, t, lo, hi, R, 1, 0, F, N, FG, FM); return 0;   \
    case REF_BF16_CHECKED: rule_plain(c, t, lo, hi, R, 1, 1, F, N, FG, FM); return 0; \
    case REF_BF16_TILE_RECORDS: /* SGD and Lion only */                         \
      if (R != REF_RULE_SGD && R != REF_RULE_LION) return -1;                   \
      rule_tiles(c, t, lo, hi, R, F, N, FG, FM); return 0;                      \
    case REF_BF16_FP8_REMAINDERS8: rule_fp8(c, t, lo, hi, R, F, N, FG, FM); return 0; \
    default: return -1;                                                         \
  }

static int run_rule(int rule, int kind, const ref_rule_consts_t* c, void* const* t, int64_t lo,
                    int64_t hi) {
  switch (rule) {
    case REF_RULE_SGD:
      if (c->first_step) {
        if (c->nesterov) { RULE_KINDS(REF_RULE_SGD, 1, 1, 0, 0) } else { RULE_KINDS(REF_RULE_SGD, 1, 0, 0, 0) }
      } else {
        if (c->nesterov) { RULE_KINDS(REF_RULE_SGD, 0, 1, 0, 0) } else { RULE_KINDS(REF_RULE_SGD, 0, 0, 0, 0) }
      }
    case REF_RULE_LION: RULE_KINDS(REF_RULE_LION, 0, 0, 0, 0)
    case REF_RULE_MUON:
      if (c->lerp_from_g) return -1;
      if (!c->nesterov) { RULE_KINDS(REF_RULE_MUON, 0, 0, 0, 0) }
      if (c->out_lerp_from_m) { RULE_KINDS(REF_RULE_MUON, 0, 1, 0, 1) }
      RULE_KINDS(REF_RULE_MUON, 0, 1, 0, 0)
    case REF_RULE_APPLY: RULE_KINDS(REF_RULE_APPLY, 0, 0, 0, 0)
    default: return -1;
  }
}
#undef RULE_KINDS

int ref_rule_step(int rule, int kind, int64_t ntensors, const int64_t* numel,
                  const int64_t* block_start, void* const* ptrs, const ref_rule_consts_t* consts) {
  if (rule < 0 || rule >= REF_RULE_COUNT) return -1;
  ref_rule_consts_t c = *consts;
  int bad = 0;
#pragma omp parallel reduction(| : bad)
  {
    int64_t b_lo, b_hi, lo, hi;
    for (int64_t k = thread_blocks(ntensors, block_start, kind == REF_BF16_TILE_RECORDS,
                                   &b_lo, &b_hi);
         k < ntensors && block_start[k] < b_hi; ++k) {
      tensor_share(k, numel, block_start, b_lo, b_hi, &lo, &hi);
      void* t[RULE_NBUF];
      for (int b = 0; b < RULE_NBUF; ++b) t[b] = ptrs[(int64_t)b * ntensors + k];
      bad |= run_rule(rule, kind, &c, t, lo, hi) != 0;
    }
  }
  return bad ? -1 : 0;
}
