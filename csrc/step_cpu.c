/* step_cpu.c - the multi-tensor step on the CPU, every rule (precis_rule_t: Adam and
 * AdamW, SGD, Lion, Muon's momentum): fused loops for the common layouts of each rule
 * (pr_fused_layouts), the generic kernel (pr_tile_staged) for any other. The
 * per-element math lives in rules.h, the stored forms in stores.h, a tile's loads and
 * stores in tile_io.h, the choice of SIMD path in cpu_isa.c, the moments' and
 * remainders' conversions in convert_cpu.c; this file only moves data: it splits the
 * tensors into chunks (one OpenMP work item each), and each chunk into tiles of
 * PR_TILE elements, each updated by loops the compiler vectorizes: every buffer is
 * read once and written once per element, converted in registers. */

/* GCC will not if-convert the selects of the fp16/fp8 conversions while it
 * assumes float ops may trap, and leaves those loops scalar. Nothing here reads
 * the FP exception flags, so say they do not matter (results are unchanged).
 * Set before the includes so the inline conversions get it too. (sqrtf
 * vectorizes because BUILD compiles the core with -fno-math-errno.) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_args.h"
#include "step_cpu.h"
#include "rules.h"
#include "stores.h"
#include "fingerprint.h"
#include "internal.h"
#include "resync.h"
#include "mkl_sqrt.h"
#include "tile_io.h"

#include "cpu_isa.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

/* Elements per OpenMP work item: PR_CHUNK, or down to PR_CHUNK_MIN in a call too small
 * to give every thread two chunks of PR_CHUNK (a tensor of 65,536 elements ran on one
 * thread of two). Tiles, and so scale blocks, never span chunks, and no chunk size
 * changes a bit: every chunk is stepped alone. */
#define PR_CHUNK ((int64_t)1 << 16)
#define PR_CHUNK_MIN ((int64_t)1 << 14)
_Static_assert(PR_CHUNK_MIN % PR_TILE == 0, "a chunk holds whole tiles");
_Static_assert(PR_CHUNK % PR_CHUNK_MIN == 0 && ((PR_CHUNK / PR_CHUNK_MIN) &
                                                (PR_CHUNK / PR_CHUNK_MIN - 1)) == 0,
               "halving PR_CHUNK reaches PR_CHUNK_MIN");

/* ------------------------------------------------------------------------ */
/* The fused step                                                            */
/* ------------------------------------------------------------------------ */

#define PR_F32 PRECIS_DTYPE_FP32
#define PR_BF16 PRECIS_DTYPE_BF16
#define PR_FP8 PRECIS_DTYPE_FP8_E4M3

/* The dtypes of a list. The fused loops take it by value: a literal one (a
 * specialized kernel) folds every dtype switch away. */
typedef struct pr_layout {
  int grad, mode, param, master, m, v; /* mode: PR_MASTER_* */
  int sees; /* 1: a separate master whose param may have been written since the last step,
               taken as the master where it is not the master's rounding (param_kept) */
} pr_layout_t;

typedef struct pr_step_call {
  const precis_step_tensors_t* t;
  precis_step_hyper_t hyper;
  int amsgrad;              /* cfg->amsgrad where its size covers it */
  uint64_t seed;
  precis_sqrt_fn_t sqrt_fn; /* cfg->cpu_sqrt, or NULL */
  int sqrt_inline;          /* PR_SQRT_*: the emulation (mkl_sqrt.h) giving sqrt_fn's bits */
  pr_layout_t layout;       /* the list's dtypes (a buffer the rule does not read: fp32) */
  /* The constants of the first tensor's step, made once: a step's tensors mostly
   * share it, and many small tensors would otherwise pay three pow()s each. */
  int64_t consts_step;
  precis_step_consts_t consts;
  /* The rule (cfg->rule) and what it reads (step_args.h); read by the generic kernel. */
  pr_rule_use_t use;
  void* const* outputs;     /* MUON_MOMENTUM: tensors->outputs, else NULL */
  precis_dtype_t output_dtype;
  const double* lr_scales; /* SGD, LION: tensors->lr_scales where given, else NULL */
  uint64_t* fingerprints;  /* tensors->param_fingerprints where given, else NULL */
  uint64_t* blocks;        /* tensors->param_block_fingerprints where given, else NULL, and
                              with it each tensor's first entry there */
  int64_t* first_block;
  int64_t* kept;           /* tensors->param_kept where given, else NULL ... */
  const uint8_t* resynced; /* ... and with it, whether tensor i was resynced whole first */
  /* tensors->param_block_records where given (with first_block), else NULL, and its
   * param_blocks_kept; the words of the fingerprint, this SIMD path's */
  const uint64_t* records;
  int64_t* blocks_kept;
  uint64_t (*fp_words)(const unsigned char*, int64_t, int64_t);
} pr_step_call_t;

/* The tensors of one tile, offset to its first element. */
typedef struct pr_tile_ptrs {
  const void* g;
  void* p;
  void* master;
  void* m;
  void* v;
  void* vmax;          /* amsgrad's running max (exp_avg_sq's dtype), or NULL */
  precis_sr_key_t key; /* stochastic rounding (bf16 param without master) */
  pr_sr_t sr;          /* the moments' stochastic rounding (index0 as below) */
  int64_t off;         /* element index of the tile in its tensor */
  uint32_t index0;     /* ... and in its whole param (element_offsets + off), low 32 bits */
  uint8_t* taken;      /* L.sees: each element's flag, set where its param was taken */
} pr_tile_ptrs_t;

/* fp32 work arrays of one tile; L1-sized. */
typedef struct pr_tile_bufs {
  _Alignas(64) float p[PR_TILE];
  _Alignas(64) float m[PR_TILE];
  _Alignas(64) float v[PR_TILE];
  _Alignas(64) float root[PR_TILE];
  _Alignas(64) float vmax[PR_TILE]; /* amsgrad only */
  _Alignas(64) float g[PR_TILE];    /* the generic kernel only (pr_*_tile_staged) */
  _Alignas(64) uint32_t hash[PR_TILE]; /* the moments' random bits (pr_moment_hashes) */
  _Alignas(64) uint8_t taken[PR_TILE];  /* L.sees: pr_tile_ptrs_t.taken */
} pr_tile_bufs_t;

/* What Adam reads (pr_rule_use's of PRECIS_RULE_ADAM, as a constant): every table. The
 * fused kernels give the generic kernel's bits, which reads call->use (test_adam.cc). */
static const pr_rule_use_t pr_adam_use = {PRECIS_RULE_ADAM, 1, 1, 1, 0, 0};

/* Whether a tile of the rule u over L stores a moment with stochastic rounding (it
 * needs the hashes). */
PR_INLINE int pr_tile_sr(pr_rule_use_t u, pr_layout_t L) {
  return (u.m && precis_moment_store_sr(L.m, 0, u.rule)) ||
         (u.v && precis_moment_store_sr(L.v, 1, u.rule));
}

PR_INLINE float pr_load_master(pr_layout_t L, pr_tile_ptrs_t s, int j) {
  if (L.mode == PR_MASTER_SEPARATE && L.sees) {
    /* A param written since the last step is taken as its master (resync.h's rule: the
     * value pr_resync_element stores, an fp16 master's rounding), flagged for the count;
     * a select in the loop, which reads the params its stores would read anyway. */
    const float master = pr_ld(s.master, L.master, j);
    const uint16_t param = ((const uint16_t*)s.p)[j];
    const int written = !pr_rounds_to(master, param, L.param);
    float taken = pr_param_value(param, L.param);
    if (L.master == PRECIS_DTYPE_FP16) taken = precis_f16_to_f32(precis_f32_to_f16_rn(taken));
    s.taken[j] = (uint8_t)written;
    return written ? taken : master;
  }
  if (L.mode == PR_MASTER_SEPARATE) return pr_ld(s.master, L.master, j);
  if (L.mode == PR_MASTER_REMAINDER) {
    return precis_remainder_master(((const uint16_t*)s.p)[j], ((const int16_t*)s.master)[j]);
  }
  if (L.mode == PR_MASTER_REMAINDER8) {
    return precis_remainder8_master(((const uint16_t*)s.p)[j], ((const int8_t*)s.master)[j]);
  }
  return pr_ld(s.p, L.param, j);
}

/* Write the updated master value p and the param derived from it. */
PR_INLINE void pr_store_master(pr_layout_t L, pr_tile_ptrs_t s, int j, float p) {
  if (L.mode == PR_MASTER_SEPARATE) {
    /* The param is the rounding of the master as stored, so a resync from the
     * master reproduces it. */
    if (L.master == PRECIS_DTYPE_FP16) p = precis_f16_to_f32(precis_f32_to_f16_rn(p));
    pr_st(s.master, L.master, j, p);
    pr_st(s.p, L.param, j, p);
  } else if (L.mode == PR_MASTER_REMAINDER) {
    ((uint16_t*)s.p)[j] = precis_remainder_param(p);
    ((int16_t*)s.master)[j] = precis_remainder_low(p);
  } else if (L.mode == PR_MASTER_REMAINDER8) {
    ((uint16_t*)s.p)[j] = precis_remainder8_param(p);
    ((int8_t*)s.master)[j] = precis_remainder8_low(p);
  } else if (L.param == PRECIS_DTYPE_BF16) {
    /* No master: stochastic rounding keeps small updates alive on average. */
    ((uint16_t*)s.p)[j] =
        precis_f32_to_bf16_sr(p, precis_sr_rand16(s.key, s.index0 + (uint32_t)j));
  } else {
    pr_st(s.p, L.param, j, p);
  }
}

/* Elements of a tile whose param is no longer its master's rounding (written since the
 * last step) take the param as their master before the tile is stepped (resync.h's
 * rule, as precis_resync_masters takes a write into part of a param); returns how many.
 * A pass that only compares while nothing was written, a vectorized count, and it
 * leaves the tile's params and masters in L1 for the update (whose stores would read
 * the params' lines anyway): the step's own compare, with no fingerprint pass before
 * it and no record after. */
PR_INLINE int pr_take_written(pr_layout_t L, pr_tile_ptrs_t s, int n) {
  const uint16_t* p = (const uint16_t*)s.p;
  int differ = 0, j;
  for (j = 0; j < n; ++j) {
    differ += !pr_rounds_to(pr_master_value(s.master, j, L.master), p[j], L.param);
  }
  if (differ != 0) {
    for (j = 0; j < n; ++j) pr_resync_element(s.master, L.master, p, L.param, j, 0);
  }
  return differ;
}

/* How many of n flags (0 or 1) are set. */
PR_INLINE int pr_count_flags(const uint8_t* restrict flags, int n) {
  int count = 0, j;
  for (j = 0; j < n; ++j) count += flags[j];
  return count;
}

/* The decayed param and the new moments of one element. */
typedef struct pr_pmv {
  float p, m, v;
} pr_pmv_t;

/* Element j of a tile: its inputs loaded, decoded, and through
 * precis_adam_moments. Returned by value: a local whose address an "omp simd"
 * loop body takes becomes an array of OpenMP's maximum vector length for the
 * default ISA (16 lanes), which caps the loop's bf16 vectors at 256 bits. */
PR_INLINE pr_pmv_t pr_load_moments(const precis_step_consts_t* c, pr_layout_t L,
                                   pr_tile_ptrs_t s, float m_scale, float v_scale, int j) {
  pr_pmv_t e;
  float g = pr_ld(s.g, L.grad, j);
  e.p = pr_load_master(L, s, j);
  e.m = pr_ld_moment(s.m, L.m, 0, j);
  e.v = pr_ld_moment(s.v, L.v, 1, j);
  if (pr_is_scaled(L.m)) e.m = precis_moment_dq(e.m, m_scale, 0);
  if (pr_is_scaled(L.v)) e.v = precis_moment_dq(e.v, v_scale, 1);
  precis_adam_moments(c, g, &e.p, &e.m, &e.v);
  return e;
}

/* Element j of an unscaled v (fp32, bf16): bf16 rounds stochastically, from
 * the element's precis_moment_hash. */
PR_INLINE void pr_st_v(pr_layout_t L, pr_tile_ptrs_t s, int j, float v, uint32_t hash) {
  if (L.v == PR_BF16) {
    ((uint16_t*)s.v)[j] = precis_f32_to_bf16_sr(v, precis_moment_rand(hash, 1, s.sr.step) >> 16);
  } else {
    pr_st(s.v, L.v, j, v);
  }
}

#if defined(_OPENMP)
/* No simdlen: simdlen(16) made 16 bf16 lanes (256 bits) the vector size, so the
 * AVX-512 bf16 loops ran on ymm registers; without it they run on zmm. */
#define PR_SIMD_LOOP _Pragma("omp simd")
#else
#define PR_SIMD_LOOP
#endif

/* Which emulation of mkl_sqrt.h gives the cpu_sqrt's bits: none (call it per
 * tile), MKL's AVX-512 kernel (Intel), or its generic SSE one (AMD). */
enum { PR_SQRT_CALL = 0, PR_SQRT_Z0 = 1, PR_SQRT_EX = 2 };

/* The emulation a path of SIMD level isa runs inline for the call's kind, or
 * PR_SQRT_CALL: Z0 needs AVX-512, EX AVX2. A constant where isa is. */
PR_INLINE int pr_sqrt_inline_on(int isa, int kind) {
  if (!PR_X86) return PR_SQRT_CALL;
  if (kind == PR_SQRT_Z0) return isa == PR_ISA_AVX512 ? kind : PR_SQRT_CALL;
  if (kind == PR_SQRT_EX) return isa >= PR_ISA_AVX2 ? kind : PR_SQRT_CALL;
  return PR_SQRT_CALL;
}

#if PR_X86
/* out[0..n) = the emulated MKL sqrt of in[0..n) (kind Z0 or EX). */
PR_INLINE void pr_mkl_sqrt(int kind, const float* restrict in, float* restrict out, int64_t n) {
  if (kind == PR_SQRT_Z0) {
    precis_mkl_sqrt_avx512(in, out, n);
  } else {
    precis_mkl_sqrt_avx2(in, out, n);
  }
}
#endif

/* out = sqrt(in) over n values, as the step takes it: MKL's bits inline
 * (mkl_inline), the cfg->cpu_sqrt, or IEEE. */
PR_INLINE void pr_roots(const pr_step_call_t* call, int mkl_inline, const float* restrict in,
                        float* restrict out, int n) {
  int j;
#if PR_X86
  if (mkl_inline != PR_SQRT_CALL) {
    pr_mkl_sqrt(mkl_inline, in, out, n);
    return;
  }
#else
  (void)mkl_inline;
#endif
  if (call->sqrt_fn != NULL) {
    call->sqrt_fn(in, out, n);
    return;
  }
  for (j = 0; j < n; ++j) out[j] = sqrtf(in[j]);
}

/* Elements per group of pr_adam_grouped. 64 streams from DRAM as fast as one
 * loop over the tile (bench/adam_cpu.py, fp32 with MKL's sqrt at 50M on the Intel
 * Xeon, AVX-512: 0.88x of the reference loop with 16, 0.94x with 64, 0.80x with
 * 256); the group's arrays stay in L1. */
#define PR_GROUP 64

/* Elements [j0, j0 + w) (w <= PR_GROUP) of a tile without scaled moments: the
 * moments in one loop, the square roots a vector at a time (pr_roots: IEEE, or
 * MKL's emulated inline), the param in a second loop. Two
 * short loops rather than one long one: the long one's chain of loads,
 * sqrt, two divisions and stores did not fit the out-of-order window twice
 * (bf16 default at 0.72x of the reference loop on an AMD EPYC Zen 3, 0.85-0.94x
 * grouped), and a SIMD sqrt function called from it made GCC spill every vector
 * register around each call. */
PR_INLINE void pr_adam_group(const pr_step_call_t* call, int mkl, const precis_step_consts_t* c,
                             pr_layout_t L, pr_tile_ptrs_t s, int j0, int w) {
  _Alignas(64) float p[PR_GROUP], m[PR_GROUP], v[PR_GROUP], root[PR_GROUP];
  int k;
  PR_SIMD_LOOP
  for (k = 0; k < w; ++k) {
    const pr_pmv_t e = pr_load_moments(c, L, s, 0.0f, 0.0f, j0 + k);
    p[k] = e.p;
    m[k] = e.m;
    v[k] = e.v;
    pr_st(s.m, L.m, j0 + k, e.m);
    /* only v rounds stochastically here: its hash inline, no tile of them */
    pr_st_v(L, s, j0 + k, e.v, precis_moment_hash(s.sr.key, s.index0 + (uint32_t)(j0 + k)));
  }
  pr_roots(call, mkl, v, root, w);
  PR_SIMD_LOOP
  for (k = 0; k < w; ++k) {
    const float x = precis_adam_param(c, precis_adam_torch_form(L.m, L.v), p[k], m[k], root[k]);
    pr_store_master(L, s, j0 + k, x);
  }
}

/* A tile without scaled moments in groups: whole groups (a constant trip count
 * after inlining), then the rest. mkl as pr_adam_group. */
PR_INLINE void pr_adam_grouped(const pr_step_call_t* call, int mkl,
                                const precis_step_consts_t* c, pr_layout_t L, pr_tile_ptrs_t s,
                                int n) {
  int j0;
  for (j0 = 0; j0 + PR_GROUP <= n; j0 += PR_GROUP) {
    pr_adam_group(call, mkl, c, L, s, j0, PR_GROUP);
  }
  if (j0 < n) pr_adam_group(call, mkl, c, L, s, j0, n - j0);
}

/* AMSGrad over a tile whose new v is in b->v (precis.h): store v, read it back
 * as stored, take the running max of the stored values, store it, and leave its
 * square root in b->root for the denominator. The tile's pointers are offset to
 * its first element, so the scales are too and the moments are at offset 0. */
PR_INLINE void pr_amsgrad_tile(const pr_step_call_t* call, int mkl_inline, pr_layout_t L,
                               pr_tile_ptrs_t s, float* v_scales, float* max_scales, int n,
                               int isa, pr_tile_bufs_t* restrict b) {
  const int64_t blk = s.off / PRECIS_SCALE_BLOCK;
  float* vs = v_scales != NULL ? v_scales + blk : NULL;
  float* xs = max_scales != NULL ? max_scales + blk : NULL;
  int j;
  if (vs != NULL) pr_roots(call, mkl_inline, b->v, b->root, n); /* v's encoding needs it */
  pr_store_moment(isa, s.v, vs, L.v, 1, PRECIS_RULE_ADAM, 0, b->v, b->root, n, &s.sr);
  pr_load_moment(b->v, s.v, vs, L.v, 1, 0, n);
  pr_load_moment(b->vmax, s.vmax, xs, L.v, 1, 0, n);
  for (j = 0; j < n; ++j) b->vmax[j] = precis_adam_max(b->vmax[j], b->v[j]);
  pr_roots(call, mkl_inline, b->vmax, b->root, n);
  pr_store_moment(isa, s.vmax, xs, L.v, 1, PRECIS_RULE_ADAM, 0, b->vmax, b->root, n, NULL);
}

/* Whether pr_adam_tile stores the moments itself (pr_adam_scaled_blocks): m and v
 * both fp8 or both fp16, without AMSGrad, with IEEE sqrt; else pr_step_chunk encodes
 * them from the tile's arrays. */
PR_INLINE int pr_adam_blocks_fused(const pr_step_call_t* call, pr_layout_t L) {
  return pr_is_scaled(L.m) && L.v == L.m && !call->amsgrad && call->sqrt_fn == NULL;
}

/* The w elements of the scale block at lo of a tile of pr_adam_blocks_fused's
 * layouts, in two loops as bench/adam_reference_loop.c takes a block: one decodes and
 * updates, keeping the new master, m and sqrt(v) and the amax of both; the other
 * stores the master and encodes both moments with the block's new scales (fp8: each
 * element's hash computed there; fp16: m rounded to nearest a block at a time, F16C's
 * where there is one, as pr_store_moment does). The same bits as the tile's passes
 * (hashes, moments, roots, params, then pr_store_moment twice): the same functions of
 * each element, the amax as pr_amax's integer max (a NaN's sign aside where a product
 * of two NaNs keeps the first operand's and the compiler commutes it, as between paths). Those seven passes over the tile's
 * arrays took 10-21% longer with fp8 or fp16 moments (AMD EPYC Zen 4, avx512 and avx2;
 * bench/RESULTS.md); the master stored in the first loop instead gained a sixth as
 * much with 8-bit remainders. */
PR_INLINE void pr_adam_scaled_block(int isa, const precis_step_consts_t* c, pr_layout_t L,
                                    pr_tile_ptrs_t s, float* restrict m_scale,
                                    float* restrict v_scale, int lo, int w,
                                    pr_tile_bufs_t* restrict b) {
  const int fp8 = L.m == PR_FP8;
  const float ms = *m_scale, vs = *v_scale;
  uint32_t am = 0, av = 0;
  float mul_m, mul_v, amax_m, amax_v;
  int j;
  for (j = lo; j < lo + w; ++j) {
    const pr_pmv_t e = pr_load_moments(c, L, s, ms, vs, j);
    const float root = sqrtf(e.v);
    const uint32_t um = precis_f32_bits(e.m) & 0x7FFFFFFFu;
    const uint32_t uv = precis_f32_bits(root) & 0x7FFFFFFFu;
    b->p[j] = precis_adam_param(c, 0, e.p, e.m, root); /* scaled moments */
    b->m[j] = e.m;
    b->root[j] = root;
    am = um > am ? um : am;
    av = uv > av ? uv : av;
  }
  amax_m = precis_bits_f32(am);
  amax_v = precis_bits_f32(av);
  *m_scale = precis_block_scale(amax_m, fp8, 0);
  *v_scale = precis_block_scale(amax_v, fp8, 1);
  mul_m = precis_block_multiplier(amax_m, fp8, 0);
  mul_v = precis_block_multiplier(amax_v, fp8, 1);
  if (fp8) {
    for (j = lo; j < lo + w; ++j) {
      const uint32_t h = precis_moment_hash(s.sr.key, s.index0 + (uint32_t)j);
      pr_store_master(L, s, j, b->p[j]);
      ((uint8_t*)s.m)[j] =
          precis_moment_sr_fp8(b->m[j], mul_m, 0, precis_moment_rand(h, 0, s.sr.step));
      ((uint8_t*)s.v)[j] =
          precis_moment_sr_fp8(b->root[j], mul_v, 1, precis_moment_rand(h, 1, s.sr.step));
    }
    return;
  }
  for (j = lo; j < lo + w; ++j) {
    const uint32_t h = precis_moment_hash(s.sr.key, s.index0 + (uint32_t)j);
    pr_store_master(L, s, j, b->p[j]);
    ((uint16_t*)s.v)[j] =
        precis_moment_sr_f16(b->root[j], mul_v, 1, precis_moment_rand(h, 1, s.sr.step));
    b->m[j] *= mul_m;
  }
  pr_f16_store(isa, (uint16_t*)s.m + lo, b->m + lo, w);
}

/* A tile of pr_adam_blocks_fused's layouts a scale block at a time, the whole blocks
 * with a constant trip count. */
PR_INLINE void pr_adam_scaled_blocks(int isa, const precis_step_consts_t* c, pr_layout_t L,
                                     pr_tile_ptrs_t s, float* m_scales, float* v_scales, int n,
                                     pr_tile_bufs_t* restrict b) {
  const int64_t blk0 = s.off / PRECIS_SCALE_BLOCK;
  int lo;
  for (lo = 0; lo + PRECIS_SCALE_BLOCK <= n; lo += PRECIS_SCALE_BLOCK) {
    const int64_t k = blk0 + lo / PRECIS_SCALE_BLOCK;
    pr_adam_scaled_block(isa, c, L, s, &m_scales[k], &v_scales[k], lo, PRECIS_SCALE_BLOCK, b);
  }
  if (lo < n) {
    const int64_t k = blk0 + lo / PRECIS_SCALE_BLOCK;
    pr_adam_scaled_block(isa, c, L, s, &m_scales[k], &v_scales[k], lo, n - lo, b);
  }
}

/* One tile of n <= PR_TILE elements: every buffer read once and written once,
 * from registers where the dtypes allow. The loops are written per element
 * (rules.h's and stores.h's functions) and vectorized by the compiler. Scaled moments
 * (fp16/fp8) are dequantized a scale block at a time on load and go through
 * b->m / b->root on store (the new block scale needs the block's amax); the
 * caller encodes them, but where pr_adam_blocks_fused takes the whole update a
 * scale block at a time. Without scaled moments or amsgrad, and with IEEE sqrt or
 * MKL's emulated inline (call->sqrt_inline): groups of PR_GROUP elements
 * (pr_adam_grouped). Otherwise two loops around the square roots of the tile
 * (forced into SIMD, a one-pass loop of scaled moments runs slower): IEEE, MKL's
 * emulation inline, or the cpu_sqrt called. Returns 1 where it stored the moments
 * itself (pr_adam_blocks_fused), else 0. */
PR_INLINE int pr_adam_tile(const pr_step_call_t* call, precis_step_consts_t c, pr_layout_t L,
                           pr_tile_ptrs_t s, float* m_scales, float* v_scales,
                           float* max_scales, int n, int isa, pr_tile_bufs_t* restrict b) {
  const precis_sqrt_fn_t sqrt_fn = call->sqrt_fn;
  const int mkl_inline = pr_sqrt_inline_on(isa, call->sqrt_inline);
  const int m_scaled = pr_is_scaled(L.m), v_scaled = pr_is_scaled(L.v);
  const int grouped = !call->amsgrad && !m_scaled && !v_scaled;
  const int torch_form = precis_adam_torch_form(L.m, L.v);
  const int64_t blk0 = s.off / PRECIS_SCALE_BLOCK;
  int lo, j;
  if (grouped && (sqrt_fn == NULL || mkl_inline != PR_SQRT_CALL)) {
    pr_adam_grouped(call, mkl_inline, &c, L, s, n);
    return 0;
  }
  if (pr_adam_blocks_fused(call, L)) {
    pr_adam_scaled_blocks(isa, &c, L, s, m_scales, v_scales, n, b);
    return 1;
  }
  if (pr_tile_sr(pr_adam_use, L)) pr_moment_hashes(b->hash, &s.sr, n);
  for (lo = 0; lo < n; lo += PRECIS_SCALE_BLOCK) {
    const int hi = n - lo < PRECIS_SCALE_BLOCK ? n : lo + PRECIS_SCALE_BLOCK;
    const float ms = m_scaled ? m_scales[blk0 + lo / PRECIS_SCALE_BLOCK] : 0.0f;
    const float vs = v_scaled ? v_scales[blk0 + lo / PRECIS_SCALE_BLOCK] : 0.0f;
    for (j = lo; j < hi; ++j) {
      const pr_pmv_t e = pr_load_moments(&c, L, s, ms, vs, j);
      b->p[j] = e.p;
      b->m[j] = e.m;
      b->v[j] = e.v;
    }
  }
  if (call->amsgrad) {
    pr_amsgrad_tile(call, mkl_inline, L, s, v_scales, max_scales, n, isa, b);
  } else {
    pr_roots(call, mkl_inline, b->v, b->root, n);
  }
  for (j = 0; j < n; ++j) {
    pr_store_master(L, s, j, precis_adam_param(&c, torch_form, b->p[j], b->m[j], b->root[j]));
    if (!m_scaled) pr_st(s.m, L.m, j, b->m[j]);
    if (!v_scaled && !call->amsgrad) pr_st_v(L, s, j, b->v[j], b->hash[j]);
  }
  return 0;
}

/* The master values of a tile's n elements into p, a loop per case. */
PR_INLINE void pr_load_master_tile(pr_layout_t L, pr_tile_ptrs_t s, float* restrict p, int n) {
  int j;
  if (L.mode == PR_MASTER_SEPARATE) {
    pr_load_tile(p, s.master, L.master, 0, 0, n);
  } else if (L.mode == PR_MASTER_REMAINDER) {
    for (j = 0; j < n; ++j) {
      p[j] = precis_remainder_master(((const uint16_t*)s.p)[j], ((const int16_t*)s.master)[j]);
    }
  } else if (L.mode == PR_MASTER_REMAINDER8) {
    for (j = 0; j < n; ++j) {
      p[j] = precis_remainder8_master(((const uint16_t*)s.p)[j], ((const int8_t*)s.master)[j]);
    }
  } else {
    pr_load_tile(p, s.p, L.param, 0, 0, n);
  }
}

/* pr_store_master over a tile (p: the updated masters, rounded in place to an
 * fp16 master's values), a loop per case. */
PR_INLINE void pr_store_master_tile(int isa, pr_layout_t L, pr_tile_ptrs_t s, float* restrict p,
                                    int n) {
  int j;
  if (L.mode == PR_MASTER_SEPARATE) {
    if (L.master == PRECIS_DTYPE_FP16) {
      for (j = 0; j < n; ++j) p[j] = precis_f16_to_f32(precis_f32_to_f16_rn(p[j]));
    }
    pr_store_tile(isa, s.master, (precis_dtype_t)L.master, 0, p, n);
    pr_store_tile(isa, s.p, (precis_dtype_t)L.param, 0, p, n);
  } else if (L.mode == PR_MASTER_REMAINDER) {
    for (j = 0; j < n; ++j) {
      ((uint16_t*)s.p)[j] = precis_remainder_param(p[j]);
      ((int16_t*)s.master)[j] = precis_remainder_low(p[j]);
    }
  } else if (L.mode == PR_MASTER_REMAINDER8) {
    for (j = 0; j < n; ++j) {
      ((uint16_t*)s.p)[j] = precis_remainder8_param(p[j]);
      ((int8_t*)s.master)[j] = precis_remainder8_low(p[j]);
    }
  } else if (L.param == PRECIS_DTYPE_BF16) {
    for (j = 0; j < n; ++j) {
      ((uint16_t*)s.p)[j] =
          precis_f32_to_bf16_sr(p[j], precis_sr_rand16(s.key, s.index0 + (uint32_t)j));
    }
  } else {
    pr_store_tile(isa, s.p, (precis_dtype_t)L.param, 0, p, n);
  }
}

/* Adam's update of a staged tile (pr_tile_staged; g, p, m and v in b): the moments,
 * the square roots of v (AMSGrad: of the running max, which pr_amsgrad_tile stores with
 * v), the params. */
PR_INLINE void pr_adam_staged(const pr_step_call_t* call, const precis_step_consts_t* c,
                              pr_layout_t L, pr_tile_ptrs_t s, float* v_scales,
                              float* max_scales, int n, int isa, pr_tile_bufs_t* restrict b) {
  const int mkl_inline = pr_sqrt_inline_on(isa, call->sqrt_inline);
  int j;
  PR_SIMD_LOOP
  for (j = 0; j < n; ++j) {
    float p = b->p[j], m = b->m[j], v = b->v[j];
    precis_adam_moments(c, b->g[j], &p, &m, &v);
    b->p[j] = p;
    b->m[j] = m;
    b->v[j] = v;
  }
  if (call->amsgrad) {
    pr_amsgrad_tile(call, mkl_inline, L, s, v_scales, max_scales, n, isa, b);
  } else {
    pr_roots(call, mkl_inline, b->v, b->root, n);
  }
  /* the form's loops apart: a select in one loop would take both forms' divisions */
  if (precis_adam_torch_form(L.m, L.v)) {
    for (j = 0; j < n; ++j) b->p[j] = precis_adam_param(c, 1, b->p[j], b->m[j], b->root[j]);
  } else {
    for (j = 0; j < n; ++j) b->p[j] = precis_adam_param(c, 0, b->p[j], b->m[j], b->root[j]);
  }
}

/* A tile of a one-state rule in b (its gradients b->g): the masters in b->p, m in b->m,
 * a direction in b->root (a rule that writes outputs), every flag a constant (a copy
 * of the loop each way of Nesterov: one loop selecting on it and a lerp's end point,
 * two invariant flags in one mask, is left scalar by GCC 12). */
PR_INLINE void pr_rule_staged_loop(const precis_step_consts_t* c, int rule, int has_m,
                                   pr_tile_bufs_t* restrict b, int n) {
  const int param = pr_rules[rule].param;
  int j;
#define PR_STAGED_ELEMENT                                             \
  do {                                                                \
    float p = param ? b->p[j] : 0.0f, m = has_m ? b->m[j] : 0.0f;     \
    const float d = precis_rule_update(c, rule, has_m, b->g[j], &p, &m); \
    if (param) b->p[j] = p;                                           \
    if (has_m) b->m[j] = m;                                           \
    if (!param) b->root[j] = d;                                       \
  } while (0)
  if (pr_rules[rule].nesterov && has_m && c->nesterov) {
    PR_SIMD_LOOP
    for (j = 0; j < n; ++j) PR_STAGED_ELEMENT;
  } else {
    PR_SIMD_LOOP
    for (j = 0; j < n; ++j) PR_STAGED_ELEMENT;
  }
#undef PR_STAGED_ELEMENT
}

/* A one-state rule's update of a staged tile (pr_tile_staged): its loop, the rule and
 * whether it keeps a momentum constants in each. */
PR_INLINE void pr_rule_staged(const precis_step_consts_t* c, pr_rule_use_t u,
                              pr_tile_bufs_t* restrict b, int n) {
  switch (u.rule) {
#define PR_STAGED_CASE(R)                              \
  case R:                                              \
    if (pr_rules[R].m == PR_M_WITH_MOMENTUM && !u.m) { \
      pr_rule_staged_loop(c, R, 0, b, n);              \
    } else {                                           \
      pr_rule_staged_loop(c, R, 1, b, n);              \
    }                                                  \
    break;
    PRECIS_ONE_STATE_RULES(PR_STAGED_CASE)
#undef PR_STAGED_CASE
    default:
      break;
  }
}

/* The generic kernel's tile: any rule over a layout known only at run time. Each
 * buffer the rule reads (call->use) goes through the tile's fp32 arrays by a loop of
 * its own (pr_load_tile, pr_load_moment, pr_store_master_tile, pr_store_moment hoist
 * the dtype switches; scaled moments dequantized with their block scales), the rule's
 * update runs over those arrays (pr_adam_staged, pr_rule_staged), so every loop
 * vectorizes, for two more passes over L1 than a fused tile. The same bits as the
 * fused tiles. Stored here: params and masters (separate, remainders, stochastic
 * rounding), unscaled moments (stochastically where precis_moment_store_sr says,
 * from the element's hash), AMSGrad's v and max, Muon's direction from b->root into
 * out (output_dtype, to nearest); a scaled m or v is encoded by the caller (the new
 * block scale needs the block's amax). */
PR_INLINE void pr_tile_staged(const pr_step_call_t* call, precis_step_consts_t c, pr_layout_t L,
                              pr_tile_ptrs_t s, const float* m_scales, float* v_scales,
                              float* max_scales, void* out, int n, int isa,
                              pr_tile_bufs_t* restrict b) {
  const pr_rule_use_t u = call->use;
  const int64_t blk0 = s.off / PRECIS_SCALE_BLOCK;
  if (pr_tile_sr(u, L)) pr_moment_hashes(b->hash, &s.sr, n);
  pr_load_tile(b->g, s.g, L.grad, 0, 0, n);
  if (u.param) pr_load_master_tile(L, s, b->p, n);
  /* pr_load_moment reads its scales at the element's offset: the tile's block
   * scales are at blk0, and its moments at s.m, s.v (offset 0). */
  if (u.m) {
    pr_load_moment(b->m, s.m, m_scales != NULL ? m_scales + blk0 : NULL, (precis_dtype_t)L.m,
                   0, 0, n);
  }
  if (u.v) {
    pr_load_moment(b->v, s.v, v_scales != NULL ? v_scales + blk0 : NULL, (precis_dtype_t)L.v,
                   1, 0, n);
  }
  if (u.rule == PRECIS_RULE_ADAM) {
    pr_adam_staged(call, &c, L, s, v_scales, max_scales, n, isa, b);
  } else {
    pr_rule_staged(&c, u, b, n);
  }
  if (u.param) pr_store_master_tile(isa, L, s, b->p, n);
  if (u.m && !pr_is_scaled(L.m)) {
    pr_store_moment(isa, s.m, NULL, (precis_dtype_t)L.m, 0, u.rule, 0, b->m, NULL, n, &s.sr);
  }
  if (u.v && !pr_is_scaled(L.v) && !call->amsgrad) {
    pr_store_moment(isa, s.v, NULL, (precis_dtype_t)L.v, 1, u.rule, 0, b->v, NULL, n, &s.sr);
  }
  if (u.output) pr_store_tile(isa, out, call->output_dtype, 0, b->root, n);
}

/* ---- the one-state rules' fused tiles ------------------------------------------------
 *
 * A one-state rule (SGD, Lion, Muon's momentum) over a layout of pr_fused_layouts (a
 * constant): one loop over the tile's elements, each buffer read once and written once
 * from registers (Adam's pr_adam_group, without the roots), the same element functions
 * and stores as pr_tile_staged, so the same bits (test_rules.cc checks them against
 * it). An fp8 m goes a scale block at a time: the loop leaves it in b->m, then the
 * block's amax, its new scale and its codes. The staged tile took about twice the
 * reference loop's time: GCC compiles its fp32 tile loads and stores into memcpy calls,
 * five passes over the tile for SGD (docs/design.md section 4). */

/* One element of a rule: the updated master p, momentum m and Muon's direction d.
 * Returned by value (pr_load_moments says why). */
typedef struct pr_pmd {
  float p, m, d;
} pr_pmd_t;

/* Element j of a tile of rule (a constant; has_m: the rule keeps a momentum):
 * loaded, decoded (an fp8 m with the block's scale m_scale), updated with k's
 * constants. */
PR_INLINE pr_pmd_t pr_rule_elem(const precis_step_consts_t* k, pr_layout_t L, pr_tile_ptrs_t s,
                                int rule, int has_m, float m_scale, int j) {
  pr_pmd_t e;
  const float g = pr_ld(s.g, L.grad, j);
  e.p = pr_rules[rule].param ? pr_load_master(L, s, j) : 0.0f;
  e.m = has_m ? pr_ld_moment(s.m, L.m, 0, j) : 0.0f;
  e.d = 0.0f;
  if (has_m && pr_is_scaled(L.m)) e.m = precis_moment_dq(e.m, m_scale, 0);
  e.d = precis_rule_update(k, rule, has_m, g, &e.p, &e.m);
  return e;
}

/* Elements [j0, j1) of a tile (one scale block where m is scaled), every flag a
 * constant: the stores of pr_tile_staged per element. An unscaled m below fp32
 * rounds stochastically from m's half of the element's hash (a one-state rule's
 * momentum, precis_moment_store_sr); a scaled one goes to m_buf, for the caller to
 * encode once the block's amax is known; Muon's direction goes to out in bf16, to
 * nearest. (No amax in this loop: an "omp simd reduction" of it held the loop to
 * 128-bit vectors on AVX2.) */
PR_INLINE void pr_rule_run(const precis_step_consts_t* k, pr_layout_t L, pr_tile_ptrs_t s,
                           void* out, int rule, int has_m, float m_scale, int j0, int j1,
                           float* restrict m_buf) {
  int j;
  PR_SIMD_LOOP
  for (j = j0; j < j1; ++j) {
    const pr_pmd_t e = pr_rule_elem(k, L, s, rule, has_m, m_scale, j);
    if (pr_rules[rule].param) pr_store_master(L, s, j, e.p);
    if (has_m) {
      if (pr_is_scaled(L.m)) {
        m_buf[j] = e.m;
      } else if (L.m == PR_BF16) {
        const uint32_t h = precis_moment_hash(s.sr.key, s.index0 + (uint32_t)j);
        ((uint16_t*)s.m)[j] = precis_f32_to_bf16_sr(e.m, precis_moment_rand(h, 0, s.sr.step) >> 16);
      } else {
        pr_st(s.m, L.m, j, e.m);
      }
    }
    if (!pr_rules[rule].param) ((uint16_t*)out)[j] = precis_f32_to_bf16_rn(e.d);
  }
}

/* Encode elements [j0, j1) of a tile's fp8 m (one scale block, x its values) with
 * the block's multiplier: pr_store_moment's stochastic rounding (m's half of the
 * element's hash), the hash computed here rather than read from a tile of them. */
PR_INLINE void pr_rule_store_m8(pr_tile_ptrs_t s, const float* restrict x, float mul, int j0,
                                int j1) {
  uint8_t* d = (uint8_t*)s.m;
  int j;
  PR_SIMD_LOOP
  for (j = j0; j < j1; ++j) {
    const uint32_t h = precis_moment_hash(s.sr.key, s.index0 + (uint32_t)j);
    d[j] = precis_moment_sr_fp8(x[j], mul, 0, precis_moment_rand(h, 0, s.sr.step));
  }
}

/* The w elements of an fp8 m's scale block at lo (w a constant in whole blocks):
 * decoded with the block's scale, updated, and encoded in a new scale from its amax
 * (pr_store_moment's bits: precis_block_scale, _multiplier). */
PR_INLINE void pr_rule_block_m8(const precis_step_consts_t* k, pr_layout_t L, pr_tile_ptrs_t s,
                                float* restrict scale, void* out, int rule, int lo, int w,
                                float* restrict m_buf) {
  float amax;
  pr_rule_run(k, L, s, out, rule, 1, *scale, lo, lo + w, m_buf);
  amax = pr_amax(m_buf + lo, w);
  *scale = precis_block_scale(amax, 1, 0);
  pr_rule_store_m8(s, m_buf, precis_block_multiplier(amax, 1, 0), lo, lo + w);
}

/* A tile of rule with Nesterov's flag nest a constant: c with it written in, so that no
 * loop selects on it (GCC 12 leaves a loop selecting on two invariant flags scalar;
 * SGD's first step stays a select). An fp8 m a scale block at a time
 * (pr_rule_block_m8), the whole blocks with a constant trip count. */
PR_INLINE void pr_rule_tile_case(precis_step_consts_t c, pr_layout_t L, pr_tile_ptrs_t s,
                                 float* m_scales, void* out, int n, int rule, int has_m,
                                 int nest, pr_tile_bufs_t* restrict b) {
  int lo;
  c.nesterov = nest;
  if (!has_m || !pr_is_scaled(L.m)) {
    pr_rule_run(&c, L, s, out, rule, has_m, 0.0f, 0, n, b->m);
    return;
  }
  m_scales += s.off / PRECIS_SCALE_BLOCK;
  for (lo = 0; lo + PRECIS_SCALE_BLOCK <= n; lo += PRECIS_SCALE_BLOCK) {
    pr_rule_block_m8(&c, L, s, &m_scales[lo / PRECIS_SCALE_BLOCK], out, rule, lo,
                     PRECIS_SCALE_BLOCK, b->m);
  }
  if (lo < n) {
    pr_rule_block_m8(&c, L, s, &m_scales[lo / PRECIS_SCALE_BLOCK], out, rule, lo, n - lo, b->m);
  }
}

/* The rules a layout of pr_fused_layouts has fused loops for: a mask of PR_RULE_BIT, a
 * bit for each rule with m and one without (SGD without momentum: Muon's apply). */
#define PR_RULE_BIT(rule, has_m) (1 << (2 * (rule) + (has_m)))
enum {
  PR_RULES_ADAM = PR_RULE_BIT(PRECIS_RULE_ADAM, 1),
  PR_RULES_SGD0 = PR_RULE_BIT(PRECIS_RULE_SGD, 0),
  PR_RULES_SGD = PR_RULE_BIT(PRECIS_RULE_SGD, 1),
  PR_RULES_LION = PR_RULE_BIT(PRECIS_RULE_LION, 1),
  PR_RULES_MUON = PR_RULE_BIT(PRECIS_RULE_MUON_MOMENTUM, 1) /* a bf16 direction */
};

/* pr_rule_tile_case with Nesterov's flag a constant where the rule takes it (with a
 * momentum: Nesterov's is a momentum's look-ahead). */
PR_INLINE void pr_rule_tile_nest(precis_step_consts_t c, pr_layout_t L, pr_tile_ptrs_t s,
                                 float* m_scales, void* out, int n, int rule, int has_m,
                                 pr_tile_bufs_t* restrict b) {
  if (pr_rules[rule].nesterov && has_m && c.nesterov) {
    pr_rule_tile_case(c, L, s, m_scales, out, n, rule, has_m, 1, b);
  } else {
    pr_rule_tile_case(c, L, s, m_scales, out, n, rule, has_m, 0, b);
  }
}

/* The fused tile of a one-state rule over a layout of pr_fused_layouts (rules: its
 * mask; pr_pick_isa picks the layout only for those): the rule, m and Nesterov read
 * here, once a tile, each case its own loop; it stores its moment, scaled or not. */
PR_INLINE void pr_rule_tile(const pr_step_call_t* call, precis_step_consts_t c, pr_layout_t L,
                            int rules, pr_tile_ptrs_t s, float* m_scales, void* out, int n,
                            pr_tile_bufs_t* restrict b) {
  const int has_m = call->use.m;
  switch (call->use.rule) { /* rules is a constant: a layout compiles its rules' cases */
#define PR_FUSED_CASE(R)                                                 \
  case R:                                                                \
    if (pr_rules[R].m == PR_M_WITH_MOMENTUM && !has_m) {                 \
      if (rules & PR_RULE_BIT(R, 0)) {                                   \
        pr_rule_tile_nest(c, L, s, m_scales, out, n, R, 0, b);           \
      }                                                                  \
    } else if (rules & PR_RULE_BIT(R, 1)) {                              \
      pr_rule_tile_nest(c, L, s, m_scales, out, n, R, 1, b);             \
    }                                                                    \
    break;
    PRECIS_ONE_STATE_RULES(PR_FUSED_CASE)
#undef PR_FUSED_CASE
    default:
      break;
  }
}

/* Elements [begin, end) of tensor ti, a tile at a time: the fused tiles of a layout of
 * pr_fused_layouts (rules: its mask; Adam's pr_adam_tile, a one-state rule's
 * pr_rule_tile), or the generic kernel's (staged: any rule, any layout; rules 0). isa,
 * L, staged and rules are constants after inlining. Returns the fingerprint terms
 * (fingerprint.h) of the whole 8-byte words of its params as written, when the call
 * keeps fingerprints (else 0): each tile's, while they are in L1, by fp_words (this
 * path's pr_fp_words: inlined in here GCC kept its lanes in scalar registers, a function
 * of its own sums in vectors). A chunk starts at a multiple of PR_TILE elements, a whole
 * number of words; the tensor's last 0-7 bytes are precis_step's to add. */
typedef uint64_t (*pr_fp_words_fn)(const unsigned char*, int64_t, int64_t);

_Static_assert(PRECIS_FINGERPRINT_BLOCK % PR_TILE == 0, "a tile lies in one record block");

/* Block `at` of tensor ti's record (param_block_fingerprints) += sum; at -1: none. A
 * block may be two threads' (chunks split at tiles), so added atomically. */
static void pr_add_block(const pr_step_call_t* call, size_t ti, int64_t at, uint64_t sum) {
  if (at < 0) return;
#if defined(_OPENMP)
#pragma omp atomic
#endif
  call->blocks[call->first_block[ti] + at] += sum;
}

PR_INLINE uint64_t pr_step_chunk(const pr_step_call_t* call, size_t ti, int64_t begin,
                                 int64_t end, int isa, pr_layout_t L, int staged, int rules,
                                 pr_fp_words_fn fp_words) {
  const precis_step_tensors_t* t = call->t;
  /* The rule and the tables it reads: a constant in a kernel of Adam's alone (pr_pick_isa
   * picks it for Adam only), so that its tile folds as in a kernel of its own. */
  const pr_rule_use_t u = rules == PR_RULES_ADAM ? pr_adam_use : call->use;
  precis_step_consts_t c = t->steps[ti] == call->consts_step
                               ? call->consts
                               : precis_step_consts_make(&call->hyper, t->steps[ti]);
  float* m_scales = pr_is_scaled(L.m) ? t->exp_avg_scales[ti] : NULL;
  float* v_scales = pr_is_scaled(L.v) ? t->exp_avg_sq_scales[ti] : NULL;
  float* max_scales = call->amsgrad && v_scales != NULL ? t->max_exp_avg_sq_scales[ti] : NULL;
  /* Stochastic rounding's keys (used where the layout rounds stochastically). */
  const uint64_t stream = pr_step_stream(t, ti);
  const int64_t element0 = pr_step_element_offset(t, ti);
  const precis_sr_key_t key = precis_sr_key(call->seed, stream, t->steps[ti]);
  pr_tile_bufs_t bufs;
  const pr_sr_t sr = {precis_moment_key(call->seed, stream), t->steps[ti], 0, bufs.hash};
  const int64_t param_size = precis_elem_size(L.param);
  uint64_t fingerprint = 0, block_sum = 0;
  int64_t off, taken = 0, block_at = -1;
  /* Writes into the params: seen by the fused loops as they load (L.sees), by a pass
   * before each tile in the generic kernel (whose staged loads take no flags); not in a
   * tensor resynced before (pr_resync_prefixes), whose kept is the resync's. */
  const int counts = L.sees && !call->resynced[ti];
  const int prepass = staged && counts;
  if (staged) L.sees = 0;
  /* SGD's and Lion's step lr of this tensor (the decoupled decay keeps cfg->lr's); no
   * other rule takes lr_scales (pr_step_check_args). */
  if (call->lr_scales != NULL) {
    precis_rule_consts_lr(&c, call->hyper.lr, call->lr_scales[ti], call->hyper.lr_float32);
  }
  for (off = begin; off < end; off += PR_TILE) {
    int n = end - off < PR_TILE ? (int)(end - off) : PR_TILE;
    pr_tile_ptrs_t s = {0};
    void* out = u.output ? (char*)call->outputs[ti] + off * precis_elem_size(call->output_dtype)
                         : NULL;
    /* whether the tile stored its scaled moments itself: the rules' fused tiles do,
     * Adam's says, the staged one leaves them to the encoding below */
    int stored = !staged;
    s.off = off;
    s.g = (const char*)t->grads[ti] + off * precis_elem_size(L.grad);
    /* Only the tables the rule reads (muon_momentum: no params or masters, whose
     * mode is then NONE; sgd without momentum: no exp_avgs; no rule but Adam: no
     * exp_avg_sqs), which pr_step_check_args checked. */
    s.p = u.param ? (char*)t->params[ti] + off * precis_elem_size(L.param) : NULL;
    s.master = L.mode == PR_MASTER_NONE
                   ? NULL
                   : (char*)t->masters[ti] + off * precis_elem_size(L.master);
    s.m = u.m ? (char*)t->exp_avgs[ti] + off * precis_elem_size(L.m) : NULL;
    s.v = u.v ? (char*)t->exp_avg_sqs[ti] + off * precis_elem_size(L.v) : NULL;
    if (call->amsgrad) s.vmax = (char*)t->max_exp_avg_sqs[ti] + off * precis_elem_size(L.v);
    /* The random numbers follow the element's index in its whole param. */
    s.index0 = (uint32_t)((uint64_t)element0 + (uint64_t)off);
    s.key = key;
    s.sr = sr;
    s.sr.index0 = s.index0;
    s.taken = bufs.taken;
    if (prepass) taken += pr_take_written(L, s, n);
    if (staged) {
      pr_tile_staged(call, c, L, s, m_scales, v_scales, max_scales, out, n, isa, &bufs);
    } else if (u.rule != PRECIS_RULE_ADAM) {
      pr_rule_tile(call, c, L, rules, s, m_scales, out, n, &bufs);
    } else if (rules & PR_RULES_ADAM) { /* (a constant: only Adam's layouts compile it) */
      stored = pr_adam_tile(call, c, L, s, m_scales, v_scales, max_scales, n, isa, &bufs);
    }
    if (!stored) { /* the scaled moments, encoded from the tile's buffers */
      if (m_scales != NULL) {
        pr_store_moment(isa, t->exp_avgs[ti], m_scales, L.m, 0, u.rule, off, bufs.m, NULL, n,
                        &s.sr);
      }
      if (v_scales != NULL && !call->amsgrad) { /* amsgrad stored it already */
        pr_store_moment(isa, t->exp_avg_sqs[ti], v_scales, L.v, 1, u.rule, off, NULL, bufs.root,
                        n, &s.sr);
      }
    }
    if (counts && !staged) taken += pr_count_flags(bufs.taken, n);
    if (call->fingerprints != NULL || call->blocks != NULL) { /* the tile's whole words, */
      const uint64_t words = fp_words((const unsigned char*)t->params[ti],  /* from L1 */
                                      off * param_size / 8, (off + n) * param_size / 8);
      fingerprint += words;
      if (call->blocks != NULL) { /* (a tile lies in one block: PR_TILE divides it) */
        const int64_t at = off / PRECIS_FINGERPRINT_BLOCK;
        if (at != block_at) {
          pr_add_block(call, ti, block_at, block_sum);
          block_at = at;
          block_sum = 0;
        }
        block_sum += words;
      }
    }
  }
  pr_add_block(call, ti, block_at, block_sum);
  if (taken != 0) {
#if defined(_OPENMP)
#pragma omp atomic
#endif
    call->kept[ti] -= taken;
  }
  return fingerprint;
}

/* 1 if a gradient in [begin, end) is NaN or +-inf. A max over the exponent and
 * mantissa bits, which vectorizes; the threshold is the inf pattern. */
PR_INLINE int pr_grads_nonfinite(const void* base, precis_dtype_t dtype, int64_t begin,
                                 int64_t end) {
  int64_t j;
  if (dtype == PRECIS_DTYPE_FP32) {
    const float* s = (const float*)base;
    uint32_t a = 0;
    for (j = begin; j < end; ++j) {
      uint32_t u = precis_f32_bits(s[j]) & 0x7FFFFFFFu;
      a = u > a ? u : a;
    }
    return a >= 0x7F800000u;
  } else {
    const uint16_t* s = (const uint16_t*)base;
    uint16_t a = 0;
    for (j = begin; j < end; ++j) {
      uint16_t u = (uint16_t)(s[j] & 0x7FFFu);
      a = u > a ? u : a;
    }
    return a >= (dtype == PRECIS_DTYPE_FP16 ? 0x7C00u : 0x7F80u);
  }
}

/* The layouts with fused loops of their own, and the rules each has them for
 * (PR_RULES_*); any other layout or rule runs the generic kernel, which reads its layout
 * at run time and stages each buffer through fp32 arrays (pr_tile_staged): vectorized
 * too, a little slower. The layouts as precis_step writes them: a buffer the rule does
 * not read stands as fp32 (v but for Adam's, m where a rule keeps none; Muon's momentum
 * writes no param: fp32 param fields without master). Adam's: the policies of the
 * README and of bench/adam_cpu.py. The one-state rules': those of bench/rules_cpu.py
 * (fp32; bf16 params with the default policy; with fp8 momentum and 8-bit remainders)
 * under SGD and Lion, Muon's momentum and its apply (SGD without momentum, reading the
 * bf16 direction); m is fp32, bf16 or fp8 (pr_rule_tile_case encodes a scaled m as
 * fp8); a Muon direction in another dtype than bf16 runs the generic kernel. */
#define PR_F16 PRECIS_DTYPE_FP16
#define PR_I16 PRECIS_DTYPE_INT16
#define PR_REM8 PR_MASTER_REMAINDER8
typedef struct pr_fused_layout {
  pr_layout_t L;
  int rules;
} pr_fused_layout_t;

#define PR_RULES_ALL (PR_RULES_ADAM | PR_RULES_SGD0 | PR_RULES_SGD | PR_RULES_LION | PR_RULES_MUON)
enum { PR_LAYOUT_FUSED = 19 };
static const pr_fused_layout_t pr_fused_layouts[PR_LAYOUT_FUSED] = {
    /* fp32: every rule */
    {{PR_F32, PR_MASTER_NONE, PR_F32, PR_F32, PR_F32, PR_F32, 0}, PR_RULES_ALL},
    /* Adam: bf16 default; remainders; fp8 moments; + remainders; fp16 moments; fp8
     * moments + 8-bit remainders */
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_BF16, PR_BF16, 0}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_REMAINDER, PR_BF16, PR_I16, PR_BF16, PR_BF16, 0}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_FP8, PR_FP8, 0}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_REMAINDER, PR_BF16, PR_I16, PR_FP8, PR_FP8, 0}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_F16, PR_F16, 0}, PR_RULES_ADAM},
    {{PR_BF16, PR_REM8, PR_BF16, PR_FP8, PR_FP8, PR_FP8, 0}, PR_RULES_ADAM},
    /* fp32 params, bf16 grads: Muon's apply; the momentum of bf16 grads in fp32 */
    {{PR_BF16, PR_MASTER_NONE, PR_F32, PR_F32, PR_F32, PR_F32, 0}, PR_RULES_SGD0 | PR_RULES_MUON},
    /* bf16 default: bf16 params, fp32 master, bf16 m; its Muon apply; its momentum */
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_BF16, PR_F32, 0},
     PR_RULES_SGD | PR_RULES_LION},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_F32, PR_F32, 0}, PR_RULES_SGD0},
    {{PR_BF16, PR_MASTER_NONE, PR_F32, PR_F32, PR_BF16, PR_F32, 0}, PR_RULES_MUON},
    /* fp8 m + 8-bit remainders; its Muon apply; its momentum */
    {{PR_BF16, PR_REM8, PR_BF16, PR_FP8, PR_FP8, PR_F32, 0}, PR_RULES_SGD | PR_RULES_LION},
    {{PR_BF16, PR_REM8, PR_BF16, PR_FP8, PR_F32, PR_F32, 0}, PR_RULES_SGD0},
    {{PR_BF16, PR_MASTER_NONE, PR_F32, PR_F32, PR_FP8, PR_F32, 0}, PR_RULES_MUON},
    /* the layouts above with a separate master, seeing writes into their params
     * (param_kept): Adam's bf16 default, fp8 and fp16 moments; SGD's and Lion's */
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_BF16, PR_BF16, 1}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_FP8, PR_FP8, 1}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_F16, PR_F16, 1}, PR_RULES_ADAM},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_BF16, PR_F32, 1},
     PR_RULES_SGD | PR_RULES_LION},
    {{PR_BF16, PR_MASTER_SEPARATE, PR_BF16, PR_F32, PR_F32, PR_F32, 1}, PR_RULES_SGD0},
};

/* The functions compiled for each SIMD level: the fingerprint's words, a chunk kernel
 * per fused layout (index k of pr_fused_layouts), the generic one, the finite check. */
#define PR_DEFINE_FUSED_FN(suffix, k, isa, attrs)                                               \
  attrs static uint64_t pr_step_chunk_##suffix##_##k(const pr_step_call_t* call, size_t ti,   \
                                                     int64_t begin, int64_t end) {            \
    return pr_step_chunk(call, ti, begin, end, isa, pr_fused_layouts[k].L, 0,                  \
                         pr_fused_layouts[k].rules, pr_fp_words_##suffix);                    \
  }
#define PR_DEFINE_CHUNK_FNS(suffix, isa, attrs)                                                 \
  attrs __attribute__((noinline)) static uint64_t pr_fp_words_##suffix(                        \
      const unsigned char* buf, int64_t begin, int64_t end) {                                   \
    return pr_fp_words(buf, begin, end);                                                        \
  }                                                                                             \
  PR_DEFINE_FUSED_FN(suffix, 0, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 1, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 2, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 3, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 4, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 5, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 6, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 7, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 8, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 9, isa, attrs)                                                     \
  PR_DEFINE_FUSED_FN(suffix, 10, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 11, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 12, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 13, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 14, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 15, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 16, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 17, isa, attrs)                                                    \
  PR_DEFINE_FUSED_FN(suffix, 18, isa, attrs)                                                    \
  attrs static uint64_t pr_step_chunk_##suffix##_any(const pr_step_call_t* call, size_t ti,     \
                                                     int64_t begin, int64_t end) {              \
    return pr_step_chunk(call, ti, begin, end, isa, call->layout, 1, 0, pr_fp_words_##suffix);  \
  }                                                                                             \
  attrs static int pr_nonfinite_##suffix(const void* base, precis_dtype_t dtype, int64_t begin, \
                                         int64_t end) {                                         \
    return pr_grads_nonfinite(base, dtype, begin, end);                                         \
  }

typedef uint64_t (*pr_step_chunk_fn)(const pr_step_call_t*, size_t, int64_t, int64_t);
typedef int (*pr_nonfinite_fn)(const void*, precis_dtype_t, int64_t, int64_t);

typedef struct pr_isa_fns {
  pr_step_chunk_fn fused[PR_LAYOUT_FUSED];
  pr_step_chunk_fn any;
  pr_nonfinite_fn check;
  pr_fp_words_fn words;
} pr_isa_fns_t;

#define PR_ISA_FNS(suffix)                                                                    \
  {                                                                                           \
    {pr_step_chunk_##suffix##_0,  pr_step_chunk_##suffix##_1,  pr_step_chunk_##suffix##_2,    \
     pr_step_chunk_##suffix##_3,  pr_step_chunk_##suffix##_4,  pr_step_chunk_##suffix##_5,    \
     pr_step_chunk_##suffix##_6,  pr_step_chunk_##suffix##_7,  pr_step_chunk_##suffix##_8,    \
     pr_step_chunk_##suffix##_9,  pr_step_chunk_##suffix##_10, pr_step_chunk_##suffix##_11,   \
     pr_step_chunk_##suffix##_12, pr_step_chunk_##suffix##_13, pr_step_chunk_##suffix##_14,   \
     pr_step_chunk_##suffix##_15, pr_step_chunk_##suffix##_16, pr_step_chunk_##suffix##_17,   \
     pr_step_chunk_##suffix##_18},                                                            \
        pr_step_chunk_##suffix##_any, pr_nonfinite_##suffix, pr_fp_words_##suffix             \
  }

PR_EACH_ISA(PR_DEFINE_CHUNK_FNS)
static const pr_isa_fns_t pr_isa_fns[PR_ISA_COUNT] = PR_ISA_TABLE(PR_ISA_FNS);

static int pr_layout_eq(pr_layout_t a, pr_layout_t b) {
  return a.grad == b.grad && a.mode == b.mode && a.param == b.param && a.master == b.master &&
         a.m == b.m && a.v == b.v && a.sees == b.sees;
}

/* The kernels of a SIMD path. */
static const pr_isa_fns_t* pr_fns(int isa) {
  return &pr_isa_fns[PR_ISA_INDEX(isa)];
}

/* pr_cpu_generic_force's flag: the generic kernel for every layout (tests). */
static int pr_generic_forced = 0;

int pr_cpu_generic_force(int generic) {
  __atomic_store_n(&pr_generic_forced, generic != 0, __ATOMIC_RELAXED);
  return 0;
}

/* The step kernel of this ISA for the layout (NULL: only the finite check): the fused
 * one of pr_fused_layouts where the layout has loops for the rule (has_m: SGD's
 * momentum; output_dtype: Muon's direction, fused in bf16 only), else the generic one. */
static void pr_pick_isa(int isa, const pr_layout_t* layout, int rule, int has_m,
                        int output_dtype, pr_step_chunk_fn* step, pr_nonfinite_fn* check) {
  const pr_isa_fns_t* fns = pr_fns(isa);
  int want, k;
  *check = fns->check;
  if (layout == NULL) return;
  *step = fns->any;
  if (__atomic_load_n(&pr_generic_forced, __ATOMIC_RELAXED)) return;
  if (rule < 0 || rule >= PRECIS_RULE_COUNT) return;
  has_m = has_m || pr_rules[rule].m == PR_M_ALWAYS; /* (Adam, Lion: whatever the caller says) */
  want = pr_rules[rule].param || output_dtype == PRECIS_DTYPE_BF16 ? PR_RULE_BIT(rule, has_m)
                                                                  : 0;
  for (k = 0; k < PR_LAYOUT_FUSED; ++k) {
    if ((pr_fused_layouts[k].rules & want) && pr_layout_eq(*layout, pr_fused_layouts[k].L)) {
      *step = fns->fused[k];
    }
  }
}

/* ---- the multi-tensor step ----------------------------------------------- */

/* The chunks of a list, and the OpenMP work items that run them: a whole chunk
 * is an item of its own; consecutive chunks of small tensors share one (up to a
 * chunk's elements together), so that 2,000 tensors of 1,000 elements are 31
 * items (up to 15 threads), not 2,000 (each item costs the runtime a dispatch).
 * Which chunk runs in which item changes no bits: every chunk is stepped alone. */
typedef struct pr_chunks {
  int64_t* first;     /* [count + 1]: tensor i's first chunk; first[count] the total */
  int64_t* items;     /* [item_count + 1]: each item's first chunk; then the total */
  int64_t item_count; /* 0 for an empty list */
  int64_t size;       /* elements per chunk (pr_chunk_size) */
} pr_chunks_t;

/* PR_CHUNK, halved while the call has fewer than 2 chunks a thread, to PR_CHUNK_MIN:
 * large calls keep long runs for the prefetchers (a chunk of 16,384 everywhere ran
 * the bf16 default step of 6M elements up to 1.4x slower on a Zen 3), smaller ones
 * get work for every thread; one thread keeps PR_CHUNK. */
static int64_t pr_chunk_size(int64_t total_elems, int threads) {
  int64_t size = PR_CHUNK;
  while (threads > 1 && size > PR_CHUNK_MIN && total_elems < size * 2 * threads) size /= 2;
  return size;
}

static int64_t pr_chunk_count(int64_t numel, int64_t size) {
  return numel / size + (numel % size != 0);
}

static void pr_chunks_free(pr_chunks_t* k) {
  free(k->first);
  free(k->items);
}

static precis_status_t pr_chunk_table(const char* fn, const precis_step_tensors_t* t,
                                      int threads, pr_chunks_t* k) {
  size_t i, count = t->count;
  int64_t c, in_item = 0, total, elems = 0;
  memset(k, 0, sizeof *k);
  if (count > SIZE_MAX / sizeof(int64_t) - 1) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: tensors->count %zu is too large", fn, count);
  }
  k->first = (int64_t*)malloc((count + 1) * sizeof *k->first);
  if (k->first == NULL) goto oom;
  for (i = 0; i < count; ++i) elems += t->numels[i];
  k->size = pr_chunk_size(elems, threads);
  k->first[0] = 0;
  for (i = 0; i < count; ++i) k->first[i + 1] = k->first[i] + pr_chunk_count(t->numels[i], k->size);
  total = k->first[count];
  if ((uint64_t)total > SIZE_MAX / sizeof(int64_t) - 1) goto oom;
  k->items = (int64_t*)malloc(((size_t)total + 1) * sizeof *k->items);
  if (k->items == NULL) goto oom;
  for (i = 0; i < count; ++i) {
    for (c = k->first[i]; c < k->first[i + 1]; ++c) {
      int64_t n = c + 1 < k->first[i + 1] ? k->size : t->numels[i] - (c - k->first[i]) * k->size;
      if (k->item_count == 0 || in_item + n > k->size) {
        k->items[k->item_count++] = c;
        in_item = 0;
      }
      in_item += n;
    }
  }
  k->items[k->item_count] = total;
  return PRECIS_OK;
oom:
  pr_chunks_free(k);
  return pr_fail(PRECIS_ERR_OUT_OF_MEMORY, "%s: cannot allocate the chunk table for %zu tensors",
                 fn, count);
}

/* Global chunk c -> its tensor *ti and element range [*begin, *end). first[i]
 * is the index of tensor i's first chunk: the tensor is the last i with
 * first[i] <= c (an empty tensor shares its successor's first chunk, so it is
 * never picked). */
static void pr_chunk_range(const pr_chunks_t* k, size_t count, const int64_t* numels, int64_t c,
                           size_t* ti, int64_t* begin, int64_t* end) {
  const int64_t* first = k->first;
  size_t lo = 0, hi = count;
  while (hi - lo > 1) {
    size_t mid = lo + (hi - lo) / 2;
    if (first[mid] <= c) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  *ti = lo;
  *begin = (c - first[lo]) * k->size;
  *end = numels[lo] - *begin > k->size ? *begin + k->size : numels[lo];
}

/* 1 if a gradient of the list is NaN or Inf: a read-only pass over every chunk
 * (no early exit: the items run in parallel). */
static int pr_grads_any_nonfinite(const precis_step_tensors_t* t, const pr_chunks_t* k,
                                  pr_nonfinite_fn check_fn, int threads) {
  int64_t item;
  int bad = 0;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad) \
    if (k->item_count > 1) num_threads(threads)
#else
  (void)threads;
#endif
  for (item = 0; item < k->item_count; ++item) {
    int64_t c;
    for (c = k->items[item]; c < k->items[item + 1]; ++c) {
      size_t ti;
      int64_t begin, end;
      pr_chunk_range(k, t->count, t->numels, c, &ti, &begin, &end);
      bad |= check_fn(t->grads[ti], t->grad_dtype, begin, end);
    }
  }
  return bad;
}

#if PR_X86
/* The emulation of mkl_sqrt.h (PR_SQRT_Z0 or _EX, each where this CPU runs it)
 * that gives fn's bits on a sample of every sign and exponent (the ends of the
 * mantissa range and spread values between), or PR_SQRT_CALL: the kernels then
 * run it inline instead of calling fn per tile. Checked once per fn (the last
 * fn of each answer is remembered, one word each; a race only checks twice). */
static int pr_sqrt_emulated(precis_sqrt_fn_t fn) {
  enum { PER_EXP = 128, COUNT = 2 * 256 * PER_EXP };
  static precis_sqrt_fn_t answered[PR_SQRT_EX + 1]; /* [kind]: a fn that got it */
  const int hw = pr_isa_hardware();
  float* in;
  int i, kind = PR_SQRT_CALL;
  for (i = 0; i <= PR_SQRT_EX; ++i) {
    if (fn == __atomic_load_n(&answered[i], __ATOMIC_RELAXED)) return i;
  }
  if (hw < PR_ISA_AVX2) return PR_SQRT_CALL;
  in = (float*)malloc(3 * COUNT * sizeof *in);
  if (in != NULL) {
    float* want = in + COUNT;
    float* got = want + COUNT;
    for (i = 0; i < COUNT; ++i) {
      uint32_t k = (uint32_t)i % PER_EXP, top = (uint32_t)i / PER_EXP; /* sign:exponent */
      uint32_t mant = k < 32 ? k : k < 64 ? 0x7FFFFFu - (k - 32) : precis_hash32((uint32_t)i);
      in[i] = precis_bits_f32(top << 23 | (mant & 0x7FFFFFu));
    }
    fn(in, want, COUNT);
    for (kind = hw == PR_ISA_AVX512 ? PR_SQRT_Z0 : PR_SQRT_EX; kind <= PR_SQRT_EX; ++kind) {
      pr_mkl_sqrt(kind, in, got, COUNT);
      if (memcmp(want, got, COUNT * sizeof *in) == 0) break;
    }
    if (kind > PR_SQRT_EX) kind = PR_SQRT_CALL;
    free(in);
  }
  __atomic_store_n(&answered[kind], fn, __ATOMIC_RELAXED);
  return kind;
}
#endif

/* Threads of a step: the config's count, or OpenMP's default for 0; at most the larger
 * of the processors and OpenMP's default (libgomp exits the process when it cannot make
 * a thread: 40,000 asked did). */
static int pr_threads(int32_t num_threads) {
#if defined(_OPENMP)
  int most = omp_get_num_procs();
  if (omp_get_max_threads() > most) most = omp_get_max_threads();
  if (num_threads <= 0) return omp_get_max_threads();
  return num_threads < most ? (int)num_threads : most;
#else
  (void)num_threads;
  return 1;
#endif
}

PRECIS_API precis_status_t precis_rule_name(int32_t rule, const char** out) {
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_rule_name: out is NULL");
  if (rule < 0 || rule >= PRECIS_RULE_COUNT) {
    char rules[256];
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "precis_rule_name: rule is %d; accepted: %s",
                   (int)rule, pr_rule_list(rules, sizeof rules));
  }
  *out = pr_rules[rule].name;
  return PRECIS_OK;
}

/* The elements of a param's first ones a step looks at before it steps any of it (a
 * whole load, which takes the whole param rather than the elements that no longer
 * round, is decided before the first element is stepped). */
#define PR_PREFIX 1024

/* tensors->param_kept's first part: each tensor whose first PR_PREFIX elements show a
 * write resynced now as precis_resync_masters does (its kept counted there; a whole load
 * taken whole), the others' kept set to their numel, for the chunks to take from;
 * *resynced (malloc'd, count flags) says which were resynced. A write that spares a
 * param's first elements is taken element by element as the tiles reach it. */
static precis_status_t pr_resync_prefixes(const char* fn, const precis_step_tensors_t* t,
                                          int master_dtype, uint8_t** resynced) {
  uint8_t* stale = (uint8_t*)calloc(t->count, 1);
  precis_status_t st;
  size_t i;
  if (stale == NULL) {
    return pr_fail(PRECIS_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu flags", fn, t->count);
  }
  for (i = 0; i < t->count; ++i) {
    const uint16_t* p = (const uint16_t*)t->params[i];
    const int64_t n = t->numels[i] < PR_PREFIX ? t->numels[i] : PR_PREFIX;
    int differ = 0;
    int64_t j;
    for (j = 0; j < n; ++j) {
      differ |= !pr_rounds_to(pr_master_value(t->masters[i], j, master_dtype), p[j],
                              (int)t->param_dtype);
    }
    stale[i] = (uint8_t)differ;
  }
  st = precis_resync_masters(t->masters, (precis_dtype_t)master_dtype,
                             (const void* const*)t->params, t->param_dtype, t->numels, stale,
                             t->param_kept, (int64_t)t->count);
  if (st != PRECIS_OK) {
    free(stale);
    return st;
  }
  *resynced = stale;
  return PRECIS_OK;
}

/* A chunk's blocks compared with their records (tensors->param_block_records) before the
 * chunk is stepped: a block whose params' fingerprint differs (written since the record)
 * has its remainders zeroed (resync.h's rule for remainders: the param is then its
 * master), the others' elements added to the tensor's param_blocks_kept. A chunk starts
 * at a block (PR_CHUNK_MIN is a whole number of them), so a block is one thread's; its
 * params, read here, are in cache when the chunk steps them. */
_Static_assert(PR_CHUNK_MIN % PRECIS_FINGERPRINT_BLOCK == 0, "a chunk starts at a block");

static void pr_compare_blocks(const pr_step_call_t* call, size_t ti, int64_t begin,
                              int64_t end) {
  const precis_step_tensors_t* t = call->t;
  const unsigned char* param = (const unsigned char*)t->params[ti];
  const int64_t numel = t->numels[ti], nbytes = numel * 2; /* (bf16 params) */
  const int64_t rsize = call->layout.mode == PR_MASTER_REMAINDER ? 2 : 1;
  int64_t b, kept = 0;
  for (b = begin; b < end; b += PRECIS_FINGERPRINT_BLOCK) {
    const int64_t e = end - b < PRECIS_FINGERPRINT_BLOCK ? end : b + PRECIS_FINGERPRINT_BLOCK;
    uint64_t sum = call->fp_words(param, b * 2 / 8, e * 2 / 8);
    if (e == numel && nbytes % 8 != 0) sum += pr_fp_tail_word(param, nbytes);
    if (sum == call->records[call->first_block[ti] + b / PRECIS_FINGERPRINT_BLOCK]) {
      kept += e - b;
    } else {
      memset((char*)t->masters[ti] + b * rsize, 0, (size_t)((e - b) * rsize));
    }
  }
  if (call->blocks_kept != NULL && kept != 0) {
#if defined(_OPENMP)
#pragma omp atomic
#endif
    call->blocks_kept[ti] += kept;
  }
}

/* Every chunk's blocks compared (pr_compare_blocks), for a step that skips. */
static void pr_compare_all_blocks(const pr_step_call_t* call, const pr_chunks_t* chunks,
                                  int threads) {
  int64_t item;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (chunks->item_count > 1) num_threads(threads)
#else
  (void)threads;
#endif
  for (item = 0; item < chunks->item_count; ++item) {
    int64_t c;
    for (c = chunks->items[item]; c < chunks->items[item + 1]; ++c) {
      size_t ti;
      int64_t begin, end;
      pr_chunk_range(chunks, call->t->count, call->t->numels, c, &ti, &begin, &end);
      pr_compare_blocks(call, ti, begin, end);
    }
  }
}

/* precis_step under the name fn (its error messages name the function called); skipped:
 * precis_step_skipped (the blocks' compare alone, as a step check_finite skips). */
static precis_status_t pr_step(const char* fn, const precis_step_config_t* cfg,
                               const precis_step_tensors_t* tensors, int32_t* found_inf,
                               int skipped) {
  pr_step_call_t call;
  pr_step_chunk_fn step_fn;
  pr_nonfinite_fn check_fn;
  pr_chunks_t chunks;
  int64_t item;
  uint8_t* resynced = NULL;
  int64_t block_entries = 0;
  int master_mode = PR_MASTER_NONE;
  int threads;
  precis_status_t st;

  pr_clear_error();
  /* Every argument, before anything is written (step_args.h, shared with CUDA). */
  st = pr_step_check_args(fn, cfg, tensors, found_inf != NULL || skipped, "found_inf", 1,
                          &master_mode);
  if (st != PRECIS_OK) return st;
  if (tensors->count == 0) {
    if (found_inf != NULL) *found_inf = 0;
    return PRECIS_OK;
  }
  threads = pr_threads(cfg->num_threads);
  st = pr_chunk_table(fn, tensors, threads, &chunks);
  if (st != PRECIS_OK) return st;

  call.t = tensors;
  call.hyper = precis_step_hyper_from_config(cfg);
  call.consts_step = tensors->steps[0];
  call.consts = precis_step_consts_make(&call.hyper, call.consts_step);
  call.amsgrad = pr_adam_amsgrad(cfg);
  call.seed = cfg->seed;
  call.sqrt_fn = cfg->cpu_sqrt;
#if PR_X86
  call.sqrt_inline = pr_isa() >= PR_ISA_AVX2 && call.sqrt_fn != NULL
                         ? pr_sqrt_emulated(call.sqrt_fn)
                         : PR_SQRT_CALL;
#else
  call.sqrt_inline = PR_SQRT_CALL;
#endif
  call.layout.grad = (int)tensors->grad_dtype;
  call.layout.mode = master_mode;
  call.layout.param = (int)tensors->param_dtype;
  call.layout.master =
      master_mode == PR_MASTER_NONE ? call.layout.param : (int)tensors->master_dtype;
  call.layout.m = (int)tensors->exp_avg_dtype;
  call.layout.v = (int)tensors->exp_avg_sq_dtype;
  /* The rule (precis_rule_t): a buffer it does not read is unchecked, its dtype
   * field too, and stands as fp32 (no scales, no stochastic rounding). */
  call.use = pr_rule_use(cfg);
  if (!call.use.m) call.layout.m = PRECIS_DTYPE_FP32;
  if (!call.use.v) call.layout.v = PRECIS_DTYPE_FP32;
  if (!call.use.param) { /* nor params or masters (muon_momentum) */
    call.layout.mode = PR_MASTER_NONE;
    call.layout.param = PRECIS_DTYPE_FP32;
    call.layout.master = PRECIS_DTYPE_FP32;
  }
  call.outputs = call.use.output ? tensors->outputs : NULL;
  call.output_dtype = call.use.output ? tensors->output_dtype : PRECIS_DTYPE_FP32;
  call.lr_scales =
      call.use.lr_scales && PR_HAS_FIELD(tensors, precis_step_tensors_t, lr_scales)
          ? tensors->lr_scales
          : NULL;
  call.fingerprints = pr_step_param_fingerprints(tensors);
  call.blocks = pr_step_param_block_fingerprints(tensors);
  call.first_block = NULL;
  call.kept = call.layout.mode == PR_MASTER_SEPARATE ? pr_step_param_kept(tensors) : NULL;
  call.resynced = NULL;
  call.layout.sees = call.kept != NULL;
  call.records = pr_step_param_block_records(tensors); /* (checked: remainders only) */
  call.blocks_kept = call.records != NULL ? pr_step_param_blocks_kept(tensors) : NULL;
  call.fp_words = pr_fns(pr_isa())->words;
  pr_pick_isa(pr_isa(), &call.layout, call.use.rule, call.use.m, (int)call.output_dtype,
              &step_fn, &check_fn);

  if (call.blocks != NULL || call.records != NULL) { /* each tensor's first block entry */
    size_t i;
    call.first_block = (int64_t*)malloc((tensors->count + 1) * sizeof(int64_t));
    if (call.first_block == NULL) {
      pr_chunks_free(&chunks);
      return pr_fail(PRECIS_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu tensors' blocks", fn,
                     tensors->count);
    }
    for (i = 0; i < tensors->count; ++i) {
      call.first_block[i] = block_entries;
      block_entries += pr_fp_block_count(tensors->numels[i], PRECIS_FINGERPRINT_BLOCK);
    }
  }

  if (call.blocks_kept != NULL) memset(call.blocks_kept, 0, tensors->count * sizeof(int64_t));
  /* check_finite: a read-only pass first, so a skipped step writes nothing (but the
   * remainders of the blocks written since their record: as a resync before it would). */
  if (skipped || (cfg->check_finite &&
                  pr_grads_any_nonfinite(tensors, &chunks, check_fn, threads))) {
    if (call.records != NULL) pr_compare_all_blocks(&call, &chunks, threads);
    pr_chunks_free(&chunks);
    free(call.first_block);
    if (found_inf != NULL) *found_inf = 1;
    return PRECIS_OK;
  }
  if (call.kept != NULL) {
    st = pr_resync_prefixes(fn, tensors, call.layout.master, &resynced);
    if (st != PRECIS_OK) {
      pr_chunks_free(&chunks);
      free(call.first_block);
      return st;
    }
    call.resynced = resynced;
  }

  /* Each tensor's fingerprint: its chunks' words added as they are written (a sum mod
   * 2^64: the same for any split among the threads), then its last bytes and length.
   * The items split statically: each thread one contiguous run of them (items hold equal
   * elements of one layout), as the reference loop splits its blocks; items handed out
   * one at a time interleaved the threads' streams, and the bf16 default at 2 threads
   * ran at 0.75-0.89x of the reference loop against 0.87-0.92x so (Zen 5). */
  if (call.fingerprints != NULL) memset(call.fingerprints, 0, tensors->count * sizeof(uint64_t));
  if (call.blocks != NULL) memset(call.blocks, 0, (size_t)block_entries * sizeof(uint64_t));
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (chunks.item_count > 1) \
    num_threads(threads)
#endif
  for (item = 0; item < chunks.item_count; ++item) {
    int64_t c;
    for (c = chunks.items[item]; c < chunks.items[item + 1]; ++c) {
      size_t ti;
      int64_t begin, end;
      uint64_t words;
      pr_chunk_range(&chunks, tensors->count, tensors->numels, c, &ti, &begin, &end);
      if (call.records != NULL) pr_compare_blocks(&call, ti, begin, end);
      words = step_fn(&call, ti, begin, end);
      if (call.fingerprints != NULL) {
#if defined(_OPENMP)
#pragma omp atomic
#endif
        call.fingerprints[ti] += words;
      }
    }
  }
  pr_chunks_free(&chunks);
  free(resynced);
  if (call.fingerprints != NULL || call.blocks != NULL) { /* last bytes (and length) */
    size_t i;
    for (i = 0; i < tensors->count; ++i) {
      const unsigned char* param = (const unsigned char*)tensors->params[i];
      const int64_t nbytes = tensors->numels[i] * precis_elem_size(call.layout.param);
      if (call.fingerprints != NULL) call.fingerprints[i] += pr_fp_tail(param, nbytes);
      if (call.blocks != NULL && nbytes % 8 != 0) {
        const int64_t last = pr_fp_block_count(tensors->numels[i], PRECIS_FINGERPRINT_BLOCK) - 1;
        call.blocks[call.first_block[i] + last] += pr_fp_tail_word(param, nbytes);
      }
    }
  }
  free(call.first_block);
  if (found_inf != NULL) *found_inf = 0;
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_step(const precis_step_config_t* cfg,
                                       const precis_step_tensors_t* tensors, int32_t* found_inf) {
  return pr_step("precis_step", cfg, tensors, found_inf, 0);
}

PRECIS_API precis_status_t precis_step_skipped(const precis_step_config_t* cfg,
                                               const precis_step_tensors_t* tensors) {
  return pr_step("precis_step_skipped", cfg, tensors, NULL, 1);
}

/* The name before issue #66 (the engine was Adam's), kept exported. */
PRECIS_API precis_status_t precis_adam_step(const precis_step_config_t* cfg,
                                            const precis_step_tensors_t* tensors,
                                            int32_t* found_inf) {
  return pr_step("precis_adam_step", cfg, tensors, found_inf, 0);
}

static precis_status_t pr_check_finite(const char* fn, const precis_step_tensors_t* tensors,
                                       int32_t* found_inf) {
  pr_nonfinite_fn check_fn;
  pr_chunks_t chunks;
  precis_status_t st;
  int threads;

  pr_clear_error();
  /* In the order of precis_cuda_step_check_finite. */
  if ((st = pr_step_check_tensors_struct(fn, tensors, 0)) != PRECIS_OK) return st;
  if (found_inf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: found_inf is NULL", fn);
  if ((st = pr_step_check_grads(fn, tensors)) != PRECIS_OK) return st;
  if (tensors->count == 0 || *found_inf != 0) return PRECIS_OK; /* nothing to find */

  threads = pr_threads(0);
  st = pr_chunk_table(fn, tensors, threads, &chunks);
  if (st != PRECIS_OK) return st;
  pr_pick_isa(pr_isa(), NULL, PRECIS_RULE_ADAM, 1, PRECIS_DTYPE_FP32, NULL, &check_fn);
  if (pr_grads_any_nonfinite(tensors, &chunks, check_fn, threads)) *found_inf = 1;
  pr_chunks_free(&chunks);
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_step_check_finite(const precis_step_tensors_t* tensors,
                                                    int32_t* found_inf) {
  return pr_check_finite("precis_step_check_finite", tensors, found_inf);
}

/* The name before issue #66, kept exported. */
PRECIS_API precis_status_t precis_adam_check_finite(const precis_step_tensors_t* tensors,
                                                    int32_t* found_inf) {
  return pr_check_finite("precis_adam_check_finite", tensors, found_inf);
}
