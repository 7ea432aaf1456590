/* convert_cpu.c - the moments' and the remainders' conversions on the CPU
 * (precis_convert.h: precis_scale_count, precis_moment_encode / _decode,
 * precis_remainder_split / _join and their 8-bit forms), with the step's stores and
 * loads (tile_io.h) on the same SIMD path, so a converted moment or master holds the
 * bits the step would have stored. */

/* As step_cpu.c: GCC leaves the fp16/fp8 conversions' selects scalar while float ops
 * may trap; nothing here reads the FP exception flags. Before the includes. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <math.h>
#include <stdint.h>

#include "cpu_isa.h"
#include "internal.h"
#include "precis_convert.h"
#include "step_args.h"
#include "tile_io.h"

/* A conversion of more elements than this runs its tiles over OpenMP's threads. */
#define PR_CONVERT_PARALLEL ((int64_t)1 << 16)

/* precis_moment_encode / _decode of the n values of one tile at element off. */
PR_INLINE void pr_encode_tile(int isa, precis_dtype_t dtype, int second, const float* src,
                              int64_t off, int n, void* dst, float* scales) {
  _Alignas(64) float root[PR_TILE];
  int j;
  if (second && pr_is_scaled((int)dtype)) {
    for (j = 0; j < n; ++j) root[j] = sqrtf(src[off + j]);
  }
  pr_store_moment(isa, dst, scales, dtype, second, PRECIS_RULE_ADAM, off, src + off, root, n,
                  NULL);
}

PR_INLINE void pr_decode_tile(int isa, precis_dtype_t dtype, int second, const void* src,
                              int64_t off, int n, float* dst, const float* scales) {
  (void)isa;
  pr_load_moment(dst + off, src, scales, dtype, second, off, n);
}

/* F(isa, dtype, second, ...) with dtype and second as constants, so that F's
 * loops vectorize (a moment dtype: fp32, fp16, bf16, fp8). */
#define PR_CODEC_DISPATCH(F, isa, dtype, second, ...)                                     \
  switch ((int)(dtype) * 2 + ((second) != 0)) {                                          \
    case PRECIS_DTYPE_FP32 * 2: F(isa, PRECIS_DTYPE_FP32, 0, __VA_ARGS__); break;          \
    case PRECIS_DTYPE_FP32 * 2 + 1: F(isa, PRECIS_DTYPE_FP32, 1, __VA_ARGS__); break;      \
    case PRECIS_DTYPE_FP16 * 2: F(isa, PRECIS_DTYPE_FP16, 0, __VA_ARGS__); break;          \
    case PRECIS_DTYPE_FP16 * 2 + 1: F(isa, PRECIS_DTYPE_FP16, 1, __VA_ARGS__); break;      \
    case PRECIS_DTYPE_BF16 * 2: F(isa, PRECIS_DTYPE_BF16, 0, __VA_ARGS__); break;          \
    case PRECIS_DTYPE_BF16 * 2 + 1: F(isa, PRECIS_DTYPE_BF16, 1, __VA_ARGS__); break;      \
    case PRECIS_DTYPE_FP8_E4M3 * 2: F(isa, PRECIS_DTYPE_FP8_E4M3, 0, __VA_ARGS__); break;  \
    default: F(isa, PRECIS_DTYPE_FP8_E4M3, 1, __VA_ARGS__); break;                         \
  }

typedef void (*pr_encode_fn)(precis_dtype_t, int, const float*, int64_t, int, void*, float*);
typedef void (*pr_decode_fn)(precis_dtype_t, int, const void*, int64_t, int, float*,
                             const float*);

/* The codecs compiled for each SIMD path. */
typedef struct pr_codec_fns {
  pr_encode_fn encode;
  pr_decode_fn decode;
} pr_codec_fns_t;

#define PR_DEFINE_CODEC_FNS(suffix, isa, attrs)                                               \
  attrs static void pr_encode_##suffix(precis_dtype_t dtype, int second, const float* src,   \
                                       int64_t off, int n, void* dst, float* scales) {        \
    PR_CODEC_DISPATCH(pr_encode_tile, isa, dtype, second, src, off, n, dst, scales)           \
  }                                                                                           \
  attrs static void pr_decode_##suffix(precis_dtype_t dtype, int second, const void* src,    \
                                       int64_t off, int n, float* dst, const float* scales) { \
    PR_CODEC_DISPATCH(pr_decode_tile, isa, dtype, second, src, off, n, dst, scales)           \
  }
#define PR_CODEC_FNS(suffix) {pr_encode_##suffix, pr_decode_##suffix}

PR_EACH_ISA(PR_DEFINE_CODEC_FNS)
static const pr_codec_fns_t pr_codecs[PR_ISA_COUNT] = PR_ISA_TABLE(PR_CODEC_FNS);

/* ------------------------------------------------------------------------ */
/* Scales, moment conversion, remainders                                     */
/* ------------------------------------------------------------------------ */

static precis_status_t pr_check_numel(const char* fn, int64_t numel) {
  if (numel >= 0) return PRECIS_OK;
  return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numel is %lld; must be >= 0", fn,
                 (long long)numel);
}

PRECIS_API precis_status_t precis_scale_count(int64_t numel, int64_t* out) {
  static const char fn[] = "precis_scale_count";
  precis_status_t st;
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: out is NULL", fn);
  if ((st = pr_check_numel(fn, numel)) != PRECIS_OK) return st;
  *out = precis_scale_blocks(numel);
  return PRECIS_OK;
}

/* src_fp32: 1 for encode (src holds fp32 values), 0 for decode. */
static precis_status_t pr_check_moment_args(const char* fn, int src_fp32, const void* src,
                                            int64_t numel, int32_t second_moment, const void* dst,
                                            precis_dtype_t dtype, const float* scales) {
  precis_status_t st;
  if ((st = pr_check_numel(fn, numel)) != PRECIS_OK) return st;
  if (second_moment != 0 && second_moment != 1) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: second_moment is %d; must be 0 or 1", fn,
                   (int)second_moment);
  }
  st = pr_step_check_dtype(fn, "dtype", (int)dtype, pr_step_moment_dtype_ok((int)dtype),
                           "fp32, fp16, bf16, fp8");
  if (st != PRECIS_OK || numel == 0) return st;
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: src is NULL", fn);
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dst is NULL", fn);
  if (pr_is_scaled((int)dtype) && scales == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: scales is NULL; %s moments need %lld block scales",
                   fn, pr_dtype_label((int)dtype),
                   (long long)precis_scale_blocks(numel));
  }
  /* The fp32 side is src of encode and dst of decode; the stored side the other. */
  if ((st = pr_check_aligned(fn, "src", -1, src, src_fp32 ? PRECIS_DTYPE_FP32 : (int)dtype)) ||
      (st = pr_check_aligned(fn, "dst", -1, dst, src_fp32 ? (int)dtype : PRECIS_DTYPE_FP32))) {
    return st;
  }
  if (pr_is_scaled((int)dtype)) return pr_check_aligned(fn, "scales", -1, scales, PRECIS_DTYPE_FP32);
  return PRECIS_OK;
}

/* A conversion's tiles on this CPU's path, over OpenMP's threads where numel is large:
 * encode (src fp32, dst the stored form, its block scales written to new_scales) or
 * decode (src the stored form, dst fp32, its block scales read from scales). */
static void pr_convert_tiles(int encode, precis_dtype_t dtype, int second, const void* src,
                             int64_t numel, void* dst, const float* scales,
                             float* new_scales) {
  const pr_codec_fns_t* f = &pr_codecs[PR_ISA_INDEX(pr_isa())];
  const int64_t tiles = (numel + PR_TILE - 1) / PR_TILE;
  int64_t k;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (numel > PR_CONVERT_PARALLEL)
#endif
  for (k = 0; k < tiles; ++k) {
    const int64_t off = k * PR_TILE;
    const int n = numel - off < PR_TILE ? (int)(numel - off) : PR_TILE;
    if (encode) {
      f->encode(dtype, second, (const float*)src, off, n, dst, new_scales);
    } else {
      f->decode(dtype, second, src, off, n, (float*)dst, scales);
    }
  }
}

PRECIS_API precis_status_t precis_moment_encode(const float* src, int64_t numel,
                                                int32_t second_moment, void* dst,
                                                precis_dtype_t dtype, float* scales) {
  static const char fn[] = "precis_moment_encode";
  int64_t k;
  precis_status_t st;
  pr_clear_error();
  st = pr_check_moment_args(fn, 1, src, numel, second_moment, dst, dtype, scales);
  if (st != PRECIS_OK || numel == 0) return st;
  if (second_moment) {
    for (k = 0; k < numel; ++k) {
      if (src[k] < 0.0f) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                       "%s: src[%lld] is %g; a second moment is never negative", fn, (long long)k,
                       (double)src[k]);
      }
    }
  }
  pr_convert_tiles(1, dtype, second_moment, src, numel, dst, NULL, scales);
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_moment_decode(const void* src, const float* scales,
                                                int64_t numel, int32_t second_moment,
                                                precis_dtype_t dtype, float* dst) {
  static const char fn[] = "precis_moment_decode";
  precis_status_t st;
  pr_clear_error();
  st = pr_check_moment_args(fn, 0, src, numel, second_moment, dst, dtype, scales);
  if (st != PRECIS_OK || numel == 0) return st;
  pr_convert_tiles(0, dtype, second_moment, src, numel, dst, scales, NULL);
  return PRECIS_OK;
}

/* The arguments of the remainder conversions, in a fixed order, the last error cleared
 * first; numel 0 needs no pointers. bits: 16 (int16 remainders) or 8 (their bytes, the
 * alignment of the fp8 code's). */
static precis_status_t pr_check_remainder_args(const char* fn, int64_t numel, const float* master,
                                               const uint16_t* param_bf16, const void* remainder,
                                               int bits) {
  const precis_dtype_t remainder_dtype = bits == 8 ? PRECIS_DTYPE_FP8_E4M3 : PRECIS_DTYPE_INT16;
  precis_status_t st;
  pr_clear_error();
  st = pr_check_numel(fn, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  if (master == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: master is NULL", fn);
  if (param_bf16 == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: param_bf16 is NULL", fn);
  if (remainder == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: remainder is NULL", fn);
  if ((st = pr_check_aligned(fn, "master", -1, master, PRECIS_DTYPE_FP32)) ||
      (st = pr_check_aligned(fn, "param_bf16", -1, param_bf16, PRECIS_DTYPE_BF16))) {
    return st;
  }
  return pr_check_aligned(fn, "remainder", -1, remainder, remainder_dtype);
}

/* fp32 master -> bf16 param + remainder of `bits` (16: int16, 8: the 24-bit master's
 * low byte), after the argument checks. */
static precis_status_t pr_remainder_split(const char* fn, const float* master, int64_t numel,
                                          uint16_t* param_bf16, void* remainder, int bits) {
  const precis_status_t st =
      pr_check_remainder_args(fn, numel, master, param_bf16, remainder, bits);
  int64_t k;
  if (st != PRECIS_OK || numel == 0) return st;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (numel > PR_CONVERT_PARALLEL)
#endif
  for (k = 0; k < numel; ++k) {
    if (bits == 8) {
      param_bf16[k] = precis_remainder8_param(master[k]);
      ((int8_t*)remainder)[k] = precis_remainder8_low(master[k]);
    } else {
      param_bf16[k] = precis_remainder_param(master[k]);
      ((int16_t*)remainder)[k] = precis_remainder_low(master[k]);
    }
  }
  return PRECIS_OK;
}

/* bf16 param + remainder of `bits` -> the master they encode, after the checks. */
static precis_status_t pr_remainder_join(const char* fn, const uint16_t* param_bf16,
                                         const void* remainder, int64_t numel, float* master,
                                         int bits) {
  const precis_status_t st =
      pr_check_remainder_args(fn, numel, master, param_bf16, remainder, bits);
  int64_t k;
  if (st != PRECIS_OK || numel == 0) return st;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (numel > PR_CONVERT_PARALLEL)
#endif
  for (k = 0; k < numel; ++k) {
    master[k] = bits == 8
                    ? precis_remainder8_master(param_bf16[k], ((const int8_t*)remainder)[k])
                    : precis_remainder_master(param_bf16[k], ((const int16_t*)remainder)[k]);
  }
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_remainder_split(const float* master, int64_t numel,
                                                  uint16_t* param_bf16, int16_t* remainder) {
  return pr_remainder_split("precis_remainder_split", master, numel, param_bf16, remainder, 16);
}

PRECIS_API precis_status_t precis_remainder_join(const uint16_t* param_bf16,
                                                 const int16_t* remainder, int64_t numel,
                                                 float* master) {
  return pr_remainder_join("precis_remainder_join", param_bf16, remainder, numel, master, 16);
}

PRECIS_API precis_status_t precis_remainder8_split(const float* master, int64_t numel,
                                                   uint16_t* param_bf16, uint8_t* remainder) {
  return pr_remainder_split("precis_remainder8_split", master, numel, param_bf16, remainder, 8);
}

PRECIS_API precis_status_t precis_remainder8_join(const uint16_t* param_bf16,
                                                  const uint8_t* remainder, int64_t numel,
                                                  float* master) {
  return pr_remainder_join("precis_remainder8_join", param_bf16, remainder, numel, master, 8);
}
